"""Gated DeltaNet core ops vs. each other and vs. the transformers Qwen3.5 torch reference."""

import pytest
import torch
import torch.nn.functional as F

from dflash_server.layers.gdn_ops import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: with 2 OpenMP threads on a busy 2-core box, spin-waiting made this file
    ~10x slower. Restored afterwards so other modules keep their setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_inputs(B, T, H, Dk, Dv, seed=0, Hk=None, dtype=torch.float32, state=False):
    """Raw (unnormalised) q/k plus v, g, beta and an optional initial state, like the GDN layer builds them."""
    gen = torch.Generator().manual_seed(seed)
    Hk = Hk or H
    q_raw = torch.randn(B, T, Hk, Dk, generator=gen)
    k_raw = torch.randn(B, T, Hk, Dk, generator=gen)
    v = torch.randn(B, T, H, Dv, generator=gen)
    # g as the layer computes it: -exp(A_log) * softplus(a + dt_bias), i.e. <= 0
    g = -torch.rand(H).mul(4).exp().mul(0.25) * F.softplus(torch.randn(B, T, H, generator=gen) - 2)
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, Dk, Dv, generator=gen) * 0.5 if state else None
    return dict(q_raw=q_raw.to(dtype), k_raw=k_raw.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), s0=s0)


def ours(fn, d, s0="default", **kw):
    """Caller-side preprocessing required by our API: fp32 l2norm of q/k, then q * Dk**-0.5."""
    q = l2norm(d["q_raw"].float()) * d["q_raw"].shape[-1] ** -0.5
    k = l2norm(d["k_raw"].float())
    return fn(q, k, d["v"], d["g"], d["beta"], d["s0"] if s0 == "default" else s0, **kw)


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


CASES = [  # (B, T, H, Dk, Dv, Hk)
    (1, 1, 2, 16, 16, None),
    (2, 15, 3, 32, 32, None),
    (1, 64, 4, 16, 16, None),
    (2, 65, 2, 16, 32, None),
    (1, 200, 4, 32, 16, 2),  # grouped heads: 2 key heads serve 4 value heads
]


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("B,T,H,Dk,Dv,Hk", CASES)
def test_chunk_matches_recurrent(B, T, H, Dk, Dv, Hk, state):
    d = make_inputs(B, T, H, Dk, Dv, seed=T, Hk=Hk, state=state)
    o_c, s_c = ours(chunk_gated_delta_rule, d)
    o_r, s_r = ours(recurrent_gated_delta_rule, d)
    assert o_c.shape == (B, T, H, Dv) and s_c.shape == (B, H, Dk, Dv)
    assert o_c.dtype == s_c.dtype == o_r.dtype == s_r.dtype == torch.float32
    assert max_diff(o_c, o_r) < TOL and max_diff(s_c, s_r) < TOL
    if state:  # inputs are not modified in place
        assert torch.equal(d["s0"], make_inputs(B, T, H, Dk, Dv, seed=T, Hk=Hk, state=True)["s0"])


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("B,T,H,Dk,Dv,Hk", CASES)
def test_matches_hf_reference(B, T, H, Dk, Dv, Hk, state):
    d = make_inputs(B, T, H, Dk, Dv, seed=100 + T, Hk=Hk, state=state)
    # HF normalises q/k itself (use_qk_l2norm_in_kernel) and always applies the Dk**-0.5 scale
    hf_args = (d["q_raw"], d["k_raw"], d["v"], d["g"], d["beta"])
    hf_kw = dict(initial_state=d["s0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*hf_args, **hf_kw)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*hf_args, **hf_kw)
    for fn, o_ref, s_ref in [(chunk_gated_delta_rule, o_hc, s_hc), (recurrent_gated_delta_rule, o_hr, s_hr),
                             (gated_delta_rule, o_hc, s_hc)]:
        o, s = ours(fn, d)
        assert max_diff(o, o_ref) < TOL and max_diff(s, s_ref) < TOL, fn.__name__


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule, gated_delta_rule])
@pytest.mark.parametrize("T,splits", [(100, [37, 63]), (200, [130, 1, 69])])
def test_split_sequence_carries_state(fn, T, splits):
    d = make_inputs(2, T, 3, 16, 32, seed=7, state=True)
    q = l2norm(d["q_raw"]) * 16 ** -0.5
    k = l2norm(d["k_raw"])
    o_full, s_full = fn(q, k, d["v"], d["g"], d["beta"], d["s0"])
    state, outs, start = d["s0"], [], 0
    for n in splits:
        sl = slice(start, start + n)
        o, state = fn(q[:, sl], k[:, sl], d["v"][:, sl], d["g"][:, sl], d["beta"][:, sl], state)
        outs.append(o)
        start += n
    assert max_diff(torch.cat(outs, 1), o_full) < TOL and max_diff(state, s_full) < TOL


