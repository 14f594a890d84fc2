"""EngineConfig: everything an engine is built from (model, placement, kernels, caches,
speculation, PFlash, shard workers), frozen and validated as a whole when it is made.

The CLI makes one from its flags (``EngineConfig.from_args``); a program may make one by
hand. The loaders (``cli.common.load_engine`` and its helpers) only read it. What can be
checked without the model is checked here, so a bad value stops start-up before any weight
is read; what needs the model or the placement (a layer split, a remote device, a draft that
fits the target) is checked where that is known. A ValueError names the CLI flag.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

DTYPE_NAMES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
QUANTIZE = ("auto", "none", "int8", "int4")


def _choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _at_least(flag: str, value, low, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
        raise ValueError(f"{flag} must be >= {low}, got {value!r}")



def address_problem(address: str) -> str | None:
    """What is wrong with a ZeroMQ address a user gave (None: nothing): ipc:///path or
    tcp://host:port with a port in [1, 65535] (ZeroMQ keeps a larger port's low 16 bits,
    so tcp://host:99999 would listen on, or reach, port 34463)."""
    if address.startswith("ipc://"):
        return None if len(address) > len("ipc://") else "an empty ipc path"
    if not address.startswith("tcp://"):
        return "use ipc:///path or tcp://host:port"
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return "the port must be in [1, 65535]"
    return None

DEFAULT_LOOKUP = 5   # prompt-lookup depth beside a draft (benchmarks/spec.py)


