"""train-draft: data sampling + feature capture, the training forward against inference,
resume, end to end on a tiny target (beats a random draft, export loads, output lossless)."""
import json
import random

import pytest
import torch

from dflash_server.cli import main
from dflash_server.cli.train_draft import acceptance, grow_layers
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.spec.config import DraftConfig
from dflash_server.spec.draft import DFlashDraft
from dflash_server.spec.proposer import DFlashProposer
from dflash_server.spec.train import DraftTrainer, TrainConfig
from dflash_server.spec.train_data import (PROMPTS_FILE, SOFT_K, generate_dataset, generate_text_dataset, load_dataset,
                                           load_prompts, pick_mask_token, read_manifest, render, sample_prompt,
                                           self_prompts,
                                           text_files, text_prompt, user_turn_prefix)
from dflash_server.weights.loader import open_model
from helpers.build import pipeline

TAPS = (1, 2)


def tiny_cfg(pipe, block=8, layers=1):
    c = pipe.config
    return DraftConfig(hidden_size=c.hidden_size, intermediate_size=128, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=16, block_size=block, mask_token_id=16, target_layer_ids=TAPS,
                       num_target_layers=c.num_layers)


def batched(path, batch=4, slots=False):
    """B sequences sampled together: a lockstep batch, or (``slots``) B sequence slots with one
    decode row each per forward (what train-draft uses on a CPU)."""
    src = open_model(path)
    return build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.float32, max_ctx=256,
                          progress=False, **({"lanes": batch} if slots else {"batch": batch}))


def test_prompts_shipped_and_mask_token(tiny_dir):
    train, held = load_prompts(split="train"), load_prompts(split="heldout")
    assert len(train) >= 300 and len(held) >= 8
    assert {p["kind"] for p in train} >= {"code", "math", "explain", "chat"}
    templated = load_prompts(PROMPTS_FILE.with_name("train_prompts_templated.jsonl"))
    assert len(templated) >= 500 and {p["split"] for p in templated} == {"train"}
    assert {p["kind"] for p in templated} >= {"code", "math", "explain", "chat"}
    texts = [p["messages"][0]["content"] for p in templated]
    assert len(set(texts)) == len(texts) and not set(texts) & {p["messages"][0]["content"] for p in train}
    written = load_prompts(PROMPTS_FILE.with_name("train_prompts_self.jsonl"))   # tools/make_self_prompts.py
    assert len(written) >= 3000 and {p["split"] for p in written} == {"train"}
    own = [p["messages"][0]["content"] for p in written]
    assert len(set(own)) == len(own) and not set(own) & (set(texts) | {p["messages"][0]["content"] for p in train})
    assert all("<|im_" not in t and len(t.split()) >= 4 for t in own)
    pipe = pipeline(tiny_dir("llama"))
    # SmolLM2's tokenizer: <empty_output> (16) is an added token the chat model never writes
    assert pick_mask_token(pipe.tokenizer, pipe.config.vocab_size) == 16
    assert pick_mask_token(pipe.tokenizer, pipe.config.vocab_size + 64) == pipe.tokenizer.vocab_size


@pytest.mark.parametrize("slots", [False, True])
def test_features_captured_while_sampling_equal_teacher_forced_prefill(tiny_dir, tmp_path, slots):
    path = tiny_dir("llama")
    pipe = batched(path, slots=slots)
    ids = render(pipe.tokenizer, load_prompts(split="train")[0])
    samples = sample_prompt(pipe, ids, TAPS, 24, temperature=1.0, gen=torch.Generator().manual_seed(0))
    assert len(samples) == 4 and all(s.prompt_len == len(ids) for s in samples)
    assert len({tuple(s.ids.tolist()) for s in samples}) > 1          # rows sample independently
    ref = pipeline(path)
    for s in samples:
        assert s.features.shape == (len(s.ids) - 1, len(TAPS) * ref.config.hidden_size)
        ref.reset()
        cap = ref.prefill(s.ids[:-1].tolist(), capture=TAPS).captures
        want = torch.cat([cap[t][0] for t in TAPS], dim=-1)
        assert (s.features - want).abs().max() < 1e-4
    # dataset shards round-trip; generation resumes instead of starting over
    man = generate_dataset(pipe, load_prompts(split="train")[:3], tmp_path, TAPS, 6, max_new=16, progress=False)
    assert man["samples"] >= 6 and man["prompts_done"] == 2
    man = generate_dataset(pipe, load_prompts(split="train")[:3], tmp_path, TAPS, 10, max_new=16, progress=False)
    assert man["prompts_done"] == 3 and len(list(tmp_path.glob("*.safetensors"))) == 2
    run = man["last_run"]   # this run's throughput, kept in the manifest
    assert run["response_tokens"] > 0 and run["seconds"] > 0 and run["tokens_per_s"] > 0
    _, loaded = load_dataset(tmp_path)
    assert len(loaded) == man["samples"] and all(len(s.features) == len(s.ids) - 1 for s in loaded)
    with pytest.raises(ValueError, match="another target"):
        generate_dataset(pipe, load_prompts()[:1], tmp_path, (0, 1), 20, progress=False)


