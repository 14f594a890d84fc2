// A whole pre-norm decoder layer (Llama/Qwen3/Qwen3.5-style attention + SwiGLU) of a decode or verify
// block in one call, for the native path: the same ops in the same order as the Python
// layer (RMSNorm, QKV qmm, attention_step, O qmm, residual add, RMSNorm, gate/up qmm,
// silu_mul, down qmm, residual add), so its result is bit-identical to it; what it
// saves is ~12 Python-level op calls per layer and token (~40 us on the dev CPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace {

at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
                         int64_t qkv_t, int64_t qkv_n, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv,
                         double scale, const at::Tensor& o_w, int64_t o_t, const at::Tensor& n2, double eps2,
                         const at::Tensor& gu_w, int64_t gu_t, int64_t inter, const at::Tensor& d_w, int64_t d_t,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                         double norm_eps, bool gated, const c10::optional<at::Tensor>& tree) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "dflash::decoder_layer: x must be (1, T, hidden)");
  TORCH_CHECK(inter > 0, "dflash::decoder_layer: bad intermediate size");
  const int64_t hidden = x.size(2), attn = nh * k_cache.size(-1);
  using dflash::qmm_op;
  auto qkv = qmm_op(dflash::rms_norm_op(x, n1, eps1), qkv_w, qkv_t, qkv_n, hidden, -1);
  auto a = dflash::attention_step_op(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, scale, false, q_norm, k_norm,
                                     norm_eps, gated, tree);
  auto x1 = x + qmm_op(a, o_w, o_t, hidden, attn, -1);
  auto gu = qmm_op(dflash::rms_norm_op(x1, n2, eps2), gu_w, gu_t, 2 * inter, hidden, -1);
  return x1 + qmm_op(dflash::silu_mul_op(gu, inter), d_w, d_t, hidden, inter, -1);
}

// The same layer over decode rows of several sequences (row b: the sequence in KV-bank lane
// lanes[b] at position positions[b]); the matmuls take all rows at once (row-invariant), the
// attention each row over its own lane (dflash::attention_rows).
at::Tensor decoder_layer_rows(const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
                              int64_t qkv_t, int64_t qkv_n, const at::Tensor& cos, const at::Tensor& sin,
                              at::Tensor& k_bank, at::Tensor& v_bank, at::IntArrayRef lanes,
                              at::IntArrayRef positions, int64_t nh, int64_t nkv, double scale, const at::Tensor& o_w,
                              int64_t o_t, const at::Tensor& n2, double eps2, const at::Tensor& gu_w, int64_t gu_t,
                              int64_t inter, const at::Tensor& d_w, int64_t d_t,
                              const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                              double norm_eps, bool gated) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "dflash::decoder_layer_rows: x must be (1, rows, hidden)");
  TORCH_CHECK(inter > 0, "dflash::decoder_layer_rows: bad intermediate size");
  const int64_t hidden = x.size(2), attn = nh * k_bank.size(-1);
  using dflash::qmm_op;
  auto qkv = qmm_op(dflash::rms_norm_op(x, n1, eps1), qkv_w, qkv_t, qkv_n, hidden, -1);
  auto a = dflash::attention_rows_op(qkv, cos, sin, k_bank, v_bank, lanes, positions, nh, nkv, scale, false, q_norm,
                                     k_norm, norm_eps, gated);
  auto x1 = x + qmm_op(a, o_w, o_t, hidden, attn, -1);
  auto gu = qmm_op(dflash::rms_norm_op(x1, n2, eps2), gu_w, gu_t, 2 * inter, hidden, -1);
  return x1 + qmm_op(dflash::silu_mul_op(gu, inter), d_w, d_t, hidden, inter, -1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("decoder_layer(Tensor x, Tensor n1, float eps1, Tensor qkv_w, int qkv_t, int qkv_n, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int start, int nh, int nkv, float scale, Tensor o_w, int o_t, "
        "Tensor n2, float eps2, Tensor gu_w, int gu_t, int inter, Tensor d_w, int d_t, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float norm_eps=1e-6, bool gated=False, Tensor? tree=None) -> Tensor");
  m.def("decoder_layer_rows(Tensor x, Tensor n1, float eps1, Tensor qkv_w, int qkv_t, int qkv_n, Tensor cos, "
        "Tensor sin, Tensor(a!) k_bank, Tensor(b!) v_bank, int[] lanes, int[] positions, int nh, int nkv, "
        "float scale, Tensor o_w, int o_t, Tensor n2, float eps2, Tensor gu_w, int gu_t, int inter, Tensor d_w, "
        "int d_t, Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=1e-6, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_rows", &decoder_layer_rows);
}
