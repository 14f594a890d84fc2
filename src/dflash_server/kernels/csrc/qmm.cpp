// Quantized matmul for 1..64 (or more) rows on GGUF block formats: y = x @ W^T.
//
// Weights stay in their GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), repacked once at
// load (losslessly) so that one vector instruction works on 8 output rows at once: rows are
// taken 8 at a time (a "group", the last one padded with zero rows) and, per block of 32
// values, the codes are interleaved in 4-value chunks (chunk c of rows 0..7 = 32 bytes),
// followed by the 8 rows' scales (layouts below, at `enum class Kind`). Activations are
// quantized to int8 per block of 32 inside the op (scale = max|x| / 127, as llama.cpp's
// q8 activations).
//
// Per block b of one (row m, output n):  sum_i w_i x_i  ~=  dw * dx * dot + e * (dx * sx)
//   Q4_0: w = dw * (q - 8) -> e = -8 dw     Q4_1: w = dw * q + m -> e = m     Q8_0: w = dw * q, e = 0
//   Q5_0, Q5_1: as Q4_0 (e = -16 dw), Q4_1
//   Q4_K, Q5_K: dw = d * sc, e = -dmin * m   Q6_K: two half blocks, each dw = d * sc, codes q - 32
//   dot = sum_i q_i xq_i (exact int32; Q8_0 codes signed), sx = sum_i xq_i
//
// Row-count invariance: every (m, n) is computed by the same operations whatever the number
// of rows: the exact int32 dot of each block, then acc += dot * (dw * dx) and
// acc_e += e * (dx * sx) with one fused multiply-add each, block after block, and finally
// acc + acc_e. Rows and groups are independent computations (threads split the groups,
// never a reduction). No -ffast-math: the compiler may not reorder. The AVX2, AVX-VNNI,
// AVX-512 VNNI and portable paths give bit-identical results. Reading a group's weights
// once serves every row of x, so a call of 8 or 16 rows reads the weights once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>

namespace {
// The vector paths prefetch the weights ahead of the block they compute. A one-row call
// (decode) otherwise computes a block, then waits for the next one's memory: measured on the
// default model, 2 threads, alternating in one process, a one-row forward took 24-28% less time
// with 2-6 KB ahead (13.9 -> 10.6, 17.6 -> 12.6 ms in two busier moments); 8 rows (the AMX
// path, which prefetches itself, or compute-bound VNNI) were unchanged. Which hint streams best
// depends on the CPU, so it is chosen at load (DFLASH_KERNELS_PREFETCH=nta|l2 overrides, for
// benchmarks):
// - AMD (Zen 4 VM, 2026-11-27, default model, 2 threads, alternating in one process): NTA 4 KB
//   ahead. Forwards of 1 / 2 / 8 rows 4.87 / 5.40 / 13.1 ms with T0 -> 4.03 / 4.81 / 12.8 with
//   NTA; over whole greedy generations 1-row decode steps 4.45 -> 4.28 and 4.71 -> 4.41 ms in two
//   runs (1,364 steps each); 1-8 KB ahead all within 3% of each other with NTA.
// - Intel (Xeon VM with AMX, 2026-12-01, the same measurement, each variant a fresh process,
//   three rounds): NTA 4 KB 11.2-11.8 ms a one-row forward, T0 4 KB 7.3-7.8, T1 (into L2) 4 KB
//   6.4-7.5, T1 8 KB 6.1-7.1, T1 12 KB 5.8-6.7, T2 8 KB 6.3-7.3: an NTA prefetch fills L1 only,
//   whose few fill buffers cap a core's stream (~10 GB/s here), while L2 keeps more misses in
//   flight (the AMX path's T1 prefetch read the 30 MB LM head at ~27 GB/s). T1 8 KB there, and on
//   CPUs of other makers.
const bool prefetch_nta = [] {
  const char* want = std::getenv("DFLASH_KERNELS_PREFETCH");
  __builtin_cpu_init();
  if (want && std::strcmp(want, "nta") == 0) return true;
  if (want && std::strcmp(want, "l2") == 0) return false;
  return __builtin_cpu_is("amd") != 0;
}();

// The AVX-512 pair path (5 or more rows) computes longer per weight line, and there an L2
// prefetch streams better on every CPU measured: on the Zen 4 VM (2026-12-02, default model's
// matrices, 2 threads, alternating in one process) the 30 MB Q8_0 LM head at 8 rows took 1.82 ->
// 1.12 ms with T1 8 KB ahead instead of NTA 4 KB (the Q4_1 layers even, 0.97-1.05x); a whole
// 8-row forward 0.93x (16 rows 0.965x). Fewer rows keep the CPU's hint (prefetch_ahead; with T1
// there the one- to four-row matrices were 0.94-1.33x the time, the LM head at 4 rows 1.33x).
inline __attribute__((always_inline)) void prefetch_ahead_l2(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + 8192, _MM_HINT_T1);
}

// one line of weights ahead of p (a read past the end of the weights is harmless: a prefetch
// never faults)
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p) {
  if (prefetch_nta) _mm_prefetch(reinterpret_cast<const char*>(p) + 4096, _MM_HINT_NTA);
  else prefetch_ahead_l2(p);
}

constexpr int QK = 32;  // values per block
constexpr int NR = 8;   // output rows per group
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml ids

// How a group's block is laid out and scaled (the kernels' view of the GGUF types):
//   Q4:  Q4_0 / Q4_1        codes 128 | d f16 x8 | e f16 x8                          w = d q + e
//   Q5:  Q5_0 / Q5_1        as Q4 with a plane of the codes' bit 4 (32 bytes) after the codes
//   Q8:  Q8_0               codes 256 (signed) | d f16 x8                           w = d q
//   Q4K: Q4_K               codes 128 | d f16 x8 | dmin f16 x8 | sc u8 x8 | m u8 x8  w = (d sc) q - (dmin m)
//   Q5K: Q5_K               as Q4K with a plane of the codes' bit 4 (32 bytes) after the codes
//   Q6K: Q6_K               codes 128 | bit-4 plane 32 | bit-5 plane 32 | d f16 x8 | sc_lo i8 x8 | sc_hi i8 x8
//                           w = (d sc) (q - 32), sc_lo for values 0..15 of the block, sc_hi for 16..31
// The products d sc and dmin m are exact in fp32 (11-bit x 6/8-bit integers), so K-quant
// weights are read exactly as GGUF stores them (the super-block's d, dmin and the 6-bit
// sub-block scales are unpacked at load: Python's kernels.kquants).
// A plane byte (r, i) of chunk c holds, in its bit c, that bit of row r's value 4c + i.
enum class Kind { Q4, Q5, Q8, Q4K, Q5K, Q6K };

Kind kind_of(int64_t t) {
  switch (t) {
    case Q4_0: case Q4_1: return Kind::Q4;
    case Q5_0: case Q5_1: return Kind::Q5;
    case Q8_0: return Kind::Q8;
    case Q4_K: return Kind::Q4K;
    case Q5_K: return Kind::Q5K;
    default: return Kind::Q6K;
  }
}
bool known_type(int64_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K || t == Q5_K || t == Q6_K;
}

constexpr int64_t block_bytes(Kind k) {
  return k == Kind::Q4 ? 160 : k == Kind::Q5 ? 192 : k == Kind::Q8 ? 272 : k == Kind::Q4K ? 176 : k == Kind::Q5K ? 208 : 224;
}
constexpr int64_t plane_bytes(Kind k) { return k == Kind::Q5K || k == Kind::Q5 ? 32 : (k == Kind::Q6K ? 64 : 0); }
constexpr int64_t scales_at(Kind k) { return (k == Kind::Q8 ? NR * QK : NR * 16) + plane_bytes(k); }
constexpr bool has_offset(Kind k) { return k == Kind::Q4 || k == Kind::Q5 || k == Kind::Q4K || k == Kind::Q5K; }
constexpr bool has_plane4(Kind k) { return k == Kind::Q5 || k == Kind::Q5K || k == Kind::Q6K; }

int64_t group_block_bytes(int64_t qtype) { return block_bytes(kind_of(qtype)); }
int64_t groups(int64_t n) { return (n + NR - 1) / NR; }

float h2f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
uint16_t f2h(float f) { return c10::Half(f).x; }

// ---- activations ------------------------------------------------------------------------
struct Acts {
  const int8_t* q;      // (M, K) int8 codes
  const float* d;       // (M, nb) block scale
  const float* ds;      // (M, nb) scale * sum of the block's codes (the offset term)
  const int32_t* s;     // (M, nb) sum of the block's codes
  const int32_t* s_lo;  // (M, nb) sum of the block's first 16 codes (Q6_K's half blocks)
};

#define DFLASH_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DFLASH_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define DFLASH_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// One block of 32 values -> int8 codes (scale = max|x| / 127, codes rounded to nearest even and
// clamped to +-127), its scale, scale * sum and the sums; a block holding NaN / inf gives NaN
// scales (NaN out, as a float matmul would give). The scalar form is the reference; the
// vector forms below do the same IEEE operations (a multiply, round-to-nearest-even under the
// default rounding mode, exact integer sums), so all give bit-identical codes and scales.
template <typename T>
void quantize_block(const T* xb, int8_t* qb, float& d, float& ds, int32_t& s, int32_t& s_lo) {
  float v[QK], amax = 0.f;
  bool finite = true;
  for (int i = 0; i < QK; ++i) {
    v[i] = static_cast<float>(xb[i]);
    amax = std::fmax(amax, std::fabs(v[i]));
    finite &= std::isfinite(v[i]);
  }
  if (!finite) {
    std::memset(qb, 0, QK);
    d = ds = std::numeric_limits<float>::quiet_NaN();
    s = s_lo = 0;
    return;
  }
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  int32_t sum = 0, sum_lo = 0;
  for (int i = 0; i < QK; ++i) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * id));
    qb[i] = static_cast<int8_t>(c < -127 ? -127 : (c > 127 ? 127 : c));
    sum += qb[i];
    if (i == 15) sum_lo = sum;
  }
  d = db;
  ds = db * static_cast<float>(sum);
  s = sum;
  s_lo = sum_lo;
}

