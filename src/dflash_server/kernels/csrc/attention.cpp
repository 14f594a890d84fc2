// One attention step over a position-addressed KV cache (optionally a sliding window), fused: split the fused QKV
// projection, normalize q and k per head where the family does (Qwen3), rotate q and k (NeoX half rotation, full or partial), write k and v at rows
// [start, start + T) of the caches, and attend causally (query t sees keys
// [0, start + t]) with grouped-query heads. For decode and verify blocks, and prefill
// chunks up to a few thousand positions.
//
// The caches are fp32, fp16 or bf16 (the KV cache type): a key or value is rounded once,
// when it is written (as c10 rounds, on every path), and read back exactly as fp32; all
// arithmetic is fp32 whatever the cache type.
//
// Every query row runs the same operations whatever T: scores in key order, a max, exps
// by one polynomial, their sum in 8 lanes (key j in lane j % 8), the weighted sum of values
// in key order, 8 lanes over the head dimension with explicit fused multiply-adds and
// fixed-order lane sums. So a row's output does not depend on how many rows are computed with it, and the
// AVX2 and portable builds of the same code give the same bits (-ffp-contract=off), as does the
// AVX-512 form of the grouped path (group_avx512: the same lane chains, two keys or 16
// dimensions to a register).
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
#include <type_traits>
#include <immintrin.h>
#include <utility>
#include <vector>

namespace {

#define DFLASH_INLINE inline __attribute__((always_inline))

DFLASH_INLINE float sum8(const float a[8]) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2;
// plain float operations only, so it vectorizes lane-wise and rounds the same everywhere
DFLASH_INLINE float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693359375f, std::fma(n, 2.12194440e-4f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

struct Geometry {
  int64_t T, nh, nkv, hd, rot, start, max_ctx;
  float scale;
  const float* q_norm;  // (hd) per-head RMSNorm weights of q and k before RoPE (Qwen3), or null
  const float* k_norm;
  float norm_eps;
  bool gated;  // each query head is [q | gate] (Qwen3.5): out = attention * sigmoid(gate)
  int64_t window = 0;  // > 0: sliding window, a query at p sees keys (p - window, p]
  bool v_norm = false;  // each value head RMS-normalised (no weight) before the write (Gemma 4)
  // a tree of rows (DDTree verify): row t's parent row (-1: none, after the cached prefix);
  // row t sits at position start + depth(t) and sees the cache before ``start`` and its
  // ancestors (itself included). null: a causal block, row t at start + t.
  const int64_t* parents = nullptr;
  // slot-addressed KV (KV Flash pools; a DFlash draft's block, whose rows see each other): row
  // t's K/V go to cache row write_rows[t], and row t attends to key_counts[t] (at most start +
  // T) cache rows key_rows[t * key_stride ...], in logical order (the caller's list: causal,
  // window and residency already applied). Every row's K/V is written before any row attends.
  // null: position-addressed.
  const int64_t* write_rows = nullptr;
  const int64_t* key_rows = nullptr;
  const int64_t* key_counts = nullptr;
  int64_t key_stride = 0;
  // KV Flash's score policy (with key lists only): the attention each row's keys receive, per
  // bucket (a pool chunk): mass[t * mass_stride + mass_keys[t * key_stride + j]] += row t's
  // probability of key j of its list, summed over the heads in fixed point (MASS_ONE), so the
  // sums are exact and do not depend on the order of the additions (threads, paths, other rows);
  // and the rotated queries of the last q_rows rows (Step::q_out, (q_rows, nh, hd) in the
  // activations' type). null / 0: none.
  int64_t* mass = nullptr;
  const int64_t* mass_keys = nullptr;
  int64_t mass_stride = 0;
  int64_t q_rows = 0;
  // the group paths' tree form over key lists (tree_lists): the list is the rows' common prefix of
  // tree_base keys, then every block row's cache row (tree_rows[r]); -1: the tree of a
  // position-addressed block (list-space start = start, block row r at cache row start + r)
  int64_t tree_base = -1;
  const int64_t* tree_rows = nullptr;
};

// where a tree's block rows begin in its key list, and block row r's cache row
DFLASH_INLINE int64_t tree_start(const Geometry& g) { return g.tree_base >= 0 ? g.tree_base : g.start; }
DFLASH_INLINE int64_t tree_row(const Geometry& g, int64_t r) { return g.tree_rows ? g.tree_rows[r] : g.start + r; }

// one row's score-policy masses: its buckets (out) and the bucket of each key of its list
struct MassRow {
  int64_t* out;
  const int64_t* keys;
};
constexpr float MASS_ONE = 4294967296.f;  // a probability of 1 in the masses' fixed point (2^32)
DFLASH_INLINE MassRow mass_row(const Geometry& g, int64_t* mass, int64_t t) {
  return {mass + t * g.mass_stride, g.mass_keys + t * g.key_stride};
}
// p_j = scores[j] * inv of one query's keys [0, n) (its list's order) into its row's buckets (a
// probability outside [0, 1], e.g. NaN from NaN inputs, counts 0: the conversion stays defined)
DFLASH_INLINE void add_mass(const float* scores, float inv, int64_t n, MassRow m) {
  for (int64_t j = 0; j < n; ++j) {
    const float p = scores[j] * inv;
    m.out[m.keys[j]] += p >= 0.f && p <= 1.f ? static_cast<int64_t>(p * MASS_ONE + 0.5f) : 0;
  }
}

// sigmoid by exp_neg on -|x| (both signs stable); plain float operations
DFLASH_INLINE float sigmoid(float x) {
  const float e = exp_neg(x >= 0.f ? -x : x);
  return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

// a head's RMSNorm (sum of squares in index order), rounded back to the input's dtype as the
// per-op path's norm output is; then it rotates like any head
template <typename T>
DFLASH_INLINE const T* head_norm(const T* src, const float* w, float eps, int64_t hd, T* tmp) {
  if (w == nullptr) return src;
  float ss = 0.f;
  for (int64_t i = 0; i < hd; ++i) {
    const float v = static_cast<float>(src[i]);
    ss = std::fma(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
  for (int64_t i = 0; i < hd; ++i) tmp[i] = static_cast<T>(static_cast<float>(src[i]) * inv * w[i]);
  return tmp;
}

template <typename T>
DFLASH_INLINE void rotate(const T* src, const float* cos, const float* sin, int64_t hd, int64_t rot, float* dst) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < rot; ++i) {
    const float x = static_cast<float>(src[i]);
    const float partner = static_cast<float>(src[i < half ? i + half : i - half]);
    dst[i] = std::fma(partner, sin[i], x * cos[i]);  // sin is the signed table: [-sin | sin]
  }
  for (int64_t i = rot; i < hd; ++i) dst[i] = static_cast<float>(src[i]);
}

// where key j of a row's key list lies, in rows of the cache from the call's base: rows j for
// j < m, then tail[j - m] (a tree row's ancestors in the block; m = n and no tail otherwise).
// The arithmetic below depends only on the key list, so a tree row attends exactly as the
// same keys laid out contiguously (a plain step of the accepted path) would.
struct KeyRows {
  int64_t m;
  const int64_t* tail;
  DFLASH_INLINE int64_t operator()(int64_t j) const { return j < m ? j : tail[j - m]; }
};
struct Contiguous {  // rows j (a causal block's row: no index to read)
  DFLASH_INLINE int64_t operator()(int64_t j) const { return j; }
};

// one query row of one head against keys [0, n): out (hd) = softmax(q k^T * scale) v.
// The reference arithmetic (the AVX2 version below does the same per lane): each score is 8
// lanes over the head dimension (lane l: dims l, l + 8, ...) summed by sum8; the softmax
// denominator sums key j into lane j % 8, in key order, then sum8; the output accumulates
// keys in order with one fused multiply-add per element.
template <typename KT, typename Rows>
DFLASH_INLINE void attend_row(const float* q, const KT* kc, const KT* vc, int64_t n, int64_t hd, float scale,
                              float* scores, float* out, Rows at, const MassRow* mass = nullptr) {
  // four keys at a time: four independent accumulation chains (each key's own arithmetic
  // is the same as alone)
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const KT *k0 = kc + at(j) * hd, *k1 = kc + at(j + 1) * hd, *k2 = kc + at(j + 2) * hd,
             *k3 = kc + at(j + 3) * hd;
    float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
    for (int64_t i = 0; i < hd; i += 8)
      for (int l = 0; l < 8; ++l) {
        a0[l] = std::fma(q[i + l], static_cast<float>(k0[i + l]), a0[l]);
        a1[l] = std::fma(q[i + l], static_cast<float>(k1[i + l]), a1[l]);
        a2[l] = std::fma(q[i + l], static_cast<float>(k2[i + l]), a2[l]);
        a3[l] = std::fma(q[i + l], static_cast<float>(k3[i + l]), a3[l]);
      }
    scores[j] = sum8(a0) * scale;
    scores[j + 1] = sum8(a1) * scale;
    scores[j + 2] = sum8(a2) * scale;
    scores[j + 3] = sum8(a3) * scale;
  }
  for (; j < n; ++j) {
    const KT* k = kc + at(j) * hd;
    float acc[8] = {};
    for (int64_t i = 0; i < hd; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] = std::fma(q[i + l], static_cast<float>(k[i + l]), acc[l]);
    scores[j] = sum8(acc) * scale;
  }
  float mx = -INFINITY;
  for (j = 0; j < n; ++j) mx = scores[j] > mx ? scores[j] : mx;
  float part[8] = {};
  for (j = 0; j < n; ++j) {
    scores[j] = exp_neg(scores[j] - mx);
    part[j % 8] += scores[j];
  }
  const float inv = 1.f / sum8(part);
  if (mass != nullptr) add_mass(scores, inv, n, *mass);
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (j = 0; j < n; ++j) {
    const float p = scores[j] * inv;
    const KT* v = vc + at(j) * hd;
    for (int64_t i = 0; i < hd; ++i) out[i] = std::fma(p, static_cast<float>(v[i]), out[i]);
  }
}

#define DFLASH_AVX2 DFLASH_SIMD_AVX2
using dflash::simd::load8;

DFLASH_AVX2 inline float sum8_avx2(__m256 v) {
  float a[8];
  _mm256_storeu_ps(a, v);
  return sum8(a);
}

// exp_neg on 8 lanes: the same operations, lane by lane
DFLASH_AVX2 inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f),
                                   _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_castsi256_ps(bits);
}

