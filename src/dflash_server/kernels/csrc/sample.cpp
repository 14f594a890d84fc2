// Sampling over a vocabulary, for every sampled token (engine/sampling.py): the softmax of
// logits at a temperature and a draw by the inverse CDF. aten's path took ~140 us a token over
// 49,152 fp32 logits on the dev CPU (its exp over the row alone ~40 us, a cumulative sum in
// fp64 ~45 us, and ~8 more ops), about 3% of a decode step, and more in a DFlash verify block,
// where every row is sampled; here one pass finds the maximum, one computes and sums the exps,
// one scales, and a draw reads block sums, then one block.
//
// softmax_t: p_i = e_i * (1 / sum_j e_j), e_i = exp((x_i - max) * inv_t) by the kernels' exp
// (simd::EXP_C: a Cody-Waite reduction and a degree-7 polynomial, ~1 ulp), 0 below -87 and for
// -inf logits (a grammar's mask keeps probability 0 exactly); the sum over 8 lanes (element i
// in lane i % 8) added in a fixed order. A row with a NaN, or with no finite logit, comes out
// all NaN, as aten's softmax gives it.
//
// draw: the first index i with w_0 + ... + w_i > u * total, the sums in fp64 (blocks of 256
// elements, 4 lanes each, then the blocks in order; inside the chosen block element by
// element), so a weight of 0 is never drawn. -1 when the total is 0 or not finite (the caller
// then takes aten's path, which defines those cases).
//
// The AVX2 and the portable builds run the same operations in the same order
// (-ffp-contract=off, explicit fused multiply-adds), so their results are the same bits.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using dflash::simd::load8;

constexpr float EXP_LO = -87.f;  // below it (and -inf, NaN aside): exp taken as 0

inline float exp_le0(float a) {  // a <= 0, not NaN
  return a >= EXP_LO ? dflash::simd::exp_in_range(a) : 0.f;
}

DFLASH_SIMD_AVX2 inline __m256 exp8_le0(__m256 a) {
  const __m256 keep = _mm256_cmp_ps(a, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
  // (the lanes set to 0 compute exp(-87))
  return _mm256_and_ps(dflash::simd::exp8_in_range(_mm256_max_ps(a, _mm256_set1_ps(EXP_LO))), keep);
}

inline float sum8(const float a[8]) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

template <typename T>
float max_or_nan(const T* x, int64_t n) {  // the row's maximum; NaN if a value is NaN
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return v;
    m = v > m ? v : m;
  }
  return m;
}

template <typename T>
DFLASH_SIMD_AVX2 float max_or_nan_avx2(const T* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    m = _mm256_max_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan)) return std::numeric_limits<float>::quiet_NaN();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (int j = 1; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return v;
    best = v > best ? v : best;
  }
  return best;
}

// the exps of the row's full 8s into out, their lanes' sums into part; returns how many
template <typename T>
DFLASH_SIMD_AVX2 int64_t exp_pass_avx2(const T* x, float* out, int64_t n, float m, float inv_t, float part[8]) {
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8_le0(_mm256_mul_ps(_mm256_sub_ps(load8(x + j), mv), tv));
    _mm256_storeu_ps(out + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  _mm256_storeu_ps(part, acc);
  return j;
}

DFLASH_SIMD_AVX2 int64_t scale_pass_avx2(float* out, int64_t n, float inv) {
  const __m256 tv = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(out + k), tv));
  return k;
}

