"""Flags shared by every command that loads the target, and the loading itself."""
from __future__ import annotations

import argparse

import torch

from ..cache.fingerprint import fingerprint, text_hash
from ..engine.config import EngineConfig
from .. import kernels
from ..errors import ShardError, UserError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


MAX_THREADS = 1024  # torch / OpenMP crash (or hang) creating tens of thousands of threads


def int_in(text: str, low: int, high: int) -> int:
    v = _int_at_least(text, low)
    if v > high:
        raise argparse.ArgumentTypeError(f"must be <= {high}, got {v}")
    return v


def thread_count(text: str) -> int:
    return int_in(text, 1, MAX_THREADS)


def utf8_text(text: str) -> str:
    """A text argument: valid UTF-8 (Python hands undecodable argv bytes over as lone
    surrogates, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return text


def non_empty_path(text: str) -> str:
    """A path argument: an empty one (an unset shell variable) would mean the working directory."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


MAX_TEXT_FILE = 64 << 20  # no prompt, template or key file is larger (a context holds far less)


def read_text_file(path, what: str, limit: int = MAX_TEXT_FILE) -> str:
    """A UTF-8 text file read within ``limit`` bytes (a UserError naming ``what`` otherwise:
    /dev/zero must not be read until the OOM killer comes)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise UserError(f"{what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise UserError(f"{what} {path}: larger than {limit >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and placement")
    g.add_argument("--model", type=non_empty_path, help="HF model directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps, xpu (default: cuda if present)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype (default bf16; fp16 is very slow on CPU)")
    g.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of linear layers (auto: follow a quantized GGUF on CPU: "
                        "4-bit types -> int4, other quantized types -> int8)")
    g.add_argument("--target-devices", help="comma-separated devices, one per shard (e.g. cpu,cpu or cuda:0,cuda:1)")
    g.add_argument("--target-layer-split", help="comma-separated relative layer counts per shard (e.g. 1,2)")
    g.add_argument("--target-shard-python", help="interpreter of the environment that runs the shard worker "
                   "for remote: devices (default: this one)")
    g.add_argument("--target-shard-connect", help="attach to a shard worker started by hand "
                   "(tcp://host:port or ipc:///path) instead of spawning one")
    g.add_argument("--shard-secret-file", help="shared secret for --target-shard-connect (else $DFLASH_SHARD_SECRET)")
    g.add_argument("--shard-timeout", type=float, default=60.0,
                   help="seconds a shard worker may take for one operation before it is restarted (default 60)")
    g.add_argument("--shard-transport", default="auto", choices=["auto", "shm", "inline"],
                   help="tensors to the worker through shared memory (one host) or inline frames "
                        "(auto: shared memory for ipc:// addresses)")
    g.add_argument("--kvflash", help="KV Flash: keep attention KV in a pool of this many tokens per layer "
                   "(or 'auto': half the context, >= 512) and page the rest to host memory")
    g.add_argument("--kvflash-policy", default="lru", choices=["lru", "score"],
                   help="which chunk leaves the pool: least recently written (lru) or least attended (score)")
    g.add_argument("--kvflash-chunk", type=positive_int, default=64, help="KV Flash chunk in tokens (default 64)")
    g.add_argument("--kvflash-tau", type=positive_int, default=64,
                   help="score policy: re-select resident chunks every N tokens (default 64)")
    g.add_argument("--max-ctx", type=positive_int, help="context size (KV preallocated); default min(model, 8192)")
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "f32", "f16", "bf16"],
                   help="element type of the attention KV cache (auto: f16 on a CPU with the native kernels and "
                        "16-bit activations, half the memory and bytes read per token of f32; f32 on a CPU "
                        "otherwise and with --compile; the compute dtype on a GPU)")
    g.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size in tokens")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the single-token decode step (slow first start, faster decode)")
    g.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                   help="replay GPU stages' decode steps, DFlash verify blocks and batched decode rows as CUDA "
                        "graphs (auto: where the stage allows it: no MoE layers, no KV Flash, no --compile)")
    g.add_argument("--threads", type=thread_count, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--kernels", choices=["native", "aten"], default=None,
                   help="CPU kernels of quantized linears, RMSNorm and decode/verify attention: 'native' (default; "
                        "the project's C++ kernels, built at first use: GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks "
                        "read as stored, int8 activations, row-count invariant) or 'aten' (torch's kernels, bf16 "
                        "activations). $DFLASH_KERNELS=0 also selects aten")
    g.add_argument("--native-kernels", action="store_const", const="native", dest="kernels", help=argparse.SUPPRESS)
    c = p.add_argument_group("prefix cache")
    c.add_argument("--prefix-cache-slots", type=int, default=32,
                   help="in-memory prefix snapshots (chat-turn boundaries); 0 disables")
    c.add_argument("--prefix-cache-bytes", type=int, default=4 << 30,
                   help="memory budget of the prefix snapshots in bytes (default 4 GiB)")
    c.add_argument("--kv-cache-dir", type=non_empty_path, help="directory of the restart-persistent prefix cache (disk); off if unset")
    c.add_argument("--kv-cache-budget", type=int, default=4096, help="disk cache budget in MB (default 4096)")
    c.add_argument("--kv-cache-min-tokens", type=int, default=256,
                   help="with --disk-prefix-cache auto: only prefixes of at least this many tokens go to disk")
    c.add_argument("--kv-cache-interval", type=int, default=0,
                   help="during long generations, write a disk snapshot every N tokens (0: off)")
    c.add_argument("--disk-prefix-cache", default="auto",
                   help="off | full (every snapshot) | auto (>= --kv-cache-min-tokens) | N (>= N tokens)")
    d = p.add_argument_group("speculative decoding (DFlash)")
    d.add_argument("--draft", help="DFlash draft directory (z-lab format) or .gguf; 'default' = the draft "
                                   "shipped for the built-in model (on by default for that model on a CPU, "
                                   "without --compile; --no-draft turns it off)")
    d.add_argument("--draft-device", help="device of the draft (default: the target's last stage device)")
    d.add_argument("--block-size", type=block_size_arg, default="auto",
                   help="verify block size N (may be smaller than trained), or auto (default): each step picks "
                        "the block, up to the trained one, expected to commit the most tokens per second from "
                        "measured acceptance and step times (1 = a plain decode step)")
    d.add_argument("--ddtree", action="store_true",
                   help="DDTree: verify a best-first tree of draft tokens each step instead of the argmax chain "
                        "(lossless; local stages without a KV Flash pool, else chains)")
    d.add_argument("--ddtree-budget", type=tree_budget_arg, default=None, metavar="N",
                   help="draft tree nodes per step, 1-63 (default 22; implies --ddtree)")
    d.add_argument("--lookup", type=lookup_arg, default=None, metavar="N",
                   help="prompt lookup: where the context repeats its last 2-4 tokens, verify up to N tokens "
                        "copied from after their earlier occurrence (0-16, 0: off; default 5 beside a --draft, "
                        "and alone, without a draft model, on a CPU target; off with --no-draft, or alone on a "
                        "GPU; with --ddtree off unless given, then grafted onto the trees as a path)")
    d.add_argument("--lookup-store", type=non_negative_int, default=0, metavar="N",
                   help="prompt lookup across requests: keep the last N tokens of finished requests' prompts "
                        "and outputs, and where a sequence's own context has no match, verify what followed "
                        "its last 3-8 tokens there (lossless; 0: off, the default: response times may then "
                        "tell one user whether another's text continued the same way); needs lookups on "
                        "(--lookup N, or the default beside a draft on a CPU)")
    d.add_argument("--batch-spec", default="auto", choices=["auto", "on", "off"],
                   help="several sequences decoding together verify their draft blocks in one forward, "
                        "sized by the batch sizer (on), or decode plain rows in one forward while each keeps "
                        "its draft context and speculates when it runs alone (off); auto (default): on unless "
                        "the target runs on CPUs only (measured there: plain rows pay better at 2-4 streams)")
    d.add_argument("--no-draft", action="store_true",
                   help="plain autoregressive decoding: no draft, and no prompt lookup unless --lookup N")
    f = p.add_argument_group("prefill compression (PFlash)")
    f.add_argument("--prefill-compression", default="off", choices=["off", "auto", "always"],
                   help="compress long prompts with the prefill drafter: never (default), from "
                        "--prefill-threshold tokens on (auto), or always; a request may override it")
    f.add_argument("--prefill-threshold", type=positive_int, default=4096,
                   help="auto: prompts of at least this many tokens are compressed (default 4096)")
    f.add_argument("--prefill-keep-ratio", type=float, default=0.1,
                   help="fraction of the prompt's 32-token chunks kept (default 0.1)")
    f.add_argument("--prefill-curve", nargs="+", metavar="T:R",
                   help="keep ratio by prompt length, piecewise linear (e.g. 2000:0.5 8000:0.2); "
                        "overrides --prefill-keep-ratio")
    f.add_argument("--prefill-drafter", metavar="PATH|self:N",
                   help="the model that scores the prompt: a model directory or .gguf (its own tokenizer), "
                        "or self:N, the target's own first N layers (no second model in memory)")
    f.add_argument("--prefill-drafter-layers", type=positive_int,
                   help="a drafter file: score with its first N layers only (default: all)")
    f.add_argument("--prefill-drafter-device", help="device of a drafter file (default: the target's first)")


FLOAT_TYPES = ("F32", "F16", "BF16")
DEFAULT_TREE_BUDGET = 22  # DDTree nodes per step (the seed's --ddtree-budget default)


def _mode_for(gguf_type: str | None) -> str:
    if gguf_type is None or gguf_type in FLOAT_TYPES:
        return "dense"
    return "int4" if gguf_type.startswith("Q4") else "int8"


def quantize_plan(source, flag: str, cpu_bf16: bool, cuda: bool = False) -> tuple[str, str]:
    """(layers mode, LM head mode). ``auto`` keeps a quantized GGUF quantized on CPU (bf16)
    and on CUDA GPUs (``cuda``: every shard on one, bf16/fp16): the layers follow the majority
    type of layer 0's weights, the head its own stored type (never below 8 bits). On a GPU
    4-bit layers run aten's int4 kernel, others stay int8 in memory (dequantized per call):
    a GGUF no longer grows to bf16 there."""
    if flag == "none":
        return ("dense", "dense")
    if flag in ("int8", "int4"):
        return (flag, "int8")  # the LM head is the most sensitive matrix: keep it at 8 bits
    if not (cpu_bf16 or cuda) or source.format != "gguf":
        return ("dense", "dense")
    names = [n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                         "mlp.down_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.out_proj.weight")
             if source.has(f"model.layers.0.{n}")]
    modes = [_mode_for(source.source_type(f"model.layers.0.{n}")) for n in names]
    layer_mode = max(set(modes), key=modes.count) if modes else "dense"
    head = "lm_head.weight" if source.has("lm_head.weight") and not source.config.tie_word_embeddings \
        else "model.embed_tokens.weight"
    head_mode = _mode_for(source.source_type(head))
    return (layer_mode, "int8" if head_mode == "int4" else head_mode)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def engine_config(args) -> EngineConfig:
    """The EngineConfig of a command's parsed flags (UserError naming the flag when one is bad)."""
    try:
        return EngineConfig.from_args(args)
    except ValueError as e:
        raise UserError(str(e)) from None