// 8 floats of x (fp32, bf16 -> the high half of an fp32, fp16 by F16C: all exact)
using dflash::simd::load8;

DFLASH_TARGET_AVX2 inline int32_t hsum8(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}

template <typename T>
DFLASH_TARGET_AVX2 void quantize_block_avx2(const T* xb, int8_t* qb, float& d, float& ds, int32_t& s,
                                            int32_t& s_lo) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(xb + 8 * j);
    const __m256 a = _mm256_and_ps(v[j], absmask);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
  }
  if (_mm256_movemask_ps(bad)) return quantize_block(xb, qb, d, ds, s, s_lo);  // the NaN path
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float db = am / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i c[4];
  for (int j = 0; j < 4; ++j)
    c[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv)), lo), hi);
  const int32_t sum_lo = hsum8(_mm256_add_epi32(c[0], c[1]));
  const int32_t sum = sum_lo + hsum8(_mm256_add_epi32(c[2], c[3]));
  // packs interleave the 128-bit lanes: dwords come out as c0lo c1lo c2lo c3lo c0hi c1hi c2hi c3hi
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  d = db;
  ds = db * static_cast<float>(sum);
  s = sum;
  s_lo = sum_lo;
}

// 8 floats -> bf16 as c10::BFloat16 rounds them: to nearest even, NaN -> 0x7FC0
DFLASH_TARGET_AVX2 inline void store8_bf16(const float* src, c10::BFloat16* dst) {
  dflash::simd::store8(_mm256_loadu_ps(src), dst);
}

// dst = res + bf16(src) for 8 values, as aten's bf16 add of the rounded product computes it:
// both operands as fp32, one sum, rounded once to bf16 (so a fused residual gives the bits of
// ``x + qmm(...)``)
DFLASH_TARGET_AVX2 inline void store8_bf16_add(const float* src, const c10::BFloat16* res, c10::BFloat16* dst) {
  alignas(16) c10::BFloat16 y[8];
  dflash::simd::store8(_mm256_loadu_ps(src), y);
  dflash::simd::store8(_mm256_add_ps(dflash::simd::load8(res), dflash::simd::load8(y)), dst);
}

// What a row of x becomes before it is quantized (qmm_fused): itself, its RMSNorm
// (dflash::rms_norm_row, rounded to x's dtype as the op rounds it) or, from a row [g | u] of
// 2k values, SwiGLU's silu(g) * u (dflash::silu_mul_row); so the quantized codes are those of
// the separate op's output, which is never written.
struct Prologue {
  const float* norm_w = nullptr;  // RMSNorm weight (k floats)
  float eps = 0.f;
  bool silu = false;
};

// Quantize x's (row, block) units [u0, u1) (unit u: block u % nb of row u / nb), each row's
// prologue computed first into ``row`` (k values): the norm over the whole row (its sum of
// squares needs it) even where this range holds part of the row, SwiGLU only over the blocks
// wanted (elementwise). A unit's codes and scales are the same whatever range computes it.
template <typename T>
void quantize_units(const T* x, int64_t k, int64_t u0, int64_t u1, int8_t* q, float* d, float* ds, int32_t* s,
                    int32_t* s_lo, bool vector, const Prologue& pro, T* row) {
  const int64_t nb = k / QK, xk = pro.silu ? 2 * k : k;
  for (int64_t u = u0; u < u1;) {
    const int64_t m = u / nb, b0 = u % nb, b1 = std::min(nb, b0 + (u1 - u));
    const T* xr = x + m * xk;
    if (pro.silu) {
      dflash::silu_mul_row(xr + b0 * QK, xr + k + b0 * QK, row + b0 * QK, (b1 - b0) * QK);
      xr = row;
    } else if (pro.norm_w) {
      dflash::rms_norm_row(xr, pro.norm_w, row, k, pro.eps);
      xr = row;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i = m * nb + b;
      if (vector)
        quantize_block_avx2(xr + b * QK, q + m * k + b * QK, d[i], ds[i], s[i], s_lo[i]);
      else
        quantize_block(xr + b * QK, q + m * k + b * QK, d[i], ds[i], s[i], s_lo[i]);
    }
    u += b1 - b0;
  }
}

// quantize_units over x's dtype (float, bf16 or fp16), with this thread's row scratch
inline void quantize_span(const at::Tensor& x, int64_t k, int64_t u0, int64_t u1, int8_t* q, float* d, float* ds,
                          int32_t* s, int32_t* s_lo, bool vector, const Prologue& pro) {
  thread_local std::vector<float> scratch;  // (k values of the row's dtype, as floats: enough room)
  const bool pre = pro.norm_w != nullptr || pro.silu;
  if (pre && static_cast<int64_t>(scratch.size()) < k) scratch.resize(k);
  void* row = scratch.data();
  switch (x.scalar_type()) {
    case at::kFloat:
      return quantize_units(x.data_ptr<float>(), k, u0, u1, q, d, ds, s, s_lo, vector, pro, static_cast<float*>(row));
    case at::kBFloat16:
      return quantize_units(x.data_ptr<c10::BFloat16>(), k, u0, u1, q, d, ds, s, s_lo, vector, pro,
                            static_cast<c10::BFloat16*>(row));
    case at::kHalf:
      return quantize_units(x.data_ptr<c10::Half>(), k, u0, u1, q, d, ds, s, s_lo, vector, pro,
                            static_cast<c10::Half*>(row));
    default: TORCH_CHECK(false, "dflash::qmm: x must be float32, bfloat16 or float16");
  }
}

// ---- portable path: the reference of the arithmetic -------------------------------------------
// the weight code of row r, value v (= 4c + i) of a group's block
template <Kind K>
int32_t code(const uint8_t* blk, int r, int c, int i) {
  if (K == Kind::Q8) return static_cast<int8_t>(blk[c * 32 + r * 4 + i]);
  const uint8_t byte = blk[(c % 4) * 32 + r * 4 + i];
  int32_t w = c < 4 ? (byte & 0x0F) : (byte >> 4);
  if (has_plane4(K)) w |= ((blk[NR * 16 + r * 4 + i] >> c) & 1) << 4;
  if (K == Kind::Q6K) w |= ((blk[NR * 16 + 32 + r * 4 + i] >> c) & 1) << 5;
  return w;
}

template <Kind K>
void group_portable(const uint8_t* g, int64_t k, const Acts& a, int64_t m_rows, float* out) {
  const int64_t nb = k / QK, gb = block_bytes(K);
  for (int64_t m = 0; m < m_rows; ++m) {
    float acc[NR] = {}, acc_e[NR] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * gb;
      const uint16_t* d = reinterpret_cast<const uint16_t*>(blk + scales_at(K));
      const uint8_t* sm = blk + scales_at(K) + (K == Kind::Q6K ? 16 : 32);  // 8-bit scale fields
      const int8_t* xq = a.q + m * k + b * QK;
      const int64_t mb = m * nb + b;
      for (int r = 0; r < NR; ++r) {
        int32_t dot[2] = {0, 0};
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) dot[c / 4] += code<K>(blk, r, c, i) * xq[4 * c + i];
        if (K == Kind::Q6K) {
          const float dlo = h2f(d[r]) * static_cast<float>(static_cast<int8_t>(sm[r]));
          const float dhi = h2f(d[r]) * static_cast<float>(static_cast<int8_t>(sm[NR + r]));
          acc[r] = std::fma(static_cast<float>(dot[0] - 32 * a.s_lo[mb]), dlo * a.d[mb], acc[r]);
          acc[r] = std::fma(static_cast<float>(dot[1] - 32 * (a.s[mb] - a.s_lo[mb])), dhi * a.d[mb], acc[r]);
          continue;
        }
        float dw = h2f(d[r]), ew = 0.f;
        if (K == Kind::Q4 || K == Kind::Q5) ew = h2f(d[NR + r]);
        if (K == Kind::Q4K || K == Kind::Q5K) {
          dw = dw * static_cast<float>(sm[r]);
          ew = -(h2f(d[NR + r]) * static_cast<float>(sm[NR + r]));
        }
        acc[r] = std::fma(static_cast<float>(dot[0] + dot[1]), dw * a.d[mb], acc[r]);
        if (has_offset(K)) acc_e[r] = std::fma(ew, a.ds[mb], acc_e[r]);
      }
    }
    for (int r = 0; r < NR; ++r) out[m * NR + r] = acc[r] + acc_e[r];
  }
}

// ---- x86 paths: one body, three integer dot products ---------------------------------------
enum class Dot { AVX2, AVXVNNI, AVX512VNNI };

// acc + lane-wise dot of 4 unsigned bytes u with 4 signed bytes s (u <= 63 here, or
// |w| <= 128 for AVX2's Q8_0 sign trick, so AVX2's int16 pair sums cannot saturate)
template <Dot D>
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s);