@dataclass(frozen=True)
class EngineConfig:
    # model and placement
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "auto"
    target_devices: str | None = None
    target_layer_split: str | None = None
    max_ctx: int | None = None
    kv_dtype: str = "auto"  # the KV cache's element type: auto, f32, f16, bf16
    chunk: int = 512
    compile: bool = False
    cuda_graphs: str = "auto"  # "auto" (on where a GPU stage allows) | "off"
    threads: int | None = None
    kernels: str | None = None  # "native" | "aten" | None (the environment's choice)
    # shard workers
    target_shard_python: str | None = None
    target_shard_connect: str | None = None
    shard_secret_file: str | None = None
    shard_timeout: float = 60.0
    shard_transport: str = "auto"
    # KV Flash
    kvflash: str | None = None  # a token count or "auto"
    kvflash_policy: str = "lru"
    kvflash_chunk: int = 64
    kvflash_tau: int = 64
    # batching
    parallel: str = "1"  # sequence slots: a number or "auto"
    step_tokens: int = 256
    # prefix cache
    prefix_cache_slots: int = 32
    prefix_cache_bytes: int = 4 << 30
    kv_cache_dir: str | None = None
    kv_cache_budget: int = 4096  # MB
    kv_cache_min_tokens: int = 256
    kv_cache_interval: int = 0
    disk_prefix_cache: str = "auto"
    # speculative decoding
    draft: str | None = None
    draft_device: str | None = None
    block_size: int | str = "auto"
    ddtree: bool = False
    ddtree_budget: int | None = None
    lookup: int | None = None  # prompt-lookup drafts a step (spec.lookup); None: see lookup_depth()
    lookup_store: int = 0      # tokens of finished requests kept for lookups across requests (0: off)
    batch_spec: str = "auto"   # several sequences verify drafts in one forward: auto | on | off (batch_speculation())
    no_draft: bool = False
    # prefill compression (PFlash)
    prefill_compression: str = "off"
    prefill_threshold: int = 4096
    prefill_keep_ratio: float = 0.1
    prefill_curve: tuple[str, ...] | None = None
    prefill_drafter: str | None = None
    prefill_drafter_layers: int | None = None
    prefill_drafter_device: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The fields a command's parsed flags carry (the others keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("prefill_curve") is not None:
            values["prefill_curve"] = tuple(values["prefill_curve"])
        if values.get("parallel") is not None:
            values["parallel"] = str(values["parallel"])
        return cls(**values)

    def __post_init__(self) -> None:
        _choice("--dtype", self.dtype, DTYPE_NAMES)
        _choice("--quantize", self.quantize, QUANTIZE)
        _choice("--kv-dtype", self.kv_dtype, ("auto", "f32", "f16", "bf16"))
        _choice("--kernels", self.kernels, ("native", "aten", None))
        _choice("--cuda-graphs", self.cuda_graphs, ("auto", "off"))
        _choice("--shard-transport", self.shard_transport, ("auto", "shm", "inline"))
        _choice("--kvflash-policy", self.kvflash_policy, ("lru", "score"))
        _choice("--prefill-compression", self.prefill_compression, ("off", "auto", "always"))
        for flag, value in (("--chunk", self.chunk), ("--kvflash-chunk", self.kvflash_chunk),
                            ("--kvflash-tau", self.kvflash_tau), ("--step-tokens", self.step_tokens),
                            ("--prefill-threshold", self.prefill_threshold)):
            _at_least(flag, value, 1)
        for flag, value in (("--max-ctx", self.max_ctx), ("--threads", self.threads),
                            ("--prefill-drafter-layers", self.prefill_drafter_layers)):
            _at_least(flag, value, 1, optional=True)
        if self.prefix_cache_slots < 0 or self.prefix_cache_bytes < 0:
            raise ValueError("--prefix-cache-slots and --prefix-cache-bytes must be >= 0")
        if self.kv_cache_interval < 0:
            raise ValueError("--kv-cache-interval must be >= 0")
        if self.kv_cache_budget < 0:
            raise ValueError("--kv-cache-budget must be >= 0")
        if not self.shard_timeout > 0:
            raise ValueError("--shard-timeout must be > 0")
        if self.target_shard_connect and (why := address_problem(self.target_shard_connect)):
            raise ValueError(f"--target-shard-connect {self.target_shard_connect}: {why}")
        if self.target_shard_connect and self.target_shard_python:
            raise ValueError("--target-shard-connect attaches to a running worker: --target-shard-python "
                             "does not apply")
        self.kvflash_pool  # noqa: B018  (parses --kvflash)
        self.lanes_flag  # noqa: B018  (parses --parallel)
        self.disk_min_tokens  # noqa: B018  (parses --disk-prefix-cache)
        if self.block_size != "auto" and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)):
            raise ValueError(f"--block-size must be an integer >= 2 or auto, got {self.block_size!r}")
        if self.block_size != "auto" and self.block_size < 2:
            raise ValueError(f"--block-size must be an integer >= 2 or auto, got {self.block_size!r}")
        from ..spec.lookup import MAX_DEPTH as LOOKUP_MAX

        if self.lookup is not None and (isinstance(self.lookup, bool) or not isinstance(self.lookup, int)
                                        or not 0 <= self.lookup <= LOOKUP_MAX):
            raise ValueError(f"--lookup must be an integer in [0, {LOOKUP_MAX}], got {self.lookup!r}")
        if self.lookup_store:
            from ..spec.lookup import LookupStore

            if isinstance(self.lookup_store, bool) or not isinstance(self.lookup_store, int) \
                    or self.lookup_store < LookupStore.MIN_CAPACITY:
                raise ValueError(f"--lookup-store must be 0 (off) or an integer of at least "
                                 f"{LookupStore.MIN_CAPACITY} tokens, got {self.lookup_store!r}")
        if self.batch_spec not in ("auto", "on", "off"):
            raise ValueError(f"--batch-spec must be auto, on or off, got {self.batch_spec!r}")
        # (without --draft, the built-in model's shipped draft where it runs by default: checked
        # once the target's devices are known, cli.common.load_engine)
        if (self.ddtree or self.ddtree_budget) and (self.no_draft or (self.draft is None and self.model is not None)):
            raise ValueError("--ddtree / --ddtree-budget draft a tree with the DFlash draft: give --draft")
        # flags that only take effect with another one: refused without it, rather than silently dropped
        for need, missing, flags in (
                ("--kv-cache-dir", self.kv_cache_dir is None,
                 (("--kv-cache-interval", self.kv_cache_interval != 0),
                  ("--disk-prefix-cache", self.disk_prefix_cache != "auto"),
                  ("--kv-cache-budget", self.kv_cache_budget != 4096),
                  ("--kv-cache-min-tokens", self.kv_cache_min_tokens != 256))),
                ("--draft", self.no_draft or self.draft is None,
                 (("--block-size", self.block_size != "auto"), ("--draft-device", self.draft_device is not None))),
                ("--kvflash", self.kvflash is None,
                 (("--kvflash-policy", self.kvflash_policy != "lru"), ("--kvflash-chunk", self.kvflash_chunk != 64),
                  ("--kvflash-tau", self.kvflash_tau != 64)))):
            bad = [f for f, on in flags if on]
            if missing and bad:
                raise ValueError(f"{', '.join(bad)} only take effect with {need}: give it (or leave them out)")

    def shipped_draft_by_default(self, builtin: bool, cpu: bool) -> bool:
        """Whether the draft shipped for the built-in model runs without --draft: for that model
        (``builtin``) on a target whose stages are all on CPUs (``cpu``; measured there:
        benchmarks/spec.py, beside prompt lookup), unless --no-draft or --compile (whose verify
        blocks would compile a graph per block size). Elsewhere only --draft turns a draft on."""
        return builtin and cpu and self.draft is None and not self.no_draft and not self.compile

    def batch_speculation(self, cpu: bool) -> bool:
        """Whether several sequences decoding together verify their drafts in one forward
        (blocks sized by the batch sizer) rather than decode plain rows, each keeping its
        draft context and speculating when it runs alone: --batch-spec on / off; auto: on
        unless the target's stages are all on CPUs (``cpu``), where no measurement found
        batched verify paying at 2-4 streams with the shipped draft (0.84-0.98x of plain rows,
        benchmarks/batch_spec.py, 2026-11-27..12-03: a plain row there costs ~4.7 ms of a
        4-row step, a drafted token ~5 ms) and the batch sizer's cost estimates on a noisy VM
        cost up to 16% by choosing verify blocks that do not pay."""
        return self.batch_spec == "on" or (self.batch_spec == "auto" and not cpu)

    def lookup_depth(self, cpu: bool = True) -> int:
        """Prompt-lookup drafts a step: --lookup, else 5, with a draft or alone on a target
        whose stages are all on CPUs (measured there: benchmarks/spec.py); none with
        --no-draft (plain decoding), with --ddtree unless given (then grafted onto the trees:
        engine.speculative.tree_step), or alone on a GPU target (not measured there yet:
        --lookup N turns it on)."""
        if self.lookup is not None:
            return self.lookup
        if self.no_draft or self.ddtree or self.ddtree_budget:
            return 0
        return DEFAULT_LOOKUP if self.draft is not None or cpu else 0

    @property
    def kvflash_pool(self) -> int | str | None:
        """--kvflash as a token count, "auto", or None (off)."""
        if not self.kvflash:
            return None
        if self.kvflash == "auto":
            return "auto"
        try:
            return int(self.kvflash)
        except (TypeError, ValueError):
            raise ValueError(f"--kvflash must be a token count or 'auto', got {self.kvflash!r}") from None

    @property
    def lanes_flag(self) -> int | str:
        """--parallel as a number of sequence slots (>= 1) or "auto"."""
        if self.parallel == "auto":
            return "auto"
        try:
            n = int(self.parallel)
        except ValueError:
            raise ValueError(f"--parallel must be a number of sequence slots or 'auto', got {self.parallel!r}") \
                from None
        if n < 1:
            raise ValueError(f"--parallel must be >= 1, got {n}")
        return n

    @property
    def disk_min_tokens(self) -> int | None:
        """None = disk cache off; else the minimum prefix length written to disk."""
        mode = str(self.disk_prefix_cache)
        if mode in ("off", "full", "auto"):
            n = {"off": None, "full": 0, "auto": max(0, self.kv_cache_min_tokens)}[mode]
        else:
            try:
                n = int(mode)
            except ValueError:
                raise ValueError(f"--disk-prefix-cache must be off, full, auto or a token count, got {mode!r}") \
                    from None
            if n < 0:
                raise ValueError("--disk-prefix-cache N needs N >= 0")
        return None if self.kv_cache_dir is None else n
