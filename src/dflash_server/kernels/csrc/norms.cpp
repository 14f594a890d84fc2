// RMSNorm over the last dimension: y = x * rsqrt(mean(x^2) + eps) * w, in fp32 whatever the
// input dtype, one row at a time. aten's rms_norm on a 576-wide bf16 row costs ~25 us on
// the dev CPU (upcast, reduction and downcast as separate kernels); this is one pass.
//
// The sum of squares has one fixed order, whatever the row count and the path: 16 lanes, lane
// j summing values i = j (mod 16) in index order with a fused multiply-add, then the lanes
// combined as (j, j + 8), then (j, j + 4), (j, j + 2), (j, j + 1). The AVX2 path (two 8-wide
// accumulators) and the portable path (16 scalars) do exactly these operations, so they give
// the same bits (a row's zero padding adds +0 to a sum that is >= +0: no change), and a row's
// result does not depend on how many rows are normalized together. The 16 lanes are
// independent dependency chains: a 576-wide row costs ~0.1 us instead of ~1.5 us of one
// serial chain (what an 8-row verify block pays twice per layer).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

namespace {

constexpr int LANES = 16;

inline float combine(float* l) {  // the lanes' fixed reduction tree
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] = l[j] + l[j + w];
  return l[0];
}

template <typename T>
float sum_squares_portable(const T* xr, int64_t h) {
  float l[LANES] = {};
  for (int64_t i = 0; i < h; ++i) {
    const float v = static_cast<float>(xr[i]);
    l[i % LANES] = std::fma(v, v, l[i % LANES]);
  }
  return combine(l);
}

#define DFLASH_TARGET_AVX2 DFLASH_SIMD_AVX2

using dflash::simd::load8;
using dflash::simd::store8;

template <typename T>
DFLASH_TARGET_AVX2 void norm_row_avx2(const T* xr, const float* w, T* yr, int64_t h, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + LANES <= h; i += LANES) {
    const __m256 v0 = load8(xr + i), v1 = load8(xr + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  alignas(32) float l[LANES];
  _mm256_store_ps(l, a0);
  _mm256_store_ps(l + 8, a1);
  for (int64_t j = 0; i + j < h; ++j) {  // the tail, into the lanes it belongs to
    const float v = static_cast<float>(xr[i + j]);
    l[j] = std::fma(v, v, l[j]);
  }
  const float inv = 1.f / std::sqrt(combine(l) / static_cast<float>(h) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= h; i += 8)
    store8(_mm256_mul_ps(_mm256_mul_ps(load8(xr + i), iv), _mm256_loadu_ps(w + i)), yr + i);
  for (; i < h; ++i) yr[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * w[i]);
}

template <typename T>
void norm_row_portable(const T* xr, const float* w, T* yr, int64_t h, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares_portable(xr, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) yr[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * w[i]);
}

// one row, the vector path where ``fast`` (fp16 rows, rare on a CPU: the portable one); what
// norm_rows does per row and what ops that normalize their input rows themselves (qmm_fused) call
template <typename T>
void norm_row(const T* x, const float* w, T* y, int64_t h, float eps, bool fast) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    norm_row_portable(x, w, y, h, eps);
  } else {
    if (fast) norm_row_avx2(x, w, y, h, eps);
    else norm_row_portable(x, w, y, h, eps);
  }
}

template <typename T>
void norm_rows(const T* x, const float* w, T* y, int64_t rows, int64_t h, float eps, bool fast) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, h)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(x + r * h, w, y + r * h, h, eps, fast);
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "dflash::rms_norm: CPU tensors only");
  const int64_t h = x_in.size(-1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == h, "dflash::rms_norm: weight must be (", h, ")");
  auto x = x_in.contiguous();
  auto w = w_in.to(at::kFloat).contiguous();
  auto y = at::empty_like(x);
  const int64_t rows = h ? x.numel() / h : 0;
  const bool fast = dflash::simd::has_avx2() && !portable;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, h, e, fast); break;
    case at::kBFloat16:
      norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), rows, h, e, fast);
      break;
    case at::kHalf:
      norm_rows(x.data_ptr<c10::Half>(), w.data_ptr<float>(), y.data_ptr<c10::Half>(), rows, h, e, fast);
      break;
    default: TORCH_CHECK(false, "dflash::rms_norm: x must be float32, bfloat16 or float16");
  }
  return y;
}

}  // namespace

namespace dflash {
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm(x, w, eps, false); }
template <typename T>
void rms_norm_row(const T* x, const float* w, T* y, int64_t h, float eps) {
  norm_row(x, w, y, h, eps, dflash::simd::has_avx2());
}
template void rms_norm_row(const float*, const float*, float*, int64_t, float);
template void rms_norm_row(const c10::BFloat16*, const float*, c10::BFloat16*, int64_t, float);
template void rms_norm_row(const c10::Half*, const float*, c10::Half*, int64_t, float);
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
