"""The native Gated DeltaNet step (``dflash::gdn_step``): equal to the aten layer (conv,
gates, norms, recurrence) within rounding, rows bit-identical to one-row calls chained,
the portable build bit-identical to the vectorized one, hostile arguments refused."""
import pytest
import torch

from dflash_server import kernels
from dflash_server.layers.context import ForwardContext
from dflash_server.layers.gdn import GatedDeltaNet, RecurrentState
from dflash_server.layers.gdn_ops import causal_conv1d

pytestmark = pytest.mark.skipif(not (kernels.enabled() and kernels.load()), reason="native kernels unavailable")


def layer(hk=2, hv=4, dk=16, dv=16, hidden=48, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.2: torch.randn(*s, generator=g) * std  # noqa: E731
    conv_dim = 2 * hk * dk + hv * dv
    return GatedDeltaNet(in_proj_qkv=r(conv_dim, hidden), in_proj_z=r(hv * dv, hidden), in_proj_b=r(hv, hidden),
                         in_proj_a=r(hv, hidden), conv_weight=r(conv_dim, 1, K, std=0.5),
                         A_log=r(hv, std=0.5), dt_bias=r(hv, std=0.5), norm_weight=1 + r(dv),
                         out_proj=r(hidden, hv * dv), num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
                         head_v_dim=dv, eps=1e-6)


def aten(m, mixed, conv, ssm):
    """The layer's aten path from its projection rows: (out before out_proj, conv, state)."""
    qkv, z, b, a = mixed.split([m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    qkv_t = qkv.transpose(1, 2)
    y, conv = causal_conv1d(qkv_t, conv, m.conv_weight)
    st = RecurrentState(conv, ssm)
    o = m._mix(mixed, y, z, b, a, ForwardContext(0, mixed.shape[1], None, None), st, qkv_t)
    return o, st.conv, st.ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, T", [(dict(), 9), (dict(hk=2, hv=2, dk=32, dv=24), 9),
                                      (dict(hk=1, hv=3, dk=8, dv=8, K=3), 9),
                                      (dict(hk=1, hv=1, dk=2, dv=8), 9),   # channels not whole vectors
                                      (dict(hk=2, hv=4, dk=64, dv=40, hidden=64), 130)])  # a prefill-sized chunk
def test_matches_aten_and_rows_are_invariant(dtype, shape, T):
    """(The vectorized build runs a block's tokens column group by column group, fused across
    tokens: a prefill chunk of any length must still give the one-row calls' bits.)"""
    m = layer(**shape).to(dtype)
    m.neg_A.data, m.dt_bias.data, m.norm_weight.data = m.neg_A.float(), m.dt_bias.float(), m.norm_weight.float()
    g = torch.Generator().manual_seed(1)
    mixed = (torch.randn(1, T, m.conv_dim + m.value_dim + 2 * m.hv, generator=g)).to(dtype)
    conv = torch.randn(1, m.conv_dim, m.conv_weight.shape[-1] - 1, generator=g).to(dtype)
    ssm = torch.randn(1, m.hv, m.dk, m.dv, generator=g) * 0.1
    o, c, s = m._native(mixed, conv, ssm)
    ro, rc, rs = aten(m, mixed, conv, ssm)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert o.dtype == dtype and o.shape == (1, T, m.value_dim)
    torch.testing.assert_close(o.float(), ro.float(), atol=tol, rtol=tol)
    assert torch.equal(c, rc)                                   # the window is a copy
    torch.testing.assert_close(s, rs, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    # rows one at a time, chaining the state == the block, bit for bit
    cc, ss, rows = conv, ssm, []
    for t in range(T):
        ot, cc, ss = m._native(mixed[:, t:t + 1], cc, ss)
        rows.append(ot)
    assert torch.equal(torch.cat(rows, dim=1), o) and torch.equal(cc, c) and torch.equal(ss, s)
    # the portable build == the vectorized one
    po, pc, ps = torch.ops.dflash.gdn_step(mixed, conv, m.conv_weight, m.neg_A, m.dt_bias, m.norm_weight, m.eps,
                                           ssm, m.hk, m.hv, m.dk, m.dv, True)
    assert torch.equal(po, o) and torch.equal(pc, c) and torch.equal(ps, s)
    assert torch.equal(ssm, ssm.clone())   # inputs are not written
    torch.library.opcheck(torch.ops.dflash.gdn_step.default,
                          (mixed, conv, m.conv_weight, m.neg_A, m.dt_bias, m.norm_weight, m.eps, ssm, m.hk, m.hv,
                           m.dk, m.dv))


def test_hostile_arguments():
    m = layer()
    mixed = torch.randn(1, 3, m.conv_dim + m.value_dim + 2 * m.hv)
    conv = torch.zeros(1, m.conv_dim, 3)
    ssm = torch.zeros(1, m.hv, m.dk, m.dv)
    op = torch.ops.dflash.gdn_step
    args = (m.conv_weight, m.neg_A, m.dt_bias, m.norm_weight, m.eps)
    for bad in (
        lambda: op(mixed[:, :, :-1], conv, *args, ssm, m.hk, m.hv, m.dk, m.dv),        # width
        lambda: op(mixed, conv[:, :, :2], *args, ssm, m.hk, m.hv, m.dk, m.dv),         # window
        lambda: op(mixed, conv, *args, ssm.double(), m.hk, m.hv, m.dk, m.dv),          # state dtype
        lambda: op(mixed, conv, *args, ssm, 3, m.hv, m.dk, m.dv),                       # heads
        lambda: op(mixed, conv.bfloat16(), *args, ssm, m.hk, m.hv, m.dk, m.dv),        # window dtype
        lambda: op(mixed.expand(2, -1, -1), conv, *args, ssm, m.hk, m.hv, m.dk, m.dv),  # batch
    ):
        with pytest.raises(RuntimeError, match="gdn_step"):
            bad()