// one row: out = softmax((x - max) * inv_t)
template <typename T>
void softmax_row(const T* x, float* out, int64_t n, float inv_t, bool fast) {
  const float m = fast ? max_or_nan_avx2(x, n) : max_or_nan(x, n);
  if (std::isnan(m) || !std::isfinite(m)) {  // a NaN, or no finite logit: aten gives NaN
    for (int64_t i = 0; i < n; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = fast ? exp_pass_avx2(x, out, n, m, inv_t, part) : 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      out[i + l] = exp_le0((static_cast<float>(x[i + l]) - m) * inv_t);
      part[l] += out[i + l];
    }
  for (; i < n; ++i) {  // the tail: lane i % 8, as a full pass of 8 would put it
    out[i] = exp_le0((static_cast<float>(x[i]) - m) * inv_t);
    part[i % 8] += out[i];
  }
  const float inv = 1.f / sum8(part);  // (the sum is >= 1: the maximum's own exp is 1)
  int64_t j = fast ? scale_pass_avx2(out, n, inv) : 0;
  for (; j < n; ++j) out[j] = out[j] * inv;
}

at::Tensor softmax_t(const at::Tensor& x_in, double inv_t, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1 && x_in.size(-1) > 0,
              "dflash::softmax_t: a CPU tensor with a non-empty last dimension");
  TORCH_CHECK(std::isfinite(inv_t) && inv_t > 0, "dflash::softmax_t: inv_t must be positive and finite");
  auto x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const bool fast = !portable && dflash::simd::has_avx2();
  const float t = static_cast<float>(inv_t);
  float* o = out.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat:
      for (int64_t r = 0; r < rows; ++r) softmax_row(x.data_ptr<float>() + r * n, o + r * n, n, t, fast);
      break;
    case at::kBFloat16:
      for (int64_t r = 0; r < rows; ++r) softmax_row(x.data_ptr<c10::BFloat16>() + r * n, o + r * n, n, t, fast);
      break;
    case at::kHalf:
      for (int64_t r = 0; r < rows; ++r) softmax_row(x.data_ptr<c10::Half>() + r * n, o + r * n, n, t, fast);
      break;
    default: TORCH_CHECK(false, "dflash::softmax_t: float32, bfloat16 or float16 only");
  }
  return out;
}

constexpr int64_t DRAW_BLOCK = 256;

