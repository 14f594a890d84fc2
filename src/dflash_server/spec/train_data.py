"""Self-distillation data for a DFlash draft: the target's own responses and features.

The target is sampled on a prompt set (``assets/train_prompts.jsonl``, written for this
project and disjoint from the evaluation sets), rendered with its chat template, by
``train_sample.py``: K continuations per prompt, in the pipeline's sequence slots (what
``train-draft`` uses on a CPU: B/K prompts at once, a finished prompt's slots refilled
with the next one) or as a lockstep batch. Each continuation is cut after its first EOS.
Samples go to safetensors shards (never pickle) with a ``dataset.json`` manifest; each
prompt samples from its own generator (seeded by the dataset's seed and the prompt's
ordinal), so generation resumes where a previous run stopped and writes what an
uninterrupted run would have.

Greedy serving accepts a draft token exactly when it equals the target's argmax, so each
position also stores that argmax (``targets``), and sampled rows switch to greedy decoding
after a random number of tokens (``greedy_after``): the sampled prefix makes the rows
differ, the greedy rest is the path greedy verification walks. Each position also keeps the
target's ``SOFT_K`` most likely tokens and their probabilities (softmax at temperature 1 over
the whole vocabulary: ``soft_ids`` / ``soft_p``), for training on the target's distribution
instead of its argmax alone (``TrainConfig.labels = "soft"``); ~1.7% of a position's bytes
beside its features.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import kernels
from .train_sample import SOFT_K, Job, Sample, sample_prompt, sample_stream, soft_labels  # noqa: F401 (re-exported)

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "assets" / "train_prompts.jsonl"
MANIFEST = "dataset.json"


def load_prompts(path: str | Path | None = None, split: str | None = None) -> list[dict]:
    """Prompts as ``{"id", "kind", "messages", "split"}``; ``split`` filters ("train"/"heldout")."""
    rows = [json.loads(line) for line in Path(path or PROMPTS_FILE).read_text().splitlines() if line.strip()]
    for n, r in enumerate(rows, 1):
        msgs = r.get("messages") if isinstance(r, dict) else None
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         and isinstance(m.get("content"), str) for m in msgs)):
            raise ValueError(f"{path or PROMPTS_FILE}: prompt {n} is not an object with a \"messages\" list of "
                             "{\"role\", \"content\"} strings")
    return [r for r in rows if split is None or r.get("split", "train") == split]


def render(tokenizer, prompt: dict) -> list[int]:
    """Chat-template the prompt; models without a template get the raw text."""
    try:
        return tokenizer.encode_chat(prompt["messages"])
    except ValueError:
        return tokenizer.encode("\n\n".join(m["content"] for m in prompt["messages"]))


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A token id the target never generates, for the MASK embedding: the first unused row
    past the tokenizer's vocabulary (z-lab's choice for Qwen3), else the last added (special)
    token that is neither BOS/EOS nor used by the chat template (SmolLM2: 16,
    ``<empty_output>``, a pretraining-only notebook marker), else the last id."""
    n = tokenizer.vocab_size
    if n < vocab_size:
        return n
    try:
        used = set(tokenizer.encode_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                         add_generation_prompt=False))
    except ValueError:
        used = set()
    used |= set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    special = [i for i in tokenizer.tok.get_added_tokens_decoder() if i not in used and i < vocab_size]
    return max(special) if special else vocab_size - 1


USER_MARK = "\x00USER\x00"   # stands for the user's text while the template is cut at it


def user_turn_prefix(tokenizer) -> tuple[list[int], list[int]]:
    """The template's tokens before a user turn's text (system prompt included, as serving
    renders a conversation without one) and the ids that can end the turn (the template's
    end-of-turn marker, EOS). ValueError where the model has no chat template."""
    text = tokenizer.render_chat([{"role": "user", "content": USER_MARK}], add_generation_prompt=False)
    head, _, tail = text.partition(USER_MARK)
    ends = set(tokenizer.eos_token_ids)
    marker = tokenizer.encode(tail.strip(), add_bos=False) if tail.strip() else []
    if marker:
        ends.add(marker[0])
    return tokenizer.encode(head, add_bos=False), sorted(ends)