// out (8 NV) = sum_j (scores[j] * inv) v_j, keys in order, the output held in registers
template <int NV, typename KT, typename Rows>
DFLASH_AVX2 inline void weighted_values_avx2(const float* scores, float inv, const KT* vc, int64_t n, float* out,
                                             Rows at) {
  constexpr int64_t hd = 8 * NV;
  __m256 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(scores[j] * inv);
    const KT* v = vc + at(j) * hd;
    for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), o[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
}

// sum8 of eight accumulators at once, lane j holding key j's: the same additions in the same
// tree (hadd adds neighbours: (x0 + x1), then ((x0 + x1) + (x2 + x3)) per 128-bit half, then the
// halves), so each score rounds exactly as sum8_avx2 gives it, in ~9 instructions instead of
// eight stores and 56 scalar adds
DFLASH_AVX2 inline __m256 sum8x8_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                      __m256 a7) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // keys 0-3: low | high halves
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  // keys 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// scores of keys [j0, j1): eight at a time, then the last few one by one (a key's arithmetic
// is the same either way: 8 lanes over the head dimension, sum8's tree, times scale)
template <typename KT, typename Rows>
DFLASH_AVX2 inline void scores_avx2(const float* q, const KT* kc, int64_t j0, int64_t j1, int64_t hd, float scale,
                                    float* scores, Rows at) {
  int64_t j = j0;
  const __m256 sv = _mm256_set1_ps(scale);
  for (; j + 8 <= j1; j += 8) {  // eight keys: eight accumulation chains, one reduction
    const KT *k0 = kc + at(j) * hd, *k1 = kc + at(j + 1) * hd, *k2 = kc + at(j + 2) * hd,
             *k3 = kc + at(j + 3) * hd, *k4 = kc + at(j + 4) * hd, *k5 = kc + at(j + 5) * hd,
             *k6 = kc + at(j + 6) * hd, *k7 = kc + at(j + 7) * hd;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < hd; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, load8(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, load8(k1 + i), a1);
      a2 = _mm256_fmadd_ps(qv, load8(k2 + i), a2);
      a3 = _mm256_fmadd_ps(qv, load8(k3 + i), a3);
      a4 = _mm256_fmadd_ps(qv, load8(k4 + i), a4);
      a5 = _mm256_fmadd_ps(qv, load8(k5 + i), a5);
      a6 = _mm256_fmadd_ps(qv, load8(k6 + i), a6);
      a7 = _mm256_fmadd_ps(qv, load8(k7 + i), a7);
    }
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(sum8x8_avx2(a0, a1, a2, a3, a4, a5, a6, a7), sv));
  }
  for (; j < j1; ++j) {
    const KT* k = kc + at(j) * hd;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
    scores[j] = sum8_avx2(acc) * scale;
  }
}

// scores[0, n) -> exp(score - max) in place; returns 1 / their sum (key j in lane j % 8)
DFLASH_AVX2 inline float softmax_avx2(float* scores, int64_t n) {
  int64_t j = 0;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (j = 0; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(scores + j));
  float mx = -INFINITY, lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (int l = 0; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  for (; j < n; ++j) mx = scores[j] > mx ? scores[j] : mx;
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 den = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mxv));
    _mm256_storeu_ps(scores + j, e);
    den = _mm256_add_ps(den, e);
  }
  float part[8];
  _mm256_storeu_ps(part, den);
  for (; j < n; ++j) {
    scores[j] = exp_neg(scores[j] - mx);
    part[j % 8] += scores[j];
  }
  return 1.f / sum8(part);
}

template <typename KT, typename Rows>
DFLASH_AVX2 void attend_row_avx2(const float* q, const KT* kc, const KT* vc, int64_t n, int64_t hd,
                                 float scale, float* scores, float* out, Rows at, const MassRow* mass = nullptr) {
  scores_avx2(q, kc, 0, n, hd, scale, scores, at);
  const float inv = softmax_avx2(scores, n);
  if (mass != nullptr) add_mass(scores, inv, n, *mass);
  if (hd == 64) return weighted_values_avx2<8>(scores, inv, vc, n, out, at);
  if (hd == 128) return weighted_values_avx2<16>(scores, inv, vc, n, out, at);
  for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(scores[j] * inv);
    const KT* v = vc + at(j) * hd;
    for (int64_t i = 0; i < hd; i += 8)
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, load8(v + i), _mm256_loadu_ps(out + i)));
  }
}

// acc (8 NV) += sum over keys [j0, j1) of (scores[j] * inv) v_j, in key order: blocks of keys
// in order continue one row's accumulation exactly as weighted_values_avx2 runs it whole
template <int NV, typename KT>
DFLASH_AVX2 inline void values_block_avx2(const float* scores, float inv, const KT* vc, int64_t j0, int64_t j1,
                                          float* acc) {
  constexpr int64_t hd = 8 * NV;
  __m256 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 p = _mm256_set1_ps(scores[j] * inv);
    const KT* v = vc + j * hd;
    for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), o[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, o[i]);
}

template <typename T, typename KT>
struct Step {
  Geometry g;
  const T* qkv;
  const float* cos;
  const float* sin;
  KT* kc;  // the caches (fp32, fp16 or bf16)
  KT* vc;
  T* out;
  T* q_out = nullptr;  // Geometry::q_rows
  int64_t qhead() const { return g.gated ? 2 * g.hd : g.hd; }  // a query head's span in qkv
  int64_t qdim() const { return g.nh * qhead(); }
  int64_t odim() const { return g.nh * g.hd; }
  int64_t width() const { return qdim() + 2 * g.nkv * g.hd; }
};

// k and v rows of kv head h into the caches (k rotated)
// (a key or value is rounded to the cache type here, once, as c10's conversion rounds it: the
// same bits on every path and as aten's ``.to(cache dtype)`` of the per-op path; the AVX2 build
// converts 8 at a time, simd.h's stores)
template <typename KT>
DFLASH_INLINE void to_cache(const float* x, KT* dst, int64_t n) {
  if constexpr (std::is_same_v<KT, float>)
    std::memcpy(dst, x, n * sizeof(float));
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<KT>(x[i]);
}
template <typename KT>
DFLASH_AVX2 inline void to_cache_avx2(const float* x, KT* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<KT, float>)
    for (; i + 8 <= n; i += 8) dflash::simd::store8(_mm256_loadu_ps(x + i), dst + i);
  to_cache(x + i, dst + i, n - i);
}

template <typename T, typename KT, bool AVX2>
DFLASH_INLINE void write_kv(const Step<T, KT>& s, int64_t h) {
  const Geometry& g = s.g;
  const int64_t kvdim = g.nkv * g.hd;
  std::vector<T> tmp(g.k_norm ? g.hd : 0);
  std::vector<float> rk(g.hd), rv(g.hd);  // the rotated key and the value in fp32, then to the cache
  for (int64_t t = 0; t < g.T; ++t) {
    const T* row = s.qkv + t * s.width();
    const int64_t at = g.write_rows ? g.write_rows[t] : g.start + t;
    KT* kd = s.kc + (h * g.max_ctx + at) * g.hd;
    KT* vd = s.vc + (h * g.max_ctx + at) * g.hd;
    const T* kn = head_norm(row + s.qdim() + h * g.hd, g.k_norm, g.norm_eps, g.hd, tmp.data());
    rotate(kn, s.cos + t * g.rot, s.sin + t * g.rot, g.hd, g.rot, rk.data());
    AVX2 ? to_cache_avx2(rk.data(), kd, g.hd) : to_cache(rk.data(), kd, g.hd);
    const T* vs = row + s.qdim() + kvdim + h * g.hd;
    if (g.v_norm) {  // as a weightless RMSNorm of the per-op path: sum of squares in order, rounded to T
      float ss = 0.f;
      for (int64_t i = 0; i < g.hd; ++i) ss = std::fma(static_cast<float>(vs[i]), static_cast<float>(vs[i]), ss);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(g.hd) + g.norm_eps);
      for (int64_t i = 0; i < g.hd; ++i) rv[i] = static_cast<float>(static_cast<T>(static_cast<float>(vs[i]) * inv));
    } else {
      for (int64_t i = 0; i < g.hd; ++i) rv[i] = static_cast<float>(vs[i]);
    }
    AVX2 ? to_cache_avx2(rv.data(), vd, g.hd) : to_cache(rv.data(), vd, g.hd);
  }
}

// head h of row t's attention output o (hd floats) into the step's output, times
// sigmoid(gate) where the heads are gated
template <typename T, typename KT>
DFLASH_INLINE void write_head(const Step<T, KT>& s, int64_t h, int64_t t, const float* o) {
  const Geometry& g = s.g;
  const T* gate = s.qkv + t * s.width() + h * s.qhead() + g.hd;
  T* dst = s.out + t * s.odim() + h * g.hd;
  if (g.gated) {
    for (int64_t i = 0; i < g.hd; ++i) dst[i] = static_cast<T>(o[i] * sigmoid(static_cast<float>(gate[i])));
  } else {
    for (int64_t i = 0; i < g.hd; ++i) dst[i] = static_cast<T>(o[i]);
  }
}

// row t's rotated query of head h (q: hd floats) into Step::q_out, if t is among the last q_rows
template <typename T, typename KT>
DFLASH_INLINE void write_query(const Step<T, KT>& s, int64_t h, int64_t t, const float* q) {
  const Geometry& g = s.g;
  const int64_t r = t - (g.T - g.q_rows);
  if (s.q_out == nullptr || r < 0) return;
  T* dst = s.q_out + (r * g.nh + h) * g.hd;
  for (int64_t i = 0; i < g.hd; ++i) dst[i] = static_cast<T>(q[i]);
}

