// A whole pre-norm decoder layer (Llama/Qwen3/Qwen3.5-style attention + SwiGLU) of a decode or verify
// block in one call, for the native path: the same ops in the same order as the Python
// layer (RMSNorm, QKV qmm, attention_step, O qmm, residual add, RMSNorm, gate/up qmm,
// silu_mul, down qmm, residual add), so its result is bit-identical to it; what it
// saves is ~12 Python-level op calls per layer and token (~40 us on the dev CPU). The norms and
// the SwiGLU activation run inside the next matmul's activation quantization and the residual
// adds in the O and down matmuls' stores (qmm_fused: the same bits as the separate ops), so a
// layer is 4 matmuls and an attention step.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
                         int64_t qkv_t, int64_t qkv_n, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv,
                         double scale, const at::Tensor& o_w, int64_t o_t, const at::Tensor& n2, double eps2,
                         const at::Tensor& gu_w, int64_t gu_t, int64_t inter, const at::Tensor& d_w, int64_t d_t,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                         double norm_eps, bool gated, const c10::optional<at::Tensor>& tree,
                         const c10::optional<at::Tensor>& write_rows, const c10::optional<at::Tensor>& key_rows,
                         const c10::optional<at::Tensor>& key_counts, const c10::optional<at::Tensor>& mass,
                         const c10::optional<at::Tensor>& q_out, const c10::optional<at::Tensor>& mass_keys) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "dflash::decoder_layer: x must be (1, T, hidden)");
  TORCH_CHECK(inter > 0, "dflash::decoder_layer: bad intermediate size");
  const int64_t hidden = x.size(2), attn = nh * k_cache.size(-1);
  using dflash::qmm_fused_op;
  const c10::optional<at::Tensor> none;
  auto qkv = qmm_fused_op(x, qkv_w, qkv_t, qkv_n, hidden, n1, eps1, false, none);  // rms_norm(x) @ QKV
  auto a = dflash::attention_step_op(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, scale, false, q_norm, k_norm,
                                     norm_eps, gated, tree, write_rows, key_rows, key_counts, mass, q_out, mass_keys);
  auto x1 = qmm_fused_op(a, o_w, o_t, hidden, attn, none, 0., false, x);  // x + O(a)
  auto gu = qmm_fused_op(x1, gu_w, gu_t, 2 * inter, hidden, n2, eps2, false, none);
  return qmm_fused_op(gu, d_w, d_t, hidden, inter, none, 0., true, x1);  // x1 + down(silu(g) * u)
}

// The same layer over decode rows of several sequences (row b: the sequence in KV-bank lane
// lanes[b] at position positions[b]); the matmuls take all rows at once (row-invariant), the
// attention each row over its own lane (dflash::attention_rows; ``tree``: its DDTree lanes;
// write_rows / key_rows / key_counts: lanes that are KV Flash pools, as attention_rows takes them,
// and mass / q_out their score policy's outputs).
at::Tensor decoder_layer_rows(const at::Tensor& x, const at::Tensor& n1, double eps1, const at::Tensor& qkv_w,
                              int64_t qkv_t, int64_t qkv_n, const at::Tensor& cos, const at::Tensor& sin,
                              at::Tensor& k_bank, at::Tensor& v_bank, at::IntArrayRef lanes,
                              at::IntArrayRef positions, int64_t nh, int64_t nkv, double scale, const at::Tensor& o_w,
                              int64_t o_t, const at::Tensor& n2, double eps2, const at::Tensor& gu_w, int64_t gu_t,
                              int64_t inter, const at::Tensor& d_w, int64_t d_t,
                              const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                              double norm_eps, bool gated, const c10::optional<at::Tensor>& tree,
                              const c10::optional<at::Tensor>& write_rows, const c10::optional<at::Tensor>& key_rows,
                              const c10::optional<at::Tensor>& key_counts, const c10::optional<at::Tensor>& mass,
                              const c10::optional<at::Tensor>& q_out, const c10::optional<at::Tensor>& mass_keys) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "dflash::decoder_layer_rows: x must be (1, rows, hidden)");
  TORCH_CHECK(inter > 0, "dflash::decoder_layer_rows: bad intermediate size");
  const int64_t hidden = x.size(2), attn = nh * k_bank.size(-1);
  using dflash::qmm_fused_op;
  const c10::optional<at::Tensor> none;
  auto qkv = qmm_fused_op(x, qkv_w, qkv_t, qkv_n, hidden, n1, eps1, false, none);  // rms_norm(x) @ QKV
  auto a = dflash::attention_rows_op(qkv, cos, sin, k_bank, v_bank, lanes, positions, nh, nkv, scale, false, q_norm,
                                     k_norm, norm_eps, gated, tree, write_rows, key_rows, key_counts, mass, q_out, mass_keys);
  auto x1 = qmm_fused_op(a, o_w, o_t, hidden, attn, none, 0., false, x);  // x + O(a)
  auto gu = qmm_fused_op(x1, gu_w, gu_t, 2 * inter, hidden, n2, eps2, false, none);
  return qmm_fused_op(gu, d_w, d_t, hidden, inter, none, 0., true, x1);  // x1 + down(silu(g) * u)
}