def self_prompts(pipe, n: int, *, openings: tuple[str, ...] = ("",), max_len: int = 128, temperature: float = 1.0,
                 top_p: float = 0.95, min_words: int = 4, seed: int = 0, keep=None, patience: int = 50,
                 progress: bool = True) -> list[dict]:
    """``n`` user prompts written by the target itself (the Magpie recipe: a chat model
    given only the template's text before a user turn writes a user's request). Each
    batch of the pipeline's slots starts from one of ``openings`` in turn (``""``: the
    model's own choice; e.g. ``"Write a Python"`` steers it to code); a prompt is kept when
    the model ended the turn within ``max_len`` tokens, has ``min_words`` words, is new,
    and ``keep(text)`` (if given) accepts it; ValueError after ``patience`` batches in a row
    kept nothing. Returns ``{"kind", "messages", "id", "split"}`` rows in the order written."""
    tok = pipe.tokenizer
    head, ends = user_turn_prefix(tok)
    ends = set(ends)
    gen = torch.Generator().manual_seed(seed)
    seen, out, tries, idle = set(), [], 0, 0    # idle: batches in a row that kept nothing
    bar = tqdm(total=n, desc="self-prompts", unit="prompt", disable=None if progress else True)
    try:
        while len(out) < n:
            opening = openings[tries % len(openings)]
            tries += 1
            idle += 1
            lead = tok.encode(opening, add_bos=False) if opening else []
            got = sample_prompt(pipe, head + lead, (0,), max_len, temperature=temperature, top_p=top_p,
                                greedy_rows=0, gen=gen)
            for s in got:
                body = s.ids[s.prompt_len:].tolist()
                stop = next((i for i, t in enumerate(body) if t in ends), None)
                if stop is None:
                    continue            # cut at max_len
                text = tok.decode(lead + body[:stop]).strip()
                if len(text.split()) < min_words or text in seen or (keep is not None and not keep(text)):
                    continue
                seen.add(text)
                idle = 0
                out.append({"kind": "self", "messages": [{"role": "user", "content": text}],
                            "id": f"sp_{len(out):05d}", "split": "train"})
                bar.update(1)
                if len(out) == n:
                    break
            if idle >= patience:
                raise ValueError(f"the model wrote no usable user turn in {idle} batches in a row ({len(out)} of "
                                 f"{n} kept; a turn is kept when it ends within {max_len} tokens with "
                                 f"{min_words}+ words, is new and passes the filter)")
    finally:
        bar.close()
    return out


def _save_shard(path: Path, samples: list[Sample], dtype=torch.bfloat16) -> int:
    from safetensors.torch import save_file

    lens = torch.tensor([len(s.ids) for s in samples])
    tensors = {"tokens": torch.cat([s.ids for s in samples]).to(torch.int32),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
               "prompt_len": torch.tensor([s.prompt_len for s in samples]),
               "features": torch.cat([s.features for s in samples]).to(dtype).contiguous()}
    if all(s.targets is not None for s in samples):
        tensors["targets"] = torch.cat([s.targets for s in samples]).to(torch.int32)
    if all(s.soft_ids is not None for s in samples):
        tensors["soft_ids"] = torch.cat([s.soft_ids for s in samples]).to(torch.int32).contiguous()
        tensors["soft_p"] = torch.cat([s.soft_p for s in samples]).to(torch.float16).contiguous()
    save_file(tensors, str(path))
    return int(lens.sum())


def read_manifest(data_dir: str | Path) -> dict | None:
    """The dataset's manifest, None where there is none; ValueError when it is not one."""
    f = Path(data_dir) / MANIFEST
    if not f.is_file():
        return None
    try:
        man = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: unreadable manifest ({e})") from None
    if not isinstance(man, dict) or not isinstance(man.get("shards", []), list):
        raise ValueError(f"{f}: not a train-draft dataset manifest")
    return man