def test_several_prompts_share_the_slots_each_row_as_its_prompt_alone(tiny_dir, tmp_path):
    """Slots spread over G prompts of different lengths: each row's features and argmax
    targets equal a teacher-forced pass over its own prompt + response, each prompt's first
    row is greedy, and a dataset sampled two continuations a prompt counts its prompts."""
    path = tiny_dir("llama")
    pipe = batched(path, slots=True)
    prompts = load_prompts(split="train")[:2]
    ids = [render(pipe.tokenizer, p) for p in prompts]
    assert len(ids[0]) != len(ids[1])
    samples = sample_prompt(pipe, ids, TAPS, 20, temperature=1.5, gen=torch.Generator().manual_seed(3))
    assert [s.prompt_len for s in samples] == [len(ids[0])] * 2 + [len(ids[1])] * 2
    ref = pipeline(path)
    for i, s in enumerate(samples):
        P = s.prompt_len
        assert s.ids[:P].tolist() == ids[i // 2]
        ref.reset()
        out = ref.forward(s.ids[:-1].tolist(), 0, logits="all", capture=TAPS)
        assert (s.features - torch.cat([out.captures[t][0] for t in TAPS], dim=-1)).abs().max() < 1e-4
        assert torch.equal(out.logits[P - 1:, :ref.config.vocab_size].argmax(-1), s.targets[P:])
    for first in (samples[0], samples[2]):                   # greedy_rows=1 per prompt
        assert torch.equal(first.ids[first.prompt_len:], first.targets[first.prompt_len:])
    assert not torch.equal(samples[1].ids[samples[1].prompt_len:], samples[1].targets[samples[1].prompt_len:])
    man = generate_dataset(pipe, load_prompts(split="train")[:5], tmp_path, TAPS, 6, max_new=12, continuations=2,
                           progress=False)
    assert man["prompts_done"] == 3 and man["samples"] == 6      # no more prompts started than needed
    assert len({tuple(s.ids[:s.prompt_len].tolist()) for s in load_dataset(tmp_path)[1]}) == 3
    with pytest.raises(ValueError, match="do not divide"):
        generate_dataset(pipe, prompts, tmp_path / "x", TAPS, 4, continuations=3, progress=False)
    with pytest.raises(ValueError, match="do not divide"):
        sample_prompt(pipe, ids + [ids[0]], TAPS, 4)
    with pytest.raises(ValueError, match="sequence slots"):
        generate_dataset(batched(path), prompts, tmp_path / "y", TAPS, 4, continuations=2, progress=False)


def _int8_slots(path, lanes, max_ctx=256):
    """Sequence slots in bf16 with int8 weights: the native kernels' rows are bit-equal to
    the same rows computed alone (on any row count), as train-draft samples on a CPU."""
    src = open_model(path)
    return build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=max_ctx,
                          quantize="int8", progress=False, lanes=lanes)


def _same(a, b):
    assert a.prompt_len == b.prompt_len and torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
    assert torch.equal(a.features, b.features) and torch.equal(a.soft_ids, b.soft_ids)
    assert torch.equal(a.soft_p, b.soft_p)


def test_refilled_slots_give_each_prompt_what_it_gives_alone(tiny_dir, monkeypatch):
    """sample_stream over 6 prompts in 2 groups of 2 slots; rows end at an EOS token or at the
    context's end (prompts of different lengths), so groups finish out of order and are
    refilled while the other decodes. Each prompt's samples equal that prompt sampled alone
    with the same generator, bit for bit; a row that ended decodes no more and a free group
    is refilled at once (the rows decoded are exactly the tokens fed)."""
    from dflash_server.spec.train_sample import Job, sample_stream
    path = tiny_dir("llama")
    prompts = [render(_int8_slots(path, 2).tokenizer, p) for p in load_prompts(split="train")[:6]]
    max_ctx = max(map(len, prompts)) + 20
    pipe, solo = _int8_slots(path, 4, max_ctx), _int8_slots(path, 2, max_ctx)

    def jobs(keys, greedy_rows=1):
        it = iter(Job(k, prompts[k], greedy_rows, torch.Generator().manual_seed(100 + k)) for k in keys)
        return lambda: next(it, None)

    def run(p, keys):
        return list(sample_stream(p, jobs(keys), TAPS, 64, 2, temperature=1.5, greedy_after=8))
    # an EOS the rows do write: a token a sampled row of prompt 0 writes early on
    eos = run(solo, [0])[0][1][1].ids[len(prompts[0]) + 2].item()
    monkeypatch.setattr(pipe.tokenizer, "eos_token_ids", (eos,))
    monkeypatch.setattr(solo.tokenizer, "eos_token_ids", (eos,))
    fed = []
    forward_rows = pipe.forward_rows
    monkeypatch.setattr(pipe, "forward_rows", lambda t, lanes, pos, **kw: fed.append(len(t)) or
                        forward_rows(t, lanes, pos, **kw))
    got = run(pipe, range(6))
    keys = [k for k, _ in got]
    assert sorted(keys) == list(range(6)) and keys != sorted(keys)          # out of order: refilled mid-flight
    ended = [s for _, ss in got for s in ss]
    assert any(s.ids[-1] == eos for s in ended) and any(s.ids[-1] != eos for s in ended)
    assert sum(fed) == sum(len(s.ids) - s.prompt_len - 1 for s in ended)  # each token fed once, none after its end
    assert max(fed) == 4 and len(fed) < max(len(s.ids) - s.prompt_len for s in ended) * 3
    for k, samples in got:
        alone = run(solo, [k])
        assert len(alone) == 1 and len(alone[0][1]) == len(samples) >= 1
        for a, b in zip(samples, alone[0][1]):
            _same(a, b)
    with pytest.raises(ValueError, match="do not divide"):
        list(sample_stream(pipe, jobs([0]), TAPS, 8, 3))
    with pytest.raises(ValueError, match="sequence slots"):
        list(sample_stream(batched(path), jobs([0]), TAPS, 8, 2))


