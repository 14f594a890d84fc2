"""Write ``assets/train_prompts_self.jsonl``: draft-training prompts written by the target.

The draft's held-out acceptance grows with the number of *distinct* prompts it trains on
(README, "DFlash draft"), and the hand-written and templated sets are used up. A chat model
given only its template's text before a user turn writes a plausible user request (the
Magpie recipe), so the default model writes its own: each batch of sequence slots starts
from one opening in turn (none, or a few words that steer it to code, maths or writing).
Every prompt is checked to share no 8-word sequence with the evaluation sets
(``../shared/eval``) or with the other training prompt sets.

    python tools/make_self_prompts.py [--n 4096] [--seed 0] [--eval-dir ../shared/eval]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_templated_prompts import ASSETS, eval_texts, shingles  # noqa: E402

OUT = ASSETS / "train_prompts_self.jsonl"
# an empty opening lets the model choose; the others steer a batch towards what the
# evaluation sets ask for (code, maths, explanations) without quoting any of them
OPENINGS = ("", "Write a Python function", "", "Solve", "", "Explain", "", "How", "", "Can you write a",
            "", "A", "", "Calculate", "", "What")


def main() -> None:
    import torch

    from dflash_server.cli.train_draft import _pipeline
    from dflash_server.spec.train_data import self_prompts
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--lanes", type=int, default=32, help="prompts written per batch")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-dir", default=str(ROOT.parent / "shared" / "eval"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    banned = set()
    for t in eval_texts(Path(args.eval_dir)):
        banned |= shingles(t)
    if not banned:
        raise SystemExit(f"no evaluation prompts under {args.eval_dir}: the overlap check would check nothing")
    for f in ("train_prompts.jsonl", "train_prompts_templated.jsonl"):
        for line in (ASSETS / f).read_text().splitlines():
            banned |= {s for m in json.loads(line)["messages"] for s in shingles(m["content"])}
    dropped = [0]

    def keep(text: str) -> bool:
        ok = not (shingles(text) & banned)
        dropped[0] += not ok
        return ok

    torch.manual_seed(args.seed)
    src = open_model(default_model_path())
    pipe = _pipeline(src, "cpu", torch.bfloat16, "auto", 512, args.lanes, slots=True)
    rows = self_prompts(pipe, args.n, openings=OPENINGS, max_len=args.max_len, seed=args.seed, keep=keep)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts ({dropped[0]} dropped for overlap) -> {args.out}")


if __name__ == "__main__":
    main()
