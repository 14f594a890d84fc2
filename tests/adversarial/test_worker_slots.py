"""Hostile sequence-slot arguments to a shard worker (continuous batching): every bad slot
count, slot id or row list is a clear value error, and the worker serves correctly after."""
import pytest
import torch

from dflash_server.weights.loader import open_model
from helpers.worker import authed_worker
from helpers.worker import call as _call

SECRET = b"slots-secret-slots-secret"


@pytest.fixture(scope="module")
def worker(tiny_dir):
    w = authed_worker(SECRET)
    path = tiny_dir("llama")
    n = open_model(path).config.num_layers
    w.load_args = {"model": str(path), "shards": [["cpu", 1, n]], "dtype": "f32", "max_ctx": 64,
                   "quantize": ["dense", "dense"], "lanes": 2}
    for bad in (0, 1000, "2", True, 1.5, None):
        h, _ = _call(w, "load", {**w.load_args, "lanes": bad})
        assert not h["ok"] and h["error"]["kind"] == "value" and "lanes" in h["error"]["message"], bad
    assert _call(w, "load", w.load_args)[0]["ok"]
    w.hidden = open_model(path).config.hidden_size
    return w


def _x(w, rows):
    return {"x": torch.randn(1, rows, w.hidden)}


@pytest.mark.parametrize("lane", [2, -1, "0", True, 1.0, [0]])
def test_bad_lane_in_state_operations(worker, lane):
    for op, args, tensors in (("forward", {"start": 0}, _x(worker, 1)), ("reset", {}, None),
                              ("checkpoint", {}, None), ("rollback", {"length": 0}, None),
                              ("snapshot_save", {"slot": 0}, None)):
        h, _ = _call(worker, op, {**args, "lane": lane}, tensors)
        assert not h["ok"] and h["error"]["kind"] == "value", (op, lane, h)


@pytest.mark.parametrize("lanes, positions, rows, why", [
    ([0, 0], [0, 2], 2, "does not extend"),  # a slot's rows leave a gap
    ([0, 0], [0, 0], 2, "does not extend"),  # the same position twice
    ([0, 0], [1, 0], 2, "does not extend"),  # out of order
    ([0, 5], [0, 0], 2, "outside"),
    ([0, 1], [0], 2, "one position per row"),
    ([0], [3], 1, "does not extend"),          # a gap after the slot's length
    ([0], [64], 1, "does not extend"),         # past the context
    ("0", [0], 1, "lists of integers"),
    ([0], [True], 1, "lists of integers"),
    ([0, 1], [0, 0], 3, "one lane and one position per row"),   # rows in x and in the lists disagree
])
def test_bad_rows(worker, lanes, positions, rows, why):
    h, _ = _call(worker, "forward_rows", {"lanes": lanes, "positions": positions}, _x(worker, rows))
    assert not h["ok"] and h["error"]["kind"] == "value" and why in h["error"]["message"], h


@pytest.mark.parametrize("capture", ["1", [True], [1.5], {"1": 1}, [None]])
def test_bad_capture_in_rows(worker, capture):
    h, _ = _call(worker, "forward_rows", {"lanes": [0], "positions": [0], "capture": capture}, _x(worker, 1))
    assert not h["ok"] and h["error"]["kind"] == "value" and "capture" in h["error"]["message"], h


def test_draft_worker_slots(tiny_dir, tmp_path):
    """The draft's operations in a worker name a sequence slot too (each holds a context);
    a hostile slot is a value error and leaves the contexts as they were."""
    import json

    from safetensors.torch import save_file

    from dflash_server.spec.config import DraftConfig
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.remote_draft import MAX_LANES, DraftOps

    c = open_model(tiny_dir("llama")).config
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(0, 1),
                      num_target_layers=c.num_layers)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(DFlashDraft(cfg, DFlashDraft.random_tensors(cfg), "cpu", torch.float32, 64).zlab_state_dict(),
              str(tmp_path / "model.safetensors"))
    ops = DraftOps()
    ops.op_draft_load({"path": str(tmp_path), "device": "cpu", "dtype": "f32", "max_ctx": 64}, {})
    feats = {"features": torch.randn(1, 3, 2 * c.hidden_size)}
    assert ops.op_draft_append({"start": 0, "lane": 1}, feats)[0]["context_length"] == 3
    for bad in (-1, MAX_LANES, "0", True, 1.5, [0], None):
        for op, args, t in ((ops.op_draft_reset, {}, {}), (ops.op_draft_append, {"start": 0}, feats),
                            (ops.op_draft_export, {}, {}),
                            (ops.op_draft_hidden, {"start": 3}, {"embeds": torch.randn(1, 4, c.hidden_size)})):
            with pytest.raises(ValueError, match="lane"):
                op({**args, "lane": bad}, t)
    assert int(ops.op_draft_export({"lane": 1}, {})[1]["length"]) == 3   # slot 1 kept its context
    assert int(ops.op_draft_export({"lane": 0}, {})[1]["length"]) == 0   # slot 0 never had one
    assert ops.op_draft_hidden({"start": 3, "lane": 1}, {"embeds": torch.randn(1, 4, c.hidden_size)})[1][
        "hidden"].shape == (1, 4, c.hidden_size)