// query row t of head h (w = h * T + t); scratch: start + T scores, then 2 * head_dim;
// mass: where this thread adds the call's masses (laid out as Geometry::mass; key lists only), or null
template <typename T, typename KT, bool AVX2>
DFLASH_INLINE void query(const Step<T, KT>& s, int64_t w, float* scratch, int64_t* mass) {
  const Geometry& g = s.g;
  const int64_t h = w / g.T, t = w % g.T, kvh = h / (g.nh / g.nkv);
  float* scores = scratch;
  float* q = scratch + g.start + g.T;
  float* o = q + g.hd;
  std::vector<T> tmp(g.q_norm ? g.hd : 0);
  const T* src = s.qkv + t * s.width() + h * s.qhead();
  rotate(head_norm(src, g.q_norm, g.norm_eps, g.hd, tmp.data()), s.cos + t * g.rot, s.sin + t * g.rot, g.hd, g.rot,
         q);
  write_query(s, h, t, q);
  int64_t n, lo;
  KeyRows at{0, nullptr};
  int64_t tail[64];
  const KT *kc = s.kc + kvh * g.max_ctx * g.hd, *vc = s.vc + kvh * g.max_ctx * g.hd;
  if (g.key_rows != nullptr) {  // the caller's key list (logical order)
    at.tail = g.key_rows + t * g.key_stride;
    n = g.key_counts[t];
    MassRow m{};
    if (mass != nullptr) m = mass_row(g, mass, t);
    if constexpr (AVX2)
      attend_row_avx2(q, kc, vc, n, g.hd, g.scale, scores, o, at, mass != nullptr ? &m : nullptr);
    else
      attend_row(q, kc, vc, n, g.hd, g.scale, scores, o, at, mass != nullptr ? &m : nullptr);
  } else if (g.parents == nullptr) {
    n = g.start + t + 1, lo = g.window > 0 && n > g.window ? n - g.window : 0;
    if constexpr (AVX2)
      attend_row_avx2(q, kc + lo * g.hd, vc + lo * g.hd, n - lo, g.hd, g.scale, scores, o, Contiguous{});
    else
      attend_row(q, kc + lo * g.hd, vc + lo * g.hd, n - lo, g.hd, g.scale, scores, o, Contiguous{});
  } else {  // the cache before start, then the ancestors root first (a parent's row is before its child's)
    int64_t path[64], d = 0;
    for (int64_t r = t; r >= 0; r = g.parents[r]) path[d++] = r;
    const int64_t end = g.start + d;  // keys at positions < end: position start + depth is this row's
    lo = g.window > 0 && end > g.window ? end - g.window : 0;
    at.m = std::max<int64_t>(0, g.start - lo);
    int64_t k = 0;
    for (int64_t i = d - 1; i >= 0; --i)
      if (g.start + (d - 1 - i) >= lo) tail[k++] = g.start + path[i] - lo;
    at.tail = tail;
    n = at.m + k + lo;
    if constexpr (AVX2)
      attend_row_avx2(q, kc + lo * g.hd, vc + lo * g.hd, n - lo, g.hd, g.scale, scores, o, at);
    else
      attend_row(q, kc + lo * g.hd, vc + lo * g.hd, n - lo, g.hd, g.scale, scores, o, at);
  }
  write_head(s, h, t, o);
}

// rows [j0, j1) of a cache (keys or values) as fp32: the cache itself when it is fp32, else
// converted once (exactly) into ``buf`` for all the group's queries to read from L1
template <typename KT>
DFLASH_AVX2 inline const float* block_f32(const KT* c, int64_t j0, int64_t j1, int64_t hd, float* buf) {
  if constexpr (std::is_same_v<KT, float>) {
    return c + j0 * hd;
  } else {
    for (int64_t i = 0, m = (j1 - j0) * hd; i < m; i += 8) _mm256_storeu_ps(buf + i, load8(c + j0 * hd + i));
    return buf;
  }
}

// keys [j0, j1) of a key list as fp32 rows in ``buf`` (list: the cache rows in logical order;
// null: rows j0..j1 themselves, block_f32)
template <typename KT>
DFLASH_AVX2 inline const float* list_f32(const KT* c, const int64_t* list, int64_t j0, int64_t j1, int64_t hd,
                                         float* buf) {
  if (list == nullptr) return block_f32(c, j0, j1, hd, buf);
  for (int64_t j = j0; j < j1; ++j) {
    const KT* src = c + list[j] * hd;
    float* d = buf + (j - j0) * hd;
    for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(d + i, load8(src + i));
  }
  return buf;
}
struct ListRows {  // key j of a row's list is cache row rows[j]
  const int64_t* rows;
  DFLASH_INLINE int64_t operator()(int64_t j) const { return rows[j]; }
};

// Slot-addressed KV (KV Flash pools): the grouped paths take the rows' key lists when each row's
// list is a prefix of the longest one (a decode row; a causal block, whose row t sees the
// resident context then rows up to t; a draft block, whose rows see the same keys). Returns that
// list and its length (*width), or null where the lists differ otherwise (the per-row path).
// A query's arithmetic depends only on its key list, so the bits are the per-row path's.
inline const int64_t* shared_key_list(const Geometry& g, int64_t* width) {
  int64_t top = 0;
  for (int64_t t = 1; t < g.T; ++t)
    if (g.key_counts[t] > g.key_counts[top]) top = t;
  const int64_t* list = g.key_rows + top * g.key_stride;
  for (int64_t t = 0; t < g.T; ++t)
    if (t != top && std::memcmp(g.key_rows + t * g.key_stride, list, g.key_counts[t] * sizeof(int64_t)) != 0)
      return nullptr;
  *width = g.key_counts[top];
  return list;
}

// queries [u0, u0 + Q) of kv head kvh's group (u = head-in-group * T + row), normed where the
// family norms them and rotated, into base + u * stride; n[u]: the keys each one sees (causal)
template <typename T, typename KT>
DFLASH_INLINE void group_queries(const Step<T, KT>& s, int64_t kvh, int64_t u0, int64_t Q, float* base, int64_t stride,
                                 int64_t* n) {
  const Geometry& g = s.g;
  const int64_t G = g.nh / g.nkv;
  std::vector<T> tmp(g.q_norm ? g.hd : 0);
  for (int64_t u = 0; u < Q; ++u) {
    const int64_t h = kvh * G + (u0 + u) / g.T, t = (u0 + u) % g.T;
    const T* src = s.qkv + t * s.width() + h * s.qhead();
    rotate(head_norm(src, g.q_norm, g.norm_eps, g.hd, tmp.data()), s.cos + t * g.rot, s.sin + t * g.rot, g.hd, g.rot,
           base + u * stride);
    write_query(s, h, t, base + u * stride);
    n[u] = g.tree_base >= 0 ? g.tree_base + t + 1 : g.key_counts != nullptr ? g.key_counts[t] : g.start + t + 1;
  }
}

// A tree block (Geometry::parents): query row t's keys are the cache before start, then its
// ancestors root first (rows ascending). The group paths score each query over the rows a
// causal row t would see, [0, start + t], then tree_compact moves its ancestors' scores down to
// list places start, start + 1, ... (in place: an ancestor's row is never before its place) and
// gives the list length; its values are the cache's [0, start) in the block loops and then the
// ancestors', one by one in list order (tree_path). So a tree row's arithmetic is the one of a
// causal row whose keys are its path, laid out contiguously: the per-row path's bits.
DFLASH_INLINE int64_t tree_path(const Geometry& g, int64_t t, int64_t* path) {
  int64_t d = 0;
  for (int64_t r = t; r >= 0; r = g.parents[r]) path[d++] = r;
  std::reverse(path, path + d);
  return d;
}
DFLASH_INLINE int64_t tree_compact(const Geometry& g, int64_t t, float* scores) {
  int64_t path[64];
  const int64_t d = tree_path(g, t, path);
  const int64_t b = tree_start(g);
  for (int64_t i = 0; i < d; ++i) scores[b + i] = scores[b + path[i]];
  return b + d;
}

// a group query's probabilities into the score policy's masses: its scores [0, n) are in its own
// key list's order (a chain row's list is a prefix of the group's; a tree row's scores were
// compacted to its prefix and path: tree_compact), as on the per-row path
DFLASH_INLINE void group_mass(const Geometry& g, int64_t t, const float* scores, float inv, int64_t n,
                              int64_t* mass) {
  add_mass(scores, inv, n, mass_row(g, mass, t));
}

