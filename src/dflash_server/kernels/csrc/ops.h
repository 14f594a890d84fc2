// The ops' C++ entry points, for ops built from them (layer.cpp) without a trip through
// Python or the dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace dflash {
at::Tensor qmm_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, int64_t isa);
// residual + qmm_op(x, ...) in one pass (the product rounded to x's dtype, then one rounded sum)
at::Tensor qmm_add_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k,
                      const at::Tensor& residual);
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_op(const at::Tensor& h, int64_t inter);
at::Tensor attention_step_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv, double scale, bool portable,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double norm_eps, bool gated, const c10::optional<at::Tensor>& tree = c10::nullopt);
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
                             const c10::optional<at::Tensor>& tree = c10::nullopt);
}  // namespace dflash
