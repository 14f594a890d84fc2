"""EngineConfig: the frozen, validated configuration every engine is built from (the CLI's
flags become one; a program can write one by hand)."""
import dataclasses

import pytest

from dflash_server.cli import build_parser
from dflash_server.engine.config import EngineConfig


def parsed(*flags, command="serve"):
    return build_parser().parse_args([command, *flags])


def test_the_cli_defaults_are_the_config_defaults():
    """A flag-less serve / generate gives the hand-made default config (the parser and the
    dataclass agree on every default), except the serve default of --parallel."""
    serve = EngineConfig.from_args(parsed())
    assert dataclasses.replace(serve, parallel="1") == EngineConfig()
    assert serve.parallel == "auto"
    gen = EngineConfig.from_args(parsed("--prompt", "x", command="generate"))
    assert gen == EngineConfig()


def test_flags_reach_the_config_and_it_is_frozen():
    cfg = EngineConfig.from_args(parsed("--kvflash", "1024", "--parallel", "3", "--prefill-curve", "2000:0.5",
                                        "8000:0.2", "--kv-cache-dir", "/tmp/x", "--disk-prefix-cache", "full",
                                        "--draft", "default", "--ddtree-budget", "9", "--block-size", "4"))
    assert (cfg.kvflash_pool, cfg.lanes_flag, cfg.disk_min_tokens) == (1024, 3, 0)
    assert cfg.prefill_curve == ("2000:0.5", "8000:0.2") and cfg.block_size == 4 and cfg.ddtree_budget == 9
    assert cfg.lookup is None and cfg.lookup_depth() == 0      # (with --ddtree-budget: trees, no lookup)
    assert EngineConfig(draft="default", ddtree=True, lookup=3).lookup_depth() == 3   # (grafted onto the trees)
    assert EngineConfig(draft="default").lookup_depth() == 5 and EngineConfig().lookup_depth() == 5
    assert EngineConfig().lookup_depth(cpu=False) == 0 and EngineConfig(draft="default").lookup_depth(cpu=False) == 5
    assert EngineConfig(no_draft=True).lookup_depth() == 0 and EngineConfig(lookup=0).lookup_depth() == 0
    assert EngineConfig.from_args(parsed("--draft", "default", "--lookup", "0")).lookup_depth() == 0
    assert EngineConfig.from_args(parsed("--lookup", "7")).lookup_depth(cpu=False) == 7
    # batched verify: auto is off on an all-CPU target, on elsewhere; on / off as given
    assert [EngineConfig().batch_speculation(cpu) for cpu in (True, False)] == [False, True]
    for flag, want in (("on", True), ("off", False)):
        cfg2 = EngineConfig.from_args(parsed("--batch-spec", flag))
        assert cfg2.batch_spec == flag and cfg2.batch_speculation(True) is want is cfg2.batch_speculation(False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk = 7
    assert cfg.shipped_draft_by_default(True, True) is False                     # (--draft given)
    assert hash(cfg) == hash(dataclasses.replace(cfg))  # frozen and hashable: one value, compared as such
    assert EngineConfig().disk_min_tokens is None
    assert EngineConfig(kv_cache_dir="/d").disk_min_tokens == 256
    assert EngineConfig(kvflash="auto").kvflash_pool == "auto" and EngineConfig().kvflash_pool is None


@pytest.mark.parametrize("kw,flag", [
    ({"dtype": "fp8"}, "--dtype"), ({"quantize": "int2"}, "--quantize"), ({"kv_dtype": "f8"}, "--kv-dtype"),
    ({"kv_dtype": "float16"}, "--kv-dtype"), ({"kv_dtype": None}, "--kv-dtype"), ({"kernels": "cuda"}, "--kernels"),
    ({"shard_transport": "udp"}, "--shard-transport"), ({"kvflash_policy": "fifo"}, "--kvflash-policy"),
    ({"prefill_compression": "sometimes"}, "--prefill-compression"), ({"chunk": 0}, "--chunk"),
    ({"chunk": True}, "--chunk"), ({"chunk": "512"}, "--chunk"), ({"max_ctx": 0}, "--max-ctx"),
    ({"threads": -1}, "--threads"), ({"kvflash_chunk": 0}, "--kvflash-chunk"), ({"step_tokens": 0}, "--step-tokens"),
    ({"prefix_cache_slots": -1}, "--prefix-cache-slots"), ({"prefix_cache_bytes": -5}, "--prefix-cache-bytes"),
    ({"kv_cache_interval": -1}, "--kv-cache-interval"), ({"kv_cache_budget": -1}, "--kv-cache-budget"),
    ({"shard_timeout": 0}, "--shard-timeout"), ({"shard_timeout": float("nan")}, "--shard-timeout"),
    ({"target_shard_connect": "tcp://127.0.0.1:1", "target_shard_python": "python3"}, "--target-shard-python"),
    ({"kvflash": "lots"}, "--kvflash"), ({"parallel": "many"}, "--parallel"), ({"parallel": "0"}, "--parallel"),
    ({"disk_prefix_cache": "sometimes"}, "--disk-prefix-cache"), ({"disk_prefix_cache": "-4"}, "--disk-prefix-cache"),
    ({"block_size": "big"}, "--block-size"), ({"ddtree": True, "model": "/m"}, "--ddtree"),
    ({"ddtree": True, "no_draft": True}, "--ddtree"),
    ({"cuda_graphs": "on"}, "--cuda-graphs"), ({"cuda_graphs": None}, "--cuda-graphs"),
    ({"ddtree_budget": 8, "draft": "default", "no_draft": True}, "--ddtree"),
    ({"lookup": -1, "draft": "default"}, "--lookup"), ({"lookup": 17, "draft": "default"}, "--lookup"),
    ({"lookup": True, "draft": "default"}, "--lookup"), ({"lookup": "5", "draft": "default"}, "--lookup"),
    ({"lookup": 2.5, "draft": "default"}, "--lookup"),
    ({"lookup_store": -1}, "--lookup-store"), ({"lookup_store": 10}, "--lookup-store"),
    ({"lookup_store": True}, "--lookup-store"), ({"lookup_store": "4096"}, "--lookup-store"),
    ({"lookup_store": 2.5}, "--lookup-store"),
    ({"batch_spec": "maybe"}, "--batch-spec"), ({"batch_spec": True}, "--batch-spec"), ({"batch_spec": None}, "--batch-spec"),
])
def test_bad_values_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**kw)