def load_engine(cfg: EngineConfig, progress: bool = True):
    """Build (source, pipeline, engine) from an EngineConfig; raises UserError on bad input."""
    from ..engine.generate import Engine
    from ..runtime.pipeline import build_pipeline
    from ..runtime.placement import parse_devices, parse_split, plan_placement
    from ..weights.default_model import default_model_path
    from ..weights.loader import open_model

    policy = pflash_policy(cfg)  # (its flags checked before any weight is read)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.kernels:
        import os

        # read by Linear.quantize_, here and in spawned shard workers
        os.environ["DFLASH_KERNELS"] = "1" if cfg.kernels == "native" else "0"
    source = open_model(cfg.model or default_model_path())
    mcfg = source.config
    try:
        device = resolve_device(cfg.device)
        devices = parse_devices(cfg.target_devices) if cfg.target_devices else parse_devices(device)
        split = parse_split(cfg.target_layer_split) if cfg.target_layer_split else None
        # an automatic split keeps KV-shared layers with their sources (no KV rows between
        # stages); a split given by hand is taken as given
        shards = plan_placement(mcfg.num_layers, devices, split, together=mcfg.kv_groups() if split is None else ())
    except ValueError as e:
        raise UserError(str(e)) from None
    for d in {s.device for s in shards}:
        if d.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device {d} requested but CUDA is not available")
    dtype = torch.bfloat16 if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    max_ctx = cfg.max_ctx or min(mcfg.max_position_embeddings, 8192)
    kinds = {s.device.removeprefix("remote:").split(":")[0] for s in shards}
    draft_path = resolve_draft_path(cfg, builtin=is_builtin_model(cfg.model), cpu=kinds == {"cpu"})
    if (cfg.ddtree or cfg.ddtree_budget) and not draft_path:
        raise UserError("--ddtree / --ddtree-budget draft a tree with the DFlash draft: give --draft (the built-in "
                        "model's shipped draft runs without it only on a CPU target, without --compile)")
    # Verify blocks run B rows at once; the weight-only int4 kernel's cost grows linearly
    # with rows while bf16 GEMM's grows slowly, but measured on the 2-core dev CPU int4 still
    # wins up to ~8-16 rows (gate_up at 8 rows: int4 174 us vs bf16 219 us; LM head 2.7 ms
    # vs 4.5 ms), so `auto` quantizes with a draft too.
    quantize = quantize_plan(source, cfg.quantize, kinds == {"cpu"} and dtype == torch.bfloat16,
                             cuda=kinds == {"cuda"} and dtype in (torch.bfloat16, torch.float16))
    kvflash = kvflash_config(cfg)
    # --compile's graphs attend with aten, which reads an fp32 cache fastest on a CPU
    kv_dtype = "f32" if cfg.kv_dtype == "auto" and cfg.compile and kinds == {"cpu"} else cfg.kv_dtype
    lanes = choose_lanes(cfg.lanes_flag, source, shards, dtype, max_ctx, quantize,
                         kv_tokens=kv_pool_tokens(kvflash, max_ctx), kv_dtype=kv_dtype)
    check_memory(source, shards, dtype, max_ctx, quantize, kvflash, progress, lanes, kv_dtype)
    try:
        pipeline = build_pipeline(source, shards, dtype=dtype, max_ctx=max_ctx, quantize=quantize,
                                  progress=progress, remote=remote_options(cfg, shards), threads=cfg.threads,
                                  kvflash=kvflash, lanes=lanes, kv_dtype=kv_dtype)
    except (ShardError, ValueError) as e:
        raise UserError(str(e)) from None
    if cfg.compile:
        pipeline.compile_decode()
    elif cfg.cuda_graphs == "auto":
        import sys

        for label, why in pipeline.use_cuda_graphs().items():
            if progress:
                print(f"dflash-server: CUDA graphs on {label}: {'off (' + why + ')' if why else 'on'}",
                      file=sys.stderr)
    lookup = cfg.lookup_depth(cpu=kinds == {"cpu"})
    if draft_path:
        proposer = load_proposer(cfg, pipeline, dtype, draft_path, quantize[0], cpu=kinds == {"cpu"})
    elif lookup:   # prompt lookup alone: no draft model
        from ..spec.lookup import LookupProposer

        proposer = LookupProposer(pipeline, lookup)
    else:
        proposer = None
    if cfg.lookup_store:
        if proposer is None or not proposer.lookup_depth:
            raise UserError("--lookup-store needs prompt lookups: give --lookup N (they are off here)")
        from ..spec.lookup import LookupStore

        proposer.lookup_store = LookupStore(cfg.lookup_store)
    fp_parts = {"snapshot_format": 1, "weights": source.fingerprint(), "format": source.format,
                "family": mcfg.family, "dtype": str(dtype), "shards": [(s.device, s.begin, s.end) for s in shards],
                "max_ctx": max_ctx, "quantize": quantize, "chat_template": text_hash(source.tokenizer.chat_template),
                "draft": draft_identity(draft_path) + [proposer.draft.quantize] if draft_path else None,
                "kvflash": [kvflash_pools(pipeline, kvflash, max_ctx), kvflash.chunk] if kvflash else None}
    if (kv := cache_dtypes(pipeline)) != ["float32"]:  # (absent for fp32: earlier caches stay valid)
        fp_parts["kv_dtype"] = kv
    # what else changes the state a prefill leaves (absent at the defaults: earlier caches stay
    # valid): the aten kernels on a CPU stage (asked for, or the native build failed) round
    # differently, and KV Flash's residency policy keeps other chunks
    if any(str(s.device).startswith("cpu") for s in shards) and not (kernels.enabled() and kernels.load()):
        fp_parts["kernels"] = "aten"
    if kvflash and (kvflash.policy, kvflash.tau, kvflash.sink_chunks, kvflash.tail_chunks) != ("lru", 64, 1, 4):
        fp_parts["kvflash_policy"] = [kvflash.policy, kvflash.tau, kvflash.sink_chunks, kvflash.tail_chunks]
        if kvflash.policy == "score":   # 2: committed rows observed, re-selection at multiples of tau (2026-12-07)
            fp_parts["kvflash_policy"].append(2)
    disk = open_disk_cache(cfg, fingerprint(fp_parts))
    compressor = load_compressor(cfg, pipeline, dtype, quantize[0])
    engine = Engine(pipeline, chunk=cfg.chunk, proposer=proposer, prefix_slots=cfg.prefix_cache_slots,
                    prefix_bytes=cfg.prefix_cache_bytes, disk_cache=disk, checkpoint_interval=cfg.kv_cache_interval,
                    step_tokens=cfg.step_tokens, compressor=compressor,
                    compress_policy=policy)
    engine.fingerprint = fingerprint(fp_parts)
    return source, pipeline, engine