def generate_dataset(pipe, prompts: list[dict], data_dir: str | Path, taps: tuple[int, ...], samples: int, *,
                     max_new: int = 256, temperature: float = 0.8, top_p: float = 0.95, greedy_rows: int = 1,
                     greedy_after: int = 0, seed: int = 0, fingerprint: str = "", shard_prompts: int = 8,
                     continuations: int | None = None, progress: bool = True) -> dict:
    """Sample until the dataset in ``data_dir`` holds at least ``samples`` sequences
    (continuing an existing one made with the same taps/model). ``continuations``: rows
    per prompt (default: every sequence slot continues one prompt); fewer spread the slots
    over several prompts at once (more distinct prompts for the same tokens), each group of
    slots taking the next prompt as soon as its continuations have ended; a prompt is
    started only while the samples done and in flight fall short of ``samples``. Samples
    are written in prompt order. Returns the manifest."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg = pipe.config
    man = read_manifest(data_dir) or {"version": 1, "model": fingerprint, "target_layer_ids": list(taps),
                                      "hidden_size": cfg.hidden_size, "num_target_layers": cfg.num_layers,
                                      "vocab_size": cfg.vocab_size, "prompts_done": 0, "samples": 0,
                                      "tokens": 0, "shards": []}
    if man["target_layer_ids"] != list(taps) or man["hidden_size"] != cfg.hidden_size or \
            (fingerprint and man.get("model") and man["model"] != fingerprint):
        raise ValueError(f"{data_dir} holds data for another target or other tapped layers; use a new --data dir")
    if not prompts:
        raise ValueError("no training prompts to sample")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    bar = tqdm(total=samples, initial=min(man["samples"], samples), desc="sampling target", unit="seq",
               disable=None if progress else True)
    pending: list[Sample] = []       # finished prompts, in order, not yet in a shard
    pending_prompts = 0
    early: dict[int, list[Sample]] = {}   # prompts that finished before an earlier one
    # this run's throughput (response tokens kept / seconds), written with the manifest
    run = man["last_run"] = {"response_tokens": 0, "seconds": 0.0, "tokens_per_s": None}
    t_run = time.perf_counter()

    def flush():
        nonlocal pending, pending_prompts
        if not pending_prompts:
            return
        name = f"data-{len(man['shards']):05d}.safetensors"
        ntok = _save_shard(data_dir / name, pending) if pending else 0
        if pending:
            man["shards"].append({"file": name, "samples": len(pending), "tokens": ntok})
        man["samples"] += len(pending)
        man["tokens"] += ntok
        man["prompts_done"] += pending_prompts
        (data_dir / (MANIFEST + ".tmp")).write_text(json.dumps(man, indent=1))
        (data_dir / (MANIFEST + ".tmp")).replace(data_dir / MANIFEST)
        pending, pending_prompts = [], 0

    lockstep = pipe.stages[0].batch
    rows = pipe.lanes if lockstep == 1 else lockstep
    per = continuations or rows
    if per < 1 or rows % per:
        raise ValueError(f"{per} continuations per prompt do not divide the {rows} rows sampled at once")
    if per != rows and lockstep > 1:
        raise ValueError("several prompts at once need sequence slots (a lockstep batch shares one prompt)")
    start = man["prompts_done"]
    launched = finished = 0

    def have() -> int:
        return man["samples"] + len(pending) + sum(map(len, early.values()))

    def next_job() -> Job | None:
        """The next prompt of the (repeating) shuffled order while the samples done and those
        expected from prompts in flight fall short; greedy rows only on the first pass."""
        nonlocal launched
        if have() + per * (launched - finished) >= samples:
            return None
        k = start + launched
        launched += 1
        return Job(k, render(pipe.tokenizer, prompts[order[k % len(order)]]), greedy_rows if k < len(order) else 0,
                   torch.Generator().manual_seed(prompt_seed(seed, k)))

    barren = 0    # prompts in a row that gave no sample

    def finish(k: int, got: list[Sample]) -> None:
        nonlocal pending, pending_prompts, finished, barren
        finished += 1
        barren = 0 if got else barren + 1
        if barren >= len(order):
            raise ValueError(f"{barren} prompts in a row gave no sample (a sample needs a response of 2+ "
                             "tokens: a larger response cap, or prompts that leave room in the context)")
        early[k] = got
        while man["prompts_done"] + pending_prompts in early:   # the next prompt in order has finished
            pending += early.pop(man["prompts_done"] + pending_prompts)
            pending_prompts += 1
        run["response_tokens"] += sum(len(x.ids) - x.prompt_len for x in got)
        run["seconds"] = round(time.perf_counter() - t_run, 2)
        run["tokens_per_s"] = round(run["response_tokens"] / max(run["seconds"], 1e-9), 1)
        bar.update(len(got))
        bar.set_postfix(tokens=man["tokens"] + sum(len(s.ids) for s in pending))
        if pending_prompts >= shard_prompts:
            flush()

    try:
        if lockstep == 1 and rows > 1:      # sequence slots, refilled as prompts finish
            for k, got in sample_stream(pipe, next_job, taps, max_new, per, temperature=temperature, top_p=top_p,
                                        greedy_after=greedy_after):
                finish(k, got)
        else:
            while (job := next_job()) is not None:
                finish(job.key, sample_prompt(pipe, job.ids, taps, max_new, temperature=temperature, top_p=top_p,
                                              greedy_rows=job.greedy_rows, greedy_after=greedy_after, gen=job.gen))
        flush()
    finally:
        bar.close()
    return man


def prompt_seed(seed: int, k: int) -> int:
    """The seed of the generator the dataset's ``k``-th prompt samples with."""
    return seed * 1_000_003 + k