def test_a_hand_made_config_builds_an_engine(tiny_dir):
    """Without argparse: the loaders read only the config."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.generate import GenerationRequest

    cfg = EngineConfig(model=str(tiny_dir("llama")), device="cpu", dtype="fp32", max_ctx=128, prefix_cache_slots=2,
                       parallel="2")
    source, pipeline, engine = load_engine(cfg, progress=False)
    try:
        assert pipeline.max_ctx == 128 and pipeline.lanes == 2 and engine.prefix_cache is not None
        ids = source.tokenizer.encode("hello there")
        r = engine.generate(GenerationRequest(tuple(ids), max_tokens=3, ignore_eos=True))
        assert len(r.token_ids) == 3
    finally:
        engine.close()


@pytest.mark.parametrize("kw,flags", [
    ({"kv_cache_interval": 64, "disk_prefix_cache": "full"}, "--kv-cache-interval, --disk-prefix-cache"),
    ({"kv_cache_budget": 1}, "--kv-cache-budget"), ({"kv_cache_min_tokens": 8}, "--kv-cache-min-tokens"),
    ({"block_size": 4}, "--block-size"), ({"draft_device": "cpu"}, "--draft-device"),
    ({"draft": "default", "no_draft": True, "block_size": 4}, "--block-size"),

    ({"kvflash_policy": "score"}, "--kvflash-policy"), ({"kvflash_chunk": 16, "kvflash_tau": 8},
                                                        "--kvflash-chunk, --kvflash-tau"),
])
def test_flags_that_need_another_are_refused_without_it(kw, flags):
    """Hostile review (2026-11-27): these were dropped without a word (no disk cache, no draft,
    no KV Flash), unlike --ddtree without --draft."""
    with pytest.raises(ValueError, match=flags):
        EngineConfig(**kw)


def test_a_block_of_one_is_refused_with_the_flags():
    """--block-size 1 passed the flags and stopped the server only after its port was bound."""
    with pytest.raises(ValueError, match="--block-size must be an integer >= 2"):
        EngineConfig(draft="default", block_size=1)


def test_the_shipped_draft_is_on_by_default_only_for_the_built_in_model_on_a_cpu(tmp_path):
    """Without --draft the shipped draft runs for the built-in model on an all-CPU target,
    not for another model, not on a GPU, not with --no-draft or --compile; --model naming
    the built-in model's file counts as the built-in model, a copy elsewhere does not."""
    from dflash_server.cli.common import is_builtin_model, resolve_draft_path
    from dflash_server.weights.default_model import default_draft_path, default_model_path

    on = EngineConfig()
    assert on.shipped_draft_by_default(builtin=True, cpu=True)
    assert not on.shipped_draft_by_default(builtin=False, cpu=True)
    assert not on.shipped_draft_by_default(builtin=True, cpu=False)
    for flags in (("--no-draft",), ("--compile",)):
        assert not EngineConfig.from_args(parsed(*flags)).shipped_draft_by_default(True, True), flags
    assert resolve_draft_path(on, builtin=True, cpu=True) == default_draft_path() is not None
    assert resolve_draft_path(on, builtin=False, cpu=True) is None
    assert resolve_draft_path(EngineConfig(no_draft=True), builtin=True, cpu=True) is None
    assert resolve_draft_path(EngineConfig(draft="x"), builtin=False, cpu=False) == "x"
    # --ddtree without --draft: the built-in model's draft where it runs by default (checked at load)
    assert resolve_draft_path(EngineConfig(ddtree=True), builtin=True, cpu=True) == default_draft_path()
    assert is_builtin_model(None) and is_builtin_model(str(default_model_path()))
    copy = tmp_path / default_model_path().name
    copy.write_bytes(b"")
    assert not is_builtin_model(str(copy)) and not is_builtin_model(str(tmp_path / "missing"))