def test_dataset_resumed_after_an_interruption_is_the_uninterrupted_one(tiny_dir, tmp_path, monkeypatch):
    """Each prompt samples with its own generator, so a dataset sampled in one run, in two
    runs (a smaller target first) and in a run killed mid-way (a shard write fails) and
    resumed hold the same samples in the same order; prompts finishing out of order are
    written in order."""
    from dflash_server.spec import train_data
    path = tiny_dir("llama")
    prompts = load_prompts(split="train")[:7]
    lens = [len(render(_int8_slots(path, 2).tokenizer, p)) for p in prompts]
    assert len(set(lens)) > 3
    pipe = _int8_slots(path, 4, max_ctx=max(lens) + 12)      # rows end where the context does: out of order
    kw = dict(max_new=64, temperature=1.3, greedy_after=5, continuations=2, shard_prompts=2, progress=False)
    whole = generate_dataset(pipe, prompts, tmp_path / "a", TAPS, 10, **kw)
    assert whole["samples"] == 10 and whole["prompts_done"] == 5
    generate_dataset(pipe, prompts, tmp_path / "b", TAPS, 3, **kw)
    two = generate_dataset(pipe, prompts, tmp_path / "b", TAPS, 10, **kw)
    save, calls = train_data._save_shard, []

    def dies(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return save(*a)
    monkeypatch.setattr(train_data, "_save_shard", dies)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(pipe, prompts, tmp_path / "c", TAPS, 10, **kw)
    monkeypatch.setattr(train_data, "_save_shard", save)
    assert read_manifest(tmp_path / "c")["prompts_done"] == 2
    three = generate_dataset(pipe, prompts, tmp_path / "c", TAPS, 10, **kw)
    assert whole["prompts_done"] == two["prompts_done"] == three["prompts_done"]
    want = load_dataset(tmp_path / "a")[1]
    for d in ("b", "c"):
        got = load_dataset(tmp_path / d)[1]
        assert len(got) == len(want)
        for a, b in zip(want, got):
            _same(a, b)
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)                              # the dataset's prompt order (seed 0)
    assert [s.ids[:s.prompt_len].tolist() for s in want] == \
        [render(pipe.tokenizer, prompts[order[k]]) for k in range(5) for _ in range(2)]


def test_the_default_model_writes_its_own_user_prompts():
    """Magpie-style prompts: the template's text before a user turn, an opening, the model's
    own words up to its end-of-turn marker; kept ones are whole turns (no template tokens),
    distinct, start with their opening and pass ``keep``."""
    from dflash_server.weights.default_model import default_model_path

    src = open_model(default_model_path())
    head, ends = user_turn_prefix(src.tokenizer)
    text = src.tokenizer.decode(head)
    assert text.endswith("<|im_start|>user\n") and "system" in text
    assert src.tokenizer.encode("<|im_end|>", add_bos=False)[0] in ends
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=256,
                          progress=False, lanes=4)
    seen = []
    rows = self_prompts(pipe, 6, openings=("", "Write a Python"), max_len=64, seed=1,
                        keep=lambda t: seen.append(t) or "banned" not in t, progress=False)
    assert len(rows) == 6 and len({r["messages"][0]["content"] for r in rows}) == 6
    assert {r["split"] for r in rows} == {"train"} and [r["id"] for r in rows] == [f"sp_{i:05d}" for i in range(6)]
    for r in rows:
        t = r["messages"][0]["content"]
        assert t in seen and len(t.split()) >= 4 and "<|im" not in t and t == t.strip()
    assert any(r["messages"][0]["content"].startswith("Write a Python") for r in rows)
    with pytest.raises(ValueError, match="no usable user turn"):   # turns cut at max_len are never kept
        self_prompts(pipe, 1, max_len=2, progress=False)
    kept = []     # a filter that takes one prompt and no more: stops (it looped forever once one was kept)
    with pytest.raises(ValueError, match=r"in 3 batches in a row \(1 of 3 kept"):
        self_prompts(pipe, 3, max_len=64, seed=1, keep=lambda t: not kept and not kept.append(t), patience=3,
                     progress=False)


@pytest.mark.parametrize("slots", [False, True])
def test_argmax_targets_and_greedy_switch(tiny_dir, tmp_path, slots):
    """Every position stores the target's argmax (== a teacher-forced forward's); sampled rows
    turn greedy after at most ``greedy_after`` tokens; targets survive the shards."""
    path = tiny_dir("llama")
    pipe = batched(path, slots=slots)
    ids = render(pipe.tokenizer, load_prompts(split="train")[2])
    samples = sample_prompt(pipe, ids, TAPS, 40, temperature=1.5, greedy_after=6,
                            gen=torch.Generator().manual_seed(4))
    ref = pipeline(path)
    P = len(ids)
    off_path = 0
    for s in samples:
        assert s.targets.shape == s.ids.shape and (s.targets[:P] == -1).all()
        ref.reset()
        logits = ref.forward(s.ids[:-1].tolist(), 0, logits="all").logits
        assert torch.equal(logits[P - 1:, :ref.config.vocab_size].argmax(-1), s.targets[P:])
        off = (s.ids[P:] != s.targets[P:]).nonzero()
        off_path += len(off)
        assert len(off) == 0 or int(off.max()) < 6             # greedy from token 6 on, at the latest
        _check_soft(s, logits[P - 1:, :ref.config.vocab_size], P)
    assert off_path > 0                                       # temperature 1.5 does leave the argmax
    assert torch.equal(samples[0].ids[P:], samples[0].targets[P:])   # the first row is greedy throughout
    generate_dataset(pipe, load_prompts(split="train")[:1], tmp_path, TAPS, 4, max_new=16, greedy_after=4,
                     progress=False)
    _, loaded = load_dataset(tmp_path)
    assert all(s.targets is not None and s.targets.shape == s.ids.shape for s in loaded)
    for s in loaded:     # soft labels survive the shards (probabilities stored in fp16)
        ref.reset()
        _check_soft(s, ref.forward(s.ids[:-1].tolist(), 0, logits="all").logits[s.prompt_len - 1:,
                                                                                  :ref.config.vocab_size],
                    s.prompt_len, rtol=2e-3)