template <>
DFLASH_TARGET_AVX2 inline __m256i dot_add<Dot::AVX2>(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
template <>
DFLASH_TARGET_AVXVNNI inline __m256i dot_add<Dot::AVXVNNI>(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
template <>
DFLASH_TARGET_AVX512 inline __m256i dot_add<Dot::AVX512VNNI>(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}

// How many 4-value chunks the AVX2 path sums in int16 before widening to int32: a chunk's pair
// sum is at most 2 x 15 x 127 = 3810 for 4-bit codes (8 chunks: 30480), 7874 for 5-bit (4:
// 31496), 16002 for 6-bit (2: 32004); Q8_0 (|w| <= 128) widens every chunk. A block-row then
// takes 9 (Q4) / 10 (Q5) / 12 (Q6_K) multiplies instead of 16 (AVX2 has no int8 dot product:
// vpmaddubsw, then vpmaddwd by ones).
template <Kind K>
constexpr int AVX2_RUN = K == Kind::Q4 || K == Kind::Q4K ? 8 : (K == Kind::Q6K ? 2 : (K == Kind::Q8 ? 1 : 4));

// bit c of each byte of a plane, moved to bit `to` (the shift stays inside each byte)
#define DFLASH_PLANE_BIT(plane, c, to)                                                               \
  _mm256_and_si256((c) <= (to) ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128((to) - (c)))              \
                               : _mm256_srl_epi16(plane, _mm_cvtsi32_si128((c) - (to))),             \
                   _mm256_set1_epi8(1 << (to)))

// 8 fp32 lanes of 8 unsigned / signed bytes
#define DFLASH_U8_PS(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))
#define DFLASH_I8_PS(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))

// A group block's 8 scales as fp32 (sp: its scale fields): dw for the dots (Q6_K: dw / dw2 for its
// half blocks), ew for the offset term
template <Kind K>
DFLASH_TARGET_AVX2 __attribute__((always_inline)) inline void block_scales(const uint8_t* sp, __m256& dw, __m256& dw2,
                                                                           __m256& ew) {
  const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
  dw = dh, dw2 = dh, ew = _mm256_setzero_ps();
  if (K == Kind::Q4 || K == Kind::Q5) ew = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
  if (K == Kind::Q4K || K == Kind::Q5K) {
    dw = _mm256_mul_ps(dh, DFLASH_U8_PS(sp + 32));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
    ew = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, DFLASH_U8_PS(sp + 40)));
  }
  if (K == Kind::Q6K) {
    dw = _mm256_mul_ps(dh, DFLASH_I8_PS(sp + 16));
    dw2 = _mm256_mul_ps(dh, DFLASH_I8_PS(sp + 24));
  }
}

// one row's exact int32 dots of a block (Q6_K: dot / dot2 for its half blocks; Q8_0's VNNI offset
// already removed) into its accumulators: acc += dot (dw dx), acc_e += ew (dx sx)
template <Kind K>
DFLASH_TARGET_AVX2 __attribute__((always_inline)) inline void scale_into(__m256i dot, __m256i dot2, __m256 dw, __m256 dw2,
                                                                         __m256 ew, const Acts& a, int64_t mb,
                                                                         __m256& acc, __m256& acc_e) {
  const __m256 dx = _mm256_set1_ps(a.d[mb]);
  if (K == Kind::Q6K) { /* exact: sum (q - 32) x = sum q x - 32 sum x, per half block */
    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(32 * a.s_lo[mb]));
    dot2 = _mm256_sub_epi32(dot2, _mm256_set1_epi32(32 * (a.s[mb] - a.s_lo[mb])));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_mul_ps(dw2, dx), acc);
    return;
  }
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx), acc);
  if (has_offset(K)) acc_e = _mm256_fmadd_ps(ew, _mm256_set1_ps(a.ds[mb]), acc_e);
}

// MR rows of x against one group (8 outputs): the group's codes are loaded (and unpacked)
// once per block and serve the MR rows
#define DFLASH_GROUP_BODY(D)                                                                         \
  constexpr bool Q8 = K == Kind::Q8;                                                                 \
  const int64_t nb = k / QK, gb = block_bytes(K);                                                    \
  __m256 acc[MR], acc_e[MR];                                                                         \
  for (int r = 0; r < MR; ++r) { acc[r] = _mm256_setzero_ps(); acc_e[r] = _mm256_setzero_ps(); }     \
  const __m256i low4 = _mm256_set1_epi8(0x0F);                                                       \
  for (int64_t b = 0; b < nb; ++b) {                                                                 \
    const uint8_t* blk = g + b * gb;                                                                 \
    for (int64_t o = 0; o < gb; o += 64) /* the block 4-8 KB ahead, one line at a time */    \
      prefetch_ahead(blk + o);                                                                       \
    __m256i wv[8];                                                                                   \
    if (!Q8) {                                                                                       \
      for (int c = 0; c < 4; ++c) {                                                                  \
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32));       \
        wv[c] = _mm256_and_si256(q, low4);                                                           \
        wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);                                 \
      }                                                                                              \
      if (has_plane4(K)) {                                                                           \
        const __m256i h4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + NR * 16));     \
        for (int c = 0; c < 8; ++c) wv[c] = _mm256_or_si256(wv[c], DFLASH_PLANE_BIT(h4, c, 4));     \
      }                                                                                              \
      if (K == Kind::Q6K) {                                                                          \
        const __m256i h5 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + NR * 16 + 32)); \
        for (int c = 0; c < 8; ++c) wv[c] = _mm256_or_si256(wv[c], DFLASH_PLANE_BIT(h5, c, 5));     \
      }                                                                                              \
    } else {                                                                                         \
      for (int c = 0; c < 8; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32)); \
    }                                                                                                \
    __m256i wu[8];  /* Q8_0 as unsigned: |w| (AVX2, sign trick) or w + 128 (VNNI) */                 \
    if (Q8) {                                                                                        \
      for (int c = 0; c < 8; ++c)                                                                    \
        wu[c] = D == Dot::AVX2 ? _mm256_sign_epi8(wv[c], wv[c])                                      \
                               : _mm256_xor_si256(wv[c], _mm256_set1_epi8(static_cast<char>(0x80))); \
    }                                                                                                \
    __m256 dw, dw2, ew;                                                                              \
    block_scales<K>(blk + scales_at(K), dw, dw2, ew);                                                \
    for (int r = 0; r < MR; ++r) {                                                                   \
      const int64_t m = m0 + r, mb = m * nb + b;                                                     \
      const int8_t* xq = a.q + m * k + b * QK;                                                       \
      /* AVX-512 VNNI (32 registers): the block's 8 dots in two chains (even / odd chunks), the   \
         exact int32 sums added after, so the bits are the one chain's; measured 0.91-0.95x the   \
         time of 2-4-row calls (Zen 4, 2026-12-07); with 16 registers 4 rows' chains would spill */ \
      constexpr bool two = D == Dot::AVX512VNNI && K != Kind::Q6K;                                   \
      __m256i dot = _mm256_setzero_si256(), dot2 = _mm256_setzero_si256();                           \
      for (int c = 0; c < 8; ++c) {                                                                  \
        int32_t chunk;                                                                               \
        std::memcpy(&chunk, xq + 4 * c, 4);                                                          \
        const __m256i xb = _mm256_set1_epi32(chunk);                                                 \
        __m256i& into = K == Kind::Q6K ? (c >= 4 ? dot2 : dot) : (two && (c & 1) ? dot2 : dot);      \
        if (!Q8) into = dot_add<D>(into, wv[c], xb);                                                 \
        else if (D == Dot::AVX2) into = dot_add<D>(into, wu[c], _mm256_sign_epi8(xb, wv[c]));        \
        else into = dot_add<D>(into, wu[c], xb);                                                     \
      }                                                                                              \
      if (two) dot = _mm256_add_epi32(dot, dot2);                                                    \
      if (Q8 && D != Dot::AVX2) /* exact: sum (w + 128) x - 128 sum x */                             \
        dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(128 * a.s[mb]));                               \
      scale_into<K>(dot, dot2, dw, dw2, ew, a, mb, acc[r], acc_e[r]);                                \
    }                                                                                                \
  }                                                                                                  \
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + (m0 + r) * NR, _mm256_add_ps(acc[r], acc_e[r]));