// a block's sum (4 lanes, element i in lane i % 4, then (l0 + l1) + (l2 + l3)), or -1 when a
// weight in it is negative (a NaN makes the sum NaN)
template <typename T>
double block_sum(const T* w, int64_t n) {
  double lane[4] = {0., 0., 0., 0.};
  bool negative = false;
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(w[i]);
    negative |= v < 0.;
    lane[i % 4] += v;
  }
  return negative ? -1. : (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

template <typename T>
DFLASH_SIMD_AVX2 double block_sum_avx2(const T* w, int64_t n) {
  if (n != DRAW_BLOCK) return block_sum(w, n);
  __m256d acc = _mm256_setzero_pd(), low = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; i += 4) {
    __m256d v;
    if constexpr (std::is_same_v<T, float>) v = _mm256_cvtps_pd(_mm_loadu_ps(w + i));
    else v = _mm256_loadu_pd(w + i);
    acc = _mm256_add_pd(acc, v);
    low = _mm256_min_pd(low, v);
  }
  alignas(32) double lane[4], lows[4];
  _mm256_store_pd(lane, acc);
  _mm256_store_pd(lows, low);
  if (lows[0] < 0. || lows[1] < 0. || lows[2] < 0. || lows[3] < 0.) return -1.;
  return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

template <typename T>
int64_t draw_row(const T* w, int64_t n, double u, bool fast) {
  const int64_t nb = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
  std::vector<double> sums(static_cast<size_t>(nb));
  double total = 0.;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = std::min(DRAW_BLOCK, n - b * DRAW_BLOCK);
    sums[b] = fast ? block_sum_avx2(w + b * DRAW_BLOCK, len) : block_sum(w + b * DRAW_BLOCK, len);
    if (!(sums[b] >= 0.)) return -1;  // a negative or NaN weight: aten's path
    total += sums[b];
  }
  if (!(total > 0.) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double run = 0.;
  int64_t b = 0;
  while (b + 1 < nb && run + sums[b] <= target) run += sums[b++];
  const int64_t lo = b * DRAW_BLOCK, hi = std::min(n, lo + DRAW_BLOCK);
  int64_t last = -1;  // the block's last positive weight (where rounding leaves the target just past its sum)
  for (int64_t i = lo; i < hi; ++i) {
    const double v = static_cast<double>(w[i]);
    if (v > 0.) {
      last = i;
      if (run + v > target) return i;
      run += v;
    }
  }
  if (last >= 0) return last;
  for (int64_t i = lo - 1; i >= 0; --i)  // (an empty block chosen by rounding: the last positive before it)
    if (static_cast<double>(w[i]) > 0.) return i;
  return -1;
}

int64_t draw(const at::Tensor& w_in, double u, bool portable) {
  TORCH_CHECK(w_in.device().is_cpu() && w_in.dim() == 1 && w_in.numel() > 0,
              "dflash::draw: a non-empty 1-D CPU tensor of weights");
  TORCH_CHECK(u >= 0. && u < 1., "dflash::draw: u must be in [0, 1)");
  auto w = w_in.contiguous();
  const bool fast = !portable && dflash::simd::has_avx2();
  switch (w.scalar_type()) {
    case at::kFloat: return draw_row(w.data_ptr<float>(), w.numel(), u, fast);
    case at::kDouble: return draw_row(w.data_ptr<double>(), w.numel(), u, fast);
    default: TORCH_CHECK(false, "dflash::draw: float32 or float64 weights only");
  }
}

// top_p_candidates: the best tokens of a distribution, sorted by probability (ties by id), enough
// of them for top-p: every token of the buckets (probabilities grouped by their float's exponent and
// 3 mantissa bits) from the most likely down to the first where the mass reaches top_p + MARGIN.
// That holds every token the top-p rule keeps and the next ones past its boundary, so the caller's
// rule (engine/sampling.py, on this sorted prefix) decides as over the fully sorted vocabulary, in
// one pass and a sort of the candidates instead of widening top-k probes (~0.5 ms a token for a
// flat distribution over 49,152 tokens). Empty tensors (the caller's path) for a negative or NaN
// probability, or where the margin takes the whole vocabulary.
constexpr double TOP_P_MARGIN = 1e-3;
constexpr int TOP_P_SHIFT = 20;  // bucket = float bits >> 20: 2^-3 wide in the mantissa

std::vector<at::Tensor> top_p_candidates(const at::Tensor& p_in, double top_p) {
  TORCH_CHECK(p_in.device().is_cpu() && p_in.dim() == 1 && p_in.numel() > 0 && p_in.scalar_type() == at::kFloat,
              "dflash::top_p_candidates: a non-empty 1-D float32 CPU tensor");
  TORCH_CHECK(top_p > 0. && top_p < 1., "dflash::top_p_candidates: top_p must be in (0, 1)");
  auto p = p_in.contiguous();
  const float* v = p.data_ptr<float>();
  const int64_t n = p.numel();
  constexpr int NB = (0x7F800000 >> TOP_P_SHIFT) + 1;  // every finite non-negative float's bucket
  std::vector<double> mass(NB, 0.);
  std::vector<int64_t> count(NB, 0);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    if (bits >= 0x7F800000u) return {};  // negative (sign bit), inf or NaN: the caller's path
    const int b = static_cast<int>(bits >> TOP_P_SHIFT);
    mass[b] += v[i];
    count[b] += 1;
  }
  double total = 0.;
  for (double m : mass) total += m;
  const double target = (top_p + TOP_P_MARGIN) * total;
  double cum = 0.;
  int low = NB;  // the lowest bucket taken
  int64_t taken = 0;
  for (int b = NB - 1; b > 0 && cum < target; --b)
    if (count[b]) cum += mass[b], taken += count[b], low = b;
  if (cum < target || taken >= n) return {};  // (the margin reaches the zeros, or takes every token)
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(taken));
  const uint32_t floor_bits = static_cast<uint32_t>(low) << TOP_P_SHIFT;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    if (bits >= floor_bits) ids.push_back(i);
  }
  std::sort(ids.begin(), ids.end(), [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  auto out_ids = at::empty({static_cast<int64_t>(ids.size())}, p.options().dtype(at::kLong));
  auto out_vals = at::empty({static_cast<int64_t>(ids.size())}, p.options());
  int64_t* oi = out_ids.data_ptr<int64_t>();
  float* ov = out_vals.data_ptr<float>();
  for (size_t j = 0; j < ids.size(); ++j) oi[j] = ids[j], ov[j] = v[ids[j]];
  return {out_vals, out_ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("softmax_t(Tensor x, float inv_t, bool portable=False) -> Tensor");
  m.def("draw(Tensor w, float u, bool portable=False) -> int");
  m.def("top_p_candidates(Tensor p, float top_p) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("softmax_t", &softmax_t);
  m.impl("draw", &draw);
  m.impl("top_p_candidates", &top_p_candidates);
}