// The queries [u0, u1) of kv head kvh's group (u = head-in-group * T + row) of a causal block
// or a tree (tree_compact), without a window, the keys streamed in blocks that every query of the group uses while they
// are in L1: a kv head's keys and values are read from L2 once per group instead of once per
// (row, head) (at a few hundred keys that re-reading was the step's cost). Each query's
// arithmetic is attend_row_avx2's (scores per key, its softmax, values accumulated in key
// order), so the output bits are the per-row path's. (Trees took the per-row path until
// 2026-12-07: an 8-node DDTree verify of the default model cost 1.75x a one-row step against
// 1.56x for a chain of the same rows; now both ~1.7x, measured alternating in one process.)
template <typename T, typename KT, int NV>
DFLASH_AVX2 void group_avx2(const Step<T, KT>& s, int64_t kvh, int64_t u0, int64_t u1, std::vector<float>& buf,
                            const int64_t* list, int64_t width, int64_t* mass) {
  const Geometry& g = s.g;
  constexpr int64_t hd = 8 * NV, KB = 32;
  const int64_t G = g.nh / g.nkv, Q = u1 - u0, stride = 2 * hd + width;
  buf.resize(static_cast<size_t>(Q * stride));
  float* base = buf.data();  // per query: q (hd), the output accumulator (hd), scores (width)
  const KT *kc = s.kc + kvh * g.max_ctx * hd, *vc = s.vc + kvh * g.max_ctx * hd;
  float inv[128];
  int64_t n[128];
  group_queries(s, kvh, u0, Q, base, stride, n);
  alignas(32) float blk[KB * hd];  // a block of keys, then of values, in fp32 (16-bit caches, key lists)
  for (int64_t kb = 0; kb < width; kb += KB) {
    const int64_t kend = std::min(kb + KB, width);
    const float* kf = list_f32(kc, list, kb, kend, hd, blk);  // (key kb is kf's row 0)
    for (int64_t u = 0; u < Q; ++u)
      if (kb < n[u])
        scores_avx2(base + u * stride, kf, 0, std::min(kend, n[u]) - kb, hd, g.scale,
                    base + u * stride + 2 * hd + kb, Contiguous{});
  }
  int64_t cont[128];  // keys [0, cont[u]) of query u's list are cache rows [0, cont[u])
  for (int64_t u = 0; u < Q; ++u) {
    if (g.parents != nullptr) n[u] = tree_compact(g, (u0 + u) % g.T, base + u * stride + 2 * hd);
    cont[u] = g.parents != nullptr ? tree_start(g) : n[u];
    inv[u] = softmax_avx2(base + u * stride + 2 * hd, n[u]);
    if (mass != nullptr) group_mass(g, (u0 + u) % g.T, base + u * stride + 2 * hd, inv[u], n[u], mass);
    std::memset(base + u * stride + hd, 0, hd * sizeof(float));
  }
  for (int64_t kb = 0; kb < width; kb += KB) {
    const int64_t kend = std::min(kb + KB, width);
    const float* vf = list_f32(vc, list, kb, kend, hd, blk);
    for (int64_t u = 0; u < Q; ++u)
      if (kb < cont[u])
        values_block_avx2<NV>(base + u * stride + 2 * hd + kb, inv[u], vf, 0, std::min(kend, cont[u]) - kb,
                              base + u * stride + hd);
  }
  if (g.parents != nullptr)
    for (int64_t u = 0; u < Q; ++u) {
      int64_t path[64];
      const int64_t d = tree_path(g, (u0 + u) % g.T, path);
      const float* sc = base + u * stride + 2 * hd;
      for (int64_t i = 0; i < d; ++i) {  // list key tree_start + i is block row path[i]'s cache row
        const int64_t r = tree_row(g, path[i]);
        values_block_avx2<NV>(sc + (tree_start(g) + i) - r, inv[u], vc, r, r + 1, base + u * stride + hd);
      }
    }
  for (int64_t u = 0; u < Q; ++u)
    write_head(s, kvh * G + (u0 + u) / g.T, (u0 + u) % g.T, base + u * stride + hd);
}

// ---- the same group computation on AVX-512 registers (same bits) ----------------------------
// 16 lanes hold two keys' 8 lanes (scores) or 16 dimensions of a value (weighted sum): every
// lane runs the same fused multiply-add chain as in group_avx2, and the scores reduce by the
// same sum8x8 tree, so the output bits are group_avx2's. Two queries share each key and value
// load (their chains interleave), so per (query, key) it issues half the loads and multiply-adds
// and the weighted sum is no longer bound by one accumulator chain's latency. Measured against
// group_avx2, alternating in one process (9 / 3 heads of 64, fp16 cache, 2 threads): 8 rows after
// 256 keys 97 -> 63 us, after 2048 597 -> 352, 1 row after 2048 125 -> 80 (after 256: even);
// an 8-row forward of the default model 0.85x the time, a one-row forward 0.92x. Four queries
// instead of two a pass (2026-12-01, the Intel Xeon VM; two for the values at head_dim 128, whose
// accumulators would spill), the op alone, 9 / 3 heads of 64, fp16 cache, 2 threads, the two
// builds alternating by process: after 256 keys 4 / 8 / 16 rows 47-48 -> 39, 64-66 -> 54, 107-113
// -> 91-93 us, after 2048 8 / 16 rows 328-351 -> 295-302, 590-650 -> 559-563 us, 1 row even.
#define DFLASH_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))

bool has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    // DFLASH_KERNELS_ISA below AVX-512 keeps the AVX2 form, as it caps qmm
    return dflash::simd::isa_cap() >= 3 && dflash::simd::has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