template <Kind K, int MR>
DFLASH_TARGET_AVX2 void rows_avx2(const uint8_t* g, int64_t k, const Acts& a, int64_t m0, float* out) {
  DFLASH_GROUP_BODY(Dot::AVX2)
}
// AVX2: chunk by chunk, each chunk's codes unpacked into one register that serves the MR rows
// at once, vpmaddubsw's int16 pair sums added in int16 over a run of AVX2_RUN chunks (Q8_0: 1),
// then one vpmaddwd per run (the group body keeps all 8 chunks' codes in registers: with AVX2's
// 16, 4 rows' accumulators do not fit beside them). Each row's integer dot is exact and its
// float operations are the group body's, so the bits are the other paths'. Measured on the
// Zen 1 VM (2026-12-02, 3072x576 Q4_1, one thread, cache-hot, alternating in one process): 1 /
// 2 / 4 / 8 / 16 rows 22.3 / 19.6 / 17.4 / 17.0 / 17.3 ns a block-row with the group body (a
// vpmaddwd every chunk) -> 18.7 / 14.1 / 12.8 / 12.3 / 13.1 (8 rows a pass: within 3% of 4); at 1 / 4
// / 8 rows on 1536x768, Q4_0 24.3 / 18.8 / 18.4 -> 20.6 / 14.1 / 13.2, Q5_0 31.1 / 21.3 / 20.3 -> 27.5 /
// 15.1 / 14.9, Q4_K 27.9 / 19.6 / 18.8 -> 23.1 / 14.6 / 14.6, Q5_K 37.0 / 22.9 / 21.5 -> 30.4 / 16.1 /
// 15.1.
template <Kind K, int MR>
DFLASH_TARGET_AVX2 void rows_avx2_chunks(const uint8_t* g, int64_t k, const Acts& a, int64_t m0, float* out) {
  const int64_t nb = k / QK, gb = block_bytes(K);
  constexpr int RUN = AVX2_RUN<K>;
  __m256 acc[MR], acc_e[MR];
  for (int r = 0; r < MR; ++r) { acc[r] = _mm256_setzero_ps(); acc_e[r] = _mm256_setzero_ps(); }
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* x0 = a.q + m0 * k;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * gb;
    for (int64_t o = 0; o < gb; o += 64) prefetch_ahead(blk + o);
    const int8_t* xb = x0 + b * QK;
    __m256i dot[MR], dot2[MR] = {};  // dot2: Q6_K's second half block only
    for (int c0 = 0; c0 < 8; c0 += RUN) {
      __m256i p16[MR];
      for (int c = c0; c < c0 + RUN; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (K == Kind::Q8 ? c : c % 4) * 32));
        // Q8_0 (signed codes): |w| times x with w's sign, the sign trick of the group body
        __m256i w = K == Kind::Q8 ? _mm256_sign_epi8(q, q) : _mm256_and_si256(c < 4 ? q : _mm256_srli_epi16(q, 4), low4);
        if (has_plane4(K))
          w = _mm256_or_si256(w, DFLASH_PLANE_BIT(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + NR * 16)), c, 4));
        if (K == Kind::Q6K)
          w = _mm256_or_si256(w, DFLASH_PLANE_BIT(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + NR * 16 + 32)), c, 5));
        for (int r = 0; r < MR; ++r) {
          int32_t chunk;
          std::memcpy(&chunk, xb + r * k + 4 * c, 4);
          const __m256i xv = _mm256_set1_epi32(chunk);
          const __m256i p = _mm256_maddubs_epi16(w, K == Kind::Q8 ? _mm256_sign_epi8(xv, q) : xv);
          p16[r] = c == c0 ? p : _mm256_add_epi16(p16[r], p);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i s = _mm256_madd_epi16(p16[r], ones);
        if (K == Kind::Q6K && c0 >= 4) dot2[r] = c0 == 4 ? s : _mm256_add_epi32(dot2[r], s);
        else dot[r] = c0 == 0 ? s : _mm256_add_epi32(dot[r], s);
      }
    }
    __m256 dw, dw2, ew;
    block_scales<K>(blk + scales_at(K), dw, dw2, ew);
    for (int r = 0; r < MR; ++r) scale_into<K>(dot[r], dot2[r], dw, dw2, ew, a, (m0 + r) * nb + b, acc[r], acc_e[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + (m0 + r) * NR, _mm256_add_ps(acc[r], acc_e[r]));
}

template <Kind K, int MR>
DFLASH_TARGET_AVXVNNI void rows_avxvnni(const uint8_t* g, int64_t k, const Acts& a, int64_t m0, float* out) {
  DFLASH_GROUP_BODY(Dot::AVXVNNI)
}
template <Kind K, int MR>
DFLASH_TARGET_AVX512 void rows_avx512(const uint8_t* g, int64_t k, const Acts& a, int64_t m0, float* out) {
  DFLASH_GROUP_BODY(Dot::AVX512VNNI)
}

// ---- AVX-512 path for several rows: two groups (16 outputs) per 512-bit register ----------
// The same layout as the 256-bit paths (no second copy of the weights): per block, the codes of
// groups g and g + 1 are loaded as 256-bit halves of one register and unpacked once, and every
// row's 8 int8 dots (vpdpbusd) then serve 16 outputs instead of 8. Each (row, output) lane does
// exactly the 256-bit paths' operations (the exact int32 dot, the same fp32 scale products, the
// same fused multiply-adds in block order), so the results are bit-identical to theirs.
#define DFLASH_LOAD2(p0, p1) \
  _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))), \
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1)
#define DFLASH_PLANE_BIT512(plane, c, to) \
  _mm512_and_si512((c) <= (to) ? _mm512_slli_epi16(plane, (to) - (c)) : _mm512_srli_epi16(plane, (c) - (to)), \
                   _mm512_set1_epi8(1 << (to)))

