"""Hostile review (2026-11-27). A hand-started worker (``shard-worker --model PATH``) is accepted when PATH holds
*different* weights of the same shapes (another fine-tune, a half-copied or corrupted
file): the fingerprint the load compares is file names and sizes only, so the split
answers silently with the wrong second half of the model."""
import shutil

from safetensors.torch import load_file, save_file

from dflash_server.weights.loader import open_model
from helpers.worker import authed_worker
from helpers.worker import call as _call

SECRET = b"fingerprint-secret-fingerprint"


def test_worker_refuses_other_weights_of_the_same_shapes(tiny_dir, tmp_path):
    path = tiny_dir("llama")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    st = load_file(str(other / "model.safetensors"))
    save_file({k: (v + 0.5 if v.is_floating_point() else v) for k, v in st.items()},
              str(other / "model.safetensors"), metadata={"format": "pt"})
    assert (other / "model.safetensors").stat().st_size == (path / "model.safetensors").stat().st_size
    w = authed_worker(SECRET)
    w.model_override = str(other)
    n = open_model(path).config.num_layers
    h, _ = _call(w, "load", {"model": str(path), "shards": [["cpu", 1, n]], "dtype": "f32", "max_ctx": 64,
                             "quantize": ["dense", "dense"], "fingerprint": open_model(path).fingerprint(mtime=False)})
    assert not h["ok"] and "fingerprint" in h["error"]["message"], "loaded weights that differ from the server's"


def test_a_copy_of_the_same_weights_compares_equal(tiny_dir, tmp_path):
    """Another host's copy (other path, other mtimes) of the same bytes is the same model."""
    import os

    path = tiny_dir("llama")
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    for f in copy.iterdir():
        os.utime(f, (1, 1))
    assert open_model(copy).fingerprint(mtime=False) == open_model(path).fingerprint(mtime=False)
    assert open_model(copy).fingerprint() != open_model(path).fingerprint()
