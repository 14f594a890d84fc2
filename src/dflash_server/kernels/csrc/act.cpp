// SwiGLU's activation in one pass: y = silu(g) * u over h = [g | u] (the fused gate/up
// matmul's output, (..., 2 * inter)), computed in fp32 and rounded once to h's dtype. aten
// spends two slices, a silu and a mul (two roundings to bf16, ~13 us for an 8-row verify block
// of 1536-wide rows); this is ~2 us, and the output is contiguous, as the down matmul reads it.
//
// exp is this file's own (Cody-Waite reduction by ln 2, a degree-7 Taylor polynomial: ~1 ulp),
// built from multiplies, fused multiply-adds, a round-to-nearest-even and exponent bits, so
// the AVX2 path and the portable path do the same IEEE operations and give the same bits; an
// elementwise op is row-count invariant by construction.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

namespace {

constexpr float LO = -87.f, HI = 88.f;  // exp's argument clamped: 2^n stays a normal float
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float C[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

// the reference: silu(g) * u with the ops below, one value at a time
inline float silu_mul_one(float g, float u) {
  float a = -g;
  a = a > LO ? a : LO;  // as _mm256_max_ps(a, LO) (NaN -> LO: g's NaN comes through the division)
  a = a < HI ? a : HI;  // as _mm256_min_ps(a, HI)
  const float n = std::nearbyint(a * LOG2E);
  float r = std::fma(n, -LN2_HI, a);
  r = std::fma(n, -LN2_LO, r);
  float p = C[7];
  for (int k = 6; k >= 0; --k) p = std::fma(p, r, C[k]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return g / (1.f + p * scale) * u;
}

#define DFLASH_TARGET_AVX2 DFLASH_SIMD_AVX2

DFLASH_TARGET_AVX2 inline __m256 silu_mul8(__m256 g, __m256 u) {
  __m256 a = _mm256_xor_ps(g, _mm256_set1_ps(-0.f));  // -g: the sign flipped, as the scalar negation
  a = _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), a);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
  __m256 p = _mm256_set1_ps(C[7]);
  for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C[k]));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(p, scale))), u);
}

using dflash::simd::load8;
using dflash::simd::store8;

template <typename T>
DFLASH_TARGET_AVX2 void row_avx2(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(silu_mul8(load8(g + i), load8(u + i)), y + i);
  for (; i < n; ++i) y[i] = static_cast<T>(silu_mul_one(static_cast<float>(g[i]), static_cast<float>(u[i])));
}

template <typename T>
void row_portable(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(silu_mul_one(static_cast<float>(g[i]), static_cast<float>(u[i])));
}

template <typename T>
void run(const T* h, T* y, int64_t rows, int64_t inter, bool fast) {
  for (int64_t r = 0; r < rows; ++r) {  // ~0.3 us a 1536-wide row: no threads
    const T* g = h + r * 2 * inter;
    if constexpr (std::is_same_v<T, c10::Half>) {
      row_portable(g, g + inter, y + r * inter, inter);
    } else {
      if (fast) row_avx2(g, g + inter, y + r * inter, inter);
      else row_portable(g, g + inter, y + r * inter, inter);
    }
  }
}

at::Tensor silu_mul(const at::Tensor& h_in, int64_t inter, bool portable) {
  TORCH_CHECK(h_in.device().is_cpu() && h_in.dim() >= 1, "dflash::silu_mul: a CPU tensor of (..., 2 * inter)");
  TORCH_CHECK(inter > 0 && h_in.size(-1) == 2 * inter, "dflash::silu_mul: the last dimension must be 2 * ", inter);
  auto h = h_in.contiguous();
  auto shape = h.sizes().vec();
  shape.back() = inter;
  auto y = at::empty(shape, h.options());
  const int64_t rows = h.numel() / (2 * inter);
  const bool fast = dflash::simd::has_avx2() && !portable;
  switch (h.scalar_type()) {
    case at::kFloat: run(h.data_ptr<float>(), y.data_ptr<float>(), rows, inter, fast); break;
    case at::kBFloat16: run(h.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, inter, fast); break;
    case at::kHalf: run(h.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), rows, inter, fast); break;
    default: TORCH_CHECK(false, "dflash::silu_mul: float32, bfloat16 or float16 only");
  }
  return y;
}

}  // namespace

namespace dflash {
at::Tensor silu_mul_op(const at::Tensor& h, int64_t inter) { return silu_mul(h, inter, false); }
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("silu_mul(Tensor h, int inter, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