// 16 fp32 lanes: 8 from each group's scale field (fp16, u8 or i8)
DFLASH_TARGET_AVX512 inline __m512 f16x2(const uint8_t* p0, const uint8_t* p1) {
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
}
DFLASH_TARGET_AVX512 inline __m512 u8x2(const uint8_t* p0, const uint8_t* p1) {
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
DFLASH_TARGET_AVX512 inline __m512 i8x2(const uint8_t* p0, const uint8_t* p1) {
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// MR rows of x (from m0) against groups g0 and g1 = g0 + gbytes; out0 / out1 receive each
// group's (MR, 8) results at rows m0..
template <Kind K, int MR>
DFLASH_TARGET_AVX512 void rows_pair512(const uint8_t* g0, int64_t gbytes, int64_t k, const Acts& a, int64_t m0,
                                       float* out0, float* out1) {
  constexpr bool Q8 = K == Kind::Q8;
  const int64_t nb = k / QK, gb = block_bytes(K);
  const uint8_t* g1 = g0 + gbytes;
  __m512 acc[MR], acc_e[MR];
  for (int r = 0; r < MR; ++r) { acc[r] = _mm512_setzero_ps(); acc_e[r] = _mm512_setzero_ps(); }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = g0 + b * gb;
    const uint8_t* b1 = g1 + b * gb;
    for (int64_t o = 0; o < gb; o += 64) {
      prefetch_ahead_l2(b0 + o);
      prefetch_ahead_l2(b1 + o);
    }
    __m512i wv[8];
    if (!Q8) {
      for (int c = 0; c < 4; ++c) {
        const __m512i q = DFLASH_LOAD2(b0 + c * 32, b1 + c * 32);
        wv[c] = _mm512_and_si512(q, low4);
        wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      }
      if (has_plane4(K)) {
        const __m512i h4 = DFLASH_LOAD2(b0 + NR * 16, b1 + NR * 16);
        for (int c = 0; c < 8; ++c) wv[c] = _mm512_or_si512(wv[c], DFLASH_PLANE_BIT512(h4, c, 4));
      }
      if (K == Kind::Q6K) {
        const __m512i h5 = DFLASH_LOAD2(b0 + NR * 16 + 32, b1 + NR * 16 + 32);
        for (int c = 0; c < 8; ++c) wv[c] = _mm512_or_si512(wv[c], DFLASH_PLANE_BIT512(h5, c, 5));
      }
    } else {  // Q8_0 as unsigned: w + 128
      for (int c = 0; c < 8; ++c)
        wv[c] = _mm512_xor_si512(DFLASH_LOAD2(b0 + c * 32, b1 + c * 32), _mm512_set1_epi8(static_cast<char>(0x80)));
    }
    const uint8_t* s0 = b0 + scales_at(K);
    const uint8_t* s1 = b1 + scales_at(K);
    const __m512 dh = f16x2(s0, s1);
    __m512 dw = dh, dw2 = dh, ew = _mm512_setzero_ps();
    if (K == Kind::Q4 || K == Kind::Q5) ew = f16x2(s0 + 16, s1 + 16);
    if (K == Kind::Q4K || K == Kind::Q5K) {
      dw = _mm512_mul_ps(dh, u8x2(s0 + 32, s1 + 32));
      ew = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(f16x2(s0 + 16, s1 + 16), u8x2(s0 + 40, s1 + 40)));
    }
    if (K == Kind::Q6K) {
      dw = _mm512_mul_ps(dh, i8x2(s0 + 16, s1 + 16));
      dw2 = _mm512_mul_ps(dh, i8x2(s0 + 24, s1 + 24));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r, mb = m * nb + b;
      const int8_t* xq = a.q + m * k + b * QK;
      // two chains of 4 (exact int32 sums, so the split changes no bit): half the latency
      __m512i dot = _mm512_setzero_si512(), dot2 = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        int32_t chunk;
        std::memcpy(&chunk, xq + 4 * c, 4);
        __m512i& into = c >= 4 ? dot2 : dot;
        into = _mm512_dpbusd_epi32(into, wv[c], _mm512_set1_epi32(chunk));
      }
      if (K != Kind::Q6K) dot = _mm512_add_epi32(dot, dot2);
      if (Q8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.s[mb]));
      const __m512 dx = _mm512_set1_ps(a.d[mb]);
      if (K == Kind::Q6K) {
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(32 * a.s_lo[mb]));
        dot2 = _mm512_sub_epi32(dot2, _mm512_set1_epi32(32 * (a.s[mb] - a.s_lo[mb])));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), _mm512_mul_ps(dw2, dx), acc[r]);
        continue;
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc[r]);
      if (has_offset(K)) acc_e[r] = _mm512_fmadd_ps(ew, _mm512_set1_ps(a.ds[mb]), acc_e[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 y = _mm512_add_ps(acc[r], acc_e[r]);
    _mm256_storeu_ps(out0 + (m0 + r) * NR, _mm512_castps512_ps256(y));
    _mm256_storeu_ps(out1 + (m0 + r) * NR, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
  }
}
#undef DFLASH_LOAD2
#undef DFLASH_PLANE_BIT512

// Measured (2026-11-27, AMD Zen 4 VM, one thread, CPU time, alternating in one process, 60
// matrices of the default model's MLP shapes, ~33 MB): Q4_1 8 / 16 / 64 rows 0.83x / 0.76x /
// 0.74x the 256-bit path's time, 6 / 7 rows 0.94x / 0.89x, but 4 rows 1.07-1.13x (the inserts
// and the second stream cost more than the wider dots save); Q8_0 4 rows 1.46x, 8 rows 0.98x,
// 16 / 64 rows 0.80x / 0.71x. Hence from 8 rows, until 2026-12-02: with the last 5-7 rows in
// one pass (they took a pass of 4 and one of 1-3, on either path) and the L2 prefetch above, the
// default model's matrices at 5 / 6 / 7 rows took 0.69-0.97x / 0.75-0.88x / 0.77-0.90x the time
// of the 256-bit path (Zen 4 VM, 2 threads, alternating in one process; the LM head the most), a
// whole forward of 5 / 6 / 7 rows 0.875x / 0.83-0.93x / 0.85x. From 2 to 4 rows the pair path
// was slower in a whole forward (1.08-1.18x), so those stay on the 256-bit path.
constexpr int64_t PAIR_MIN_ROWS = 5;

// all rows of x against groups g and g + 1 on the AVX-512 pair path: 8 rows a pass, then the
// last 1-7 in one pass (each row's operations are the same whatever the pass, so the bits are
// too)
template <Kind K>
void pair512(const uint8_t* g, int64_t gbytes, int64_t k, const Acts& a, int64_t m_rows, float* out0, float* out1) {
  int64_t m = 0;
  for (; m + 8 <= m_rows; m += 8) rows_pair512<K, 8>(g, gbytes, k, a, m, out0, out1);
  switch (m_rows - m) {
    case 7: return rows_pair512<K, 7>(g, gbytes, k, a, m, out0, out1);
    case 6: return rows_pair512<K, 6>(g, gbytes, k, a, m, out0, out1);
    case 5: return rows_pair512<K, 5>(g, gbytes, k, a, m, out0, out1);
    case 4: return rows_pair512<K, 4>(g, gbytes, k, a, m, out0, out1);
    case 3: return rows_pair512<K, 3>(g, gbytes, k, a, m, out0, out1);
    case 2: return rows_pair512<K, 2>(g, gbytes, k, a, m, out0, out1);
    case 1: return rows_pair512<K, 1>(g, gbytes, k, a, m, out0, out1);
    default: return;
  }
}

void run_pair512(Kind kind, const uint8_t* g, int64_t gbytes, int64_t k, const Acts& a, int64_t m_rows, float* out0,
                 float* out1) {
  switch (kind) {
    case Kind::Q4: return pair512<Kind::Q4>(g, gbytes, k, a, m_rows, out0, out1);
    case Kind::Q5: return pair512<Kind::Q5>(g, gbytes, k, a, m_rows, out0, out1);
    case Kind::Q8: return pair512<Kind::Q8>(g, gbytes, k, a, m_rows, out0, out1);
    case Kind::Q4K: return pair512<Kind::Q4K>(g, gbytes, k, a, m_rows, out0, out1);
    case Kind::Q5K: return pair512<Kind::Q5K>(g, gbytes, k, a, m_rows, out0, out1);
    case Kind::Q6K: return pair512<Kind::Q6K>(g, gbytes, k, a, m_rows, out0, out1);
  }
}

enum class Isa { Portable, AVX2, AVXVNNI, AVX512VNNI, AMX };

// Linux hands out the AMX tile state only to a process that asks for it (once, for all threads)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

bool supported(Isa isa) {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  const bool avx512 = base && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw");
  switch (isa) {
    case Isa::AMX:
      return avx512 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
    case Isa::AVX512VNNI:
      return avx512;
    case Isa::AVXVNNI: return base && __builtin_cpu_supports("avxvnni");
    case Isa::AVX2: return base;
    default: return true;
  }
}

// the best path this CPU runs, or at most DFLASH_KERNELS_ISA's (a name of kernels.ISAS: for
// benchmarks and for machines where a path misbehaves)
Isa detect() {
  const int cap = dflash::simd::isa_cap();
  for (Isa isa : {Isa::AMX, Isa::AVX512VNNI, Isa::AVXVNNI, Isa::AVX2})
    if (static_cast<int>(isa) <= cap && supported(isa)) return isa;
  return Isa::Portable;
}

Isa active_isa = detect();

// MR rows of x against one group on a SIMD path (MR accumulators of 8 outputs each)
template <Kind K, int MR>
void rows_on(Isa isa, const uint8_t* g, int64_t k, const Acts& a, int64_t m0, float* out) {
  if (isa == Isa::AVX512VNNI || isa == Isa::AMX) return rows_avx512<K, MR>(g, k, a, m0, out);
  if (isa == Isa::AVXVNNI) return rows_avxvnni<K, MR>(g, k, a, m0, out);
  // Q6_K alone: its two bit planes re-unpacked per chunk cost more than the int16 sums save (1536x768,
  // one thread, cache-hot: 41 ns a block-row on the group body, 45 chunk by chunk; 4 / 8 rows 23.7 / 22.7
  // -> 20.0 / 19.3)
  if constexpr (K == Kind::Q6K && MR == 1) rows_avx2<K, MR>(g, k, a, m0, out);
  else rows_avx2_chunks<K, MR>(g, k, a, m0, out);
}

// all rows of x against one group: 4 rows a pass over the group's weights, then the last 1-3 in
// one pass (before 2026-11-27 the last rows went one a pass, and AVX2 / AVX-VNNI took 2 a pass:
// each pass reads and unpacks every weight block again). Measured on the default model's
// matrices, alternating in one process: AVX-512, 2 / 3 rows 0.77x / 0.74x the time; AVX-VNNI,
// 3 / 4 / 5 / 8 rows 0.87x / 0.87x / 0.93x / 0.87x; AVX2, 4 / 5 / 8 rows 0.90x / 0.93x / 0.90x
// (its 16 registers spill some accumulators at 3-4 rows, which costs less than a pass). Each
// row's operations are the same whatever MR, so the bits are too.
template <Kind K>
void group(Isa isa, const uint8_t* g, int64_t k, const Acts& a, int64_t m_rows, float* out) {
  if (isa == Isa::Portable) return group_portable<K>(g, k, a, m_rows, out);
  int64_t m = 0;
  for (; m + 4 <= m_rows; m += 4) rows_on<K, 4>(isa, g, k, a, m, out);
  switch (m_rows - m) {
    case 3: return rows_on<K, 3>(isa, g, k, a, m, out);
    case 2: return rows_on<K, 2>(isa, g, k, a, m, out);
    case 1: return rows_on<K, 1>(isa, g, k, a, m, out);
    default: return;
  }
}

void run_group(Kind kind, Isa isa, const uint8_t* g, int64_t k, const Acts& a, int64_t m_rows, float* out) {
  switch (kind) {
    case Kind::Q4: return group<Kind::Q4>(isa, g, k, a, m_rows, out);
    case Kind::Q5: return group<Kind::Q5>(isa, g, k, a, m_rows, out);
    case Kind::Q8: return group<Kind::Q8>(isa, g, k, a, m_rows, out);
    case Kind::Q4K: return group<Kind::Q4K>(isa, g, k, a, m_rows, out);
    case Kind::Q5K: return group<Kind::Q5K>(isa, g, k, a, m_rows, out);
    case Kind::Q6K: return group<Kind::Q6K>(isa, g, k, a, m_rows, out);
  }
}

// ---- AMX path: rows in chunks of 8 against two groups (16 outputs) per tile product ----------
// Per block of 32 values, one tile product computes the exact int32 dots of 8 rows of x (tile
// A: the rows' int8 codes, read in place) with 16 outputs (tile B: the two groups' codes, whose
// 4-value chunks are already the layout AMX wants: chunk c of a group is row c of B); then
// every (row, output) is scaled exactly as the vector paths scale it (acc += dot * (dw dx),
// acc_e += e * (dx sx), block after block), so the results are bit-identical to theirs. Only
// the integer dots move to the tile unit. The pipeline (amx_rows): block b's product is issued
// while the pair's block b + 2 is unpacked (a tile load of bytes just written by vector stores
// waits ~70 cycles: no forwarding), block b - 2's C tile is stored (storing the tile of the
// product just issued stalls on it) and block b - 3's stored dots are scaled (vector loads of a
// tile stored an iteration ago find it in L1); the weights of the pair 4 ahead are prefetched
// meanwhile. Unpacking inside the pipeline instead of in a pass before it, with three C tiles
// instead of two (store one block behind) and the 16 accumulators in registers (they were
// spilled): an 8-row forward of the default model 0.87-0.89x the time, alternating in one
// process (16 rows 0.94-0.95x). A whole 3072x576 Q4_1 matmul was 1.05-1.2x faster than AVX-512
// VNNI at 8 rows, 1.3-1.4x at 16 (2 threads) before that;
// below AMX_MIN_ROWS rows the vector path is as fast.
#define DFLASH_TARGET_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

// measured (a whole forward of the default model, alternating in one process, after the pipeline
// above): 6 rows 0.86-0.96x the time with AMX, 5 rows even, 4 rows 1.28x; 8 rows 0.82x (VNNI 1.21x)
constexpr int AMX_MIN_ROWS = 6;
constexpr int AMX_ROWS = 8;  // rows per tile product (x holds AMX_ROWS spare rows: tile A may read them)
// a last chunk of at most this many rows goes to the vector path: measured 2026-12-07 (Xeon VM,
// 2 threads, 1536x576 Q4_1 and 576x1536 Q8_0, bf16 rows, each count's time over 8 rows', two
// processes per variant): 9 rows 1.49-1.55x -> 1.20-1.22x (Q4_1), 1.26-1.37x -> 1.20-1.23x (Q8_0);
// 10 rows 1.42-1.66x -> 1.33-1.34x / even; 11 rows 1.56-1.63x -> 1.44-1.49x / even; 12-13 rows
// slower on the vector path (12: 1.51-1.64x -> 1.58-1.64x, Q8_0 1.33-1.44x -> 1.46-1.53x), so they
// keep the tile pass. A 64-row tile's remainder of 1-3 rows too (a call of 65-67 rows: a prefill
// chunk's last tile), measured the same way on 576x1536 Q8_0, time over 64 rows': 65 rows
// 1.13-1.23x -> 0.90-1.07x, 129 rows 1.73-2.44x -> 1.60-1.95x
constexpr int AMX_TAIL_VECTOR_ROWS = 3;
bool amx_takes(Kind k, int64_t m_rows) {
  return m_rows >= AMX_MIN_ROWS &&
         (k == Kind::Q4 || k == Kind::Q5 || k == Kind::Q4K || k == Kind::Q5K || k == Kind::Q8);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-2: C (8 x ng*8 int32), 3-4: A (8 x 32 bytes), 5-6: B (8 x ng*32 bytes)
DFLASH_TARGET_AMX void amx_configure(int ng) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = AMX_ROWS;
    cfg.colsb[t] = static_cast<uint16_t>(t == 3 || t == 4 ? 32 : ng * 32);
  }
  // not _tile_loadconfig: GCC 12 drops the stores into cfg before its builtin (it does not see
  // the builtin read them), which leaves the tiles unconfigured
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

DFLASH_TARGET_AMX void amx_release() { _tile_release(); }

// 8 floats into lanes 8 H .. 8 H + 7 of 16 (AVX-512F only: insertf32x8 would need DQ)
template <int H>
DFLASH_TARGET_AMX inline __m512 insert8(__m512 v, __m256 h) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(v), _mm256_castps_pd(h), H));
}

