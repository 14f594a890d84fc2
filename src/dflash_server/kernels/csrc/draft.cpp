// A DFlash draft's whole pass over one block in one call (spec/draft.py, DFlashDraft.pass_block):
// the context update of the positions committed since the last pass, every layer, the final norm
// and the draft's own LM head. The per-op native path (DraftLayer.forward_native, append_context)
// made ~20 Python-level op calls and as many module calls a pass, ~1 ms of a drafted step on the
// dev CPU against ~0.6 ms of matmuls; here they are C++ calls.
//
// The context update rides on each layer's block pass: the context vectors
// c = hidden_norm(fc(features)) of the n new positions are the first n rows of the layer's QKV
// matmul (the block's normed rows after them; the kernel's rows are independent of each other,
// so the block's rows get the bits they get alone), and one slot-addressed attention call writes
// every row's K/V (the context's at their positions, the block's after them: rows the next
// update overwrites) before any row attends. The block's rows attend to the whole context and the
// whole block; the context rows' own outputs are not used (each attends to one key). A context
// row's K/V is thus normed and rotated inside the attention op, in fp32, as the block's are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

// per layer: n1, qkv_w, o_w, n2, gu_w, d_w, q_norm, k_norm; 8 ints: qkv_t, qkv_n, nh, nkv, o_t,
// gu_t, inter, d_t; 4 floats: eps1, scale, eps2, norm_eps
constexpr int64_t WPL = 8, INTS = 8, FLOATS = 4;

std::vector<at::Tensor> draft_pass(const at::Tensor& x, const c10::optional<at::Tensor>& features, int64_t ctx_start,
                                   const at::Tensor& fc_w, int64_t fc_t, const at::Tensor& hidden_norm, double hn_eps,
                                   at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                                   at::IntArrayRef ints, at::ArrayRef<double> floats, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& norm_w, double norm_eps,
                                   const c10::optional<at::Tensor>& head_w, int64_t head_t, int64_t head_n) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) >= 1, "dflash::draft_pass: x must be (1, B, hidden)");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(weights.size()) == WPL * L && static_cast<int64_t>(ints.size()) == INTS * L &&
                  static_cast<int64_t>(floats.size()) == FLOATS * L,
              "dflash::draft_pass: one K and V cache, ", WPL, " tensors, ", INTS, " ints and ", FLOATS,
              " floats per layer");
  const int64_t H = x.size(2), B = x.size(1);
  const int64_t n = features.has_value() ? features->size(1) : 0;
  TORCH_CHECK(!features.has_value() || (features->dim() == 3 && features->size(0) == 1 && n >= 1),
              "dflash::draft_pass: features must be (1, n >= 1, taps * hidden)");
  const int64_t start = ctx_start + n, rows = n + B, total = start + B;
  const int64_t max_ctx = k_caches[0].size(2);
  TORCH_CHECK(ctx_start >= 0 && total <= max_ctx, "dflash::draft_pass: rows past the context cache");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && sin.sizes() == cos.sizes(),
              "dflash::draft_pass: cos/sin must hold a row per context and block row");
  at::Tensor ctx;
  if (n > 0) ctx = dflash::rms_norm_op(dflash::qmm_op(*features, fc_w, fc_t, H, features->size(2), -1), hidden_norm, hn_eps);
  // every row's cache row and keys: a context row sees key 0 only (its output is not used), a
  // block row the context and the whole block
  auto opts = at::TensorOptions().dtype(at::kLong);
  const auto write = at::arange(ctx_start, total, opts);
  const auto keys = at::arange(total, opts).expand({rows, total}).contiguous();
  auto counts = at::full({rows}, total, opts);
  if (n > 0) counts.narrow(0, 0, n).fill_(1);
  at::Tensor h = x;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * WPL;
    const int64_t* i = ints.data() + l * INTS;
    const double* f = floats.data() + l * FLOATS;
    const int64_t nh = i[2], nkv = i[3], attn = nh * k_caches[l].size(3);
    auto normed = dflash::rms_norm_op(h, w[0], f[0]);
    auto qkv = dflash::qmm_op(n > 0 ? at::cat({ctx, normed}, 1) : normed, w[1], i[0], i[1], H, -1);
    at::Tensor k = k_caches[l], v = v_caches[l];
    auto a = dflash::attention_keys_op(qkv, cos, sin, k, v, ctx_start, nh, nkv, f[1], w[6], w[7], f[3], write, keys,
                                       counts);
    if (n > 0) a = a.narrow(1, n, B).contiguous();
    auto x1 = h + dflash::qmm_op(a, w[2], i[4], H, attn, -1);
    auto gu = dflash::qmm_op(dflash::rms_norm_op(x1, w[3], f[2]), w[4], i[5], 2 * i[6], H, -1);
    h = x1 + dflash::qmm_op(dflash::silu_mul_op(gu, i[6]), w[5], i[7], H, i[6], -1);
  }
  auto hidden = dflash::rms_norm_op(h, norm_w, norm_eps);
  at::Tensor logits;
  if (head_w.has_value() && B > 1)
    logits = dflash::qmm_op(hidden.narrow(1, 1, B - 1).contiguous(), *head_w, head_t, head_n, H, -1);
  else
    logits = at::empty({0}, hidden.options());
  return {hidden, logits};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("draft_pass(Tensor x, Tensor? features, int ctx_start, Tensor fc_w, int fc_t, Tensor hidden_norm, "
        "float hn_eps, Tensor[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] ints, float[] floats, "
        "Tensor cos, Tensor sin, Tensor norm_w, float norm_eps, Tensor? head_w=None, int head_t=0, int head_n=0) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) { m.impl("draft_pass", &draft_pass); }
