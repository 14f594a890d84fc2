// The ops' C++ entry points, for ops built from them (layer.cpp) without a trip through
// Python or the dispatcher.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace dflash {
at::Tensor qmm_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, int64_t isa);
// qmm_op with what sits around a matmul in a decoder layer done inside it, each with the bits of
// the separate op: the input rows normalized first (rms_norm_op(x, norm_w, eps)) or taken as
// SwiGLU's [g | u] (silu_mul_op(x, k): x is (..., 2k)), and a residual added to the product
// (residual + product, the product rounded to x's dtype, then one rounded sum, as aten adds)
at::Tensor qmm_fused_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& norm_w, double eps, bool silu,
                        const c10::optional<at::Tensor>& residual);
// one row of rms_norm_op / silu_mul_op (T: float, c10::BFloat16, c10::Half), the same bits
template <typename T>
void rms_norm_row(const T* x, const float* w, T* y, int64_t h, float eps);
template <typename T>
void silu_mul_row(const T* g, const T* u, T* y, int64_t n);
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_op(const at::Tensor& h, int64_t inter);
at::Tensor attention_step_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv, double scale, bool portable,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double norm_eps, bool gated, const c10::optional<at::Tensor>& tree = c10::nullopt,
                             const c10::optional<at::Tensor>& write_rows = c10::nullopt,
                             const c10::optional<at::Tensor>& key_rows = c10::nullopt,
                             const c10::optional<at::Tensor>& key_counts = c10::nullopt,
                             const c10::optional<at::Tensor>& mass = c10::nullopt,
                             const c10::optional<at::Tensor>& q_out = c10::nullopt,
                             const c10::optional<at::Tensor>& mass_keys = c10::nullopt);
// attention_step's slot-addressed form: row t's K/V written to cache row write_rows[t], the row
// attending to key_counts[t] cache rows key_rows[t, ...] (every row's K/V written first)
at::Tensor attention_keys_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv, double scale,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double norm_eps, const at::Tensor& write_rows, const at::Tensor& key_rows,
                             const at::Tensor& key_counts);
at::Tensor attention_rows_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_bank,
                             at::Tensor& v_bank, at::IntArrayRef lanes, at::IntArrayRef positions, int64_t nh,
                             int64_t nkv, double scale, bool portable, const c10::optional<at::Tensor>& q_norm,
                             const c10::optional<at::Tensor>& k_norm, double norm_eps, bool gated,
                             const c10::optional<at::Tensor>& tree = c10::nullopt,
                             const c10::optional<at::Tensor>& write_rows = c10::nullopt,
                             const c10::optional<at::Tensor>& key_rows = c10::nullopt,
                             const c10::optional<at::Tensor>& key_counts = c10::nullopt,
                             const c10::optional<at::Tensor>& mass = c10::nullopt,
                             const c10::optional<at::Tensor>& q_out = c10::nullopt,
                             const c10::optional<at::Tensor>& mass_keys = c10::nullopt);
}  // namespace dflash