// block b of NG groups (gbytes apart) -> tile B's bytes (8 rows of NG * 32) and the block's 16
// lanes of scales, computed as the vector paths compute them
template <Kind K, int NG>
DFLASH_TARGET_AMX __attribute__((always_inline)) inline void amx_unpack_block(const uint8_t* g, int64_t gbytes,
                                                                               int64_t b, uint8_t* bt, float* dws,
                                                                               float* ews) {
  constexpr int RB = NG * 32;  // bytes per row of B
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 dw = _mm512_setzero_ps(), ew = _mm512_setzero_ps();
  uint8_t* tb = bt + b * 8 * RB;
  for (int j = 0; j < NG; ++j) {
    const uint8_t* blk = g + j * gbytes + b * block_bytes(K);
    if (K == Kind::Q8) {
      for (int c = 0; c < 8; ++c)
        _mm256_store_si256(reinterpret_cast<__m256i*>(tb + c * RB + j * 32),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32)));
    } else {  // the vector paths' codes: nibbles, with the bit-4 plane OR-ed in (Q5_x)
      __m256i wv[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32));
        wv[c] = _mm256_and_si256(q, low4);
        wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      }
      if (has_plane4(K)) {
        const __m256i h4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + NR * 16));
        for (int c = 0; c < 8; ++c) wv[c] = _mm256_or_si256(wv[c], DFLASH_PLANE_BIT(h4, c, 4));
      }
      for (int c = 0; c < 8; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(tb + c * RB + j * 32), wv[c]);
    }
    __m256 dwj, dw2j, ewj;
    block_scales<K>(blk + scales_at(K), dwj, dw2j, ewj);
    dw = j == 0 ? insert8<0>(dw, dwj) : insert8<1>(dw, dwj);
    ew = j == 0 ? insert8<0>(ew, ewj) : insert8<1>(ew, ewj);
  }
  _mm512_store_ps(dws + b * 16, dw);
  _mm512_store_ps(ews + b * 16, ew);
}

// block b's dots (ct: a stored C tile, 8 rows of 16 int32) into all 8 rows' accumulators, as
// the vector paths scale them. Rows past the call's own (a chunk of fewer than 8) are scaled by
// the spare rows' zero scales and never stored.
template <Kind K>
DFLASH_TARGET_AMX __attribute__((always_inline)) inline void amx_scale(const int32_t* ct, const float* dws,
                                                                        const float* ews, const Acts& a, int64_t nb,
                                                                        int64_t b, __m512 (&acc)[AMX_ROWS],
                                                                        __m512 (&acc_e)[AMX_ROWS]) {
  const __m512 dw = _mm512_load_ps(dws + b * 16), ew = _mm512_load_ps(ews + b * 16);
#pragma GCC unroll 8
  for (int r = 0; r < AMX_ROWS; ++r) {
    const int64_t mb = r * nb + b;
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_epi32(ct + r * 16));
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[mb])), acc[r]);
    if (has_offset(K)) acc_e[r] = _mm512_fmadd_ps(ew, _mm512_set1_ps(a.ds[mb]), acc_e[r]);
  }
}

// 8 rows of x against NG groups, their blocks unpacked in bt / dws / ews; out[j] receives
// group j's (rows, 8) results (rows <= 8: the first `rows` of the chunk). Tiles: C 0-2, A 3-4,
// B 5-6 (amx_configure). Block b's product goes to C tile b % 3 and is stored two blocks later
// (a tile product's latency is longer than a block's scaling: storing the C tile of the block
// just issued stalled), into ct[b % 2], and scaled one block after that (so the vector loads
// find the stored dots in L1); blocks are scaled in order, so the result is the vector paths'.
// With src (the pair's first group; the first chunk of rows), block b + 2 is unpacked into bt /
// dws / ews while block b's product runs; without, bt holds them all already.
template <Kind K, int NG>
DFLASH_TARGET_AMX void amx_rows(uint8_t* bt, float* dws, float* ews, int64_t k, const Acts& a,
                                int rows, float* const* out, const uint8_t* pf, int64_t pf_step,
                                const uint8_t* src, int64_t gbytes) {
  constexpr bool Q8 = K == Kind::Q8;
  constexpr int64_t AHEAD = 2;  // src: block b + AHEAD is unpacked while block b's product runs
  const int64_t nb = k / QK;
  if (src)
    for (int64_t b = 0; b < std::min(AHEAD, nb); ++b) amx_unpack_block<K, NG>(src, gbytes, b, bt, dws, ews);
  alignas(64) int32_t ct[2][AMX_ROWS * 16];  // NG = 1: lanes 8-15 of each row are the tile's zeros
  __m512 acc[AMX_ROWS], acc_e[AMX_ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = acc_e[r] = _mm512_setzero_ps();
  if (NG == 1) std::memset(ct, 0, sizeof(ct));
#define DFLASH_AMX_ISSUE(C, A, B, b)                          \
  _tile_zero(C);                                              \
  _tile_loadd(B, bt + (b) * 8 * NG * 32, NG * 32);            \
  _tile_loadd(A, a.q + (b) * QK, k);                          \
  if (Q8) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);
  for (int64_t b = 0; b < nb + 2; ++b) {
    if (b < nb) {
      if (pf && b >= 1)  // the next groups' weights, a slice a block, so that memory streams while the tiles compute
        for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + (b - 1) * pf_step + o), _MM_HINT_T1);
      if (src && b + AHEAD < nb) amx_unpack_block<K, NG>(src, gbytes, b + AHEAD, bt, dws, ews);
      switch (b % 6) {  // C tile b % 3, A / B tiles b % 2
        case 0: DFLASH_AMX_ISSUE(0, 3, 5, b) break;
        case 1: DFLASH_AMX_ISSUE(1, 4, 6, b) break;
        case 2: DFLASH_AMX_ISSUE(2, 3, 5, b) break;
        case 3: DFLASH_AMX_ISSUE(0, 4, 6, b) break;
        case 4: DFLASH_AMX_ISSUE(1, 3, 5, b) break;
        default: DFLASH_AMX_ISSUE(2, 4, 6, b) break;
      }
    }
    const int64_t st = b - 2;  // the block whose C tile is stored now
    if (st >= 0) {
      int32_t* dst = ct[st % 2];
      switch (st % 3) {
        case 0: _tile_stored(0, dst, 64); break;
        case 1: _tile_stored(1, dst, 64); break;
        default: _tile_stored(2, dst, 64); break;
      }
    }
    if (st >= 1) amx_scale<K>(ct[(st - 1) % 2], dws, ews, a, nb, st - 1, acc, acc_e);
  }
#undef DFLASH_AMX_ISSUE
  amx_scale<K>(ct[(nb - 1) % 2], dws, ews, a, nb, nb - 1, acc, acc_e);
  alignas(64) float y[AMX_ROWS * 16];
#pragma GCC unroll 8
  for (int r = 0; r < AMX_ROWS; ++r)  // constant indices only: the accumulators stay in registers
    _mm512_store_ps(y + r * 16, _mm512_add_ps(acc[r], acc_e[r]));
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < NG; ++j) std::memcpy(out[j] + r * NR, y + r * 16 + j * 8, NR * sizeof(float));
}

