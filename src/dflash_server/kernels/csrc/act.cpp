// SwiGLU's activation in one pass: y = silu(g) * u over h = [g | u] (the fused gate/up
// matmul's output, (..., 2 * inter)), computed in fp32 and rounded once to h's dtype. aten
// spends two slices, a silu and a mul (two roundings to bf16, ~13 us for an 8-row verify block
// of 1536-wide rows); this is one pass (~1.2 us a 1536-wide row, rows split over threads from
// ~4 rows), and the output is contiguous, as the down matmul reads it.
//
// exp is the kernels' own (simd.h: Cody-Waite reduction by ln 2, a degree-7 Taylor polynomial:
// ~1 ulp), built from multiplies, fused multiply-adds, a round-to-nearest-even and exponent
// bits, so the AVX2 path and the portable path do the same IEEE operations and give the same
// bits; an elementwise op is row-count invariant by construction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

namespace {

using dflash::simd::silu_mul8;
using dflash::simd::silu_mul_one;
#define DFLASH_TARGET_AVX2 DFLASH_SIMD_AVX2

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

// ~1.2 us a 1536-wide row on the Zen 4 dev VM (an 8-row verify block ~10 us on one thread):
// threads for chunks of at least ~6K values (a row's result is the same in any chunk)
constexpr int64_t SILU_GRAIN_VALUES = 6144;

// one row of [g | u] -> y, the vector path where ``fast`` (fp16 rows: the portable one); what
// run does per row and what ops that take [g | u] rows themselves (qmm_fused) call
template <typename T>
void one_row(const T* g, const T* u, T* y, int64_t n, bool fast) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    row_portable(g, u, y, n);
  } else {
    if (fast) row_avx2(g, u, y, n);
    else row_portable(g, u, y, n);
  }
}

template <typename T>
void run(const T* h, T* y, int64_t rows, int64_t inter, bool fast) {
  at::parallel_for(0, rows, std::max<int64_t>(1, SILU_GRAIN_VALUES / inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) one_row(h + r * 2 * inter, h + r * 2 * inter + inter, y + r * inter, inter, fast);
  });
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
template <typename T>
void silu_mul_row(const T* g, const T* u, T* y, int64_t n) { one_row(g, u, y, n, dflash::simd::has_avx2()); }
template void silu_mul_row(const float*, const float*, float*, int64_t);
template void silu_mul_row(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t);
template void silu_mul_row(const c10::Half*, const c10::Half*, c10::Half*, int64_t);
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("silu_mul(Tensor h, int inter, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