// A stack of such layers in one call: what a decode step or verify block of the layers of a
// stage costs in Python is then one op call instead of one per layer (~30 us each on the dev
// CPU: module dispatch, ~20 attribute lookups, 25 arguments boxed). Per layer: WPL tensors
// (n1, qkv_w, o_w, n2, gu_w, d_w[, q_norm, k_norm]), 9 ints (qkv_t, qkv_n, nh, nkv, o_t, gu_t,
// inter, d_t, gated), 4 floats (eps1, scale, eps2, norm_eps) and its K/V cache (or bank, with
// lanes / positions: the rows form; write_rows / key_rows / key_counts: a KV Flash pool's slots,
// the same for every layer, as attention_step takes them, or with lanes as attention_rows does;
// mass / q_out: the score policy's, mass shared by the layers, q_out one per layer). Returns the
// last layer's output, then the outputs of the layers named in ``capture`` (stack positions), in
// that order. Each layer is decoder_layer / decoder_layer_rows, so the result is bit-identical to
// calling them one by one.
constexpr int64_t STACK_INTS = 9, STACK_FLOATS = 4;

std::vector<at::Tensor> decoder_stack(const at::Tensor& x, at::TensorList weights, at::TensorList k_caches,
                                      at::TensorList v_caches, at::IntArrayRef ints, at::ArrayRef<double> floats,
                                      const at::Tensor& cos, const at::Tensor& sin, int64_t start,
                                      at::IntArrayRef capture, const c10::optional<at::Tensor>& tree,
                                      at::OptionalIntArrayRef lanes, at::OptionalIntArrayRef positions,
                                      const c10::optional<at::Tensor>& write_rows,
                                      const c10::optional<at::Tensor>& key_rows,
                                      const c10::optional<at::Tensor>& key_counts,
                                      const c10::optional<at::Tensor>& mass, const c10::optional<at::Tensor>& q_out,
                                      const c10::optional<at::Tensor>& mass_keys) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches.size()) == L, "dflash::decoder_stack: one K and one V cache per layer");
  const int64_t wpl = static_cast<int64_t>(weights.size()) / L;
  TORCH_CHECK((wpl == 6 || wpl == 8) && static_cast<int64_t>(weights.size()) == wpl * L &&
                  static_cast<int64_t>(ints.size()) == STACK_INTS * L &&
                  static_cast<int64_t>(floats.size()) == STACK_FLOATS * L,
              "dflash::decoder_stack: 6 or 8 tensors, ", STACK_INTS, " ints and ", STACK_FLOATS, " floats per layer");
  TORCH_CHECK(lanes.has_value() == positions.has_value(), "dflash::decoder_stack: lanes and positions go together");
  for (int64_t c : capture) TORCH_CHECK(c >= 0 && c < L, "dflash::decoder_stack: capture ", c, " outside the stack");
  TORCH_CHECK(!q_out.has_value() || (q_out->dim() == (lanes.has_value() ? 4 : 5) && q_out->size(0) == L),
              "dflash::decoder_stack: q_out must be (layers, 1, rows, nh, head_dim), with lanes (layers, rows, nh, "
              "head_dim)");
  std::vector<at::Tensor> caps(capture.size());
  at::Tensor h = x;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * wpl;
    const int64_t* i = ints.data() + l * STACK_INTS;
    const double* f = floats.data() + l * STACK_FLOATS;
    const c10::optional<at::Tensor> qn = wpl == 8 ? c10::optional<at::Tensor>(w[6]) : c10::nullopt;
    const c10::optional<at::Tensor> kn = wpl == 8 ? c10::optional<at::Tensor>(w[7]) : c10::nullopt;
    at::Tensor k = k_caches[l], v = v_caches[l];
    h = lanes.has_value()
            ? decoder_layer_rows(h, w[0], f[0], w[1], i[0], i[1], cos, sin, k, v, *lanes, *positions, i[2], i[3], f[1],
                                 w[2], i[4], w[3], f[2], w[4], i[5], i[6], w[5], i[7], qn, kn, f[3], i[8] != 0, tree,
                                 write_rows, key_rows, key_counts, mass,
                                 q_out.has_value() ? c10::optional<at::Tensor>(q_out->select(0, l)) : c10::nullopt,
                                 mass_keys)
            : decoder_layer(h, w[0], f[0], w[1], i[0], i[1], cos, sin, k, v, start, i[2], i[3], f[1], w[2], i[4], w[3],
                            f[2], w[4], i[5], i[6], w[5], i[7], qn, kn, f[3], i[8] != 0, tree, write_rows, key_rows,
                            key_counts, mass,
                            q_out.has_value() ? c10::optional<at::Tensor>(q_out->select(0, l)) : c10::nullopt,
                            mass_keys);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) caps[c] = h;
  }
  caps.insert(caps.begin(), h);
  return caps;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("decoder_stack(Tensor x, Tensor[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] ints, "
        "float[] floats, Tensor cos, Tensor sin, int start, int[] capture, Tensor? tree=None, int[]? lanes=None, "
        "int[]? positions=None, Tensor? write_rows=None, Tensor? key_rows=None, Tensor? key_counts=None, "
        "Tensor(c!)? mass=None, Tensor(d!)? q_out=None, Tensor? mass_keys=None) -> Tensor[]");
  m.def("decoder_layer(Tensor x, Tensor n1, float eps1, Tensor qkv_w, int qkv_t, int qkv_n, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int start, int nh, int nkv, float scale, Tensor o_w, int o_t, "
        "Tensor n2, float eps2, Tensor gu_w, int gu_t, int inter, Tensor d_w, int d_t, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float norm_eps=1e-6, bool gated=False, Tensor? tree=None, Tensor? write_rows=None, "
        "Tensor? key_rows=None, Tensor? key_counts=None, Tensor(c!)? mass=None, Tensor(d!)? q_out=None, "
        "Tensor? mass_keys=None) -> Tensor");
  m.def("decoder_layer_rows(Tensor x, Tensor n1, float eps1, Tensor qkv_w, int qkv_t, int qkv_n, Tensor cos, "
        "Tensor sin, Tensor(a!) k_bank, Tensor(b!) v_bank, int[] lanes, int[] positions, int nh, int nkv, "
        "float scale, Tensor o_w, int o_t, Tensor n2, float eps2, Tensor gu_w, int gu_t, int inter, Tensor d_w, "
        "int d_t, Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=1e-6, bool gated=False, "
        "Tensor? tree=None, Tensor? write_rows=None, Tensor? key_rows=None, Tensor? key_counts=None, "
        "Tensor(c!)? mass=None, Tensor(d!)? q_out=None, Tensor? mass_keys=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_rows", &decoder_layer_rows);
  m.impl("decoder_stack", &decoder_stack);
}