def pflash_policy(cfg: EngineConfig):
    """The PFlashPolicy of the --prefill-* flags (UserError when they do not add up)."""
    from ..pflash.policy import PFlashPolicy, parse_curve

    try:
        policy = PFlashPolicy(cfg.prefill_compression, cfg.prefill_threshold, cfg.prefill_keep_ratio,
                              parse_curve(cfg.prefill_curve))
    except ValueError as e:
        raise UserError(f"--prefill-*: {e}") from None
    if policy.mode != "off" and not cfg.prefill_drafter:
        raise UserError(f"--prefill-compression {policy.mode} needs --prefill-drafter (a model directory or "
                        ".gguf, or self:N for the target's own first N layers)")
    return policy


def load_compressor(cfg: EngineConfig, pipeline, dtype, layer_mode: str = "dense"):
    """The PFlash Compressor of --prefill-drafter, or None."""
    from ..pflash.compressor import Compressor
    from ..pflash.scorer import PromptScorer

    spec = cfg.prefill_drafter
    if not spec:
        if cfg.prefill_drafter_layers or cfg.prefill_drafter_device:
            raise UserError("--prefill-drafter-layers / --prefill-drafter-device need --prefill-drafter")
        return None
    try:
        if spec.startswith("self:"):
            if cfg.prefill_drafter_layers or cfg.prefill_drafter_device:
                raise UserError("--prefill-drafter self:N uses the target's layers where they are: "
                                "--prefill-drafter-layers / --prefill-drafter-device do not apply")
            try:
                n = int(spec.removeprefix("self:"))
            except ValueError:
                raise UserError(f"--prefill-drafter {spec}: expected self:N with N a number of layers") from None
            scorer = PromptScorer.from_stage(pipeline.stages[0], n, chunk=cfg.chunk)
        elif spec.startswith("remote:"):
            raise UserError("--prefill-drafter takes a model path or self:N; put a drafter file in a worker with "
                            "--prefill-drafter-device remote:<device>")
        else:
            device = resolve_device(cfg.prefill_drafter_device) if cfg.prefill_drafter_device \
                else str(pipeline.stages[0].device)
            if device.startswith("remote:"):
                return Compressor(remote_scorer(cfg, spec, device.removeprefix("remote:"), pipeline, dtype),
                                  pipeline.tokenizer)
            scorer = PromptScorer.load(spec, device=device, dtype=dtype, max_ctx=pipeline.max_ctx,
                                       n_layers=cfg.prefill_drafter_layers,
                                       quantize=layer_mode if device.startswith("cpu") else "dense",
                                       chunk=cfg.chunk)
    except (ValueError, OSError) as e:
        raise UserError(f"--prefill-drafter {spec}: {e}") from None
    return Compressor(scorer, pipeline.tokenizer)