DFLASH_AVX512 inline __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
DFLASH_AVX512 inline __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// scores of 8 keys (4 pairs, interleaved in kp: pair p's step s = 16 floats at (p S + s) 16,
// key 2p in lanes 0-7) for NQ queries (qd[q]: the query with each 8-float step duplicated)
template <int NQ, int S>
DFLASH_AVX512 inline void scores8_avx512(const float* const* qd, const float* kp, float scale, float* const* out) {
  __m512 acc[NQ][4];
  for (int q = 0; q < NQ; ++q)
    for (int p = 0; p < 4; ++p) acc[q][p] = _mm512_setzero_ps();
  for (int s = 0; s < S; ++s) {
    const __m512 k0 = _mm512_loadu_ps(kp + (0 * S + s) * 16), k1 = _mm512_loadu_ps(kp + (1 * S + s) * 16),
                 k2 = _mm512_loadu_ps(kp + (2 * S + s) * 16), k3 = _mm512_loadu_ps(kp + (3 * S + s) * 16);
    for (int q = 0; q < NQ; ++q) {
      const __m512 qv = _mm512_loadu_ps(qd[q] + 16 * s);
      acc[q][0] = _mm512_fmadd_ps(qv, k0, acc[q][0]);
      acc[q][1] = _mm512_fmadd_ps(qv, k1, acc[q][1]);
      acc[q][2] = _mm512_fmadd_ps(qv, k2, acc[q][2]);
      acc[q][3] = _mm512_fmadd_ps(qv, k3, acc[q][3]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int q = 0; q < NQ; ++q)
    _mm256_storeu_ps(out[q], _mm256_mul_ps(sum8x8_avx2(lo8(acc[q][0]), hi8(acc[q][0]), lo8(acc[q][1]), hi8(acc[q][1]),
                                                       lo8(acc[q][2]), hi8(acc[q][2]), lo8(acc[q][3]), hi8(acc[q][3])),
                                           sv));
}

// acc[q] (16 NV floats) += sum over keys [j0, j1) of (sc[q][j] * inv[q]) v_j, keys in order;
// v_j at vf + (j - kb) hd
template <int NQ, int NV>
DFLASH_AVX512 inline void values_avx512(const float* vf, int64_t kb, int64_t j0, int64_t j1, const float* const* sc,
                                        const float* inv, float* const* acc) {
  constexpr int64_t hd = 16 * NV;
  __m512 o[NQ][NV];
  for (int q = 0; q < NQ; ++q)
    for (int i = 0; i < NV; ++i) o[q][i] = _mm512_loadu_ps(acc[q] + 16 * i);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(vf + (j - kb) * hd + 16 * i);
    for (int q = 0; q < NQ; ++q) {
      const __m512 p = _mm512_set1_ps(sc[q][j] * inv[q]);
      for (int i = 0; i < NV; ++i) o[q][i] = _mm512_fmadd_ps(p, v[i], o[q][i]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[q] + 16 * i, o[q][i]);
}

// group_avx2's computation (same queries, same keys, same bits), four queries at a time (QS, QV)
template <typename T, typename KT, int NV>
DFLASH_AVX512 void group_avx512(const Step<T, KT>& s, int64_t kvh, int64_t u0, int64_t u1, std::vector<float>& buf,
                                const int64_t* list, int64_t width, int64_t* mass) {
  const Geometry& g = s.g;
  constexpr int64_t hd = 8 * NV, S = NV, KB = 32;
  // queries per pass over a block's keys (scores) and values: each key / value register load
  // serves QS / QV queries; a query's own lane chains are the same whatever the count
  constexpr int QS = 4, QV = NV / 2 == 4 ? 4 : 2;  // (head_dim 128: 4 queries' accumulators would spill)
  const int64_t G = g.nh / g.nkv, Q = u1 - u0, stride = 4 * hd + width;
  buf.resize(static_cast<size_t>(Q * stride));
  float* base = buf.data();  // per query: q (hd), the output accumulator (hd), q with steps doubled (2 hd), scores
  const KT *kc = s.kc + kvh * g.max_ctx * hd, *vc = s.vc + kvh * g.max_ctx * hd;
  float inv[128];
  int64_t n[128];
  group_queries(s, kvh, u0, Q, base, stride, n);
  for (int64_t u = 0; u < Q; ++u) {
    float* q = base + u * stride;
    for (int64_t st = 0; st < S; ++st) {
      std::memcpy(q + 2 * hd + 16 * st, q + 8 * st, 8 * sizeof(float));
      std::memcpy(q + 2 * hd + 16 * st + 8, q + 8 * st, 8 * sizeof(float));
    }
  }
  auto scores = [&](int64_t u) { return base + u * stride + 4 * hd; };
  alignas(64) float kp[KB * hd];  // a block's keys, pairs interleaved (scores8_avx512)
  alignas(64) float blk[KB * hd];  // a 16-bit cache's block of values in fp32
  for (int64_t kb = 0; kb < width; kb += KB) {
    const int64_t kend = std::min(kb + KB, width), full = kb + (kend - kb) / 8 * 8;
    for (int64_t j = kb; j < full; j += 2)
      for (int64_t st = 0; st < S; ++st) {
        float* d = kp + (((j - kb) / 2) * S + st) * 16;
        const int64_t r0 = list ? list[j] : j, r1 = list ? list[j + 1] : j + 1;
        _mm256_storeu_ps(d, load8(kc + r0 * hd + 8 * st));
        _mm256_storeu_ps(d + 8, load8(kc + r1 * hd + 8 * st));
      }
    for (int64_t u = 0; u < Q; u += QS) {
      const int nq = static_cast<int>(std::min<int64_t>(QS, Q - u));
      int64_t reach = 0;
      const float* qd[QS];
      for (int e = 0; e < nq; ++e) {
        reach = std::max(reach, n[u + e]);
        qd[e] = base + (u + e) * stride + 2 * hd;
      }
      for (int64_t j = kb; j < std::min(full, reach); j += 8) {  // keys past a query's reach: unused scores
        float* out[QS];
        for (int e = 0; e < nq; ++e) out[e] = scores(u + e) + j;
        const float* kg = kp + ((j - kb) / 2) * S * 16;
        switch (nq) {
          case 4: scores8_avx512<4, S>(qd, kg, g.scale, out); break;
          case 3: scores8_avx512<3, S>(qd, kg, g.scale, out); break;
          case 2: scores8_avx512<2, S>(qd, kg, g.scale, out); break;
          default: scores8_avx512<1, S>(qd, kg, g.scale, out);
        }
      }
      for (int e = 0; e < nq; ++e)  // the block's last keys, fewer than 8, one by one
        if (full < std::min(kend, n[u + e])) {
          if (list != nullptr)
            scores_avx2(base + (u + e) * stride, kc, full, std::min(kend, n[u + e]), hd, g.scale, scores(u + e),
                        ListRows{list});
          else
            scores_avx2(base + (u + e) * stride, kc, full, std::min(kend, n[u + e]), hd, g.scale, scores(u + e),
                        Contiguous{});
        }
    }
  }
  int64_t cont[128];  // keys [0, cont[u]) of query u's list are cache rows [0, cont[u])
  for (int64_t u = 0; u < Q; ++u) {
    if (g.parents != nullptr) n[u] = tree_compact(g, (u0 + u) % g.T, scores(u));
    cont[u] = g.parents != nullptr ? tree_start(g) : n[u];
    inv[u] = softmax_avx2(scores(u), n[u]);
    if (mass != nullptr) group_mass(g, (u0 + u) % g.T, scores(u), inv[u], n[u], mass);
    std::memset(base + u * stride + hd, 0, hd * sizeof(float));
  }
  for (int64_t kb = 0; kb < width; kb += KB) {
    const int64_t kend = std::min(kb + KB, width);
    const float* vf = list_f32(vc, list, kb, kend, hd, blk);  // key kb is vf's row 0
    for (int64_t u = 0; u < Q; u += QV) {
      const int nq = static_cast<int>(std::min<int64_t>(QV, Q - u));
      const float* sc[QV];
      float* acc[QV];
      int64_t all = kend;  // keys [kb, all) are seen by every query of these
      for (int e = 0; e < nq; ++e) {
        sc[e] = scores(u + e);
        acc[e] = base + (u + e) * stride + hd;
        all = std::min(all, cont[u + e]);
      }
      all = std::max(kb, all);
      if constexpr (QV == 4) {
        if (nq == 4) values_avx512<4, NV / 2>(vf, kb, kb, all, sc, inv + u, acc);
        if (nq == 3) values_avx512<3, NV / 2>(vf, kb, kb, all, sc, inv + u, acc);
      }
      if (nq == 2) values_avx512<2, NV / 2>(vf, kb, kb, all, sc, inv + u, acc);
      if (nq == 1) values_avx512<1, NV / 2>(vf, kb, kb, all, sc, inv + u, acc);
      for (int e = 0; e < nq; ++e)  // a longer query's keys past the shortest one's, in order after them
        if (all < std::min(kend, cont[u + e]))
          values_avx512<1, NV / 2>(vf, kb, all, std::min(kend, cont[u + e]), sc + e, inv + u + e, acc + e);
    }
  }
  if (g.parents != nullptr)
    for (int64_t u = 0; u < Q; ++u) {
      int64_t path[64];
      const int64_t d = tree_path(g, (u0 + u) % g.T, path);
      const float* sc = scores(u);
      float* acc = base + u * stride + hd;
      for (int64_t i = 0; i < d; ++i) {  // list key j = tree_start + i is block row path[i]'s cache row
        const int64_t j = tree_start(g) + i, r = tree_row(g, path[i]);
        values_avx512<1, NV / 2>(block_f32(vc, r, r + 1, hd, blk), j, j, j + 1, &sc, inv + u, &acc);
      }
    }
  for (int64_t u = 0; u < Q; ++u)
    write_head(s, kvh * G + (u0 + u) / g.T, (u0 + u) % g.T, base + u * stride + hd);
}

// the same code compiled twice: with AVX2+FMA (vectorized lanes) and for any x86-64
template <typename T, typename KT>
DFLASH_AVX2 void write_kv_avx2(const Step<T, KT>& s, int64_t h) { write_kv<T, KT, true>(s, h); }
template <typename T, typename KT>
void write_kv_portable(const Step<T, KT>& s, int64_t h) { write_kv<T, KT, false>(s, h); }
template <typename T, typename KT>
DFLASH_AVX2 void query_avx2(const Step<T, KT>& s, int64_t w, float* scratch, int64_t* mass) {
  query<T, KT, true>(s, w, scratch, mass);
}
template <typename T, typename KT>
void query_portable(const Step<T, KT>& s, int64_t w, float* scratch, int64_t* mass) {
  query<T, KT, false>(s, w, scratch, mass);
}

// Whether a step's queries take the grouped paths (group_avx512 / group_avx2): no window, head_dim
// 64 or 128, more than one query per kv head, at most 16384 keys, and position-addressed KV or
// key lists that are prefixes of the longest one (*list: that list, null for positions; *width:
// the most keys a query sees).
inline bool grouped_step(const Geometry& g, bool fast, const int64_t** list, int64_t* width) {
  *width = g.start + g.T;
  *list = g.key_rows != nullptr ? shared_key_list(g, width) : nullptr;
  return fast && (g.key_rows == nullptr || *list != nullptr) && g.window == 0 && (g.hd == 64 || g.hd == 128) &&
         g.nh / g.nkv * g.T > 1 && *width <= 16384;
}

// A DDTree block over key lists (a KV Flash pool's tree verify: row t's list is the pool keys
// before the block, then its ancestors' write rows root first, ending with its own), which are
// not prefixes of one another: the group paths' tree form takes it as one list, that common prefix
// of n0 keys and then every block row's write row, with each row's parent read off the lists
// (tree_base n0, tree_rows the write rows), so a tree row's keys and their order are its own
// list's. tree: the list and parents it builds (alive while the step runs). False when the lists
// are not of that shape.
struct TreeLists {
  std::vector<int64_t> list, parents;
};
inline bool tree_lists(const Geometry& g, TreeLists& tree) {
  if (g.key_rows == nullptr || g.parents != nullptr || g.window != 0 || g.T < 2 || g.T > 64) return false;
  const int64_t T = g.T, n0 = g.key_counts[0] - 1;
  const int64_t* first = g.key_rows;
  if (n0 < 0 || first[n0] != g.write_rows[0]) return false;
  tree.parents.assign(static_cast<size_t>(T), -1);
  std::vector<int64_t> depth(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* own = g.key_rows + t * g.key_stride;
    const int64_t d = g.key_counts[t] - n0;  // the rows of its path
    if (d < 1 || d > t + 1 || own[n0 + d - 1] != g.write_rows[t] ||
        std::memcmp(own, first, static_cast<size_t>(n0) * sizeof(int64_t)) != 0)
      return false;
    if (d > 1) {
      int64_t p = -1;
      for (int64_t r = 0; r < t && p < 0; ++r)
        if (g.write_rows[r] == own[n0 + d - 2]) p = r;
      if (p < 0 || depth[p] != d - 2 ||
          std::memcmp(own + n0, g.key_rows + p * g.key_stride + n0, static_cast<size_t>(d - 1) * sizeof(int64_t)) != 0)
        return false;
      tree.parents[t] = p;
    }
    depth[t] = d - 1;
  }
  tree.list.assign(first, first + n0);
  tree.list.insert(tree.list.end(), g.write_rows, g.write_rows + T);
  return true;
}

// grouped_step, and for a tree over key lists (tree_lists) the step as the group paths take it:
// gs is s, or s with the tree form's geometry (list and width then its one list)
template <typename T, typename KT>
bool group_form(const Step<T, KT>& s, bool fast, Step<T, KT>& gs, TreeLists& tree, const int64_t** list,
                int64_t* width) {
  gs = s;
  if (grouped_step(s.g, fast, list, width)) return true;
  const Geometry& g = s.g;
  if (!fast || g.key_rows == nullptr || (g.hd != 64 && g.hd != 128) || !tree_lists(g, tree)) return false;
  const int64_t n0 = static_cast<int64_t>(tree.list.size()) - g.T;
  if (n0 + g.T > 16384) return false;
  gs.g.parents = tree.parents.data();
  gs.g.tree_base = n0;
  gs.g.tree_rows = g.write_rows;
  *list = tree.list.data();
  *width = n0 + g.T;
  return true;
}

// queries [u0, u1) of kv head kvh's group on the grouped path of this CPU (AVX-512 or AVX2)
template <typename T, typename KT>
void run_group(const Step<T, KT>& s, int64_t kvh, int64_t u0, int64_t u1, std::vector<float>& buf,
               const int64_t* list, int64_t width, int64_t* mass, bool wide) {
  if (wide)
    s.g.hd == 64 ? group_avx512<T, KT, 8>(s, kvh, u0, u1, buf, list, width, mass)
                 : group_avx512<T, KT, 16>(s, kvh, u0, u1, buf, list, width, mass);
  else
    s.g.hd == 64 ? group_avx2<T, KT, 8>(s, kvh, u0, u1, buf, list, width, mass)
                 : group_avx2<T, KT, 16>(s, kvh, u0, u1, buf, list, width, mass);
}

// The score policy's masses are fixed-point sums (MASS_ONE), exact in any order: each thread adds
// into its own copy of the call's buckets (zeroed at its first use), and the copies are added
// after the work, so the totals do not depend on the threads, the paths or the work items.
struct MassBuffers {
  int64_t* mass;  // the call's buckets (null: no masses)
  size_t size;
  std::vector<std::vector<int64_t>> local;
  MassBuffers(int64_t* m, int64_t n) : mass(m), size(static_cast<size_t>(n)), local(m ? at::get_num_threads() : 0) {}
  int64_t* mine() {  // this thread's buckets, or null
    if (mass == nullptr) return nullptr;
    const int64_t tid = at::get_thread_num();
    TORCH_CHECK(tid >= 0 && tid < static_cast<int64_t>(local.size()), "dflash: attention masses: thread id ", tid,
                " outside the pool of ", local.size());
    auto& b = local[static_cast<size_t>(tid)];
    if (b.empty()) b.assign(size, 0);
    return b.data();
  }
  void add() {
    for (const auto& b : local)
      for (size_t i = 0; i < b.size(); ++i) mass[i] += b[i];
  }
};

template <typename T, typename KT>
void run_step(const Step<T, KT>& s, bool fast) {
  const Geometry& g = s.g;
  // the KV write is a few hundred values per row: no threads for it; query rows split over
  // threads only when each chunk has ~32K multiply-adds to do (waking threads costs more)
  for (int64_t h = 0; h < g.nkv; ++h) fast ? write_kv_avx2(s, h) : write_kv_portable(s, h);
  const int64_t G = g.nh / g.nkv, per = G * g.T;
  int64_t width;  // the longest key list
  const int64_t* list;
  Step<T, KT> gs = s;   // the step as the group paths take it (a tree over key lists: tree_lists)
  TreeLists tree;
  const bool grouped = group_form(s, fast, gs, tree, &list, &width), wide = has_avx512();
  MassBuffers masses(g.mass, g.T * g.mass_stride);
  if (grouped) {
    // each kv head's queries in a few chunks, so the threads have about two each (at most
    // 128 queries a chunk: group_avx2's per-query arrays), but at least MIN_QUERIES a chunk
    // where the group has that many: every chunk widens its kv head's 16-bit keys and values
    // to fp32 again, which for a decode row's few queries costs as much as their scores (with
    // 3 queries per kv head split in two, two threads were no faster than one; measured, one
    // decode row of 9 / 3 heads after 2048 keys, alternating in one process: 142 -> 103 us with
    // an fp16 cache, 121 -> 113 with fp32). Each query's arithmetic is the same whatever the
    // chunks, so the bits do not depend on them.
    constexpr int64_t MIN_QUERIES = 8;
    const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, per / MIN_QUERIES),
                                             std::max<int64_t>(1, (2 * at::get_num_threads() + g.nkv - 1) / g.nkv));
    const int64_t size = std::min<int64_t>(128, (per + chunks - 1) / chunks);
    const int64_t pieces = (per + size - 1) / size;
    at::parallel_for(0, g.nkv * pieces, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> buf;
      int64_t* mass = masses.mine();
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t kvh = w / pieces, u0 = (w % pieces) * size, u1 = std::min(per, u0 + size);
        run_group(gs, kvh, u0, u1, buf, list, width, mass, wide);
      }
    });
    masses.add();
    return;
  }
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, (g.start + g.T) * g.hd));
  at::parallel_for(0, g.nh * g.T, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(g.start + g.T + 2 * g.hd);
    int64_t* mass = masses.mine();
    for (int64_t w = w0; w < w1; ++w)
      fast ? query_avx2(s, w, scratch.data(), mass) : query_portable(s, w, scratch.data(), mass);
  });
  masses.add();
}

