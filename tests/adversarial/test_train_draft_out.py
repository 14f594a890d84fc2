"""train-draft pointed at folders that are not its own (hostile review, 2026-11-27): the
user's files are never deleted or overwritten: a folder of other files, the --model folder
itself, symbolic links out of the folder, a dataset folder holding other files. Each is
refused with one line (exit 2) before any work; an empty, new or earlier train-draft folder
is taken."""
import json
import shutil

from dflash_server.cli import main

TINY = ["--device", "cpu", "--dtype", "fp32", "--quantize", "none", "--samples", "2", "--max-new-tokens", "8",
        "--steps", "1", "--batch", "1", "--anchors", "2", "--eval-prompts", "0", "--layers", "1", "--heads", "4",
        "--intermediate-size", "64", "--block-size", "4", "--threads", "1"]


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_folder_of_other_files_is_refused_untouched(tiny_dir, tmp_path, capsys):
    out = tmp_path / "work"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "notes.txt").write_text("my notes")
    (out / "checkpoint.old").mkdir()
    (out / "checkpoint.old" / "keep.txt").write_text("keep")
    (out / "config.json").write_text('{"mine": 1}')
    (out / "model.safetensors").write_bytes(b"user weights")
    before = _tree(out)
    assert main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(out), *TINY]) == 2
    assert "not a train-draft output" in capsys.readouterr().err
    assert _tree(out) == before


def test_the_model_folder_is_never_the_output(tiny_dir, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), model)
    before = _tree(model)
    for out in (model, model / "sub", tmp_path):
        assert main(["train-draft", "--model", str(model), "--out", str(out), *TINY]) == 2
        assert "--model folder" in capsys.readouterr().err
    assert _tree(model) == before and not (model / "sub").exists()


def test_files_are_not_written_through_symlinks(tiny_dir, tmp_path, capsys):
    out, victim = tmp_path / "out", tmp_path / "victim.json"
    out.mkdir()
    victim.write_text('{"precious": true}')
    (out / "config.json").symlink_to(victim)
    (out / ".dflash-train-draft").write_text("ours\n")   # even in a folder of ours
    assert main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(out), *TINY]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert json.loads(victim.read_text()) == {"precious": True}


def test_a_dataset_folder_of_other_files_is_refused(tiny_dir, tmp_path, capsys):
    data = tmp_path / "docs"
    data.mkdir()
    (data / "report.txt").write_text("mine")
    assert main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(tmp_path / "o"), "--data",
                 str(data), *TINY]) == 2
    assert "not a dataset" in capsys.readouterr().err
    assert _tree(data) == {"report.txt": b"mine"}


def test_an_empty_folder_is_taken_and_can_be_trained_again(tiny_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    args = ["train-draft", "--model", str(tiny_dir("llama")), "--out", str(out), *TINY]
    assert main(args) == 0
    assert (out / ".dflash-train-draft").is_file() and (out / "model.safetensors").is_file()
    (out / ".dflash-train-draft").unlink()    # an output made before the marker: its files say it is ours
    assert main(args) == 0 and (out / "checkpoint" / "state.json").is_file()
