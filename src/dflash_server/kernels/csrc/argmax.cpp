// argmax along the last dimension, as torch.argmax gives it (the first index of the largest
// value; a NaN counts as the largest, the first NaN wins), for greedy decoding: the sampler
// takes one over the vocabulary for every token (aten: ~120 us for 49,152 fp32 logits on the
// dev CPU, most of it its reduction's overhead) and the DFlash proposer one per drafted row.
// Two passes over the row, 8 lanes at a time: the maximum (and whether a NaN is there), then
// the first position equal to it; rows with a NaN take the scalar reference.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <immintrin.h>

namespace {

using dflash::simd::load8;

template <typename T>
int64_t argmax_scalar(const T* x, int64_t n) {
  float best = static_cast<float>(x[0]);
  if (std::isnan(best)) return 0;
  int64_t at = 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

template <typename T>
DFLASH_SIMD_AVX2 int64_t argmax_avx2(const T* x, int64_t n) {
  if (n < 16) return argmax_scalar(x, n);
  __m256 m = load8(x);
  __m256 nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    m = _mm256_max_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (int j = 1; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    any_nan |= std::isnan(v);
    best = v > best ? v : best;
  }
  if (any_nan) return argmax_scalar(x, n);
  const __m256 b = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + j), b, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
  for (; j < n; ++j)
    if (static_cast<float>(x[j]) == best) return j;
  return argmax_scalar(x, n);  // not reached: the maximum is one of the values
}

template <typename T>
void rows(const T* x, int64_t* out, int64_t n_rows, int64_t n, bool fast) {
  for (int64_t r = 0; r < n_rows; ++r) out[r] = fast ? argmax_avx2(x + r * n, n) : argmax_scalar(x + r * n, n);
}

at::Tensor argmax(const at::Tensor& x_in, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1 && x_in.size(-1) > 0,
              "dflash::argmax: a CPU tensor with a non-empty last dimension");
  auto x = x_in.contiguous();
  const int64_t n = x.size(-1), n_rows = x.numel() / n;
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto out = at::empty(shape, x.options().dtype(at::kLong));
  const bool fast = !portable && dflash::simd::has_avx2();
  switch (x.scalar_type()) {
    case at::kFloat: rows(x.data_ptr<float>(), out.data_ptr<int64_t>(), n_rows, n, fast); break;
    case at::kBFloat16: rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<int64_t>(), n_rows, n, fast); break;
    case at::kHalf: rows(x.data_ptr<c10::Half>(), out.data_ptr<int64_t>(), n_rows, n, false); break;
    default: TORCH_CHECK(false, "dflash::argmax: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("argmax(Tensor x, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("argmax", &argmax);
}