def _check_soft(s, logits, P, rtol=1e-4):
    """``s``'s soft labels are the target's SOFT_K most likely tokens after each prompt
    position, with their probabilities (softmax of the teacher-forced ``logits``), most likely
    first; nothing in the prompt."""
    assert s.soft_ids.shape == s.soft_p.shape == (len(s.ids), SOFT_K)
    assert (s.soft_ids[:P] == -1).all() and (s.soft_p[:P] == 0).all()
    probs = torch.softmax(logits.double(), -1)
    assert torch.allclose(s.soft_p[P:].double(), probs.gather(-1, s.soft_ids[P:]), rtol=rtol, atol=1e-6)
    assert (s.soft_p[P:, :-1] >= s.soft_p[P:, 1:]).all()                       # sorted, most likely first
    assert torch.allclose(s.soft_p[P:].double().sum(-1), probs.topk(SOFT_K, -1).values.sum(-1), rtol=rtol)


def _corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)          # binary: skipped
    (root / ".hidden").write_text("not this " * 300)                # hidden: skipped
    (root / "sub" / "b.py").write_text("def double(x):\n    return x * 2\n\n" * 25)
    return root


def test_text_corpus_windows_features_targets_and_resume(tiny_dir, tmp_path, monkeypatch):
    """--text data: chat-wrapped windows of the corpus stream, features and argmax targets
    equal to a teacher-forced batch-1 forward; a second run continues the stream."""
    path = tiny_dir("llama")
    corpus = _corpus(tmp_path / "corpus")
    pipe = batched(path, batch=3)
    tok = pipe.tokenizer
    prompt = text_prompt(tok)
    P, L = len(prompt), len(prompt) + 20
    sep = tok.encode("\n\n")
    files = text_files([corpus], seed=0)
    assert sorted(f.name for f in files) == ["a.txt", "b.py", "blob.bin"]       # .hidden left out
    stream = [t for f in files if f.suffix != ".bin" for t in tok.encode(f.read_text()) + sep]
    man = generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 4 * L, length=L, progress=False)
    assert man["samples"] == 4 == man["windows_done"]     # a group of 3 and a short one (padded, copy dropped)
    man = generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 7 * L, length=L, progress=False)
    assert man["samples"] == 7 and len(man["shards"]) == 2
    _, got = load_dataset(tmp_path / "td")
    bodies = [t for s in got for t in s.ids[P:].tolist()]
    assert bodies == stream[:len(bodies)] and len(bodies) == 7 * 20   # in order, nothing repeated or skipped
    ref = pipeline(path)
    for s in got:
        assert s.prompt_len == P and s.ids[:P].tolist() == prompt and (s.targets[:P] == -1).all()
        ref.reset()
        out = ref.forward(s.ids[:-1].tolist(), 0, logits="all", capture=TAPS)
        want = torch.cat([out.captures[t][0] for t in TAPS], -1)             # stored in bf16
        assert torch.allclose(s.features.float(), want, rtol=8e-3, atol=1e-4)
        assert torch.equal(out.logits[P - 1:, :ref.config.vocab_size].argmax(-1), s.targets[P:])
        _check_soft(s, out.logits[P - 1:, :ref.config.vocab_size], P, rtol=2e-3)
    # the corpus runs out: what there is, no error; another window length is another dataset
    man = generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 10 ** 6, length=L, progress=False)
    assert man["samples"] == len(stream) // 20 and man["exhausted"]
    import dflash_server.spec.train_data as td

    def no_reread(*a, **k):
        raise AssertionError("an exhausted corpus is read again")
    monkeypatch.setattr(td, "text_files", no_reread)
    assert generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 10 ** 7, length=L,
                                 progress=False)["samples"] == man["samples"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="--text-len"):
        generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 10, length=L + 1, progress=False)
    with pytest.raises(ValueError, match="--seed"):
        generate_text_dataset(pipe, [corpus], tmp_path / "td", TAPS, 10, length=L, seed=1, progress=False)
    with pytest.raises(ValueError, match="no such file"):
        generate_text_dataset(pipe, [tmp_path / "nope"], tmp_path / "td2", TAPS, 10, length=L, progress=False)


def test_train_draft_on_text_only(tiny_dir, tmp_path, capsys):
    path, out = tiny_dir("llama"), tmp_path / "draft"
    corpus = _corpus(tmp_path / "corpus")
    base = ["train-draft", "--model", str(path), "--out", str(out), "--device", "cpu", "--dtype", "fp32",
            "--quantize", "none", "--layers", "1", "--heads", "4", "--intermediate-size", "128", "--block-size", "4",
            "--eval-prompts", "0"]
    assert main(base + ["--samples", "0"]) == 2 and "--samples 0 needs --text" in capsys.readouterr().err
    assert main(base + ["--samples", "0", "--text", str(corpus), "--text-tokens", "300", "--text-len", "64",
                        "--gen-batch", "1", "--steps", "3", "--batch", "2", "--anchors", "4"]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["samples"] == 0 and summary["text_windows"] == 5 and summary["steps"] == 3
    assert DFlashDraft.load(out, dtype=torch.float32).cfg.block_size == 4
    # the text data was captured with the default taps: a draft tapping other layers is refused
    assert main(base + ["--samples", "0", "--text", str(corpus), "--text-tokens", "300", "--text-len", "64",
                        "--target-layers", "0,3", "--data-only"]) == 2
    assert "--text-data" in capsys.readouterr().err


def test_train_draft_continuations_flag_spreads_a_batch_over_prompts(tiny_dir, tmp_path):
    out = tmp_path / "d"
    assert main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(out), "--device", "cpu",
                 "--dtype", "fp32", "--quantize", "none", "--samples", "4", "--max-new-tokens", "6",
                 "--gen-batch", "4", "--continuations", "1", "--data-only"]) == 0
    man = json.loads((out / "data" / "dataset.json").read_text())
    assert man["prompts_done"] == 4 and man["samples"] == 4
    assert len({tuple(s.ids[:s.prompt_len].tolist()) for s in load_dataset(out / "data")[1]}) == 4