def top_tokens(samples: list[Sample], k: int) -> tuple[torch.Tensor, float]:
    """The ``k`` most frequent labels of the samples' responses (the target's argmax where
    stored, else the data tokens), as sorted ids, and the fraction of labels they cover.
    Only tokens that occur are taken, so fewer than ``k`` may come back."""
    labels = [s.targets[s.prompt_len:] if s.targets is not None else s.ids[s.prompt_len:] for s in samples]
    labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    labels = labels[labels >= 0]
    if labels.numel() == 0:
        raise ValueError("no response tokens to choose a draft vocabulary from")
    counts = torch.bincount(labels)
    order = torch.argsort(counts, descending=True, stable=True)[:k]   # ties: lower id first
    order = order[counts[order] > 0]
    return order.sort().values, float(counts[order].sum()) / labels.numel()


def load_dataset(data_dir: str | Path, limit: int | None = None) -> tuple[dict, list[Sample]]:
    """The manifest and its samples (features kept in their stored dtype)."""
    from safetensors.torch import load_file

    man = read_manifest(data_dir)
    if man is None:
        raise ValueError(f"{data_dir}: no {MANIFEST} (not a train-draft dataset)")
    out: list[Sample] = []
    for shard in man.get("shards", []):
        try:
            t = load_file(str(Path(data_dir) / shard["file"]))
            off, pl = t["offsets"].tolist(), t["prompt_len"].tolist()
            t["tokens"], t["features"]   # noqa: B018 - present, or the shard is not one of ours
            soft = "soft_ids" in t
            if soft and not (t["soft_ids"].dim() == 2 and t["soft_p"].shape == t["soft_ids"].shape
                             and t["soft_ids"].shape[0] == t["tokens"].shape[0]):
                raise ValueError("soft labels do not match the tokens")
        except Exception as e:  # noqa: BLE001 - a truncated / foreign shard (SafetensorError, KeyError, ...)
            raise ValueError(f"{data_dir}: corrupt dataset shard {shard!r:.80} ({type(e).__name__})") from None
        feat_off = 0
        for i in range(len(pl)):
            ids = t["tokens"][off[i]:off[i + 1]].long()
            n = len(ids) - 1
            targets = t["targets"][off[i]:off[i + 1]].long() if "targets" in t else None
            sl = slice(off[i], off[i + 1])
            out.append(Sample(ids, pl[i], t["features"][feat_off:feat_off + n], targets,
                              t["soft_ids"][sl] if soft else None, t["soft_p"][sl] if soft else None))  # (as stored)
            feat_off += n
        if limit is not None and len(out) >= limit:
            return man, out[:limit]
    return man, out