AUTO_LANES = 4  # --parallel auto: at most this many sequence slots


def cache_dtypes(pipeline) -> list[str]:
    """The KV caches' element types over the stages (a shard worker's: its --kv-dtype choice),
    part of the snapshot fingerprint: a snapshot restores only into caches of its own type."""
    kinds: set[str] = set()
    for st in pipeline.stages:
        if st.is_remote:
            kinds.add(f"remote:{st.kv_dtype}")
        else:
            kinds.update(str(b.k.dtype).removeprefix("torch.") for b in st.banks if b is not None)
    return sorted(kinds) or ["float32"]


def kvflash_pools(pipeline, kvflash, max_ctx: int):
    """The KV Flash pool size for the cache fingerprint: the one the settings give (what
    earlier caches recorded), or, where a stage built another (``auto`` on a GPU sizes it
    from free memory and the slots), every local stage's."""
    nominal = kvflash.pool_tokens(max_ctx)
    built = [st.kv_pool_tokens for st in pipeline.stages if not st.is_remote]
    return nominal if all(b == nominal for b in built) else built


def choose_lanes(flag: int | str, source, shards, dtype, max_ctx: int, quantize, kv_tokens: int | None = None,
                 kv_dtype: str = "auto") -> int:
    """Sequence slots for ``--parallel`` (EngineConfig.lanes_flag): a number, or ``auto``: up
    to AUTO_LANES, fewer when their KV would take more than a quarter of the host's available
    memory (CPU shards, a shard worker on this host included) or not fit a GPU."""
    from ..runtime.memory import check_fits, estimate, gpu_free, host_available

    if flag != "auto":
        return int(flag)
    for n in range(AUTO_LANES, 1, -1):
        needs = estimate(source, shards, dtype, max_ctx, quantize, kv_tokens, lanes=n, kv_dtype=kv_dtype)
        host_kv = sum(d.kv for d in needs if d.device.removeprefix("remote:").startswith("cpu"))
        if host_kv > host_available() // 4:
            continue
        try:
            check_fits(needs, gpu_free(needs))
        except ValueError:
            continue
        return n
    return 1


