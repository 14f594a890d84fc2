"""A stage's layers in one ``dflash::decoder_stack`` call (layers/stack.py) against the
per-layer path it replaces: logits, captured layer outputs and KV caches bit-identical for
decode steps, verify blocks with captures, a DDTree block and batched rows of several slots;
hybrid stacks keep the per-layer loop."""
import pytest
import torch

from dflash_server import kernels
from helpers.build import greedy, pipeline, prompt_ids

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")


def _pair(path, **kw):
    """Two identical pipelines (bf16, int8 layers: the native path); the second never takes
    the stack."""
    fused, plain = (pipeline(path, dtype=torch.bfloat16, quantize="int8", max_ctx=256, **kw) for _ in range(2))
    for st in plain.stages:
        st._stack = None  # decided: no stack
    return fused, plain


def _caches(pipe):
    return [t for st in pipe.stages for b in st.banks if b is not None for t in (b.k, b.v)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stack_equals_the_layers_one_by_one(tiny_dir, family):
    fused, plain = _pair(tiny_dir(family), stages=2)   # (two stages: each its own stack)
    taps = (0, 2, fused.config.num_layers - 1)
    ids = prompt_ids(fused, 30)
    for pipe in (fused, plain):
        pipe.reset()
        pipe.prefill(ids, chunk=16)
    outs = {}
    for name, pipe in (("fused", fused), ("plain", plain)):
        got = [pipe.forward([ids[3]], 30, capture=taps)]                   # a decode step
        got.append(pipe.forward(ids[5:13], 31, logits="all", capture=taps))  # a verify block
        pipe.checkpoint()
        got.append(pipe.forward(ids[:5], 39, logits="all", tree=(-1, 0, 0, 1, 2)))  # a DDTree block
        pipe.rollback_tree([0, 2])
        got.append(pipe.forward([ids[7]], 41, capture=taps))
        outs[name] = got
    assert all(st._stack is not None for st in fused.stages)
    for step, (a, b) in enumerate(zip(outs["fused"], outs["plain"])):
        assert torch.equal(a.logits, b.logits)
        assert a.captures.keys() == b.captures.keys() == (set() if step == 2 else set(taps))
        assert all(torch.equal(a.captures[i], b.captures[i]) for i in a.captures)
    assert all(torch.equal(x, y) for x, y in zip(_caches(fused), _caches(plain)))


def test_stack_rows_equal_the_layers_one_by_one(tiny_dir):
    """Decode rows of three slots (continuous batching) through the stack's rows form."""
    fused, plain = _pair(tiny_dir("llama"), lanes=3)
    prompts = [prompt_ids(fused, n, seed=n) for n in (9, 17, 4)]
    got = {}
    for name, pipe in (("fused", fused), ("plain", plain)):
        for lane, p in enumerate(prompts):
            pipe.select(lane)
            pipe.reset()
            pipe.prefill(p, chunk=8)
        out = pipe.forward_rows([5, 6, 7], [0, 1, 2], [len(p) for p in prompts], capture=(1,))
        got[name] = out
    assert fused.stages[0]._stack is not None
    assert torch.equal(got["fused"].logits, got["plain"].logits)
    assert torch.equal(got["fused"].captures[1], got["plain"].captures[1])
    assert all(torch.equal(x, y) for x, y in zip(_caches(fused), _caches(plain)))


def test_kv_flash_pools_through_the_stack_equal_the_layers(tiny_dir):
    """A KV Flash pool that pages (a 200-token prompt in a 128-token pool): prefill chunks,
    decode steps, a verify block with captures and a DDTree block through the stack (key
    lists of pool slots, the same for every layer) equal the layers one by one, logits,
    captures and pools bit for bit."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    fused, plain = _pair(tiny_dir("llama"), kvflash=KvFlashConfig(128, chunk=16))
    calls = []
    stack = fused.stages[0]._native_stack()
    orig = stack.run
    stack.run = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    taps = (0, fused.config.num_layers - 1)
    ids = prompt_ids(fused, 200)
    outs = {}
    for name, pipe in (("fused", fused), ("plain", plain)):
        pipe.reset()
        got = [pipe.prefill(ids[:190], chunk=32).logits]
        got.append(pipe.forward([ids[190]], 190, capture=taps))                    # a decode step
        got.append(pipe.forward(ids[191:197], 191, logits="all", capture=taps))    # a verify block
        pipe.checkpoint()
        got.append(pipe.forward(ids[:5], 197, logits="all", tree=(-1, 0, 0, 1, 2)))  # a DDTree block
        pipe.rollback_tree([0, 2])
        got.append(pipe.forward([ids[7]], 199, capture=taps))
        assert pipe.kvflash_stats()[0]["paged_chunks"] > 0
        outs[name] = got
    assert len(calls) >= 10   # (7 prefill chunks, the steps and blocks: all through the stack)
    assert torch.equal(outs["fused"][0], outs["plain"][0])
    for a, b in zip(outs["fused"][1:], outs["plain"][1:]):
        assert torch.equal(a.logits, b.logits)
        assert a.captures.keys() == b.captures.keys()
        assert all(torch.equal(a.captures[i], b.captures[i]) for i in a.captures)
    assert all(torch.equal(x, y) for x, y in zip(_caches(fused), _caches(plain)))


def test_generation_through_the_stack_equals_the_layers(tiny_dir):
    fused, plain = _pair(tiny_dir("qwen3"))
    ids = prompt_ids(fused, 12)
    assert greedy(fused, ids, max_tokens=12) == greedy(plain, ids, max_tokens=12)


def test_hybrid_and_aten_stages_keep_the_per_layer_loop(tiny_dir, monkeypatch):
    hybrid = pipeline(tiny_dir("qwen3_5"), dtype=torch.bfloat16, quantize="int8", max_ctx=128)
    hybrid.reset()
    hybrid.prefill(prompt_ids(hybrid, 6), chunk=8)
    assert hybrid.stages[0]._stack is None
    monkeypatch.setenv("DFLASH_KERNELS", "0")
    aten = pipeline(tiny_dir("llama"), dtype=torch.bfloat16, quantize="int8", max_ctx=128)
    aten.reset()
    aten.prefill(prompt_ids(aten, 6), chunk=8)
    assert aten.stages[0]._stack is None


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_layers_outside_the_stack_fuse_norms_and_residual_adds_with_the_same_bits(tiny_dir, family):
    """A layer that does not run as one decoder_layer call (every layer of a hybrid stage; a
    llama stage without its stack or fused layers) runs its MLP half as two qmm_fused calls,
    and a Gated DeltaNet layer its mixer half too (norm into the input projection, residual
    into the output projection): prefill logits, a recorded verify block's logits, the state
    after its rollback and a greedy generation equal the ops one by one."""
    fused, plain = _pair(tiny_dir(family))
    for pipe in (fused, plain):
        for st in pipe.stages:
            st._stack = None
            for layer in st.layers:
                layer._fused = False  # (llama: the per-layer path, as a hybrid stage's)
    for st in plain.stages:
        for layer in st.layers:
            layer._fused_mlp = False
            layer.mixer.residual_step = lambda *a: None  # (a GDN mixer's fused half)
    ids = prompt_ids(fused, 10)
    outs = []
    for pipe in (fused, plain):
        pipe.reset()
        a = pipe.prefill(ids[:7], chunk=4).logits
        pipe.checkpoint()
        b = pipe.forward(ids[7:], 7, logits="all").logits
        pipe.rollback(8)  # keep the block's first row: the recurrent state replayed to it
        c = pipe.forward(ids[8:], 8, logits="all").logits
        assert torch.equal(c, b[1:])
        outs.append((a, b, greedy(pipe, ids, max_tokens=10)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]
    assert all(layer._fused_mlp for st in fused.stages for layer in st.layers)
    if family == "qwen3_5":
        from dflash_server.layers.gdn import GatedDeltaNet

        gdn = [layer for st in fused.stages for layer in st.layers if isinstance(layer.mixer, GatedDeltaNet)]
        assert gdn
        x = torch.randn(1, 2, fused.config.hidden_size, dtype=torch.bfloat16)
        from dflash_server.layers.context import ForwardContext

        state = gdn[0].mixer.new_state(16, "cpu", torch.bfloat16)
        assert gdn[0].mixer.residual_step(x, gdn[0].input_norm, ForwardContext(0, 2, None, None), state) is not None


def test_the_op_rejects_malformed_stacks():
    x = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        torch.ops.dflash.decoder_stack(x, [], [], [], [], [], x, x, 0, [])
    k = torch.zeros(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="per layer"):
        torch.ops.dflash.decoder_stack(x, [x] * 5, [k], [k], [0] * 9, [0.0] * 4, x, x, 0, [])
    with pytest.raises(RuntimeError, match="outside the stack"):
        torch.ops.dflash.decoder_stack(x, [x] * 6, [k], [k], [0] * 9, [0.0] * 4, x, x, 0, [1])
    one = torch.zeros(1, dtype=torch.long)
    for q_out, lanes in ((torch.zeros(1, 1, 1, 1, 64), [0]),    # with lanes: (layers, rows, nh, head_dim)
                         (torch.zeros(1, 1, 1, 64), None),        # one sequence: (layers, 1, rows, nh, head_dim)
                         (torch.zeros(2, 1, 1, 64), [0])):        # one per layer
        pos = None if lanes is None else [0]
        with pytest.raises(RuntimeError, match="q_out must be"):   # the score policy's queries
            torch.ops.dflash.decoder_stack(x, [x] * 6, [k], [k], [0] * 9, [0.0] * 4, x, x, 0, [], lanes=lanes,
                                           positions=pos, write_rows=one, key_rows=one[None], key_counts=one + 1,
                                           mass=torch.zeros(8), q_out=q_out)


def _stack_call(tiny_dir, rows: int, capture: list[int]) -> tuple:
    """decoder_stack's arguments for ``rows`` new rows after a 5-token prefill of the tiny
    llama (bf16, int8: its stack), on copies of the caches."""
    pipe = pipeline(tiny_dir("llama"), dtype=torch.bfloat16, quantize="int8", max_ctx=64)
    pipe.reset()
    pipe.prefill(prompt_ids(pipe, 5), chunk=8)
    (st,) = pipe.stages
    stack = st._stack
    cos, sin = st.rope.rows(5, rows)
    x = torch.randn(1, rows, pipe.config.hidden_size, dtype=torch.bfloat16)
    return (x, stack.weights, [s.k.clone() for s in st.states], [s.v.clone() for s in st.states], stack.ints,
            stack.floats, cos.float().contiguous(), sin.float().contiguous(), 5, capture)


def test_hostile_key_lists_through_the_stack_are_refused(tiny_dir):
    """KV Flash arguments of the stack reach the attention step's checks: a key or write row
    past the pool, a key count past the rows or the list: a clean error naming the op."""
    base = _stack_call(tiny_dir, 1, [])
    keys = torch.arange(6)[None]
    for bad in (dict(write_rows=torch.tensor([64]), key_rows=keys, key_counts=torch.tensor([6])),
                dict(write_rows=torch.tensor([5]), key_rows=keys + 60, key_counts=torch.tensor([6])),
                dict(write_rows=torch.tensor([5]), key_rows=keys, key_counts=torch.tensor([7])),
                dict(write_rows=torch.tensor([5]), key_rows=keys, key_counts=torch.tensor([0])),
                dict(write_rows=torch.tensor([5]), key_rows=keys)):
        with pytest.raises(RuntimeError, match="attention_step"):
            torch.ops.dflash.decoder_stack(*base, **bad)
    out = torch.ops.dflash.decoder_stack(*base, write_rows=torch.tensor([5]), key_rows=keys,
                                         key_counts=torch.tensor([6]))
    assert torch.isfinite(out[0].float()).all()


def test_the_op_passes_opcheck(tiny_dir):
    """Schema (the caches it writes), fake implementation and dispatch. Not aot_dispatch:
    functionalization does not take a list of written tensors beside a list output, and the
    stack never runs under torch.compile (``native_step_ok`` is false there; its graphs
    trace the per-layer ops)."""
    args = _stack_call(tiny_dir, 2, [0, 1])
    torch.library.opcheck(torch.ops.dflash.decoder_stack.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
