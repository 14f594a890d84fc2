"""Hostile review (2026-11-27): model, draft and dataset folders whose JSON holds the wrong
types, misses a field, or whose files are truncated: one clear error line and a non-zero
exit, never a traceback (as tests/unit/test_cli_errors.py asks of other bad inputs), and no
unbounded work before the check (a draft config claiming 10M layers built 10M layer
entries before any tensor was looked at)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from unit.test_cli_errors import assert_clean_error, gen, run_cli


def _model(tiny_dir, tmp_path, name, text):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize("name,text", [
    ("config.json", "[1]"),
    ("model.safetensors.index.json", '{"weight_map": [1]}'),
    ("model.safetensors.index.json", "[1]"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 1}}'),
    ("tokenizer_config.json", "[1]"),
])
def test_model_folder_json_of_wrong_type(tiny_dir, tmp_path, name, text):
    assert_clean_error(gen(_model(tiny_dir, tmp_path, name, text)), name.split(".")[0])


BASE = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 128, "block_size": 4, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1]}}


@pytest.mark.parametrize("patch", [
    {"intermediate_size": None},
    {"num_attention_heads": 0},
    {"num_hidden_layers": 2, "layer_types": ["full_attention"]},
    {"num_hidden_layers": 10 ** 7},
    {"dflash_config": [1]},
    "LIST",
])
def test_draft_config_of_wrong_shape(tiny_dir, tmp_path, patch):
    d = tmp_path / "draft"
    d.mkdir()
    cfg = [1] if patch == "LIST" else {k: v for k, v in {**BASE, **patch}.items() if v is not None}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"fc.weight": torch.zeros(64, 64)}, str(d / "model.safetensors"))
    assert_clean_error(gen(tiny_dir("llama"), "--draft", str(d)), "config")


TINY = ["--device", "cpu", "--dtype", "fp32", "--quantize", "none", "--samples", "2", "--max-new-tokens", "8",
        "--steps", "1", "--batch", "1", "--anchors", "2", "--eval-prompts", "0", "--layers", "1", "--heads", "4",
        "--intermediate-size", "64", "--block-size", "4", "--threads", "1"]


def test_a_corrupt_dataset_is_a_clean_error(tiny_dir, tmp_path):
    model = tiny_dir("llama")
    out = tmp_path / "o"
    (out / "data").mkdir(parents=True)
    (out / "data" / "dataset.json").write_text("{")
    assert_clean_error(run_cli("train-draft", "--model", str(model), "--out", str(out), *TINY), "dataset.json")
    good = tmp_path / "good"                      # a real dataset, then its shard cut short
    assert run_cli("train-draft", "--model", str(model), "--out", str(good), "--data-only", *TINY).returncode == 0
    (shard,) = (good / "data").glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:100])
    assert_clean_error(run_cli("train-draft", "--model", str(model), "--out", str(tmp_path / "o2"), "--data",
                               str(good / "data"), *TINY), "corrupt dataset shard")