def check_memory(source, shards, dtype, max_ctx, quantize, kvflash, progress: bool, lanes: int = 1,
                 kv_dtype: str = "auto") -> None:
    """Print what each device will hold (placements with a GPU) and stop before loading when
    a GPU cannot hold its share (``runtime.memory``). A KV Flash pool counts at its size (``auto``: its minimum;
    it grows into what is free)."""
    import sys

    from ..runtime.memory import GIB, check_fits, estimate, gpu_free, host_available

    needs = estimate(source, shards, dtype, max_ctx, quantize, kv_pool_tokens(kvflash, max_ctx), lanes, kv_dtype)
    if all(s.device.removeprefix("remote:").startswith("cpu") for s in shards):
        # a CPU placement loads whatever fits (the weights are mapped), but a KV cache (and
        # the RoPE tables) that the host cannot hold at all is refused here, not by an abort
        # or the OOM killer later
        local = sum(n.kv for n, sh in zip(needs, shards) if not sh.device.startswith("remote:"))
        local += 2 * max_ctx * source.config.head_dim * 4
        room = host_available()
        if local > room:
            raise UserError(f"the KV cache of {lanes} sequence slot(s) x --max-ctx {max_ctx} needs "
                            f"~{local / GIB:.1f} GiB on this host, which has {room / GIB:.1f} GiB available: lower "
                            f"--max-ctx or --parallel, or bound the KV with --kvflash")
        return
    if progress:
        print("dflash-server: memory estimate: " + "; ".join(n.describe() for n in needs), file=sys.stderr)
    try:
        check_fits(needs, gpu_free(needs))
    except ValueError as e:
        raise UserError(str(e)) from None