// the caches' element type: fp32, fp16 or bf16, both caches alike
bool cache_type_ok(const at::Tensor& k, const at::Tensor& v) {
  const auto t = k.scalar_type();
  return v.scalar_type() == t && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
}

// f(qkv pointer, out pointer, cache pointer type tag): one instantiation per (qkv, cache) type pair
template <typename F>
void dispatch_types(const at::Tensor& qkv, at::Tensor& out, const at::Tensor& cache, const char* op, F&& f) {
  auto with_cache = [&](auto* qp, auto* op_) {
    switch (cache.scalar_type()) {
      case at::kFloat: return f(qp, op_, static_cast<float*>(nullptr));
      case at::kHalf: return f(qp, op_, static_cast<c10::Half*>(nullptr));
      case at::kBFloat16: return f(qp, op_, static_cast<c10::BFloat16*>(nullptr));
      default: TORCH_CHECK(false, op, ": caches must be float32, float16 or bfloat16");
    }
  };
  switch (qkv.scalar_type()) {
    case at::kFloat: return with_cache(qkv.data_ptr<float>(), out.data_ptr<float>());
    case at::kBFloat16: return with_cache(qkv.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
    case at::kHalf: return with_cache(qkv.data_ptr<c10::Half>(), out.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, op, ": qkv must be float32, bfloat16 or float16");
  }
}

// the score policy's arguments: mass (rows, buckets) int64, contiguous (added to); mass_keys
// (rows, L) like key_rows: each listed key's bucket, in [0, buckets). Returns mass_keys as int64
// (like key_rows, not to share storage with what the op writes: the checks are made once).
at::Tensor check_mass(const at::Tensor& mass, const at::Tensor& mass_keys, int64_t rows, const at::Tensor& key_rows,
                      const at::Tensor& key_counts, const char* op) {
  TORCH_CHECK(mass.scalar_type() == at::kLong && mass.dim() == 2 && mass.size(0) == rows && mass.size(1) >= 1 &&
                  mass.is_contiguous() && mass_keys.dim() == 2 && mass_keys.sizes() == key_rows.sizes(),
              op, ": mass must be a contiguous int64 (rows, buckets) tensor and mass_keys (rows, L) as key_rows");
  auto mk = mass_keys.to(at::kLong).contiguous();
  const int64_t L = mk.size(1), S = mass.size(1);
  const int64_t *k = mk.data_ptr<int64_t>(), *c = key_counts.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < c[t]; ++j)
      TORCH_CHECK(k[t * L + j] >= 0 && k[t * L + j] < S, op, ": a mass key outside [0, buckets)");
  return mk;
}

at::Tensor attention_step(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                          at::Tensor& k_cache, at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv,
                          double scale, bool portable, const c10::optional<at::Tensor>& q_norm,
                          const c10::optional<at::Tensor>& k_norm, double norm_eps, bool gated, int64_t window,
                          bool v_norm, const c10::optional<at::Tensor>& tree,
                          const c10::optional<at::Tensor>& write_rows, const c10::optional<at::Tensor>& key_rows,
                          const c10::optional<at::Tensor>& key_counts, const c10::optional<at::Tensor>& mass,
                          const c10::optional<at::Tensor>& q_out, const c10::optional<at::Tensor>& mass_keys) {
  TORCH_CHECK(qkv_in.device().is_cpu() && qkv_in.dim() == 3 && qkv_in.size(0) == 1,
              "dflash::attention_step: qkv must be (1, T, width) on the CPU");
  TORCH_CHECK(window >= 0, "dflash::attention_step: window must be >= 0 (0: none)");
  TORCH_CHECK(cache_type_ok(k_cache, v_cache) && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == 1 && k_cache.size(1) == nkv &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "dflash::attention_step: caches must be contiguous (1, nkv, max_ctx, head_dim), both float32, float16 or "
              "bfloat16");
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "dflash::attention_step: bad head counts");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "dflash::attention_step: q_norm and k_norm go together");
  at::Tensor qn, kn;
  if (q_norm.has_value()) {
    qn = q_norm->to(at::kFloat).contiguous();
    kn = k_norm->to(at::kFloat).contiguous();
    TORCH_CHECK(qn.dim() == 1 && qn.size(0) == k_cache.size(3) && kn.sizes() == qn.sizes(),
                "dflash::attention_step: q_norm / k_norm must be (head_dim)");
  }
  Geometry g{qkv_in.size(1), nh, nkv, k_cache.size(3), cos_in.size(-1), start, k_cache.size(2),
             static_cast<float>(scale), qn.defined() ? qn.data_ptr<float>() : nullptr,
             kn.defined() ? kn.data_ptr<float>() : nullptr, static_cast<float>(norm_eps), gated, window, v_norm};
  TORCH_CHECK(g.hd % 8 == 0 && g.rot % 2 == 0 && g.rot <= g.hd, "dflash::attention_step: head_dim must be a "
              "multiple of 8 and the rotary width even and at most head_dim");
  TORCH_CHECK(qkv_in.size(2) == ((gated ? 2 : 1) * nh + 2 * nkv) * g.hd,
              "dflash::attention_step: qkv width does not match heads");
  at::Tensor wr, kr, kcnt;
  if (write_rows.has_value() || key_rows.has_value() || key_counts.has_value()) {
    TORCH_CHECK(write_rows.has_value() && key_rows.has_value() && key_counts.has_value() && !tree.has_value() &&
                    window == 0 && start >= 0,
                "dflash::attention_step: slot-addressed KV takes write_rows, key_rows and key_counts together "
                "(windows applied in the key lists; not with a tree)");
    wr = write_rows->to(at::kLong).contiguous();
    kr = key_rows->to(at::kLong).contiguous();
    kcnt = key_counts->to(at::kLong).contiguous();
    TORCH_CHECK(wr.dim() == 1 && wr.size(0) == g.T && kr.dim() == 2 && kr.size(0) == g.T && kcnt.dim() == 1 &&
                    kcnt.size(0) == g.T,
                "dflash::attention_step: write_rows (T), key_rows (T, L) and key_counts (T)");
    const int64_t *w = wr.data_ptr<int64_t>(), *k = kr.data_ptr<int64_t>(), *c = kcnt.data_ptr<int64_t>();
    const int64_t L = kr.size(1);
    for (int64_t t = 0; t < g.T; ++t) {
      TORCH_CHECK(w[t] >= 0 && w[t] < g.max_ctx, "dflash::attention_step: a write row past the cache");
      TORCH_CHECK(c[t] >= 1 && c[t] <= L && c[t] <= start + g.T,
                  "dflash::attention_step: a row's key count must be in [1, its keys' width] and at most start + rows");
      for (int64_t j = 0; j < c[t]; ++j)
        TORCH_CHECK(k[t * L + j] >= 0 && k[t * L + j] < g.max_ctx, "dflash::attention_step: a key row past the cache");
    }
    g.write_rows = w, g.key_rows = k, g.key_counts = c, g.key_stride = L;
  } else {
    TORCH_CHECK(start >= 0 && g.T <= g.max_ctx && start <= g.max_ctx - g.T,
                "dflash::attention_step: rows past the cache");
  }
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) == g.T && sin_in.sizes() == cos_in.sizes(),
              "dflash::attention_step: cos/sin must be (T, rotary_dim)");
  at::Tensor parents;
  if (tree.has_value()) {
    parents = tree->to(at::kLong).contiguous();
    TORCH_CHECK(parents.dim() == 1 && parents.size(0) == g.T && g.T <= 64,
                "dflash::attention_step: tree must give the parent of each of at most 64 rows");
    const int64_t* pp = parents.data_ptr<int64_t>();
    for (int64_t t = 0; t < g.T; ++t)
      TORCH_CHECK(pp[t] >= -1 && pp[t] < t, "dflash::attention_step: a row's parent must be an earlier row or -1");
    g.parents = pp;
  }
  auto qkv = qkv_in.contiguous();
  at::Tensor mk;
  if (mass.has_value() || mass_keys.has_value()) {  // KV Flash's score policy: each row's attention per bucket
    TORCH_CHECK(g.key_rows != nullptr && mass.has_value() && mass_keys.has_value(),
                "dflash::attention_step: mass and mass_keys go together, with key lists");
    mk = check_mass(*mass, *mass_keys, g.T, kr, kcnt, "dflash::attention_step");
    g.mass = mass->data_ptr<int64_t>(), g.mass_keys = mk.data_ptr<int64_t>(), g.mass_stride = mass->size(1);
  }
  if (q_out.has_value()) {  // ... and the latest rows' rotated queries
    TORCH_CHECK(q_out->scalar_type() == qkv.scalar_type() && q_out->dim() == 4 && q_out->size(0) == 1 &&
                    q_out->size(1) >= 1 && q_out->size(1) <= g.T && q_out->size(2) == nh &&
                    q_out->size(3) == g.hd && q_out->is_contiguous(),
                "dflash::attention_step: q_out must be a contiguous (1, rows <= T, nh, head_dim) tensor of qkv's type");
    g.q_rows = q_out->size(1);
  }
  auto cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  auto out = at::empty({1, g.T, nh * g.hd}, qkv.options());
  const bool fast = !portable && dflash::simd::has_avx2();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  dispatch_types(qkv, out, k_cache, "dflash::attention_step", [&](auto* qp, auto* op, auto* tag) {
    using CT = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    using KT = std::remove_pointer_t<decltype(tag)>;
    Step<CT, KT> step{g, qp, cp, sp, static_cast<KT*>(k_cache.data_ptr()), static_cast<KT*>(v_cache.data_ptr()), op};
    if (q_out.has_value()) step.q_out = static_cast<CT*>(q_out->data_ptr());
    run_step(step, fast);
  });
  return out;
}