// mt (<= 64) rows of x against NG groups starting at g (gbytes apart): unpack once, then rows
// in chunks of 8; out[j] receives group j's (mt, 8) results
template <Kind K, int NG>
void amx_groups(const uint8_t* g, int64_t gbytes, int64_t k, const Acts& a, int64_t mt, float* const* out,
                const uint8_t* next) {
  const int64_t nb = k / QK;
  thread_local std::vector<int8_t> raw;
  raw.resize(nb * (8 * NG * 32 + 2 * 64) + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
  float* dws = reinterpret_cast<float*>(base);
  float* ews = dws + nb * 16;
  uint8_t* bt = reinterpret_cast<uint8_t*>(ews + nb * 16);
  for (int64_t m0 = 0; m0 < mt; m0 += AMX_ROWS) {
    if (mt - m0 <= AMX_TAIL_VECTOR_ROWS) {
      // a short last chunk on the vector path, whose cost grows with its rows, not a tile pass,
      // which scales 8 rows whatever it holds (the pair's weights are still in cache; or, for a
      // 64-row tile's remainder of 1-3 rows, read once as a vector pass reads them). Same bits
      // (every path rounds alike).
      const Acts rest{a.q + m0 * k, a.d + m0 * nb, a.ds + m0 * nb, a.s ? a.s + m0 * nb : nullptr,
                      a.s_lo ? a.s_lo + m0 * nb : nullptr};
      for (int j = 0; j < NG; ++j) group<K>(Isa::AVX512VNNI, g + j * gbytes, k, rest, mt - m0, out[j] + m0 * NR);
      break;
    }
    const Acts part{a.q + m0 * k, a.d + m0 * (k / QK), a.ds + m0 * (k / QK), nullptr, nullptr};
    float* o[2] = {out[0] + m0 * NR, out[1] + m0 * NR};
    // the first chunk unpacks the pair's blocks as it goes and prefetches the next pair's
    // weights (2 gbytes from `next`, over nb - 1 blocks); later chunks reuse the unpacked blocks
    amx_rows<K, NG>(bt, dws, ews, k, part, static_cast<int>(std::min<int64_t>(AMX_ROWS, mt - m0)), o,
                    m0 == 0 ? next : nullptr, (2 * gbytes + nb - 2) / std::max<int64_t>(1, nb - 1),
                    m0 == 0 ? g : nullptr, gbytes);
  }
}

template <int NG>
void amx_run(Kind kind, const uint8_t* g, int64_t gbytes, int64_t k, const Acts& a, int64_t mt, float* const* out,
             const uint8_t* next) {
  switch (kind) {
    case Kind::Q4: return amx_groups<Kind::Q4, NG>(g, gbytes, k, a, mt, out, next);
    case Kind::Q4K: return amx_groups<Kind::Q4K, NG>(g, gbytes, k, a, mt, out, next);
    case Kind::Q5: return amx_groups<Kind::Q5, NG>(g, gbytes, k, a, mt, out, next);
    case Kind::Q5K: return amx_groups<Kind::Q5K, NG>(g, gbytes, k, a, mt, out, next);
    case Kind::Q8: return amx_groups<Kind::Q8, NG>(g, gbytes, k, a, mt, out, next);
    default: TORCH_CHECK(false, "dflash::qmm: no AMX path for this block type");
  }
}

void check_args(const at::Tensor& w, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(known_type(qtype), "dflash::qmm: unsupported block type ", qtype);
  TORCH_CHECK(k > 0 && k % QK == 0, "dflash::qmm: K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(n > 0, "dflash::qmm: N must be positive");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "dflash::qmm: weights must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == groups(n) && w.size(1) == (k / QK) * group_block_bytes(qtype),
              "dflash::qmm: weights of shape ", w.sizes(), " do not hold ", n, " rows of ", k, " values");
}

// y (M, N) = x (M, K) @ dequant(w)^T; x fp32 / bf16 / fp16, y in x's dtype. ``pro``: x's rows
// normalized or taken as SwiGLU's [g | u] (then x is (M, 2K)) before they are quantized (see
// Prologue). With a residual (x's dtype, M x N values): y = residual + that product, the
// product rounded to y's dtype first and the sum rounded once, as ``residual + qmm(x, ...)``
// computes it. So a decoder layer's norms, activation and residual adds cost no op of their
// own (no allocation, no aten add, no separate pass over the rows).
at::Tensor qmm(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k,
               int64_t isa_override, const at::Tensor* residual_in = nullptr, const Prologue& pro = {}) {
  check_args(w, qtype, n, k);
  const int64_t xk = pro.silu ? 2 * k : k;
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1 && x_in.size(-1) == xk,
              "dflash::qmm: x must be (..., ", xk, ") on the CPU");
  if (residual_in != nullptr && (n % NR != 0 || residual_in->scalar_type() != x_in.scalar_type() ||
                                 !residual_in->device().is_cpu() || residual_in->numel() != x_in.numel() / xk * n))
    return *residual_in + qmm(x_in, w, qtype, n, k, isa_override, nullptr, pro);  // (odd N: an fp32 tile first)
  // another path may be asked for (tests compare them); never one the CPU lacks
  TORCH_CHECK(isa_override < 5, "dflash::qmm: unknown isa ", isa_override);
  const Isa isa = isa_override < 0 ? active_isa : static_cast<Isa>(isa_override);
  TORCH_CHECK(supported(isa), "dflash::qmm: this CPU cannot run isa ", isa_override);
  auto x = x_in.reshape({-1, xk}).contiguous();
  const int64_t m_rows = x.size(0), nb = k / QK, ng = groups(n);
  // the quantized activations live in per-thread scratch (no allocation per call)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds;
  thread_local std::vector<int32_t> s, s_lo;
  q.resize((m_rows + AMX_ROWS) * k);  // spare rows: an AMX tile of 8 rows may read past the last
  s_lo.resize(m_rows * nb);
  d.assign((m_rows + AMX_ROWS) * nb, 0.f);  // spare rows: the AMX path scales 8 rows at a time
  ds.assign((m_rows + AMX_ROWS) * nb, 0.f);
  s.resize(m_rows * nb);
  const bool vec = isa != Isa::Portable;  // every SIMD path has AVX2
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "dflash::qmm: x must be float32, bfloat16 or float16");
  // (raw pointers: inside the parallel region below, ``q`` names each thread's own scratch)
  int8_t* const qp = q.data();
  float* const dp = d.data();
  float* const dsp = ds.data();
  int32_t* const sp = s.data();
  int32_t* const slp = s_lo.data();
  const Acts a{qp, dp, dsp, sp, slp};
  // each thread owns whole groups of 8 outputs, so a group's weights are read once per call
  // whatever M; a group writes its (M, 8) outputs straight into y when N is a multiple of 8
  const bool direct = n % NR == 0;
  auto y = at::empty({m_rows, direct ? n : ng * NR}, x.options().dtype(direct ? x.scalar_type() : at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ystride = y.size(1);
  at::Tensor residual;  // (direct only: y and the residual share the dtype and the (M, N) layout)
  if (residual_in != nullptr) residual = residual_in->contiguous();
  const void* res = residual.defined() ? residual.data_ptr() : nullptr;
  // a group's (rows, 8) tile into y, in y's dtype (plus the residual's values there)
  // (y's pointer and dtype taken once: data_ptr<T>() checks storage and dtype on every call,
  // ~1.5% of a one-row forward's samples when each group's store asked for it)
  void* const yp = y.data_ptr();
  const auto ytype = y.scalar_type();
  auto store = [yp, ytype, ystride, vec, res](const float* tile, int64_t m0, int64_t rows, int64_t col) {
    switch (ytype) {
      case at::kBFloat16: {
        auto* p = static_cast<c10::BFloat16*>(yp);
        const auto* rp = static_cast<const c10::BFloat16*>(res);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (m0 + r) * ystride + col;
          if (vec) {
            if (rp) store8_bf16_add(tile + r * NR, rp + at, p + at);
            else store8_bf16(tile + r * NR, p + at);
            continue;
          }
          for (int i = 0; i < NR; ++i)
            p[at + i] = rp ? c10::BFloat16(static_cast<float>(rp[at + i]) +
                                           static_cast<float>(c10::BFloat16(tile[r * NR + i])))
                           : c10::BFloat16(tile[r * NR + i]);
        }
        break;
      }
      case at::kHalf: {
        auto* p = static_cast<c10::Half*>(yp);
        const auto* rp = static_cast<const c10::Half*>(res);
        for (int64_t r = 0; r < rows; ++r)
          for (int i = 0; i < NR; ++i) {
            const int64_t at = (m0 + r) * ystride + col + i;
            p[at] = rp ? c10::Half(static_cast<float>(rp[at]) + static_cast<float>(c10::Half(tile[r * NR + i])))
                       : c10::Half(tile[r * NR + i]);
          }
        break;
      }
      default: {
        float* p = static_cast<float*>(yp);
        const auto* rp = static_cast<const float*>(res);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (m0 + r) * ystride + col;
          if (rp)
            for (int i = 0; i < NR; ++i) p[at + i] = rp[at + i] + tile[r * NR + i];
          else
            std::memcpy(p + at, tile + r * NR, NR * 4);
        }
      }
    }
  };
  const int64_t gbytes = nb * group_block_bytes(qtype);
  const Kind kind = kind_of(qtype);
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, nb * m_rows));
  const bool amx = isa == Isa::AMX && amx_takes(kind, m_rows);
  const bool pair = !amx && (isa == Isa::AVX512VNNI || isa == Isa::AMX) && m_rows >= PAIR_MIN_ROWS;
  auto body = [&](int64_t g0, int64_t g1) {
    float tile[64 * NR];
    if (amx) {  // groups in pairs (the last one alone), rows in tiles of 64
      float tile2[64 * NR];
      float* outs[2] = {tile, tile2};
      int configured = 0;
      for (int64_t m0 = 0; m0 < m_rows; m0 += 64) {
        const int64_t mt = std::min<int64_t>(64, m_rows - m0);
        const Acts rows{a.q + m0 * k, a.d + m0 * nb, a.ds + m0 * nb, a.s + m0 * nb, a.s_lo + m0 * nb};
        for (int64_t g = g0; g < g1; g += 2) {
          const int pair = g + 1 < g1 ? 2 : 1;
          if (configured != pair) amx_configure(pair);
          configured = pair;
          // prefetched while this pair computes: the pair 4 ahead (measured: 2-4 pairs hide the
          // memory latency behind the tiles; the next pair alone does not)
          const uint8_t* next = g + 9 < ng ? wp + (g + 8) * gbytes : nullptr;
          if (pair == 2) amx_run<2>(kind, wp + g * gbytes, gbytes, k, rows, mt, outs, next);
          else amx_run<1>(kind, wp + g * gbytes, gbytes, k, rows, mt, outs, next);
          for (int j = 0; j < pair; ++j) store(outs[j], m0, mt, (g + j) * NR);
        }
      }
      amx_release();
      return;
    }
    int64_t g = g0;
    if (pair)  // groups in pairs on 512-bit registers (the last one alone, below)
      for (float tile2[64 * NR]; g + 1 < g1; g += 2)
        for (int64_t m0 = 0; m0 < m_rows; m0 += 64) {
          const int64_t mt = std::min<int64_t>(64, m_rows - m0);
          const Acts rows{a.q + m0 * k, a.d + m0 * nb, a.ds + m0 * nb, a.s + m0 * nb, a.s_lo + m0 * nb};
          run_pair512(kind, wp + g * gbytes, gbytes, k, rows, mt, tile, tile2);
          store(tile, m0, mt, g * NR);
          store(tile2, m0, mt, (g + 1) * NR);
        }
    for (; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < m_rows; m0 += 64) {  // rows in tiles of 64: the tile stays on the stack
        const int64_t mt = std::min<int64_t>(64, m_rows - m0);
        const Acts rows{a.q + m0 * k, a.d + m0 * nb, a.ds + m0 * nb, a.s + m0 * nb, a.s_lo + m0 * nb};
        run_group(kind, isa, wp + g * gbytes, k, rows, mt, tile);
        store(tile, m0, mt, g * NR);
      }
    }
  };
  // One parallel region: the threads quantize the activations (each a contiguous share of
  // the (row, block) units, its rows' prologue included), meet at a barrier, then compute
  // their groups, so a verify block's norms, SwiGLU and quantization no longer run on one
  // thread while the others wait, and one fork serves both (measured 2026-12-04, Zen 4, two
  // threads, alternating in one process: an 8-row forward of the default model 0.986x the
  // time, 4 rows of 4 sequence slots 0.97x, one row unchanged; 8-row Q4_1 calls 0.94-0.99x).
  // The groups split as at::parallel_for(0, ng, grain) splits them; the bits depend on
  // neither split.
  const int64_t units = m_rows * nb;
  const bool threads = ng > grain && at::get_num_threads() > 1 && !at::in_parallel_region();
  if (!threads || (m_rows == 1 && !pro.silu)) {
    // (a single plain or normalized row is a fraction of a microsecond: less than splitting
    // it costs, measured 1-row calls 0.7 us slower split)
    quantize_span(x, k, 0, units, qp, dp, dsp, sp, slp, vec, pro);
    at::parallel_for(0, ng, grain, body);
  } else {
    at::internal::lazy_init_num_threads();
    std::exception_ptr failed[2];
    std::atomic_flag flagged[2] = {ATOMIC_FLAG_INIT, ATOMIC_FLAG_INIT};
#pragma omp parallel
    {
      const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t workers = std::min<int64_t>(team, (ng + grain - 1) / grain);
      at::internal::ThreadIdGuard tid_guard(tid);
      c10::ParallelGuard guard(true);
      try {  // (an exception must not skip the barrier)
        // whole rows per thread where there are several (no norm computed twice), else the
        // blocks of one SwiGLU row (elementwise: ~1.2 us a 1536-wide row)
        const int64_t step = m_rows > 1 ? nb : 1;
        const int64_t per = ((units / step + team - 1) / team) * step, u0 = tid * per;
        if (u0 < units)
          quantize_span(x, k, u0, std::min(units, u0 + per), qp, dp, dsp, sp, slp, vec, pro);
      } catch (...) {
        if (!flagged[0].test_and_set()) failed[0] = std::current_exception();
      }
#pragma omp barrier
      const int64_t chunk = (ng + workers - 1) / workers, g0 = tid * chunk;
      if (!failed[0] && tid < workers && g0 < ng) try {
          body(g0, std::min(ng, g0 + chunk));
        } catch (...) {
          if (!flagged[1].test_and_set()) failed[1] = std::current_exception();
        }
    }
    for (auto& e : failed)
      if (e) std::rethrow_exception(e);
  }
  if (!direct) y = y.narrow(1, 0, n);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  return (direct ? y : y.to(x_in.scalar_type()).contiguous()).reshape(out_shape);
}