def kv_pool_tokens(kvflash, max_ctx: int) -> int | None:
    """KV rows per layer and slot under KV Flash (``auto``: its minimum; it grows into what
    is free); None without it (the whole context)."""
    return kvflash.pool_tokens(max_ctx, 0 if kvflash.pool == "auto" else None) if kvflash else None


def kvflash_config(cfg: EngineConfig):
    from ..runtime.kv_pager import KvFlashConfig

    pool = cfg.kvflash_pool
    if pool is None:
        return None
    try:
        return KvFlashConfig(pool, chunk=cfg.kvflash_chunk, policy=cfg.kvflash_policy, tau=cfg.kvflash_tau)
    except ValueError as e:
        raise UserError(str(e)) from None


def remote_options(cfg: EngineConfig, shards):
    """RemoteOptions for ``remote:`` shards (None when every shard is local)."""
    from ..runtime.placement import is_remote

    if not any(is_remote(s.device) for s in shards):
        if cfg.target_shard_connect or cfg.target_shard_python:
            raise UserError("--target-shard-connect / --target-shard-python need remote: devices in "
                            "--target-devices (e.g. cpu,remote:cpu)")
        return None
    secret = None
    if cfg.target_shard_connect:
        from .shard_worker import read_secret

        secret = read_secret(cfg.shard_secret_file)
    return worker_options(cfg, connect=cfg.target_shard_connect, secret=secret)


