"""The DFlash draft model: a small Qwen3-style decoder that drafts a whole block in one pass.

It has no embedding and no LM head (it borrows the target's). Every layer's keys/values are
``[K/V of the context ; K/V of the block]``: the context is one vector per committed token,
``hidden_norm(fc(concat of tapped target-layer outputs))``, projected by that layer's own
k/v projections (no input norm) and cached; the block is ``[anchor, MASK x (B-1)]``.
Queries come only from the block, which attends bidirectionally (full layers) or causally
within a window (sliding layers). Output position k predicts the token at position k.
An optional ``vocab_ids`` tensor (our extension of the z-lab format) limits the proposals
to a subset of the vocabulary, so the borrowed LM head projects onto fewer rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..layers.linear import Linear
from ..layers.mlp import SwiGLU
from ..layers.norms import RMSNorm
from ..layers.rope import RotaryTable, apply_rope
from ..layers.sdpa import sdpa
from .config import DraftConfig


def attention_mask(q_pos, q_anchor, q_block, k_pos, k_block, causal: bool, window: int | None):
    """Bool (T, S) "may attend" mask. Keys with ``k_block == -1`` are context: visible when
    strictly before the query's anchor. Block keys are visible within the same block; causal
    layers also require ``k_pos <= q_pos``; windowed layers ``k_pos > q_pos - window`` (and,
    when not causal, ``k_pos < q_pos + window``)."""
    ctx = (k_block[None, :] == -1) & (k_pos[None, :] < q_anchor[:, None])
    blk = k_block[None, :] == q_block[:, None]
    m = ctx | blk
    if causal:
        m = m & (k_pos[None, :] <= q_pos[:, None])
    if window:
        m = m & (k_pos[None, :] > q_pos[:, None] - window)
        if not causal:   # a non-causal sliding layer sees the window on both sides (the reference's rule)
            m = m & (k_pos[None, :] < q_pos[:, None] + window)
    return m


def grouped_dynamic_convolve(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """DFlash 2's causal convolution along the block: out[t] = sum_k (base[k] + dynamic[t, k])
    * x[t - k], per channel, the dynamic part shared by the ``group`` channels of a group.
    x (B, T, H), dynamic (B, T, K, H // group), base (K, H)."""
    B, T, H = x.shape
    G = H // group
    blocks = x.view(B, T, G, group)
    out = torch.zeros_like(blocks)
    for k in range(base.shape[0]):
        v = blocks if k == 0 else F.pad(blocks[:, :-k], (0, 0, 0, 0, k, 0))
        out = out + base[k].view(1, 1, G, group).to(x.dtype) * v
        out = torch.addcmul(out, dynamic[:, :, k].view(B, T, G, 1), v)
    return out.view_as(x)


class DynamicConv(nn.Module):
    """DFlash 2: one projection gives the dynamic kernels of a convolution before a
    sublayer (``prepare``) and of one after it (``finish``)."""

    def __init__(self, base: torch.Tensor, projection: torch.Tensor, group: int):
        super().__init__()
        self.base = nn.Parameter(base, requires_grad=False)          # (2, K, H)
        self.projection = Linear(projection)                          # (2 * K * H // group, H)
        self.group, self.K = group, base.shape[1]

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        G = h.shape[-1] // self.group
        dyn = self.projection(h).view(*h.shape[:-1], 2, self.K, G)
        return grouped_dynamic_convolve(h, dyn[..., 0, :, :], self.base[0], self.group), dyn[..., 1, :, :]

    def finish(self, h: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_convolve(h, dyn, self.base[1], self.group)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, index: int, get):
        super().__init__()
        p = f"layers.{index}."
        eps = cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(get(p + "input_layernorm.weight"), eps)
        self.post_attention_layernorm = RMSNorm(get(p + "post_attention_layernorm.weight"), eps)
        a = p + "self_attn."
        def bias(name):   # projection biases when the config sets attention_bias
            return get(a + name + ".bias") if cfg.attention_bias else None
        self.q_proj = Linear(get(a + "q_proj.weight"), bias("q_proj"))
        self.kv_proj = Linear.fused([get(a + "k_proj.weight"), get(a + "v_proj.weight")],
                                    [bias("k_proj"), bias("v_proj")])
        self.o_proj = Linear(get(a + "o_proj.weight"), bias("o_proj"))
        self.q_norm = RMSNorm(get(a + "q_norm.weight"), eps)
        self.k_norm = RMSNorm(get(a + "k_norm.weight"), eps)
        self.mlp = SwiGLU(get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight"),
                          get(p + "mlp.down_proj.weight"))
        self.causal, self.window = cfg.layer_attention[index]
        self.eps = eps
        self._qkv = None   # the native path's fused Q/K/V weight (built at its first use)
        self.attention_conv = self.mlp_conv = None
        if cfg.dflash2:
            self.attention_conv = DynamicConv(get(p + "attention_conv.base_kernel"),
                                              get(p + "attention_conv.kernel_projection.weight"), cfg.conv_group_size)
            self.mlp_conv = DynamicConv(get(p + "mlp_conv.base_kernel"), get(p + "mlp_conv.kernel_projection.weight"),
                                        cfg.conv_group_size)

    def project_kv(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """h (1, T, H) -> roped k, v as (1, nkv, T, hd)."""
        B, T, _ = h.shape
        kv = self.kv_proj(h).view(B, T, 2 * self.nkv, self.hd)
        k = apply_rope(self.k_norm(kv[:, :, :self.nkv]), cos[:, None], sin[:, None])
        return k.transpose(1, 2), kv[:, :, self.nkv:].transpose(1, 2)

    def native_ready(self) -> bool:
        """Whether ``forward_native`` runs this layer: a full (bidirectional, unwindowed)
        DFlash 1 layer whose projections run on ``dflash::qmm`` in one block type, no biases."""
        q, kv = self.q_proj, self.kv_proj
        return (self.attention_conv is None and not self.causal and self.window is None and self.q_norm.native
                and q.mode == kv.mode == self.o_proj.mode == "native" and q.qtype == kv.qtype
                and q.bias is None and kv.bias is None and self.o_proj.bias is None and q.out_features % 8 == 0
                and self.hd % 8 == 0)

    def forward_native(self, x, cos, sin, blocks) -> torch.Tensor:
        """``forward`` with the native kernels: one QKV matmul for all rows, and per block one
        ``dflash::attention_step`` that writes the block's K/V into its context cache after the
        context (rows the next ``append_context`` overwrites) and lets every row of the block
        attend to the context and the whole block (q/k norms and RoPE inside); the context's
        own length is unchanged. ``blocks``: (k_cache, v_cache, start, rows, block_rows) per
        block of x's rows in order; cos/sin fp32 rows. About 20 fewer op calls a layer than
        ``forward``."""
        if self._qkv is None:
            self._qkv = torch.cat([self.q_proj.weight, self.kv_proj.weight])
        H = x.shape[-1]
        qkv = torch.ops.dflash.qmm(self.input_layernorm(x), self._qkv, self.q_proj.qtype,
                                   self.q_proj.out_features + self.kv_proj.out_features, H)
        outs, a = [], 0
        for kc, vc, start, n, (write, keys, counts) in blocks:
            outs.append(torch.ops.dflash.attention_step(
                qkv[:, a:a + n], cos[a:a + n], sin[a:a + n], kc, vc, start, self.nh, self.nkv, self.hd ** -0.5,
                False, self.q_norm.weight, self.k_norm.weight, self.eps, False, 0, False, None, write, keys, counts))
            a += n
        x = x + self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
        return x + self.mlp(self.post_attention_layernorm(x))

    @staticmethod
    def block_rows(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward_native``'s key lists for a block of ``n`` rows after ``start`` context
        positions (the same for every layer): the cache rows it writes, and every row's keys
        (the context and the whole block) and their count."""
        return torch.arange(start, start + n), torch.arange(start + n).expand(n, -1), torch.full((n,), start + n)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, sizes: list[int] | None = None):
        """``sizes``: x holds several blocks one after another (of several sequences, one
        draft pass for all); block i attends over its context ``ctx_k[i]`` / ``ctx_v[i]``
        and itself under ``mask[i]``, the projections and the MLP take all rows."""
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, dyn = self.attention_conv.prepare(h)
        q = apply_rope(self.q_norm(self.q_proj(h).view(B, T, self.nh, self.hd)), cos[:, None], sin[:, None])
        k, v = self.project_kv(h, cos, sin)
        q = q.transpose(1, 2)
        if sizes is None:
            sizes, ctx_k, ctx_v, mask = [T], [ctx_k], [ctx_v], [mask]
        outs, a = [], 0
        for n, ck, cv, m in zip(sizes, ctx_k, ctx_v, mask):
            keys = torch.cat([ck, k[:, :, a:a + n].to(ck.dtype)], dim=2)
            values = torch.cat([cv, v[:, :, a:a + n].to(cv.dtype)], dim=2)
            outs.append(sdpa(q[:, :, a:a + n].to(keys.dtype), keys, values, m, gqa=self.nh != self.nkv))
            a += n
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd).to(x.dtype))
        if self.attention_conv is not None:
            out = self.attention_conv.finish(out, dyn)
        x = x + out
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return x + self.mlp(h)
        h, dyn = self.mlp_conv.prepare(h)
        return x + self.mlp_conv.finish(self.mlp(h), dyn)


@dataclass
class DraftContext:
    """Cached context K/V per layer for positions [0, length)."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0


# Optional tensor (1-D int64, sorted distinct token ids): the draft only proposes these tokens
# (e.g. the few thousand its target actually generates), so its LM-head projection covers a
# fraction of the vocabulary. Lossless either way: the target verifies every proposal.
VOCAB_IDS = "vocab_ids"


def check_vocab_ids(ids: torch.Tensor | None) -> torch.Tensor | None:
    """The draft vocabulary as sorted int64 ids, or a clear error (None: the whole vocabulary)."""
    if ids is None:
        return None
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft weights: {VOCAB_IDS} must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"draft weights: {VOCAB_IDS} must hold integers, got {ids.dtype}")
    ids = ids.detach().to("cpu", torch.int64)
    if int(ids.min()) < 0:
        raise ValueError(f"draft weights: {VOCAB_IDS} holds a negative id ({int(ids.min())})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"draft weights: {VOCAB_IDS} must be sorted and distinct")
    return ids


class CandidateSelector(nn.Module):
    """DFlash 2: each position's top-k tokens (by the draft's logits) rescored by how well
    they follow the token chosen before them, walking from the anchor:
    score(c) = logit(c) + <pred[prev] * P h_pos, succ[c]> (pred / succ: rank-r codebooks with
    a row per token, P: rank x hidden)."""

    def __init__(self, pred: torch.Tensor, succ: torch.Tensor, proj: torch.Tensor, top_k: int):
        super().__init__()
        self.pred = nn.Parameter(pred, requires_grad=False)
        self.succ = nn.Parameter(succ, requires_grad=False)
        self.proj = Linear(proj)
        self.top_k = top_k

    @torch.inference_mode()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor | None, anchor: int,
             temperature: float = 0.0, generator: torch.Generator | None = None):
        """(tokens, candidates, q): hidden (T, H) and logits (T, R) of the drafted positions,
        ``ids`` the token id of each logit row (None: row r is token r). Greedy: the best
        score at each step; temperature > 0: drawn from softmax(scores / temperature), q
        (T, k) those distributions over ``candidates`` (T, k) token ids."""
        unary, rows = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1, sorted=False)
        cands = rows if ids is None else ids.to(rows.device)[rows]
        h = self.proj(hidden.to(self.proj.weight.dtype)).float()
        prev = torch.tensor(anchor, device=cands.device)
        out, qs = [], []
        for t in range(cands.shape[0]):
            scores = unary[t] + (self.succ[cands[t]].float() @ (self.pred[prev].float() * h[t]))
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                cdf = q.double().cumsum(-1)
                u = torch.rand((1,), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
                i = min(int(torch.searchsorted(cdf, u, right=True)), q.shape[0] - 1)
                qs.append(q)
            else:
                i = int(scores.argmax())
            prev = cands[t, i]
            out.append(int(prev))
        return out, cands, (torch.stack(qs) if qs else None)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, tensors: dict[str, torch.Tensor], device="cpu",
                 dtype=torch.bfloat16, max_ctx: int = 4096, quantize: str = "dense"):
        """``quantize``: dense | int8 | int4 weight-only linears (``fc`` and the layers').
        On a CPU int8 makes a drafted step ~1.6x cheaper (bf16 GEMMs of a few rows are slow
        there: ``fc`` on one row 1.4 ms dense vs 0.18 ms int8) at no measured acceptance cost."""
        super().__init__()
        if quantize not in ("dense", "int8", "int4"):
            raise ValueError(f"draft quantization must be dense, int8 or int4, got {quantize!r}")
        self.cfg, self.device, self.dtype, self.max_ctx = cfg, torch.device(device), dtype, max_ctx
        self.quantize = quantize
        self.vocab_ids = check_vocab_ids(tensors.get(VOCAB_IDS))

        def get(name):
            if name not in tensors:
                raise ValueError(f"draft weights: missing tensor {name}")
            return tensors[name].to(self.device, dtype)
        H = cfg.hidden_size
        expect = {"fc.weight": (H, cfg.num_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for name, shape in expect.items():
            if name not in tensors:
                raise ValueError(f"draft weights: missing tensor {name}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"draft weights: {name} has shape {tuple(tensors[name].shape)}, the config "
                                 f"implies {shape}")
        self.fc = Linear(get("fc.weight"))
        self.hidden_norm = RMSNorm(get("hidden_norm.weight"), cfg.rms_norm_eps)
        self.norm = RMSNorm(get("norm.weight"), cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i, get) for i in range(cfg.num_layers))
        self.selector = None
        if cfg.dflash2:
            def either(name):   # the reference's checkpoints name the codebooks with or without ".weight"
                return get(name if name in tensors else name + ".weight")
            pred, succ = either("candidate_selector.predecessor_codebook"), either("candidate_selector.successor_codebook")
            if pred.shape != (cfg.vocab_size, cfg.selector_rank) or succ.shape != pred.shape:
                raise ValueError(f"draft weights: the selector codebooks have shape {tuple(pred.shape)}, the config "
                                 f"implies {(cfg.vocab_size, cfg.selector_rank)}")
            self.selector = CandidateSelector(pred, succ, get("candidate_selector.hidden_projection.weight"),
                                              cfg.selector_top_k)
        self.rope = RotaryTable(cfg.head_dim, cfg.head_dim, cfg.rope_theta, max_ctx + cfg.block_size,
                                cfg.rope_scaling, self.device, dtype)
        # like the target's KV on CPU: fp32 attention is much faster there
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else dtype
        for m in self.modules():
            if isinstance(m, Linear):
                m.quantize_(quantize)
        self.contexts = {0: self._empty_context()}  # sequence slot -> its context
        self.context = self.contexts[0]
        self._native_layers: bool | None = None   # decided at the first pass (_native)
        self._fused_args = False                   # pass_block's arguments (False: not built yet)

    # --- construction ---------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, device="cpu", dtype=torch.bfloat16, max_ctx: int = 4096,
             quantize: str = "dense") -> "DFlashDraft":
        from safetensors.torch import load_file

        path = Path(path)
        if path.suffix.lower() == ".gguf":
            from .draft_gguf import load_gguf_draft
            return cls(*load_gguf_draft(path), device, dtype, max_ctx, quantize)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: no config.json (not a DFlash draft directory)")
        try:
            cfg = DraftConfig.from_dict(json.loads(cfg_file.read_text()))
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors weights")
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except Exception as e:
                raise ValueError(f"{f}: corrupt or truncated safetensors ({e})") from None
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        return cls(cfg, tensors, device, dtype, max_ctx, quantize)

    @staticmethod
    def random_tensors(cfg: DraftConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

        def rnd(*shape):
            return torch.randn(*shape, generator=g) * std
        t = {"fc.weight": rnd(H, cfg.num_taps * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            t.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                      p + "self_attn.q_proj.weight": rnd(cfg.num_heads * hd, H),
                      p + "self_attn.k_proj.weight": rnd(cfg.num_kv_heads * hd, H),
                      p + "self_attn.v_proj.weight": rnd(cfg.num_kv_heads * hd, H),
                      p + "self_attn.o_proj.weight": rnd(H, cfg.num_heads * hd),
                      p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                      p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                      p + "mlp.down_proj.weight": rnd(H, I)})
        return t

    def zlab_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the z-lab checkpoint names (for export)."""
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm.weight,
               "norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            kv = layer.kv_proj.weight
            nk = layer.nkv * layer.hd
            out.update({p + "input_layernorm.weight": layer.input_layernorm.weight,
                        p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                        p + "self_attn.q_proj.weight": layer.q_proj.weight, p + "self_attn.k_proj.weight": kv[:nk],
                        p + "self_attn.v_proj.weight": kv[nk:], p + "self_attn.o_proj.weight": layer.o_proj.weight,
                        p + "self_attn.q_norm.weight": layer.q_norm.weight,
                        p + "self_attn.k_norm.weight": layer.k_norm.weight,
                        p + "mlp.gate_proj.weight": layer.mlp.gate_up.weight[:layer.mlp.inter],
                        p + "mlp.up_proj.weight": layer.mlp.gate_up.weight[layer.mlp.inter:],
                        p + "mlp.down_proj.weight": layer.mlp.down.weight})
        out = {k: v.detach().contiguous() for k, v in out.items()}
        if self.vocab_ids is not None:
            out[VOCAB_IDS] = self.vocab_ids.clone()
        return out

    def check_target(self, num_target_layers: int, hidden_size: int, vocab_size: int) -> None:
        """Clear errors for a draft that does not fit the target."""
        c = self.cfg
        if c.hidden_size != hidden_size:
            raise ValueError(f"draft hidden_size {c.hidden_size} != target hidden_size {hidden_size}")
        bad = [t for t in c.target_layer_ids if not 0 <= t < num_target_layers]
        if bad:
            raise ValueError(f"draft target_layer_ids {bad} outside the target's {num_target_layers} layers")
        if not 0 <= c.mask_token_id < vocab_size:
            raise ValueError(f"draft mask_token_id {c.mask_token_id} outside the target vocabulary ({vocab_size})")
        ids = getattr(self, "vocab_ids", None)
        if ids is not None and int(ids[-1]) >= vocab_size:
            raise ValueError(f"draft vocab_ids reach {int(ids[-1])}, outside the target vocabulary ({vocab_size})")

    # --- context (committed tokens' features) -------------------------------------------
    def _empty_context(self) -> DraftContext:
        shape = (1, self.cfg.num_kv_heads, self.max_ctx, self.cfg.head_dim)
        return DraftContext([torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in self.layers],
                            [torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in self.layers])

    def reset(self) -> None:
        self.context.length = 0

    def health(self) -> dict:
        """An in-process draft is always up (``RemoteDraft`` reports its worker)."""
        return {"status": "ok"}

    def close(self) -> None:
        """Nothing to stop in process (``RemoteDraft`` stops its worker)."""

    def select(self, lane: int) -> None:
        """Make ``lane``'s context the one the other methods act on (continuous batching:
        one context per sequence slot, allocated at its first use)."""
        if lane not in self.contexts:
            self.contexts[lane] = self._empty_context()
        self.context = self.contexts[lane]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(1, n, taps*H) tapped target outputs -> (1, n, H) context vectors."""
        return self.hidden_norm(self.fc(features.to(self.device, self.dtype)))

    @torch.inference_mode()
    def append_context(self, features: torch.Tensor, start: int) -> None:
        """Project the features of committed positions [start, start+n) into every layer's
        context cache (``start <= length``: later rows are overwritten)."""
        n = features.shape[1]
        if start > self.context.length or start + n > self.max_ctx:
            raise ValueError(f"draft context: cannot write [{start}, {start + n}) after length "
                             f"{self.context.length} (max {self.max_ctx})")
        c = self.fuse(features)
        cos, sin = self.rope.rows(start, n)
        for layer, k_cache, v_cache in zip(self.layers, self.context.k, self.context.v):
            k, v = layer.project_kv(c, cos, sin)
            k_cache[:, :, start:start + n] = k
            v_cache[:, :, start:start + n] = v
        self.context.length = start + n

    @torch.inference_mode()
    def append_contexts(self, items: list[tuple[int, torch.Tensor, int]]) -> None:
        """``append_context`` of several slots: (slot, features (1, n, taps*H), start) each, in
        one pass (the fc and each layer's K/V projection take every slot's rows together: on
        a CPU a small matmul's cost is mostly its weights' read, once here instead of once a
        slot). The selected slot is the last item's afterwards."""
        if len(items) == 1:
            lane, features, start = items[0]
            self.select(lane)
            self.append_context(features, start)
            return
        sizes, cos, sin = [], [], []
        for lane, features, start in items:
            self.select(lane)
            n = features.shape[1]
            if start > self.context.length or start + n > self.max_ctx:
                raise ValueError(f"draft context of slot {lane}: cannot write [{start}, {start + n}) after length "
                                 f"{self.context.length} (max {self.max_ctx})")
            sizes.append(n)
            c, s = self.rope.rows(start, n)
            cos.append(c)
            sin.append(s)
        c = self.fuse(torch.cat([f for _, f, _ in items], dim=1))
        cos, sin = torch.cat(cos), torch.cat(sin)
        for i, layer in enumerate(self.layers):
            k, v = layer.project_kv(c, cos, sin)
            a = 0
            for (lane, _, start), n in zip(items, sizes):
                ctx = self.contexts[lane]
                ctx.k[i][:, :, start:start + n] = k[:, :, a:a + n]
                ctx.v[i][:, :, start:start + n] = v[:, :, a:a + n]
                a += n
        for (lane, _, start), n in zip(items, sizes):
            self.contexts[lane].length = start + n

    def crop(self, length: int) -> None:
        self.context.length = min(self.context.length, length)

    # --- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def draft_hidden(self, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        """block_embeds (1, B, H) = target embeddings of [anchor, MASK...] at positions
        [start, start+B) with the context covering [0, start). Returns the final-normed
        hidden states (1, B, H); position k predicts the token at start + k."""
        return self.draft_hidden_rows([(None, block_embeds, start)])[0]

    @property
    def batches_blocks(self) -> bool:
        """Whether ``draft_hidden_rows`` runs several blocks in one pass (DFlash 2's
        convolutions run along the rows, so its blocks go one at a time)."""
        return not self.cfg.dflash2

    @torch.inference_mode()
    def draft_hidden_rows(self, blocks: list[tuple[int | None, torch.Tensor, int]]) -> list[torch.Tensor]:
        """``draft_hidden`` of several sequences' blocks: (slot, block_embeds, start) each
        (slot None: the selected one), in one pass where ``batches_blocks`` (each block
        attends over its own slot's context and itself; the projections and the MLP take
        every block's rows together). Returns each block's hidden states (1, B_i, H); the
        selected slot is the last block's afterwards."""
        if len(blocks) > 1 and not self.batches_blocks:
            return [self.draft_hidden_rows([b])[0] for b in blocks]
        ctxs, sizes, cos, sin = [], [], [], []
        for lane, emb, start in blocks:
            if lane is not None:
                self.select(lane)
            S, B = self.context.length, emb.shape[1]
            if S != start:
                raise ValueError(f"draft context covers {S} positions, block starts at {start}")
            ctxs.append(self.context)
            sizes.append(B)
            c, s = self.rope.rows(start, B)
            cos.append(c)
            sin.append(s)
        x = torch.cat([emb.to(self.device, self.dtype) for _, emb, _ in blocks], dim=1)
        cos, sin = torch.cat(cos), torch.cat(sin)
        if self._native(ctxs, sizes):
            cos, sin = cos.float(), sin.float()
            at = [DraftLayer.block_rows(c.length, n) for c, n in zip(ctxs, sizes)]
            for i, layer in enumerate(self.layers):
                x = layer.forward_native(x, cos, sin, [(c.k[i], c.v[i], c.length, n, r)
                                                       for c, n, r in zip(ctxs, sizes, at)])
            return list(self.norm(x).split(sizes, dim=1))
        masks = [self._masks(c.length, n) for c, n in zip(ctxs, sizes)]
        for i, layer in enumerate(self.layers):
            key = (layer.causal, layer.window)
            x = layer(x, cos, sin, [c.k[i][:, :, :c.length] for c in ctxs], [c.v[i][:, :, :c.length] for c in ctxs],
                      [m[key] for m in masks], sizes)
        return list(self.norm(x).split(sizes, dim=1))

    @torch.inference_mode()
    def pass_block(self, block_embeds: torch.Tensor, start: int, features: torch.Tensor | None = None,
                   ctx_start: int | None = None, head: Linear | None = None):
        """``append_context(features, ctx_start)`` (when given: (1, n, taps*H), n = start -
        ctx_start, ctx_start <= the context's length) then ``draft_hidden(block_embeds,
        start)`` in one native call (``dflash::draft_pass``), and with ``head`` (a native
        Linear) the head's logits of the block's rows after the first (1, B - 1, rows).
        Returns (hidden, logits or None), or None where that pass cannot run (nothing
        changed then: the caller takes the per-op path). The context's K/V come out of the
        attention op (normed and rotated in fp32, as the block's rows are) instead of
        ``project_kv``, so they can differ from ``append_context``'s in the last bf16 bit."""
        n = 0 if features is None else features.shape[1]
        ctx_start = start if features is None else ctx_start
        B = block_embeds.shape[1]
        if not self._native([self.context], [B]) or self._fused is None or start + B > self.max_ctx:
            return None
        if ctx_start is None or ctx_start + n != start or not 0 <= ctx_start <= self.context.length or \
                (features is None and self.context.length != start):
            raise ValueError(f"draft context covers {self.context.length} positions: cannot write [{ctx_start}, "
                             f"{start}) then draft a block at {start}")
        if head is not None and head.mode != "native":
            head = None
        cos, sin = self.rope.rows(ctx_start, n + B)
        weights, ints, floats = self._fused
        feats = None if features is None else features.to(self.device, self.dtype)
        hidden, logits = torch.ops.dflash.draft_pass(
            block_embeds.to(self.device, self.dtype), feats, ctx_start, self.fc.weight, self.fc.qtype,
            self.hidden_norm.weight, self.hidden_norm.eps, weights, self.context.k, self.context.v, ints, floats,
            cos.float(), sin.float(), self.norm.weight, self.norm.eps,
            None if head is None else head.weight, 0 if head is None else head.qtype,
            0 if head is None else head.out_features)
        self.context.length = start
        return hidden, (logits if head is not None and B > 1 else None)

    @property
    def _fused(self):
        """``dflash::draft_pass``'s per-layer arguments (weights, ints, floats), or None where the
        draft cannot take it (a non-native fc or MLP; the layers' own test is ``_native``)."""
        if self._fused_args is False:
            self._fused_args = None
            mlps = [layer.mlp for layer in self.layers]
            if self.fc.fusable and all(m.act == "silu" and m.gate_up.fusable and m.down.fusable for m in mlps) \
                    and all(layer.native_ready() for layer in self.layers):
                weights, ints, floats = [], [], []
                for layer in self.layers:
                    if layer._qkv is None:
                        layer._qkv = torch.cat([layer.q_proj.weight, layer.kv_proj.weight])
                    m = layer.mlp
                    weights += [layer.input_layernorm.weight, layer._qkv, layer.o_proj.weight,
                                layer.post_attention_layernorm.weight, m.gate_up.weight, m.down.weight,
                                layer.q_norm.weight, layer.k_norm.weight]
                    ints += [layer.q_proj.qtype, layer.q_proj.out_features + layer.kv_proj.out_features, layer.nh,
                             layer.nkv, layer.o_proj.qtype, m.gate_up.qtype, m.inter, m.down.qtype]
                    floats += [float(layer.input_layernorm.eps), layer.hd ** -0.5,
                               float(layer.post_attention_layernorm.eps), float(layer.eps)]
                self._fused_args = (weights, ints, floats)
        return self._fused_args

    def _masks(self, start: int, B: int) -> dict:
        """A block's attention masks by (causal, window) of the layers (None: every key)."""
        q_pos = torch.arange(start, start + B, device=self.device)
        k_pos = torch.arange(0, start + B, device=self.device)
        k_block = torch.cat([torch.full((start,), -1, device=self.device),
                             torch.zeros(B, device=self.device, dtype=torch.long)])
        mask = {}
        for layer in self.layers:
            key = (layer.causal, layer.window)
            if key not in mask:
                mask[key] = None if key == (False, None) else attention_mask(
                    q_pos, torch.full_like(q_pos, start), torch.zeros_like(q_pos), k_pos, k_block, *key)
        return mask

    def _native(self, ctxs, sizes) -> bool:
        """The native kernels run this pass: every layer can (``DraftLayer.native_ready``), on
        the CPU under inference, and each block fits its context cache after the context."""
        if self._native_layers is None:
            self._native_layers = (self.device.type == "cpu" and kernels.enabled() and kernels.load()
                                   and all(layer.native_ready() for layer in self.layers))
        return (self._native_layers and not torch.is_grad_enabled()
                and all(c.length + n <= self.max_ctx for c, n in zip(ctxs, sizes)))

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def context_export(self) -> dict[str, torch.Tensor]:
        """The context K/V of positions [0, length), right-sized copies (for snapshots)."""
        n = self.context.length
        out = {"length": torch.tensor(n, dtype=torch.int64)}
        for i, (k, v) in enumerate(zip(self.context.k, self.context.v)):
            out[f"k.{i}"], out[f"v.{i}"] = k[:, :, :n].clone(), v[:, :, :n].clone()
        return out

    def context_import(self, tensors: dict[str, torch.Tensor]) -> None:
        n = int(tensors["length"])
        for i, (k, v) in enumerate(zip(self.context.k, self.context.v)):
            src_k, src_v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if src_k.shape != (1, k.shape[1], n, k.shape[3]) or src_v.shape != src_k.shape:
                raise ValueError(f"draft context snapshot: layer {i} has shape {tuple(src_k.shape)}")
            k[:, :, :n].copy_(src_k)
            v[:, :, :n].copy_(src_v)
        self.context.length = n