def test_sampling_batch_defaults():
    """Sequence slots default to 32 rows of 16 prompts (2 continuations each), a lockstep
    batch to 8 continuations of one prompt; given flags win; K must divide B."""
    import argparse

    from dflash_server.cli.train_draft import sampling_batch
    from dflash_server.errors import UserError

    def ns(b=None, k=None):
        return argparse.Namespace(gen_batch=b, continuations=k)
    assert sampling_batch(ns(), True) == (32, 2) and sampling_batch(ns(), False) == (8, 8)
    assert sampling_batch(ns(3), True) == (3, 3) and sampling_batch(ns(8), True) == (8, 2)
    assert sampling_batch(ns(8, 8), True) == (8, 8) and sampling_batch(ns(4), False) == (4, 4)
    with pytest.raises(UserError, match="does not divide"):
        sampling_batch(ns(4, 3), True)


def test_greedy_labels_count_only_the_argmax_path(tiny_dir):
    pipe = batched(tiny_dir("llama"), batch=1)
    ids = render(pipe.tokenizer, load_prompts(split="train")[1])
    s = sample_prompt(pipe, ids, TAPS, 24, gen=torch.Generator().manual_seed(1))[0]
    P = len(ids)
    s.targets = s.ids.clone()
    s.targets[:P] = -1
    s.targets[P + 3] = (int(s.ids[P + 3]) + 1) % pipe.config.vocab_size   # the data leaves the argmax at P+3
    tr = DraftTrainer(tiny_cfg(pipe, block=4), [s], pipe.stages[0].embed, pipe.stages[0].embed.weight,
                      TrainConfig(steps=1, gamma=1e9), head_dtype=torch.float32)
    anchors = torch.tensor([P, P + 1, P + 3])
    y, w, soft = tr.labels(s, anchors)
    assert soft is None
    assert int(y[0, 2]) == int(s.targets[P + 3]) != int(s.ids[P + 3])    # the label is the argmax
    # anchor P: P+1..P+3 count (the data is on the argmax path before P+3); anchor P+1: P+2 and
    # P+3 count, P+4 not (reached only through the off-path P+3); anchor P+3: all
    assert (w > 0).tolist() == [[True, True, True], [True, True, False], [True, True, True]]
    tr.tc.labels = "soft"       # the same positions count; the labels are the target's top tokens
    y2, w2, (ids, p) = tr.labels(s, anchors)
    assert torch.equal(y2, y) and torch.equal(w2, w)
    assert torch.equal(ids, s.soft_ids[anchors[:, None] + torch.arange(1, 4)])
    assert torch.allclose(p.sum(-1), torch.ones(3, 3))
    tr.tc.labels = "sampled"
    y, w, _ = tr.labels(s, anchors)
    assert int(y[0, 2]) == int(s.ids[P + 3]) and bool((w > 0).all())


@pytest.mark.parametrize("head_vocab", ["full", "data"])
def test_soft_labels_loss_is_the_cross_entropy_against_the_targets_top_tokens(tiny_dir, head_vocab):
    """labels="soft": with one token the loss (and its gradient) is the greedy loss; with K it
    is -sum_k p_k log q(id_k), p the stored probabilities renormalized over the K tokens; a
    dataset without soft labels is refused."""
    pipe = batched(tiny_dir("llama"), batch=2)
    ids = render(pipe.tokenizer, load_prompts(split="train")[3])
    samples = sample_prompt(pipe, ids, TAPS, 24, temperature=1.2, greedy_after=5, gen=torch.Generator().manual_seed(2))

    def trainer(labels, k=SOFT_K, data=samples):
        return DraftTrainer(tiny_cfg(pipe, block=4), data, pipe.stages[0].embed, pipe.stages[0].embed.weight,
                            TrainConfig(steps=1, anchors=6, labels=labels, soft_k=k, head_vocab=head_vocab,
                                        negatives=64, seed=3), head_dtype=torch.float32)

    anchors = [trainer("greedy").anchors_for(s, 0, j) for j, s in enumerate(samples)]

    def loss_and_grad(tr):
        loss, m = tr.loss(samples, anchors)
        loss.backward()
        return loss, torch.cat([p.grad.reshape(-1) for p in tr.params]), m
    hard, g_hard, m_hard = loss_and_grad(trainer("greedy"))
    one, g_one, m_one = loss_and_grad(trainer("soft", 1))
    assert torch.allclose(one, hard, rtol=1e-6) and torch.allclose(g_one, g_hard, rtol=1e-4, atol=1e-7)
    assert m_one["tau_tf"] == m_hard["tau_tf"]
    tr = trainer("soft")
    got, _, _ = loss_and_grad(tr)
    got = got.detach()
    # by hand: the full-vocabulary log-softmax of the draft's logits at each counted position
    num = den = 0.0
    with torch.no_grad():
        for s, a in zip(samples, anchors):
            h = tr._blocks(s, a)[:, 1:].reshape(-1, tr.cfg.hidden_size)
            logq = torch.log_softmax(h @ tr.head.T, -1)
            _, w, (sid, sp) = tr.labels(s, a)
            if head_vocab == "data":   # the softmax over that step's candidates only
                cand = torch.cat([tr.vocab, torch.randint(0, tr.head.shape[0], (64,),
                                  generator=torch.Generator().manual_seed(3 * 7_777_777))] +
                                 [tr.labels(x, b)[2][0].reshape(-1) for x, b in zip(samples, anchors)]).unique()
                logq = torch.full_like(logq, -torch.inf)
                logq[:, cand] = torch.log_softmax(h @ tr.head[cand].T, -1)
            ce = -(sp.reshape(-1, SOFT_K) * logq.gather(-1, sid.reshape(-1, SOFT_K))).sum(-1)
            num += float((ce * w.reshape(-1)).sum())
            den += float(w.sum())
    assert abs(float(got) - num / den) < 1e-4 * num / den
    assert float(got) > float(hard.detach()) * 0.5     # (a different loss: the target's spread, not its argmax alone)
    old = [type(s)(s.ids, s.prompt_len, s.features, s.targets) for s in samples]
    with pytest.raises(ValueError, match="soft"):
        trainer("soft", data=old)
    with pytest.raises(ValueError, match="soft_k"):
        trainer("soft", 0)


