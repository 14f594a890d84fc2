// AVX2 helpers the kernels share: 8 values of x as fp32 (exact for fp32 / bf16 / fp16) and 8
// fp32 results stored as bf16 or fp16 rounded exactly as c10::BFloat16 / c10::Half round (to
// nearest even; NaN -> 0x7FC0 / the sign and 0x7E00), so the vector paths' outputs equal the portable paths'; and silu(g) * u with the
// kernels' own exp, one value at a time and 8 at a time, with the same bits.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#define DFLASH_SIMD_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace dflash::simd {

// whether this CPU runs the AVX2 paths (AVX2, FMA, F16C), asked once
inline bool has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

// the highest path DFLASH_KERNELS_ISA allows, as an index of kernels.ISAS (portable, avx2,
// avx-vnni, avx512-vnni, amx): for benchmarks and for machines where a path misbehaves; 4 when
// unset or not one of those names. Read once.
inline int isa_cap() {
  static const int cap = [] {
    static const char* names[] = {"portable", "avx2", "avx-vnni", "avx512-vnni", "amx"};
    if (const char* want = std::getenv("DFLASH_KERNELS_ISA"))
      for (int i = 0; i < 5; ++i)
        if (std::strcmp(want, names[i]) == 0) return i;
    return 4;
  }();
  return cap;
}

DFLASH_SIMD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DFLASH_SIMD_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
DFLASH_SIMD_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DFLASH_SIMD_AVX2 inline void store8(__m256 f, float* dst) { _mm256_storeu_ps(dst, f); }
DFLASH_SIMD_AVX2 inline void store8(__m256 f, c10::BFloat16* dst) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// 8 fp32 values stored as fp16 exactly as c10::Half rounds them (to nearest even; NaN -> the
// sign and 0x7E00, where the instruction would keep the payload)
DFLASH_SIMD_AVX2 inline void store8(__m256 f, c10::Half* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const int nan = _mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  if (nan) {
    float v[8];
    _mm256_storeu_ps(v, f);
    for (int i = 0; i < 8; ++i)
      if (nan >> i & 1) dst[i] = static_cast<c10::Half>(v[i]);
  }
}

// silu(g) * u: exp by a Cody-Waite reduction by ln 2 and a degree-7 Taylor polynomial (~1 ulp),
// from multiplies, fused multiply-adds, a round-to-nearest-even and exponent bits (the
// argument clamped so 2^n stays a normal float)
constexpr float SILU_LO = -87.f, SILU_HI = 88.f;
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_C[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

// exp(a) for a in [SILU_LO, SILU_HI] (2^n stays a normal float), one value and 8 at a time,
// the same bits (silu_mul below, the sampler's softmax in sample.cpp)
inline float exp_in_range(float a) {
  const float n = std::nearbyint(a * LOG2E);
  float r = std::fma(n, -LN2_HI, a);
  r = std::fma(n, -LN2_LO, r);
  float p = EXP_C[7];
  for (int k = 6; k >= 0; --k) p = std::fma(p, r, EXP_C[k]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

DFLASH_SIMD_AVX2 inline __m256 exp8_in_range(__m256 a) {
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), a);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_C[7]);
  for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[k]));
  const __m256 scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(p, scale);
}

// the reference, one value at a time (silu_mul_one(g, 1.f) is silu(g))
inline float silu_mul_one(float g, float u) {
  float a = -g;
  a = a > SILU_LO ? a : SILU_LO;  // as _mm256_max_ps(a, LO) (NaN -> LO: g's NaN comes through the division)
  a = a < SILU_HI ? a : SILU_HI;  // as _mm256_min_ps(a, HI)
  return g / (1.f + exp_in_range(a)) * u;
}

DFLASH_SIMD_AVX2 inline __m256 silu_mul8(__m256 g, __m256 u) {
  __m256 a = _mm256_xor_ps(g, _mm256_set1_ps(-0.f));  // -g: the sign flipped, as the scalar negation
  a = _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(SILU_LO)), _mm256_set1_ps(SILU_HI));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8_in_range(a))), u);
}

}  // namespace dflash::simd
