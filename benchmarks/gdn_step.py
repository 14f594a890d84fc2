"""A Gated DeltaNet mixer between its projections (Qwen3.5-0.8B's sizes: 16 key and 16 value
heads of 128, conv of 4 taps, bf16 activations, fp32 state): the native op
(``dflash::gdn_step``, token by token, bit-identical to one-row calls) against the aten path
(the chunked WY form for a block of rows, what prefill chunks ran before the op took them),
for T = 1, 8, 64, 512 rows; milliseconds per call (median of alternating calls):

    python benchmarks/gdn_step.py [--threads 2] [--reps 7] [--out benchmarks/results/gdn_step.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash_server import kernels
from dflash_server.layers.context import ForwardContext
from dflash_server.layers.gdn import GatedDeltaNet, RecurrentState
from dflash_server.layers.gdn_ops import causal_conv1d

ROOT = Path(__file__).resolve().parents[1]


def qwen35_mixer(hk=16, hv=16, dk=128, dv=128, hidden=1024, K=4) -> GatedDeltaNet:
    g = torch.Generator().manual_seed(0)
    r = lambda *s, std=0.2: torch.randn(*s, generator=g) * std  # noqa: E731
    conv_dim = 2 * hk * dk + hv * dv
    m = GatedDeltaNet(in_proj_qkv=r(conv_dim, hidden), in_proj_z=r(hv * dv, hidden), in_proj_b=r(hv, hidden),
                      in_proj_a=r(hv, hidden), conv_weight=r(conv_dim, 1, K, std=0.5), A_log=r(hv, std=0.5),
                      dt_bias=r(hv, std=0.5), norm_weight=1 + r(dv), out_proj=r(hidden, hv * dv), num_k_heads=hk,
                      num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=1e-6).to(torch.bfloat16)
    m.neg_A.data, m.dt_bias.data, m.norm_weight.data = m.neg_A.float(), m.dt_bias.float(), m.norm_weight.float()
    return m


def aten(m: GatedDeltaNet, mixed, conv, ssm):
    qkv, z, b, a = mixed.split([m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    qkv_t = qkv.transpose(1, 2)
    y, conv = causal_conv1d(qkv_t, conv, m.conv_weight)
    st = RecurrentState(conv, ssm)
    return m._mix(mixed, y, z, b, a, ForwardContext(0, mixed.shape[1], None, None), st, qkv_t), st.ssm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gdn_step.json"))
    a = ap.parse_args()
    if not kernels.load():
        raise SystemExit("the native kernels are unavailable here")
    torch.set_num_threads(a.threads)
    m = qwen35_mixer()
    rows = []
    with torch.inference_mode():
        for T in (1, 8, 64, 512):
            g = torch.Generator().manual_seed(T)
            mixed = torch.randn(1, T, m.conv_dim + m.value_dim + 2 * m.hv, generator=g).to(torch.bfloat16)
            conv = torch.randn(1, m.conv_dim, 3, generator=g).to(torch.bfloat16)
            ssm = torch.randn(1, m.hv, m.dk, m.dv, generator=g) * 0.1
            times = {"native": [], "aten": []}
            for rep in range(a.reps + 1):
                for name, fn in (("native", lambda: m._native(mixed, conv, ssm)),
                                 ("aten", lambda: aten(m, mixed, conv, ssm))):
                    t = time.perf_counter()
                    fn()
                    if rep:  # (the first round warms up)
                        times[name].append(time.perf_counter() - t)
            row = {"rows": T, **{f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()}}
            row["aten_over_native"] = round(row["aten_ms"] / row["native_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    res = {"threads": a.threads, "shape": "Qwen3.5-0.8B GDN (16+16 heads of 128, conv 4, bf16)", "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