def test_training_forward_equals_inference_draft(tiny_dir):
    """The packed multi-anchor training pass computes, for every block, exactly what the
    inference draft computes from a context of the positions before that anchor."""
    pipe = batched(tiny_dir("llama"), batch=1)
    ids = render(pipe.tokenizer, load_prompts(split="train")[1])
    sample = sample_prompt(pipe, ids, TAPS, 30, gen=torch.Generator().manual_seed(1))[0]
    cfg = DraftConfig.from_dict({**tiny_cfg(pipe, layers=2).to_dict(), "layer_types": ["sliding_attention",
                                 "full_attention"], "sliding_window": 9})
    tr = DraftTrainer(cfg, [sample], pipe.stages[0].embed, pipe.stages[0].embed.weight,
                      TrainConfig(steps=1, seed=3), head_dtype=torch.float32)
    with torch.no_grad():
        tr.draft.fc.weight.mul_(3)  # a non-trivial context contribution
    anchors = torch.tensor([len(ids), len(ids) + 4, len(ids) + 11])
    with torch.no_grad():
        got = tr._blocks(sample, anchors)
    inf = tr.inference_draft(max_ctx=128)
    for a, hid in zip(anchors.tolist(), got):
        inf.reset()
        inf.append_context(sample.features[None, :a].float(), 0)
        block = torch.tensor([[int(sample.ids[a])] + [cfg.mask_token_id] * (cfg.block_size - 1)])
        want = inf.draft_hidden(pipe.embed(block), a)[0]
        assert (hid - want).abs().max() < 1e-4, a


def _samples(path, n_prompts=3):
    pipe = batched(path)
    gen = torch.Generator().manual_seed(0)
    out = []
    for p in load_prompts(split="train")[:n_prompts]:
        out += sample_prompt(pipe, render(pipe.tokenizer, p), TAPS, 24, temperature=0.5, gen=gen)
    return pipe, out


def test_resume_continues_exactly(tiny_dir, tmp_path):
    pipe, samples = _samples(tiny_dir("llama"))
    cfg = tiny_cfg(pipe)
    tc = TrainConfig(steps=8, batch=3, anchors=6, lr=2e-3, gamma=4.0, seed=5, head_vocab="data", negatives=64,
                     amp=True)

    def trainer(ckpt, resume=False):
        return DraftTrainer(cfg, samples, pipe.stages[0].embed, pipe.stages[0].embed.weight, tc,
                            ckpt_dir=ckpt, resume=resume, head_dtype=torch.float32)
    full = trainer(tmp_path / "a")
    full.train(progress=False)
    half = trainer(tmp_path / "b")
    half.train(until=4, progress=False)              # checkpoints at the end of the run
    state = json.loads((tmp_path / "b" / "state.json").read_text())
    assert state["step"] == 4
    resumed = trainer(tmp_path / "b", resume=True)
    assert resumed.step == 4 and len(resumed.history) == 4
    resumed.train(progress=False)
    assert resumed.step == 8
    assert [h["step"] for h in resumed.history] == list(range(8))
    for (k, a), b in zip(full.tensors().items(), resumed.tensors().values()):
        assert (a - b).abs().max() < 1e-5, k
    assert abs(full.history[-1]["loss"] - resumed.history[-1]["loss"]) < 1e-4
    with pytest.raises(ValueError, match="another draft"):
        DraftTrainer(tiny_cfg(pipe, block=4), samples, pipe.stages[0].embed, pipe.stages[0].embed.weight, tc,
                     ckpt_dir=tmp_path / "b", resume=True)