def worker_options(cfg: EngineConfig, **kw):
    """RemoteOptions from the --target-shard-python / --shard-* flags (target or draft worker)."""
    from ..runtime.worker_link import RemoteOptions

    return RemoteOptions(python=cfg.target_shard_python, timeout_s=cfg.shard_timeout,
                         transport=cfg.shard_transport, **kw)


def remote_draft(cfg: EngineConfig, path, device: str, pipeline, dtype, quantize: str = "dense"):
    """The draft in its own spawned shard worker (``--draft-device remote:<device>``)."""
    from ..runtime.placement import parse_devices
    from ..spec.remote_draft import RemoteDraft

    try:
        parse_devices(device)
    except ValueError:
        raise UserError(f"--draft-device remote:{device}: unknown device") from None
    opts = worker_options(cfg)
    try:
        return RemoteDraft(path, device=device, home=str(pipeline.device), dtype=dtype, max_ctx=pipeline.max_ctx,
                           options=opts, quantize=quantize)
    except ShardError as e:
        raise UserError(str(e)) from None


def remote_scorer(cfg: EngineConfig, path: str, device: str, pipeline, dtype):
    """The prefill drafter in its own spawned shard worker (``--prefill-drafter-device remote:<device>``)."""
    from ..pflash.remote import RemoteScorer
    from ..runtime.placement import parse_devices

    try:
        parse_devices(device)
    except ValueError:
        raise UserError(f"--prefill-drafter-device remote:{device}: unknown device") from None
    try:
        return RemoteScorer(path, device=device, dtype=dtype, max_ctx=pipeline.max_ctx, options=worker_options(cfg),
                            n_layers=cfg.prefill_drafter_layers, chunk=cfg.chunk,
                            quantize="dense")
    except ShardError as e:
        raise UserError(str(e)) from None


def draft_identity(path) -> list:
    from pathlib import Path

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.iterdir())
    return [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files if f.is_file()]


