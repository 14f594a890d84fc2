"""``dflash-server train-draft``: make a DFlash draft for any supported target by
self-distillation (sample the target, capture its features, train, export z-lab format).

The draft borrows the target's embedding and LM head, so its hidden size is the target's
(``--hidden-size`` is checked, not free). The held-out acceptance shown while training is
real speculative decoding (engine + DFlashProposer, greedy) on held-out prompts, which is
why it lives here and not in ``spec/`` (spec must not import the engine).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..errors import UserError
from .train_out import claim_data, claim_out
from .common import DTYPES, int_in, non_negative_int, positive_int, quantize_plan, resolve_device, thread_count


def add_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train a DFlash draft for a target by self-distillation")
    p.add_argument("--model", help="target: HF model directory or .gguf (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (draft, checkpoint, log; data under OUT/data)")
    p.add_argument("--data", help="dataset directory (default OUT/data); reused and extended if present")
    p.add_argument("--more-data", action="append", default=[], metavar="DIR",
                   help="another sampled dataset to train on as well, used whole and never extended (repeatable; "
                        "e.g. one sampled with other --prompts)")
    p.add_argument("--prompts", help="JSONL prompt file (default: the shipped train_prompts.jsonl)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (target and draft)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="target compute dtype (default bf16)")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="target weights for sampling and evaluation (as in generate)")
    p.add_argument("--threads", type=thread_count, help="CPU threads for torch")
    p.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("draft architecture")
    a.add_argument("--init", metavar="DRAFT",
                   help="start from this draft's weights (z-lab dir or GGUF); its architecture, tapped layers, "
                        "block size and MASK id are used (architecture flags must agree or be left out)")
    a.add_argument("--layers", type=positive_int,
                   help="draft decoder layers (default 1; with --init, more than its layers grows the draft)")
    a.add_argument("--hidden-size", type=positive_int,
                   help="must equal the target's (the draft uses the target's embedding and LM head)")
    a.add_argument("--intermediate-size", type=positive_int, help="MLP size (default: the target's)")
    a.add_argument("--heads", type=positive_int, help="attention heads (default: the target's)")
    a.add_argument("--kv-heads", type=positive_int, help="KV heads (default: the target's when it divides --heads)")
    a.add_argument("--head-dim", type=positive_int, help="default hidden/heads")
    a.add_argument("--block-size", type=draft_block, help="2-64, default 16")
    a.add_argument("--target-layers", type=layer_ids,
                   help="comma-separated tapped target layer ids (default: 5 spread uniformly)")
    a.add_argument("--mask-token-id", type=int, help="MASK id (default: an id the target never generates)")
    a.add_argument("--draft-vocab", type=non_negative_int, metavar="K",
                   help="the draft proposes only the K most frequent tokens of the training responses: its LM-head "
                        "projection shrinks to K rows (0: the whole vocabulary; default: the --init draft's, "
                        "else the whole vocabulary)")
    d = p.add_argument_group("data (sampled from the target)")
    d.add_argument("--samples", "--data-size", dest="samples", type=non_negative_int, default=1024,
                   help="training sequences to sample (0: none, with --text)")
    d.add_argument("--max-new-tokens", type=positive_int, default=256, help="response length cap")
    d.add_argument("--gen-batch", type=positive_int,
                   help="sequences sampled at once (default %d in sequence slots on a CPU, else %d; also the --text "
                        "windows per forward, default %d)" % (SLOT_BATCH, LOCKSTEP_BATCH, LOCKSTEP_BATCH))
    d.add_argument("--continuations", type=positive_int, metavar="K",
                   help="continuations per prompt, the first one greedy (default %d in sequence slots, where "
                        "--gen-batch/K prompts decode at once and a finished prompt's slots take the next one; "
                        "in a lockstep batch always --gen-batch)" % SLOT_CONTINUATIONS)
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--top-p", type=float, default=0.95)
    d.add_argument("--greedy-after", type=int, default=64,
                   help="sampled continuations turn greedy after a random 1..N tokens (0: sample to the end)")
    d.add_argument("--data-only", action="store_true", help="make the datasets (sampled, and --text) and stop")
    x = p.add_argument_group("data (teacher-forced over local text: several times cheaper per token than sampling)")
    x.add_argument("--text", action="append", metavar="PATH",
                   help="a text file or a directory of them (repeatable); windows of it are run through the "
                        "target as an assistant turn and its features and argmax kept (never an eval set)")
    x.add_argument("--text-tokens", type=positive_int, default=200_000, help="tokens of text data to capture")
    x.add_argument("--text-len", type=positive_int, default=384, help="tokens per text window (prompt included)")
    x.add_argument("--text-data", help="text dataset directory (default OUT/text-data)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=positive_int, default=1000)
    t.add_argument("--batch", type=positive_int, default=4, help="sequences per optimizer step")
    t.add_argument("--anchors", type=positive_int, default=32, help="blocks per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    t.add_argument("--gamma", type=float, help="loss decay exp(-(k-1)/gamma) (default 7/5/4 for B=16/10/8)")
    t.add_argument("--head-vocab", default="auto", choices=["auto", "full", "data"],
                   help="softmax over the full vocabulary, or over the dataset's tokens plus --negatives random "
                        "ones per step (several times faster on CPU; auto: data on CPU, full elsewhere)")
    t.add_argument("--negatives", type=positive_int, default=4096, help="random extra tokens per step (data vocab)")
    t.add_argument("--labels", default="greedy", choices=["greedy", "sampled", "soft"],
                   help="greedy: the target's argmax stored with the data, positions past the first off-argmax "
                        "data token of a block not counted (what greedy verification accepts); sampled: the data "
                        "tokens; soft: as greedy, but against the target's distribution there (its --soft-k most "
                        "likely tokens, stored with data sampled since 2026-12-05)")
    t.add_argument("--soft-k", type=positive_int, default=16,
                   help="--labels soft: the target's most likely tokens a position trains on (at most the 16 stored)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--ckpt-every", type=positive_int, default=100, help="checkpoint interval in steps")
    t.add_argument("--eval-every", type=int, default=0, help="held-out acceptance interval (default steps/10; 0 too)")
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation (0: none)")
    t.add_argument("--eval-tokens", type=positive_int, default=128, help="tokens generated per held-out prompt")
    p.set_defaults(func=run)


SLOT_BATCH, SLOT_CONTINUATIONS = 32, 2   # sequence slots: 32 rows, 16 prompts at once (the fastest measured)
LOCKSTEP_BATCH = 8


def sampling_batch(args, slots: bool) -> tuple[int, int]:
    """(sequences sampled at once, continuations per prompt) from the flags and their
    defaults: in sequence slots 32 rows of 16 prompts (2 continuations each; refilled as
    prompts finish, 1.2-1.3x the response tokens/s of 8 rows of one prompt on the 2-core
    VM, 2026-12-07, and 4x the prompts), in a lockstep batch 8 continuations of one prompt."""
    batch = args.gen_batch or (SLOT_BATCH if slots else LOCKSTEP_BATCH)
    per = args.continuations or (SLOT_CONTINUATIONS if slots and batch % SLOT_CONTINUATIONS == 0 else batch)
    if batch % per:
        raise UserError(f"--continuations {per} does not divide --gen-batch {batch}")
    return batch, per


def layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _pipeline(source, device, dtype, quantize, max_ctx, batch, slots: bool = False):
    """``slots``: the B sequences in B sequence slots, one decode row each per forward (on a
    CPU the native kernels batch those rows); else a lockstep batch of B."""
    from ..runtime.pipeline import build_pipeline
    from ..runtime.placement import plan_placement

    plan = quantize_plan(source, quantize, device == "cpu" and dtype == torch.bfloat16)
    return build_pipeline(source, plan_placement(source.config.num_layers, [device]), dtype=dtype,
                          max_ctx=max_ctx, quantize=plan, progress=False,
                          **({"lanes": batch} if slots else {"batch": batch}))


def draft_config(args, mc, tokenizer):
    from ..spec.config import DraftConfig, default_target_layer_ids
    from ..spec.train_data import pick_mask_token

    H = mc.hidden_size
    if args.hidden_size is not None and args.hidden_size != H:
        raise UserError(f"--hidden-size {args.hidden_size}: a DFlash draft must use the target's hidden size ({H}); "
                        "it feeds the target's embeddings in and its LM head reads the draft's output")
    heads = args.heads or mc.num_heads
    kv = args.kv_heads or (mc.num_kv_heads if heads % mc.num_kv_heads == 0 else heads)
    if heads % kv:
        raise UserError(f"--heads {heads} is not a multiple of --kv-heads {kv}")
    taps = args.target_layers or default_target_layer_ids(mc.num_layers, min(5, mc.num_layers))
    bad = [t for t in taps if not 0 <= t < mc.num_layers]
    if bad:
        raise UserError(f"--target-layers {bad} outside the target's {mc.num_layers} layers")
    mask = args.mask_token_id if args.mask_token_id is not None else pick_mask_token(tokenizer, mc.vocab_size)
    if not 0 <= mask < mc.vocab_size:
        raise UserError(f"--mask-token-id {mask} outside the vocabulary ({mc.vocab_size})")
    try:
        return DraftConfig(hidden_size=H, intermediate_size=args.intermediate_size or mc.intermediate_size,
                           num_layers=args.layers or 1, num_heads=heads, num_kv_heads=kv,
                           head_dim=args.head_dim or (mc.head_dim if heads == mc.num_heads else H // heads),
                           block_size=args.block_size or 16, mask_token_id=mask, target_layer_ids=taps,
                           rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling,
                           num_target_layers=mc.num_layers)
    except ValueError as e:
        raise UserError(str(e)) from None


ARCH_FLAGS = {"layers": "num_layers", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
              "heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim", "block_size": "block_size",
              "mask_token_id": "mask_token_id"}


def init_draft(args, mc) -> tuple:
    """(config, fp32 tensors) of the ``--init`` draft, checked against the target and the flags.
    ``--layers`` above the draft's count grows it: see ``grow_layers``."""
    from ..spec.draft import DFlashDraft

    try:
        d = DFlashDraft.load(args.init, dtype=torch.float32, max_ctx=8)
        d.check_target(mc.num_layers, mc.hidden_size, mc.vocab_size)
    except (OSError, ValueError) as e:
        raise UserError(f"--init: {e}") from None
    for flag, field in ARCH_FLAGS.items():
        v = getattr(args, flag)
        if flag == "layers" and v is not None and v > d.cfg.num_layers:
            continue
        if v is not None and v != getattr(d.cfg, field):
            raise UserError(f"--{flag.replace('_', '-')} {v} differs from the --init draft's {field} "
                            f"{getattr(d.cfg, field)}")
    if args.target_layers and args.target_layers != d.cfg.target_layer_ids:
        raise UserError(f"--target-layers differs from the --init draft's {list(d.cfg.target_layer_ids)}")
    tensors = {k: v.detach().clone() for k, v in d.zlab_state_dict().items()}
    if args.layers and args.layers > d.cfg.num_layers:
        return grow_layers(d.cfg, tensors, args.layers, args.seed)
    return d.cfg, tensors