// Rows of several sequences, each sequence in its own lane of a KV bank: row b is a token of
// the sequence in lane lanes[b], at position positions[b]. A lane may take several rows (a
// speculative verify block among other sequences' rows), at increasing positions: every row's
// K/V is written before any row attends, and row b attends over [0, positions[b]] of its lane,
// so its later rows stay out of its view. A lane's rows at consecutive positions run as one
// Step (what attention_step runs for that sequence's own block; a row's bits are those of its
// single-row step, on the grouped and the per-row paths alike), so a sequence's output does not
// depend on which others share the call.
// tree (rows,): each row's parent row in this call, -1 for none. A lane with a row that has a
// parent holds a DDTree verify: its rows (adjacent, at consecutive cache rows from the first,
// at most 64, every parent an earlier row of the lane) run as one Step of attention_step's tree
// form: row t's K/V go to cache row positions[first] + t, it attends to the cache before
// positions[first] and to its ancestors (the caller's cos/sin place it at its depth), exactly
// as that sequence's own tree forward does.
// write_rows (rows,), key_rows (rows, L), key_counts (rows,): slot-addressed lanes (KV Flash,
// a pool per lane): row b's K/V go to lane row write_rows[b] and it attends to key_counts[b]
// lane rows key_rows[b, ...] in logical order, as attention_step's key lists (causal order,
// residency and windows applied by the caller, a tree row's list its path: no ``tree`` then);
// positions[b] is then the row's logical position, which may pass the lane's rows.
at::Tensor attention_rows(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                          at::Tensor& k_bank, at::Tensor& v_bank, at::IntArrayRef lanes, at::IntArrayRef positions,
                          int64_t nh, int64_t nkv, double scale, bool portable,
                          const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                          double norm_eps, bool gated, int64_t window, bool v_norm,
                          const c10::optional<at::Tensor>& tree, const c10::optional<at::Tensor>& write_rows,
                          const c10::optional<at::Tensor>& key_rows, const c10::optional<at::Tensor>& key_counts,
                          const c10::optional<at::Tensor>& mass, const c10::optional<at::Tensor>& q_out,
                          const c10::optional<at::Tensor>& mass_keys) {
  TORCH_CHECK(qkv_in.device().is_cpu() && qkv_in.dim() == 3 && qkv_in.size(0) == 1,
              "dflash::attention_rows: qkv must be (1, rows, width) on the CPU");
  TORCH_CHECK(window >= 0, "dflash::attention_rows: window must be >= 0 (0: none)");
  TORCH_CHECK(cache_type_ok(k_bank, v_bank) && k_bank.dim() == 4 &&
                  k_bank.sizes() == v_bank.sizes() && k_bank.size(1) == nkv && k_bank.is_contiguous() &&
                  v_bank.is_contiguous(),
              "dflash::attention_rows: banks must be contiguous (lanes, nkv, max_ctx, head_dim), both float32, float16 or "
              "bfloat16");
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "dflash::attention_rows: bad head counts");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "dflash::attention_rows: q_norm and k_norm go together");
  const int64_t B = qkv_in.size(1), n_lanes = k_bank.size(0), hd = k_bank.size(3), max_ctx = k_bank.size(2);
  TORCH_CHECK(static_cast<int64_t>(lanes.size()) == B && static_cast<int64_t>(positions.size()) == B,
              "dflash::attention_rows: one lane and one position per row");
  const bool listed = write_rows.has_value() || key_rows.has_value() || key_counts.has_value();
  at::Tensor wr, kr, kcnt;
  int64_t L = 0;
  if (listed) {
    TORCH_CHECK(write_rows.has_value() && key_rows.has_value() && key_counts.has_value() && !tree.has_value() &&
                    window == 0,
                "dflash::attention_rows: slot-addressed lanes take write_rows, key_rows and key_counts together "
                "(windows and trees applied in the key lists)");
    wr = write_rows->to(at::kLong).contiguous();
    kr = key_rows->to(at::kLong).contiguous();
    kcnt = key_counts->to(at::kLong).contiguous();
    TORCH_CHECK(wr.dim() == 1 && wr.size(0) == B && kr.dim() == 2 && kr.size(0) == B && kcnt.dim() == 1 &&
                    kcnt.size(0) == B,
                "dflash::attention_rows: write_rows (rows), key_rows (rows, L) and key_counts (rows)");
    L = kr.size(1);
  }
  std::vector<int64_t> last(n_lanes, -1);  // each lane's latest row position so far
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lanes[b] >= 0 && lanes[b] < n_lanes, "dflash::attention_rows: lane out of range");
    TORCH_CHECK(positions[b] >= 0 && (listed || positions[b] < max_ctx), "dflash::attention_rows: position past the cache");
    if (listed) {
      const int64_t w = wr.data_ptr<int64_t>()[b], c = kcnt.data_ptr<int64_t>()[b];
      const int64_t* k = kr.data_ptr<int64_t>() + b * L;
      TORCH_CHECK(w >= 0 && w < max_ctx, "dflash::attention_rows: a write row past the lane");
      TORCH_CHECK(c >= 1 && c <= L && c <= positions[b] + 1,
                  "dflash::attention_rows: a row's key count must be in [1, its keys' width] and at most its position + 1");
      for (int64_t j = 0; j < c; ++j)
        TORCH_CHECK(k[j] >= 0 && k[j] < max_ctx, "dflash::attention_rows: a key row past the lane");
    }
    TORCH_CHECK(positions[b] > last[lanes[b]],
                "dflash::attention_rows: a lane's rows must come at increasing positions");
    last[lanes[b]] = positions[b];
    longest = std::max(longest, positions[b] + 1);
  }
  // a tree lane's rows: one step from its first row (run_of[b]: that row, else -1 for plain rows)
  std::vector<int64_t> run_of(B, -1), local(B, -1);
  at::Tensor parents;
  if (tree.has_value()) {
    parents = tree->to(at::kLong).contiguous();
    TORCH_CHECK(parents.dim() == 1 && parents.size(0) == B, "dflash::attention_rows: tree must give one parent per row");
    const int64_t* pp = parents.data_ptr<int64_t>();
    std::vector<char> is_tree(n_lanes, 0), done(n_lanes, 0);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pp[b] >= -1 && pp[b] < b && (pp[b] < 0 || lanes[pp[b]] == lanes[b]),
                  "dflash::attention_rows: a row's parent must be an earlier row of its lane or -1");
      if (pp[b] >= 0) is_tree[lanes[b]] = 1;
    }
    for (int64_t b = 0; b < B;) {
      const int64_t lane = lanes[b];
      int64_t e = b + 1;
      while (e < B && lanes[e] == lane) ++e;
      if (is_tree[lane]) {
        TORCH_CHECK(!done[lane] && e - b <= 64, "dflash::attention_rows: a tree lane's rows must be adjacent, at most 64");
        done[lane] = 1;
        for (int64_t t = b; t < e; ++t) {
          TORCH_CHECK(positions[t] == positions[b] + (t - b) && (pp[t] < 0 || pp[t] >= b),
                      "dflash::attention_rows: a tree's rows at consecutive cache rows, parents inside the tree");
          run_of[t] = b;
          local[t] = pp[t] < 0 ? -1 : pp[t] - b;
        }
      }
      b = e;
    }
  }
  at::Tensor qn, kn;
  if (q_norm.has_value()) {
    qn = q_norm->to(at::kFloat).contiguous();
    kn = k_norm->to(at::kFloat).contiguous();
    TORCH_CHECK(qn.dim() == 1 && qn.size(0) == hd && kn.sizes() == qn.sizes(),
                "dflash::attention_rows: q_norm / k_norm must be (head_dim)");
  }
  TORCH_CHECK(hd % 8 == 0 && cos_in.size(-1) % 2 == 0 && cos_in.size(-1) <= hd,
              "dflash::attention_rows: head_dim must be a multiple of 8 and the rotary width even and at most head_dim");
  TORCH_CHECK(qkv_in.size(2) == ((gated ? 2 : 1) * nh + 2 * nkv) * hd,
              "dflash::attention_rows: qkv width does not match heads");
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) == B && sin_in.sizes() == cos_in.sizes(),
              "dflash::attention_rows: cos/sin must be (rows, rotary_dim)");
  auto qkv = qkv_in.contiguous();
  at::Tensor mk;
  if (mass.has_value() || mass_keys.has_value()) {  // KV Flash's score policy: each row's attention per bucket
    TORCH_CHECK(listed && mass.has_value() && mass_keys.has_value(),
                "dflash::attention_rows: mass and mass_keys go together, with key lists");
    mk = check_mass(*mass, *mass_keys, B, kr, kcnt, "dflash::attention_rows");
  }
  if (q_out.has_value())  // ... and every row's rotated queries
    TORCH_CHECK(q_out->scalar_type() == qkv.scalar_type() && q_out->dim() == 3 && q_out->size(0) == B &&
                    q_out->size(1) == nh && q_out->size(2) == hd && q_out->is_contiguous(),
                "dflash::attention_rows: q_out must be a contiguous (rows, nh, head_dim) tensor of qkv's type");
  auto cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  auto out = at::empty({1, B, nh * hd}, qkv.options());
  const bool fast = !portable && dflash::simd::has_avx2();
  const int64_t rot = cos.size(1), width = qkv.size(2), lane_elems = nkv * max_ctx * hd;
  int64_t* mass_p = mass.has_value() ? mass->data_ptr<int64_t>() : nullptr;
  const int64_t mass_stride = mass.has_value() ? mass->size(1) : 0;
  dispatch_types(qkv, out, k_bank, "dflash::attention_rows", [&](auto* qp, auto* op, auto* tag) {
    using CT = std::remove_pointer_t<decltype(qp)>;
    using KT = std::remove_pointer_t<decltype(tag)>;
    KT* kb = static_cast<KT*>(k_bank.data_ptr());
    KT* vb = static_cast<KT*>(v_bank.data_ptr());
    std::vector<Step<CT, KT>> steps;
    steps.reserve(B);
    for (int64_t b = 0; b < B;) {
      // a tree lane's rows; else a lane's rows at consecutive positions (a verify block: a causal
      // step, as that sequence's own)
      int64_t e = b + 1;
      if (run_of[b] >= 0)
        while (e < B && run_of[e] == b) ++e;
      else
        while (e < B && run_of[e] < 0 && lanes[e] == lanes[b] && positions[e] == positions[e - 1] + 1) ++e;
      const int64_t T = e - b;
      Geometry g{T, nh, nkv, hd, rot, positions[b], max_ctx, static_cast<float>(scale),
                 qn.defined() ? qn.data_ptr<float>() : nullptr, kn.defined() ? kn.data_ptr<float>() : nullptr,
                 static_cast<float>(norm_eps), gated, window, v_norm};
      if (run_of[b] >= 0) g.parents = local.data() + b;
      if (listed) {
        g.write_rows = wr.data_ptr<int64_t>() + b, g.key_rows = kr.data_ptr<int64_t>() + b * L;
        g.key_counts = kcnt.data_ptr<int64_t>() + b, g.key_stride = L;
      }
      if (mass_p != nullptr)
        g.mass = mass_p + b * mass_stride, g.mass_keys = mk.data_ptr<int64_t>() + b * L, g.mass_stride = mass_stride;
      if (q_out.has_value()) g.q_rows = T;
      steps.push_back(Step<CT, KT>{g, qp + b * width, cos.data_ptr<float>() + b * rot, sin.data_ptr<float>() + b * rot,
                               kb + lanes[b] * lane_elems, vb + lanes[b] * lane_elems, op + b * nh * hd});
      if (q_out.has_value()) steps.back().q_out = static_cast<CT*>(q_out->data_ptr()) + b * nh * hd;
      b = e;
    }
    for (const auto& st : steps)
      for (int64_t h = 0; h < nkv; ++h) fast ? write_kv_avx2(st, h) : write_kv_portable(st, h);
    // work items: a grouped step's kv heads (at most 128 queries each: group_*'s arrays), each
    // reading its keys once for its group's queries; other steps' queries one by one, in runs of
    // ~32K multiply-adds. The same bits as each step alone (attention_step). A single row takes
    // the grouped path from ROWS_GROUPED_KEYS keys on: below, its few queries ran faster one by one
    // (4 lanes' decode rows of 9 / 3 heads, fp16 bank, alternating builds: 100 keys 22.7 vs
    // 20.1 us, 512 keys even, 1024 121-127 vs 122-139, 4096 484-533 vs 603-619).
    constexpr int64_t ROWS_GROUPED_KEYS = 512;
    struct Item {
      int64_t step, a, b, kvh;  // grouped (kvh >= 0): queries [a, b) of kv head kvh; else work items [a, b)
    };
    std::vector<Item> items;
    std::vector<const int64_t*> lists(steps.size());
    std::vector<int64_t> widths(steps.size());
    std::vector<Step<CT, KT>> gsteps(steps);   // each step as the group paths take it (group_form)
    std::vector<TreeLists> trees(steps.size());
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, longest * hd));
    for (int64_t s = 0; s < static_cast<int64_t>(steps.size()); ++s) {
      const Geometry& g = steps[s].g;
      const int64_t per = g.nh / g.nkv * g.T;
      const bool grouped = group_form(steps[s], fast, gsteps[s], trees[s], &lists[s], &widths[s]) &&
                           (g.T > 1 || widths[s] >= ROWS_GROUPED_KEYS);
      if (grouped) {  // (at most 128 queries an item: group_*'s arrays)
        for (int64_t kvh = 0; kvh < nkv; ++kvh)
          for (int64_t u0 = 0; u0 < per; u0 += 128) items.push_back({s, u0, std::min(per, u0 + 128), kvh});
      } else {
        for (int64_t w0 = 0; w0 < nh * g.T; w0 += grain) items.push_back({s, w0, std::min(nh * g.T, w0 + grain), -1});
      }
    }
    // the score policy's masses: each thread's buckets for all the call's rows (MassBuffers), a
    // step's at its first row
    MassBuffers masses(mass_p, B * mass_stride);
    const bool wide = has_avx512();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scratch(longest + 2 * hd), buf;
      int64_t* mine = masses.mine();
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        const auto& st = steps[it.step];
        int64_t* m = mine != nullptr ? mine + (st.g.mass - mass_p) : nullptr;
        if (it.kvh >= 0) {
          run_group(gsteps[it.step], it.kvh, it.a, it.b, buf, lists[it.step], widths[it.step], m, wide);
          continue;
        }
        for (int64_t w = it.a; w < it.b; ++w)
          fast ? query_avx2(st, w, scratch.data(), m) : query_portable(st, w, scratch.data(), m);
      }
    });
    masses.add();
  });
  return out;
}

}  // namespace

