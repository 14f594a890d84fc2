// AVX2 helpers the kernels share: 8 values of x as fp32 (exact for fp32 / bf16 / fp16) and 8
// fp32 results stored as bf16 rounded exactly as c10::BFloat16 rounds (to nearest even, NaN ->
// 0x7FC0), so the vector paths' outputs equal the portable paths'.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

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

}  // namespace dflash::simd