def test_train_draft_command_end_to_end(tiny_dir, tmp_path, capsys):
    """Sample, train, export on a tiny target in well under a minute; the draft beats a
    random one on held-out prompts (real greedy speculative decoding) and stays lossless."""
    path, out = tiny_dir("llama"), tmp_path / "draft"
    args = ["train-draft", "--model", str(path), "--out", str(out), "--device", "cpu", "--dtype", "fp32",
            "--quantize", "none", "--samples", "32", "--max-new-tokens", "40", "--temperature", "0.05",
            "--layers", "1", "--heads", "4", "--intermediate-size", "128", "--block-size", "8", "--steps", "60",
            "--batch", "4", "--anchors", "16", "--lr", "3e-3", "--eval-prompts", "2", "--eval-tokens", "16",
            "--eval-every", "30"]
    assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["samples"] == 32 and summary["steps"] == 60 and "heldout_tau" in summary
    assert summary["sampling_tok_s"] > 0     # sampled in sequence slots (a CPU), throughput reported
    assert (out / "checkpoint" / "state.json").is_file() and (out / "train_log.jsonl").is_file()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum(h["loss"] for h in log[-10:]) < sum(h["loss"] for h in log[:10])
    pipe = pipeline(path)
    trained = DFlashDraft.load(out, dtype=torch.float32, max_ctx=pipe.max_ctx)
    assert trained.cfg.block_size == 8 and trained.cfg.mask_token_id == 16
    rand = DFlashDraft(trained.cfg, DFlashDraft.random_tensors(trained.cfg, seed=1), "cpu", torch.float32,
                       pipe.max_ctx)
    held = [render(pipe.tokenizer, p) for p in load_prompts(split="heldout")[2:8]]
    tau_trained = acceptance(pipe, trained, held, 32)["tau"]
    tau_random = acceptance(pipe, rand, held, 32)["tau"]
    assert tau_trained > tau_random + 0.5, (tau_trained, tau_random)
    plain, spec = Engine(pipe), Engine(pipe, proposer=DFlashProposer(trained, pipe))
    for ids in held[:3]:
        req = GenerationRequest(tuple(ids), max_tokens=32, ignore_eos=True)
        assert spec.generate(req).token_ids == plain.generate(req).token_ids
    # resuming a finished run only re-exports
    assert main(args + ["--resume"]) == 0
    # fine-tune the exported draft on the same data: starts where it ended
    again = ["train-draft", "--model", str(path), "--out", str(tmp_path / "ft"), "--data", str(out / "data"),
             "--device", "cpu", "--dtype", "fp32", "--quantize", "none", "--samples", "32", "--init", str(out),
             "--block-size", "8", "--steps", "2", "--batch", "4", "--anchors", "16", "--lr", "1e-9",
             "--eval-prompts", "0"]
    assert main(again + ["--more-data", str(tmp_path / "nowhere")]) == 2
    assert "--more-data" in capsys.readouterr().err
    # --more-data adds a second dataset (here the same one again) to the training set
    assert main(again + ["--more-data", str(out / "data")]) == 0
    assert json.loads((tmp_path / "ft" / "train_summary.json").read_text())["samples"] == 64
    tuned = DFlashDraft.load(tmp_path / "ft", dtype=torch.float32)
    assert tuned.cfg == trained.cfg
    for (k, a), b in zip(trained.zlab_state_dict().items(), tuned.zlab_state_dict().values()):
        assert (a - b).abs().max() < 1e-3, k
    # --layers above the --init draft's grows it: old weights kept, new layers' outputs near zero
    grow = again[:again.index("--out") + 1] + [str(tmp_path / "grow")] + again[again.index("--out") + 2:]
    assert main(grow + ["--layers", "2"]) == 0
    grown = DFlashDraft.load(tmp_path / "grow", dtype=torch.float32).zlab_state_dict()
    assert DFlashDraft.load(tmp_path / "grow", dtype=torch.float32).cfg.num_layers == 2
    for k, a in trained.zlab_state_dict().items():
        assert (a - grown[k]).abs().max() < 1e-3, k
    for k in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert grown[k].abs().max() < 1e-3, k
    # --draft-vocab K: the draft proposes only the K most frequent labels of the responses
    capsys.readouterr()
    vocab_run = again[:again.index("--out") + 1] + [str(tmp_path / "v")] + again[again.index("--out") + 2:]
    assert main(vocab_run + ["--draft-vocab", "4"]) == 0
    assert "draft vocabulary: 4 tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "v" / "train_summary.json").read_text())["draft_vocab"] == 4
    v = DFlashDraft.load(tmp_path / "v", dtype=torch.float32, max_ctx=pipe.max_ctx)
    counts = torch.bincount(torch.cat([s.targets[s.prompt_len:] for s in load_dataset(out / "data")[1]]),
                            minlength=pipe.config.vocab_size)
    chosen = torch.zeros_like(counts, dtype=torch.bool)
    chosen[v.vocab_ids] = True
    assert chosen.sum() == 4 and counts[chosen].min() >= counts[~chosen].max() and counts[chosen].min() > 0
    spec = Engine(pipe, proposer=DFlashProposer(v, pipe))
    for ids in held[:2]:
        req = GenerationRequest(tuple(ids), max_tokens=32, ignore_eos=True)
        assert spec.generate(req).token_ids == plain.generate(req).token_ids
    # fine-tuning keeps the --init draft's vocabulary unless told otherwise (0: the whole one)
    keep = again[:again.index("--init") + 1] + [str(tmp_path / "v")] + again[again.index("--init") + 2:]
    keep[keep.index("--out") + 1] = str(tmp_path / "v2")
    assert main(keep) == 0
    assert torch.equal(DFlashDraft.load(tmp_path / "v2", dtype=torch.float32).vocab_ids, v.vocab_ids)
    assert main(keep + ["--draft-vocab", "0"]) == 0
    assert DFlashDraft.load(tmp_path / "v2", dtype=torch.float32).vocab_ids is None