# --- text-corpus data: teacher-forced prefill over local text ------------------------------
# Sampling the target costs one forward per token per prompt; a prefill over existing text
# captures a whole window per forward (on the 2-core dev CPU ~350 tokens/s with the int4
# target, ~870 with bf16 weights, vs ~85 sampling). The draft learns the same map either way
# (target features -> the target's argmax); labels are the argmax at every position, and
# block positions k > 1 count only where the text follows the argmax (``labels="greedy"``),
# so text mostly teaches the first draft positions. Windows are chat-wrapped as an assistant
# turn (what serving drafts on): ``[user: TEXT_INSTRUCTION] + assistant + window``.
TEXT_INSTRUCTION = "Continue the text."
TEXT_MAX_FILE = 1 << 20     # bytes read per file: one huge file must not dominate the corpus


def text_files(paths, seed: int | None = None) -> list[Path]:
    """Files named directly, and every regular file under named directories (hidden entries
    skipped), in a fixed order: sorted, then shuffled by ``seed`` when given (so a token
    budget smaller than the corpus samples all of it, not its alphabetical start)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file()
                          and not any(part.startswith(".") for part in f.relative_to(p).parts))
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    if seed is not None:
        random.Random(seed).shuffle(out)
    return out


def _read_text(f: Path) -> str | None:
    """UTF-8 text of the file's first TEXT_MAX_FILE bytes; None for binary or unreadable files."""
    try:
        with open(f, "rb") as fh:
            data = fh.read(TEXT_MAX_FILE)
    except OSError:
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="ignore")


def text_windows(tokenizer, files: list[Path], body_len: int):
    """The corpus as one token stream (files in order, a blank line between them), cut into
    windows of ``body_len`` tokens."""
    buf: list[int] = []
    sep = tokenizer.encode("\n\n")
    for f in files:
        text = _read_text(f)
        if not text or not text.strip():
            continue
        buf += tokenizer.encode(text) + sep
        start = 0
        while len(buf) - start >= body_len:
            yield buf[start:start + body_len]
            start += body_len
        buf = buf[start:]


def text_prompt(tokenizer) -> list[int]:
    try:
        return tokenizer.encode_chat([{"role": "user", "content": TEXT_INSTRUCTION}])
    except ValueError:
        return []


def capture_windows(pipe, prompt: list[int], bodies: list[list[int]], taps: tuple[int, ...]) -> list[Sample]:
    """One teacher-forced forward over ``prompt + body`` rows (the pipeline's batch; a short
    last group is padded with copies and the copies dropped): features at every position
    and the target's argmax (and soft labels) for every body position."""
    B, vocab = pipe.stages[0].batch, pipe.config.vocab_size
    rows = [prompt + b for b in bodies]
    ids = torch.tensor(rows + [rows[-1]] * (B - len(rows)), dtype=torch.long)
    P, L = len(prompt), ids.shape[1]
    with torch.inference_mode():
        pipe.reset()
        out = pipe.forward(ids, 0, logits="all", capture=taps)
        logits = out.logits if out.logits.dim() == 3 else out.logits[None]
        top = kernels.argmax(logits[..., :vocab]).cpu()                                # (B, L)
        lv = logits[..., :vocab].float()
        sid, sp = soft_labels(*lv.topk(min(SOFT_K, vocab), dim=-1), lv)                # (B, L, K)
        feats = torch.cat([out.captures[t] for t in taps], dim=-1).cpu()
    samples = []
    for b in range(len(bodies)):
        p0 = max(P, 1)
        targets = torch.full((L,), -1, dtype=torch.long)
        targets[p0:] = top[b, p0 - 1:L - 1]          # the argmax predicting each body token
        soft_ids = torch.full((L, sid.shape[-1]), -1, dtype=torch.long)
        soft_p = torch.zeros(L, sid.shape[-1])
        soft_ids[p0:], soft_p[p0:] = sid[b, p0 - 1:L - 1], sp[b, p0 - 1:L - 1]
        samples.append(Sample(ids[b].clone(), p0, feats[b, :L - 1].clone(), targets, soft_ids, soft_p))
    return samples