def test_serves_after_bad_input(worker):
    for lane in (0, 1):
        assert _call(worker, "reset", {"lane": lane})[0]["ok"]
    h, out = _call(worker, "forward_rows", {"lanes": [1, 0], "positions": [0, 0]}, _x(worker, 2))
    assert h["ok"] and h["result"]["lengths"] == [1, 1] and out["logits"].shape[0] == 2
    h, _ = _call(worker, "forward", {"start": 1, "lane": 1}, _x(worker, 3))
    assert h["ok"] and h["result"]["length"] == 4
    h, _ = _call(worker, "forward", {"start": 1, "lane": 0}, _x(worker, 1))
    assert h["ok"] and h["result"]["length"] == 2          # slot 0 kept its own length
    n = open_model(worker.load_args["model"]).config.num_layers
    h, out = _call(worker, "forward_rows", {"lanes": [0, 1], "positions": [2, 4], "capture": [1, n - 1, n + 5]},
                   _x(worker, 2))
    assert h["ok"] and out[f"cap.{n - 1}"].shape == (1, 2, worker.hidden) and "cap.1" in out


def test_bad_kv_dtype_is_refused_and_a_16_bit_cache_loads(worker):
    """``kv_dtype`` in a load: a name outside auto/f32/f16/bf16 (or not a string) is a value
    error; f16 loads caches of that type, whose forwards serve; the first load serves after."""
    for bad in ("f8", "float16", 16, ["f16"], None, True):
        h, _ = _call(worker, "load", {**worker.load_args, "kv_dtype": bad})
        assert not h["ok"] and h["error"]["kind"] == "value" and "kv_dtype" in h["error"]["message"], bad
    try:
        assert _call(worker, "load", {**worker.load_args, "kv_dtype": "f16"})[0]["ok"]
        h, out = _call(worker, "forward", {"start": 0, "logits": "last"}, _x(worker, 2))
        assert h["ok"] and torch.isfinite(out["logits"]).all()
    finally:
        assert _call(worker, "load", worker.load_args)[0]["ok"]


def test_bad_layer_ranges_are_refused_and_the_worker_loads_after(worker):
    """A worker builds its stages as a server builds a pipeline (over hidden states): layer
    ranges out of the model, with gaps, overlapping or on a remote: device (a worker does not
    spawn workers) are value errors; a good load afterwards serves forwards again."""
    n = int(worker.load_args["shards"][0][2])
    for shards in ([["cpu", 1, n + 1]], [["cpu", 0, 0]], [["cpu", 1, 2], ["cpu", 3, n]], [["cpu", 1, 3], ["cpu", 2, n]],
                   [["remote:cpu", 1, n]]):
        h, _ = _call(worker, "load", {**worker.load_args, "shards": shards})
        assert not h["ok"] and h["error"]["kind"] == "value", (shards, h)
    h, _ = _call(worker, "forward", {"start": 0}, _x(worker, 1))
    assert not h["ok"] and "load first" in h["error"]["message"]
    assert _call(worker, "load", worker.load_args)[0]["ok"]
    h, out = _call(worker, "forward", {"start": 0, "logits": "last"}, _x(worker, 2))
    assert h["ok"] and out["logits"].shape[-1] > 0


def test_cuda_graphs_op_before_load_and_with_junk_arguments(worker):
    """The CUDA-graphs op: a clear value error before any layers are loaded; junk arguments
    are ignored (it takes none); a CPU worker's stages take no graphs; the worker serves on."""
    fresh = authed_worker(SECRET)
    h, _ = _call(fresh, "cuda_graphs")
    assert not h["ok"] and h["error"]["kind"] == "value" and "no layers loaded" in h["error"]["message"], h
    for junk in ({}, {"lane": 0}, {"stages": "all"}, {"x": [1, 2, 3]}):
        h, _ = _call(worker, "cuda_graphs", junk)
        assert h["ok"] and h["result"]["stages"] == {}, (junk, h)
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 3))[0]["ok"]