def test_chunk_size_is_free():
    d = make_inputs(1, 70, 2, 16, 16, seed=3, state=True)
    o64, s64 = ours(chunk_gated_delta_rule, d)
    o16, s16 = ours(chunk_gated_delta_rule, d, chunk_size=16)
    assert max_diff(o64, o16) < TOL and max_diff(s64, s16) < TOL


def test_bf16_inputs_give_fp32_outputs():
    d32 = make_inputs(1, 80, 2, 32, 32, seed=5, state=True)
    d16 = {n: (x.bfloat16() if x is not None and n != "s0" else x) for n, x in d32.items()}
    o_ref, s_ref = ours(chunk_gated_delta_rule, d32)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = ours(fn, d16)
        assert o.dtype == s.dtype == torch.float32
        # bf16 rounding of the inputs only (~3 significant digits); the recurrence itself is fp32
        assert max_diff(o, o_ref) < 2e-2 * o_ref.abs().max().item()
        assert max_diff(s, s_ref) < 2e-2 * s_ref.abs().max().item()


def test_l2norm_matches_hf():
    x = torch.randn(3, 5, 16)
    assert torch.equal(l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))


# ----------------------------------------------------------------------------- causal conv

def conv_inputs(B=2, C=6, T=11, K=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, T, generator=gen), torch.randn(C, K, generator=gen)


@pytest.mark.parametrize("T", [1, 2, 3, 11])
def test_conv_fresh_matches_hf(T):
    x, w = conv_inputs(T=T)
    y, state = causal_conv1d(x, None, w)
    ref = hf.causal_conv1d_fn(x, weight=w, bias=None, activation="silu")
    assert y.shape == x.shape and state.shape == (2, 6, 3)
    assert max_diff(y, ref) < 1e-6
    # new state = last K-1 inputs, zero-padded on the left when T < K-1
    assert torch.equal(state, F.pad(x, (3, 0))[:, :, -3:])


def test_conv_incremental_and_split_match_one_shot():
    x, w = conv_inputs(T=13)
    y_full, s_full = causal_conv1d(x, None, w)
    # token by token, also against HF's in-place update (whose state keeps K columns)
    state, hf_state, ys = None, torch.zeros(2, 6, 4), []
    for t in range(13):
        y, state = causal_conv1d(x[:, :, t:t + 1], state, w)
        ref = hf.causal_conv1d_update(x[:, :, t:t + 1], hf_state, w, None, "silu")
        assert max_diff(y, ref) < 1e-6
        ys.append(y)
    assert max_diff(torch.cat(ys, -1), y_full) < 1e-6 and torch.equal(state, s_full)
    assert torch.equal(state, hf_state[:, :, 1:])
    # two calls, including a piece shorter than K-1
    for cut in (1, 2, 7):
        y1, st = causal_conv1d(x[:, :, :cut], None, w)
        y2, st = causal_conv1d(x[:, :, cut:], st, w)
        assert max_diff(torch.cat([y1, y2], -1), y_full) < 1e-6 and torch.equal(st, s_full)


def test_conv_dtypes():
    x, w = conv_inputs(T=5)
    y, st = causal_conv1d(x.bfloat16(), torch.zeros(2, 6, 3), w)  # fp32 weight, bf16 activations
    assert y.dtype == st.dtype == torch.bfloat16
    ref, _ = causal_conv1d(x.bfloat16().float(), None, w)
    assert max_diff(y, ref) < 2e-2
    y_hf = hf.causal_conv1d_fn(x.bfloat16(), weight=w.bfloat16(), bias=None, activation="silu")
    y_ours, _ = causal_conv1d(x.bfloat16(), None, w.bfloat16())
    assert torch.equal(y_ours, y_hf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    d = make_inputs(2, 150, 4, 32, 32, seed=11, Hk=2, state=True)
    dc = {n: x.cuda() for n, x in d.items()}
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = ours(fn, d)
        oc, sc = ours(fn, dc)
        assert oc.is_cuda and max_diff(oc.cpu(), o) < 1e-3 and max_diff(sc.cpu(), s) < 1e-3
    x, w = conv_inputs(T=9)
    y, st = causal_conv1d(x, None, w)
    yc, stc = causal_conv1d(x.cuda(), None, w.cuda())
    assert max_diff(yc.cpu(), y) < 1e-5 and torch.equal(stc.cpu(), st)