def grow_layers(cfg, tensors: dict, layers: int, seed: int) -> tuple:
    """Append decoder layers to a draft so that it still computes the same function: each new
    layer gets random weights but zero output projections (``o_proj``, ``down_proj``), so its
    residual branches add nothing until training moves them. New layers take the attention
    type of the last existing one."""
    from dataclasses import replace

    from ..spec.draft import DFlashDraft

    grown = replace(cfg, num_layers=layers,
                    layer_attention=cfg.layer_attention + (cfg.layer_attention[-1],) * (layers - cfg.num_layers))
    fresh = DFlashDraft.random_tensors(grown, seed)
    out = dict(tensors)
    for i in range(cfg.num_layers, layers):
        p = f"layers.{i}."
        out.update({k: v for k, v in fresh.items() if k.startswith(p)})
        out[p + "self_attn.o_proj.weight"].zero_()
        out[p + "mlp.down_proj.weight"].zero_()
    return grown, out


def acceptance(pipe, draft, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy speculative decoding on ``prompts``: mean acceptance length (tau) over all steps."""
    from ..engine.generate import Engine, GenerationRequest
    from ..spec.proposer import DFlashProposer

    engine = Engine(pipe, proposer=DFlashProposer(draft, pipe))
    committed = steps = 0
    for ids in prompts:
        spec = engine.generate(GenerationRequest(tuple(ids), max_tokens=max_tokens)).extra.get("spec", {})
        committed += spec.get("acceptance_length", 0) * spec.get("steps", 0)
        steps += spec.get("steps", 0)
    return {"tau": committed / steps if steps else 0.0}


def draft_block(text: str) -> int:
    """A draft's block: 2-64 (a verify block is at most MAX_VERIFY_ROWS rows)."""
    from ..spec.proposer import MAX_VERIFY_ROWS

    return int_in(text, 2, MAX_VERIFY_ROWS)


def run(args: argparse.Namespace) -> int:
    from ..spec.train import DraftTrainer, TrainConfig, default_gamma
    from ..spec.train_data import (SOFT_K, generate_dataset, generate_text_dataset, load_dataset, load_prompts,
                                   read_manifest, render)
    from ..weights.default_model import default_model_path
    from ..weights.loader import open_model

    if args.greedy_after < 0:
        raise UserError("--greedy-after must be >= 0")
    device = resolve_device(args.device)
    slots = device == "cpu"     # sequence slots on a CPU (the native kernels batch their rows), else lockstep
    gen_batch, continuations = sampling_batch(args, slots)
    if not 0 <= args.temperature <= 100:   # (NaN fails both)
        raise UserError(f"--temperature must be in [0, 100], got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.soft_k > SOFT_K:
        raise UserError(f"--soft-k must be at most {SOFT_K} (the tokens stored per position), got {args.soft_k}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    data_dir = Path(args.data) if args.data else out / "data"
    model_dir = Path(args.model) if args.model else default_model_path()
    # before any work: a folder that is not ours is refused (and one we take is marked as ours)
    claim_out(out, model_dir, write=not (args.data_only and args.data))
    claim_data(data_dir, "--data", model_dir)
    if args.text:
        claim_data(Path(args.text_data) if args.text_data else out / "text-data", "--text-data", model_dir)
    source = open_model(args.model or default_model_path())
    mc = source.config
    dtype = torch.bfloat16 if args.dtype == "auto" else DTYPES[args.dtype]
    cfg, init = init_draft(args, mc) if args.init else (draft_config(args, mc, source.tokenizer), None)
    try:
        prompts = load_prompts(args.prompts)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--prompts: {e}") from None
    train_prompts = [p for p in prompts if p.get("split", "train") == "train"]
    held = [p for p in prompts if p.get("split") == "heldout"][:max(0, args.eval_prompts)]
    max_ctx = min(mc.max_position_embeddings, 4096)
    if args.samples == 0 and not args.text:
        raise UserError("--samples 0 needs --text (no training data otherwise)")
    try:
        man = read_manifest(data_dir)
    except ValueError as e:
        raise UserError(f"--data: {e}") from None
    t0 = time.time()
    sampled_tok_s = None   # this run's sampling rate (None: nothing sampled now)
    if args.samples and (man is None or man["samples"] < args.samples):
        # each slot's KV is allocated for the whole context: only what the longest prompt needs
        longest = max((len(render(source.tokenizer, p)) for p in train_prompts), default=0)
        pipe = _pipeline(source, device, dtype, args.quantize, min(max_ctx, longest + args.max_new_tokens),
                         gen_batch, slots=slots)
        try:
            man = generate_dataset(pipe, train_prompts, data_dir, cfg.target_layer_ids, args.samples,
                                   max_new=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                   greedy_after=args.greedy_after, seed=args.seed,
                                   fingerprint=source.fingerprint(), continuations=continuations)
        except ValueError as e:
            raise UserError(str(e)) from None
        del pipe
        sampled_tok_s = (man.get("last_run") or {}).get("tokens_per_s")
    t_data = time.time() - t0

    def load_checked(data, limit, flag):
        """A dataset's samples, refused unless made from this target with the draft's taps."""
        try:
            man, got = load_dataset(data, limit=limit)
        except ValueError as e:
            raise UserError(f"{flag}: {e}") from None
        if tuple(man["target_layer_ids"]) != cfg.target_layer_ids or man["hidden_size"] != mc.hidden_size or \
                (man.get("model") and man["model"] != source.fingerprint()):
            raise UserError(f"{data} holds features of target layers {man['target_layer_ids']} (hidden "
                            f"{man['hidden_size']}) of model {man.get('model')}; the draft taps "
                            f"{list(cfg.target_layer_ids)} of {source.fingerprint()}: pass --target-layers to "
                            f"match or use another {flag} dir")
        return got

    samples = load_checked(data_dir, args.samples, "--data") if args.samples else []
    for extra in args.more_data:
        samples += load_checked(extra, None, "--more-data")
    print(f"dataset: {len(samples)} sequences, {sum(len(s.ids) for s in samples)} tokens "
          f"({t_data:.0f} s sampling" + (f", {sampled_tok_s} response tokens/s" if sampled_tok_s else "") + ")")
    n_sampled = len(samples)
    if args.text:
        t0 = time.time()
        text_dir = Path(args.text_data) if args.text_data else out / "text-data"
        text_len = min(args.text_len, max_ctx)
        try:
            man = read_manifest(text_dir)
        except ValueError as e:
            raise UserError(f"--text-data: {e}") from None
        if man is None or (man["tokens"] < args.text_tokens and not man.get("exhausted")):
            pipe = _pipeline(source, device, dtype, args.quantize, max_ctx, args.gen_batch or LOCKSTEP_BATCH)
            try:
                generate_text_dataset(pipe, args.text, text_dir, cfg.target_layer_ids, args.text_tokens,
                                      length=text_len, seed=args.seed,
                                      fingerprint=source.fingerprint())
            except ValueError as e:
                raise UserError(str(e)) from None
            del pipe
        text = load_checked(text_dir, -(-args.text_tokens // text_len), "--text-data")
        samples += text
        print(f"text dataset: {len(text)} windows, {sum(len(s.ids) for s in text)} tokens "
              f"({time.time() - t0:.0f} s capturing)")
    if args.data_only:
        return 0
    claim_out(out, model_dir, write=True)
    pipe = _pipeline(source, device, dtype, args.quantize, max_ctx, 1)
    tc = TrainConfig(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
                     gamma=args.gamma or default_gamma(cfg.block_size), seed=args.seed,
                     head_vocab=args.head_vocab if args.head_vocab != "auto" else "data" if device == "cpu" else "full",
                     negatives=args.negatives, amp=dtype != torch.float32, labels=args.labels,
                     soft_k=args.soft_k)
    head = pipe.stages[-1].lm_head
    if head.mode != "dense":  # quantized for serving: train against the dense matrix
        tied = mc.tie_word_embeddings or not source.has("lm_head.weight")
        head_w = source.get("model.embed_tokens.weight" if tied else "lm_head.weight").float()
    else:
        head_w = head.weight
    try:
        trainer = DraftTrainer(cfg, samples, pipe.stages[0].embed, head_w, tc, device=device,
                               ckpt_dir=out / "checkpoint", resume=args.resume,
                               head_dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16,
                               norm_weight=pipe.stages[-1].final_norm.weight, init=init)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.draft_vocab is not None:
        trainer.draft.vocab_ids = None
        if args.draft_vocab:
            from ..spec.train_data import top_tokens
            try:
                ids, covered = top_tokens(samples, args.draft_vocab)
            except ValueError as e:
                raise UserError(f"--draft-vocab: {e}") from None
            trainer.draft.vocab_ids = ids
            print(f"draft vocabulary: {len(ids)} tokens, {100 * covered:.2f}% of the training labels")
    held_ids = [render(source.tokenizer, p) for p in held]

    def evaluate(tr):
        return acceptance(pipe, tr.inference_draft(device, dtype, max_ctx), held_ids, args.eval_tokens)

    t1 = time.time()
    ev = trainer.train(ckpt_every=args.ckpt_every, eval_every=args.eval_every or max(1, args.steps // 10),
                       eval_fn=evaluate if held_ids else None, log_path=out / "train_log.jsonl")
    trainer.export(out)
    summary = {"draft": str(out), "samples": n_sampled, "text_windows": len(samples) - n_sampled,
               "tokens": sum(len(s.ids) for s in samples),
               "sampling_s": round(t_data), "sampling_tok_s": sampled_tok_s,
               "training_s": round(time.time() - t1), "steps": trainer.step,
               "draft_vocab": None if trainer.draft.vocab_ids is None else len(trainer.draft.vocab_ids),
               "heldout_prompts": len(held_ids), **{f"heldout_{k}": round(v, 3) for k, v in ev.items()}}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0