// GGUF blocks (N rows of nb blocks) -> the group layout (groups of 8 rows, padded with zeros);
// the K-quants are repacked in Python (kernels.kquants), where their bit fields unpack by
// vector ops
at::Tensor repack(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dflash::repack: unsupported block type ", qtype,
              " (Q5_0, Q5_1 and the K-quants: kernels.kquants)");
  TORCH_CHECK(k > 0 && k % QK == 0 && n > 0, "dflash::repack: K must be a positive multiple of 32, got ", k);
  const int64_t nb = k / QK, ng = groups(n), gb = group_block_bytes(qtype);
  const int64_t bsize = qtype == Q4_0 ? 18 : (qtype == Q4_1 ? 20 : 34);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.numel() == n * nb * bsize,
              "dflash::repack: expected ", n * nb * bsize, " contiguous CPU bytes");
  auto out = at::zeros({ng, nb * gb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  bool overflow = false;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = j / NR, r = j % NR;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = src + (j * nb + b) * bsize;
      uint8_t* gblk = dst + g * nb * gb + b * gb;
      uint16_t dh;
      std::memcpy(&dh, blk, 2);
      uint16_t* dd = reinterpret_cast<uint16_t*>(gblk + (qtype == Q8_0 ? NR * QK : NR * 16));
      dd[r] = dh;
      if (qtype == Q8_0) {  // chunk c of row r: values 4c..4c+3
        for (int c = 0; c < 8; ++c) std::memcpy(gblk + c * 32 + r * 4, blk + 2 + 4 * c, 4);
        continue;
      }
      // GGUF byte i holds value i (low nibble) and value i + 16 (high nibble): the same
      // bytes, placed so that chunk c (c < 4) is the low nibbles and chunk c + 4 the high
      const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
      for (int c = 0; c < 4; ++c) std::memcpy(gblk + c * 32 + r * 4, qs + 4 * c, 4);
      if (qtype == Q4_1) {
        std::memcpy(&dd[NR + r], blk + 2, 2);
      } else {
        const float eb = -8.f * h2f(dh);
        dd[NR + r] = f2h(eb);
        overflow |= h2f(dd[NR + r]) != eb;
      }
    }
  }
  TORCH_CHECK(!overflow, "dflash::repack: a Q4_0 scale does not fit the fp16 offset");
  return out;
}

int64_t isa_level() { return static_cast<int64_t>(active_isa); }
std::string prefetch_mode() { return prefetch_nta ? "nta" : "l2"; }
bool isa_supported(int64_t isa) { return isa >= 0 && isa < 5 && supported(static_cast<Isa>(isa)); }

}  // namespace

namespace dflash {
at::Tensor qmm_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, int64_t isa) {
  return qmm(x, w, qtype, n, k, isa);
}
at::Tensor qmm_fused_op(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& norm_w, double eps, bool silu,
                        const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(!(silu && norm_w.has_value()), "dflash::qmm_fused: a norm or the SwiGLU activation, not both");
  at::Tensor nw;
  Prologue pro;
  pro.silu = silu;
  if (norm_w.has_value()) {
    TORCH_CHECK(norm_w->device().is_cpu() && norm_w->dim() == 1 && norm_w->size(0) == k,
                "dflash::qmm_fused: the norm weight must be (", k, ") on the CPU");
    nw = norm_w->to(at::kFloat).contiguous();
    pro.norm_w = nw.data_ptr<float>();
    pro.eps = static_cast<float>(eps);
  }
  return qmm(x, w, qtype, n, k, -1, residual.has_value() ? &*residual : nullptr, pro);
}
}  // namespace dflash

TORCH_LIBRARY(dflash, m) {
  m.def("qmm(Tensor x, Tensor w, int qtype, int n, int k, int isa=-1) -> Tensor");
  m.def("qmm_fused(Tensor x, Tensor w, int qtype, int n, int k, Tensor? norm_weight=None, float eps=1e-6, "
        "bool silu=False, Tensor? residual=None) -> Tensor");
  m.def("repack(Tensor blocks, int qtype, int n, int k) -> Tensor");
  m.def("isa() -> int", &isa_level);
  m.def("isa_supported(int isa) -> bool", &isa_supported);
  m.def("prefetch() -> str", &prefetch_mode);
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("qmm", [](const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, int64_t isa) {
    return qmm(x, w, qtype, n, k, isa);
  });
  m.impl("qmm_fused", &dflash::qmm_fused_op);
  m.impl("repack", &repack);
}