namespace dflash {
at::Tensor attention_step_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv, double scale, bool portable,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double norm_eps, bool gated, const c10::optional<at::Tensor>& tree,
                             const c10::optional<at::Tensor>& write_rows, const c10::optional<at::Tensor>& key_rows,
                             const c10::optional<at::Tensor>& key_counts, const c10::optional<at::Tensor>& mass,
                             const c10::optional<at::Tensor>& q_out, const c10::optional<at::Tensor>& mass_keys) {
  return attention_step(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, scale, portable, q_norm, k_norm, norm_eps,
                        gated, 0, false, tree, write_rows, key_rows, key_counts, mass, q_out, mass_keys);
}
at::Tensor attention_keys_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, int64_t start, int64_t nh, int64_t nkv, double scale,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double norm_eps, const at::Tensor& write_rows, const at::Tensor& key_rows,
                             const at::Tensor& key_counts) {
  return attention_step(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, scale, false, q_norm, k_norm, norm_eps, false,
                        0, false, c10::nullopt, write_rows, key_rows, key_counts, c10::nullopt, c10::nullopt,
                        c10::nullopt);
}
at::Tensor attention_rows_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_bank,
                             at::Tensor& v_bank, at::IntArrayRef lanes, at::IntArrayRef positions, int64_t nh,
                             int64_t nkv, double scale, bool portable, const c10::optional<at::Tensor>& q_norm,
                             const c10::optional<at::Tensor>& k_norm, double norm_eps, bool gated,
                             const c10::optional<at::Tensor>& tree, const c10::optional<at::Tensor>& write_rows,
                             const c10::optional<at::Tensor>& key_rows, const c10::optional<at::Tensor>& key_counts,
                             const c10::optional<at::Tensor>& mass, const c10::optional<at::Tensor>& q_out,
                             const c10::optional<at::Tensor>& mass_keys) {
  return attention_rows(qkv, cos, sin, k_bank, v_bank, lanes, positions, nh, nkv, scale, portable, q_norm, k_norm,
                        norm_eps, gated, 0, false, tree, write_rows, key_rows, key_counts, mass, q_out, mass_keys);
}
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("attention_step(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int start, "
        "int nh, int nkv, float scale, bool portable=False, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float norm_eps=1e-6, bool gated=False, int window=0, bool v_norm=False, Tensor? tree=None, "
        "Tensor? write_rows=None, Tensor? key_rows=None, Tensor? key_counts=None, Tensor(c!)? mass=None, "
        "Tensor(d!)? q_out=None, Tensor? mass_keys=None) -> Tensor");
  m.def("attention_rows(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_bank, Tensor(b!) v_bank, int[] lanes, "
        "int[] positions, int nh, int nkv, float scale, bool portable=False, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float norm_eps=1e-6, bool gated=False, int window=0, bool v_norm=False, "
        "Tensor? tree=None, Tensor? write_rows=None, Tensor? key_rows=None, Tensor? key_counts=None, "
        "Tensor(c!)? mass=None, Tensor(d!)? q_out=None, Tensor? mass_keys=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("attention_step", &attention_step);
  m.impl("attention_rows", &attention_rows);
}