def test_hidden_size_must_match_target(tiny_dir, tmp_path, capsys):
    rc = main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(tmp_path), "--hidden-size", "128"])
    assert rc == 2 and "target's hidden size (64)" in capsys.readouterr().err
    rc = main(["train-draft", "--model", str(tiny_dir("llama")), "--out", str(tmp_path), "--target-layers", "1,7"])
    assert rc == 2 and "outside the target's 4 layers" in capsys.readouterr().err


def test_init_from_a_draft(tiny_dir, tmp_path, capsys):
    from dflash_server.weights.default_model import default_draft_path

    path = tiny_dir("llama")
    pipe = pipeline(path)
    cfg = tiny_cfg(pipe)
    DraftTrainer(cfg, [_samples(path, 1)[1][0]], pipe.stages[0].embed, pipe.stages[0].embed.weight,
                 TrainConfig(steps=1, seed=9), head_dtype=torch.float32).export(tmp_path / "d", torch.float32)
    init = DFlashDraft.load(tmp_path / "d", dtype=torch.float32).zlab_state_dict()
    tr = DraftTrainer(cfg, [_samples(path, 1)[1][0]], pipe.stages[0].embed, pipe.stages[0].embed.weight,
                      TrainConfig(steps=1, seed=0), head_dtype=torch.float32, init=init)
    assert all(torch.equal(tr.tensors()[k], v) for k, v in init.items())
    # a grown draft computes the same function as the one it grew from
    gcfg, gtensors = grow_layers(cfg, init, 3, seed=1)
    assert gcfg.num_layers == 3 and len(gcfg.layer_attention) == 3
    grown = DraftTrainer(gcfg, [_samples(path, 1)[1][0]], pipe.stages[0].embed, pipe.stages[0].embed.weight,
                         TrainConfig(steps=1, seed=0), head_dtype=torch.float32, init=gtensors)
    sample = tr.samples[0]
    anchors = tr.anchors_for(sample, 0, 0)
    assert torch.allclose(grown._blocks(sample, anchors), tr._blocks(sample, anchors), atol=1e-6)
    assert not torch.allclose(grown.tensors()["layers.2.self_attn.q_proj.weight"], torch.zeros(1))
    base = ["train-draft", "--model", str(path), "--out", str(tmp_path / "o"), "--init"]
    assert main(base + [str(tmp_path / "d"), "--block-size", "4"]) == 2
    assert "--block-size 4 differs from the --init draft's block_size 8" in capsys.readouterr().err
    assert main(base + [str(default_draft_path())]) == 2
    assert "--init: draft hidden_size 576 != target hidden_size 64" in capsys.readouterr().err


def test_shipped_draft_loads_and_is_lossless_on_the_default_model():
    from dflash_server.weights.default_model import default_draft_path, default_model_path

    path = default_draft_path()
    assert path is not None and (path / "model.safetensors").stat().st_size < 40 * 2**20
    draft = DFlashDraft.load(path, dtype=torch.float32, max_ctx=512)
    assert draft.cfg.hidden_size == 576 and draft.cfg.mask_token_id == 16 and draft.cfg.block_size == 8
    assert len(draft.vocab_ids) == 15048                      # its draft vocabulary
    pipe = pipeline(default_model_path())                     # fp32 dense: exact comparison
    ids = render(pipe.tokenizer, load_prompts(split="heldout")[0])
    req = GenerationRequest(tuple(ids), max_tokens=40, ignore_eos=True)
    res = Engine(pipe, proposer=DFlashProposer(draft, pipe)).generate(req)
    assert res.token_ids == Engine(pipe).generate(req).token_ids
    assert res.extra["spec"]["acceptance_length"] > 1.0


def test_native_kernels_make_dflash_lossless_in_the_serving_configuration(monkeypatch):
    """bf16 activations, GGUF Q4_1/Q8_0 weights (the default serving configuration) with
    --native-kernels: every op of a verify block is row-count invariant (the quantized
    matmuls, RMSNorm, the fused attention step), so a block of rows gives bit-identical
    logits to one-row steps and DFlash with the shipped draft writes exactly what plain
    decoding writes, on every prompt (with the aten kernels it differs on some)."""
    from dflash_server import kernels
    from dflash_server.cli.common import quantize_plan
    from dflash_server.weights.default_model import default_draft_path, default_model_path
    from dflash_server.weights.loader import open_model

    monkeypatch.setenv("DFLASH_KERNELS", "1")
    assert kernels.load()
    path = default_model_path()
    pipe = pipeline(path, dtype=torch.bfloat16, quantize=quantize_plan(open_model(path), "auto", True))
    draft = DFlashDraft.load(default_draft_path(), dtype=torch.bfloat16, max_ctx=512, quantize="int8")
    ids = pipe.tokenizer.encode("Once upon a time there was a little fox who")
    block = pipe.tokenizer.encode(" lived in the forest near the river bank")[:8]
    pipe.reset()
    pipe.prefill(ids)
    many = pipe.forward(block, len(ids), logits="all").logits.clone()
    pipe.reset()
    pipe.prefill(ids)
    one = torch.cat([pipe.forward([t], len(ids) + i, logits="all").logits for i, t in enumerate(block)])
    assert torch.equal(many, one)
    spec = Engine(pipe, proposer=DFlashProposer(draft, pipe, block_size=8))
    plain = Engine(pipe)
    for prompt in load_prompts(split="heldout")[:8]:
        req = GenerationRequest(tuple(render(pipe.tokenizer, prompt)), max_tokens=32, ignore_eos=True)
        res = spec.generate(req)
        assert res.token_ids == plain.generate(req).token_ids, prompt
        assert res.extra["spec"]["acceptance_length"] > 1.0