def open_disk_cache(cfg: EngineConfig, fp: str):
    from ..cache.disk import DiskCache

    min_tokens = cfg.disk_min_tokens
    if min_tokens is None:
        return None
    try:
        return DiskCache(cfg.kv_cache_dir, fp, cfg.kv_cache_budget << 20, min_tokens)
    except OSError as e:
        raise UserError(f"--kv-cache-dir {cfg.kv_cache_dir}: {e}") from None


def is_builtin_model(model: str | None) -> bool:
    """Whether --model names the built-in default model (or is absent)."""
    from pathlib import Path

    from ..weights.default_model import default_model_path

    if model is None:
        return True
    try:
        return Path(model).resolve() == Path(default_model_path()).resolve()
    except (OSError, RuntimeError, ValueError, UserError):   # (the built-in model not installed)
        return False


def resolve_draft_path(cfg: EngineConfig, builtin: bool = False, cpu: bool = False):
    """--draft PATH, or ``--draft default`` for the draft shipped with the built-in model;
    without --draft that draft too where ``cfg.shipped_draft_by_default`` says (the built-in
    model on a CPU: measured with benchmarks/spec.py, the shipped draft beside prompt lookup
    ran at 1.10-1.40x plain decoding greedy against 1.03-1.30x for lookup alone, once a
    drafted step became one native call); None with --no-draft."""
    from ..weights.default_model import default_draft_path

    if cfg.no_draft:
        return None
    if cfg.draft is None:
        return default_draft_path() if cfg.shipped_draft_by_default(builtin, cpu) else None
    if cfg.draft == "default":
        path = default_draft_path()
        if path is None:
            raise UserError("--draft default: no draft ships with this installation")
        return path
    return cfg.draft


def block_size_arg(text: str):
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 or auto, got {text!r}") from None


def lookup_arg(text: str) -> int:
    from ..spec.lookup import MAX_DEPTH

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_DEPTH}], got {text!r}") from None
    if not 0 <= n <= MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_DEPTH}], got {n}")
    return n


def tree_budget_arg(text: str) -> int:
    from ..spec.proposer import MAX_TREE_BUDGET

    n = positive_int(text)
    if n > MAX_TREE_BUDGET:
        raise argparse.ArgumentTypeError(f"at most {MAX_TREE_BUDGET} nodes (a verify of 64 rows), got {n}")
    return n


def draft_quantize(layer_mode: str, device: str) -> str:
    """The draft's linears: int8 on a CPU when the target's layers are quantized (a drafted
    step ~1.6x cheaper, acceptance unchanged as measured), else as dense as the target."""
    return "int8" if layer_mode != "dense" and device.removeprefix("remote:").split(":")[0] == "cpu" else "dense"


def load_proposer(cfg: EngineConfig, pipeline, dtype, path, layer_mode: str = "dense", cpu: bool = False):
    """Load the DFlash draft at ``path`` and wrap it for the pipeline (UserError if unfit);
    ``cpu``: the target's stages are all on CPUs (``EngineConfig.batch_speculation``)."""
    from ..spec.draft import DFlashDraft
    from ..spec.proposer import DFlashProposer

    device = resolve_device(cfg.draft_device) if cfg.draft_device else str(pipeline.device)
    quantize = draft_quantize(layer_mode, device)
    try:
        if device.startswith("remote:"):
            draft = remote_draft(cfg, path, device.removeprefix("remote:"), pipeline, dtype, quantize)
        else:
            draft = DFlashDraft.load(path, device=device, dtype=dtype, max_ctx=pipeline.max_ctx, quantize=quantize)
        auto = cfg.block_size == "auto"
        if not auto and cfg.block_size < 2:
            raise ValueError("--block-size must be >= 2 or auto")
        budget = cfg.ddtree_budget or (DEFAULT_TREE_BUDGET if cfg.ddtree else 0)
        return DFlashProposer(draft, pipeline, block_size=None if auto else cfg.block_size, adaptive=auto,
                              tree_budget=budget, lookup=cfg.lookup_depth(), batched=cfg.batch_speculation(cpu))
    except (ValueError, OSError) as e:
        raise UserError(f"draft {path}: {e}") from None