def test_ragged_rows_only_where_the_worker_says(tiny_dir):
    """A worker reports ``can_ragged`` at load (several rows of a slot in one
    ``forward_rows``: verify blocks of several sequences): attention and Gated DeltaNet
    layers take them, and so do KV Flash pools (each slot's block as its own forward); a
    slot's rows apart are a value error."""
    for family, kvflash in (("llama", None), ("qwen3_5", None), ("llama", {"pool": 32, "chunk": 8})):
        w = authed_worker(SECRET)
        path = tiny_dir(family)
        n = open_model(path).config.num_layers
        h, _ = _call(w, "load", {"model": str(path), "shards": [["cpu", 1, n]], "dtype": "f32", "max_ctx": 64,
                                 "quantize": ["dense", "dense"], "lanes": 2, "kvflash": kvflash})
        assert h["ok"] and h["result"]["can_ragged"] is True, h
        hidden = open_model(path).config.hidden_size
        h, _ = _call(w, "forward_rows", {"lanes": [0, 0, 1], "positions": [0, 1, 0]},
                     {"x": torch.randn(1, 3, hidden)})
        assert h["ok"] and h["result"]["lengths"] == [2, 2, 1], h
        h, _ = _call(w, "forward_rows", {"lanes": [0, 1, 0], "positions": [2, 1, 3]},   # a slot's rows apart
                     {"x": torch.randn(1, 3, hidden)})
        assert not h["ok"] and h["error"]["kind"] == "value", h


def test_tree_rows_at_the_worker(tiny_dir):
    """``forward_rows`` with ``trees`` ([slot, parents] pairs; a worker reports
    ``can_tree_rows`` at load): every malformed or inconsistent tree is a value error that
    leaves the slots as they were; a good one verifies the tree beside another slot's row and
    ``rollback_tree`` keeps its path, on attention and Gated DeltaNet layers and with KV Flash
    pools."""
    for family, kvflash in (("llama", None), ("qwen3_5", None), ("llama", {"pool": 32, "chunk": 8})):
        w = authed_worker(SECRET)
        path = tiny_dir(family)
        cfg = open_model(path).config
        h, _ = _call(w, "load", {"model": str(path), "shards": [["cpu", 1, cfg.num_layers]], "dtype": "f32",
                                 "max_ctx": 64, "quantize": ["dense", "dense"], "lanes": 2, "kvflash": kvflash})
        assert h["ok"] and h["result"]["can_tree_rows"] is True, h
        for lane in (0, 1):
            assert _call(w, "forward", {"start": 0, "lane": lane}, {"x": torch.randn(1, 4, cfg.hidden_size)})[0]["ok"]
        assert _call(w, "checkpoint", {"lane": 0})[0]["ok"]
        rows = {"lanes": [0, 0, 0, 1], "positions": [4, 5, 6, 4]}
        x = {"x": torch.randn(1, 4, cfg.hidden_size)}
        for trees in ("0", {"0": [-1, 0, 0]}, [[0]], [[True, [-1, 0, 0]]], [[0, "x"]], [[0, [-1, 0]]],
                      [[0, [0, 0, 1]]], [[0, [-1, 2, 0]]], [[0, [-1, 0, 0]], [0, [-1, 0, 0]]],
                      [[1, [-1]]], [[5, [-1]]], [[0, [-1] + [0] * 70]], [[0, [-1, 0, 0]], [1, [-1]], [0, [-1]]]):
            h, _ = _call(w, "forward_rows", {**rows, "trees": trees}, x)
            assert not h["ok"] and h["error"]["kind"] == "value", (trees, h)
        h, _ = _call(w, "forward_rows", {**rows, "trees": [[0, [-1, 0, 0]]]}, x)
        assert h["ok"] and h["result"]["lengths"] == [7, 7, 7, 5], h
        assert not _call(w, "rollback", {"lane": 0, "length": 6})[0]["ok"]     # after a tree: a path
        h, _ = _call(w, "rollback_tree", {"lane": 0, "path": [0, 2]})
        assert h["ok"] and h["result"]["length"] == 6, h
        h, _ = _call(w, "forward_rows", {"lanes": [0, 1], "positions": [6, 5]}, {"x": torch.randn(1, 2, cfg.hidden_size)})
        assert h["ok"] and h["result"]["lengths"] == [7, 6], h