def generate_text_dataset(pipe, paths, data_dir: str | Path, taps: tuple[int, ...], tokens: int, *,
                          length: int = 384, seed: int = 0, fingerprint: str = "", shard_windows: int = 64,
                          progress: bool = True) -> dict:
    """Capture windows of ``length`` tokens (chat prompt included) from the text under
    ``paths`` until the dataset in ``data_dir`` holds at least ``tokens`` tokens; continues
    an existing one (the corpus is read in the same order and the windows done are skipped,
    so the corpus and ``seed``, which orders its files, must not change in between)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg, tok = pipe.config, pipe.tokenizer
    prompt = text_prompt(tok)
    body_len = length - len(prompt)
    if body_len < 2:
        raise ValueError(f"--text-len {length} leaves no room after the {len(prompt)}-token prompt")
    man = read_manifest(data_dir) or {"version": 1, "kind": "text", "model": fingerprint,
                                      "target_layer_ids": list(taps), "hidden_size": cfg.hidden_size,
                                      "num_target_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                                      "length": length, "seed": seed, "windows_done": 0,
                                      "samples": 0, "tokens": 0, "shards": []}
    if man["target_layer_ids"] != list(taps) or man["hidden_size"] != cfg.hidden_size or \
            (fingerprint and man.get("model") and man["model"] != fingerprint) or \
            (man.get("length"), man.get("seed")) != (length, seed):
        raise ValueError(f"{data_dir} holds text data for another target, tapped layers, --text-len or "
                         f"--seed; use another directory")
    if man.get("exhausted") or man["tokens"] >= tokens:
        return man
    files = text_files(paths, seed)
    windows = text_windows(tok, files, body_len)
    for _ in range(man["windows_done"]):
        if next(windows, None) is None:
            break
    bar = tqdm(total=tokens, initial=min(man["tokens"], tokens), desc="capturing text", unit="tok",
               disable=None if progress else True)
    pending: list[Sample] = []

    def write_manifest():
        (data_dir / (MANIFEST + ".tmp")).write_text(json.dumps(man, indent=1))
        (data_dir / (MANIFEST + ".tmp")).replace(data_dir / MANIFEST)

    def flush():
        nonlocal pending
        if not pending:
            return
        name = f"text-{len(man['shards']):05d}.safetensors"
        ntok = _save_shard(data_dir / name, pending)
        man["shards"].append({"file": name, "samples": len(pending), "tokens": ntok})
        man["samples"] += len(pending)
        man["windows_done"] += len(pending)
        man["tokens"] += ntok
        write_manifest()
        pending = []

    try:
        B = pipe.stages[0].batch
        while man["tokens"] + length * len(pending) < tokens:
            need = -(-(tokens - man["tokens"]) // length) - len(pending)
            group = [w for _, w in zip(range(min(B, need)), windows)]
            if not group:                               # the corpus is exhausted: later runs need not re-read it
                man["exhausted"] = True
                break
            pending += capture_windows(pipe, prompt, group, taps)
            bar.update(length * len(group))
            if len(pending) >= shard_windows:
                flush()
        flush()
        if man.get("exhausted") and man["samples"]:
            write_manifest()
    finally:
        bar.close()
    if man["samples"] == 0:
        raise ValueError(f"no text windows of {body_len} tokens in {', '.join(map(str, paths))}")
    return man
