// A Gated DeltaNet mixer (Qwen3.5 / Qwen3.6 linear attention) for a block of rows (decode, verify, a prefill chunk), after
// its fused input projection and before its output projection, in one call: causal depthwise
// conv over the conv window + SiLU, q/k L2 norms, the gates (beta = sigmoid(b), decay =
// exp(-A * softplus(a + dt_bias))), the gated delta rule token by token on the fp32 state, and
// the gated RMSNorm (norm(o) * silu(z)). Tokens run in order and each token's arithmetic is the
// same whatever the block's length, so a block of T rows is bit-identical to T one-row calls
// (what makes speculative verify blocks and batched rows agree with plain decoding). Per value
// head, with S in R^{Dk x Dv}:
//     S <- decay * S;  u = beta * (v - S^T k);  S <- S + k u^T;  o = S^T q
// The vectorized build accumulates each output element in the same order as the portable one
// (across the key dimension, one fused multiply-add per step), so the two are bit-identical.
// SiLU uses the kernels' own exp (simd.h), so its vector form gives the scalar bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#define DFLASH_INLINE inline __attribute__((always_inline))

namespace {

struct Gdn {
  int64_t T, hk, hv, dk, dv, K;          // rows, key / value heads, head sizes, conv taps
  int64_t conv_dim, value_dim, width;    // channels of the conv; z's width; a row of ``mixed``
  float eps;
};

template <typename T>
DFLASH_INLINE float f(T v) { return static_cast<float>(v); }

// the recurrence of one value head over all rows, token by token (the reference arithmetic);
// q/k/v rows already prepared (fp32)
void head_rows_portable(const Gdn& g, int64_t h, const float* qn, const float* kn, const float* v, const float* beta,
                        const float* decay, float* S, float* o) {
  const int64_t kh = h / (g.hv / g.hk), dv = g.dv, dk = g.dk;
  std::vector<float> ks(dv), u(dv);
  for (int64_t t = 0; t < g.T; ++t) {
    const float* q = qn + (t * g.hk + kh) * dk;
    const float* k = kn + (t * g.hk + kh) * dk;
    const float* vt = v + (t * g.hv + h) * dv;
    const float d = decay[t * g.hv + h], b = beta[t * g.hv + h];
    float* ot = o + (t * g.hv + h) * dv;
    for (int64_t j = 0; j < dv; ++j) ks[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      for (int64_t j = 0; j < dv; ++j) {
        row[j] = row[j] * d;
        ks[j] = std::fma(row[j], k[i], ks[j]);
      }
    }
    for (int64_t j = 0; j < dv; ++j) {
      u[j] = (vt[j] - ks[j]) * b;
      ot[j] = 0.f;
    }
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      for (int64_t j = 0; j < dv; ++j) {
        row[j] = std::fma(k[i], u[j], row[j]);
        ot[j] = std::fma(row[j], q[i], ot[j]);
      }
    }
  }
}

// The same arithmetic, vectorized and reordered for speed without changing any result: each
// block of 8 NV value columns runs all T tokens while its slice of S (dk x 8 NV floats) stays in
// L1 (the columns of S evolve independently), and token t's second half (S += k u^T, o = S^T q)
// shares one pass over the slice with token t + 1's first half (S *= decay, ks = S^T k). Every
// element and accumulator sees the operations of the portable loop in the same order, so the
// bits are the portable build's, for a block of any length (a 512-row prefill chunk included).
template <int NV>
DFLASH_SIMD_AVX2 void head_block_avx2(const Gdn& g, int64_t h, int64_t j0, const float* qn,
                                                         const float* kn, const float* v, const float* beta,
                                                         const float* decay, float* S, float* o) {
  const int64_t kh = h / (g.hv / g.hk), dv = g.dv, dk = g.dk;
  auto key = [&](int64_t t) { return kn + (t * g.hk + kh) * dk; };
  __m256 ks[NV], u[NV], oo[NV];
  {  // token 0's first half
    const float* k = key(0);
    const __m256 dd = _mm256_set1_ps(decay[h]);
    for (int n = 0; n < NV; ++n) ks[n] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv + j0;
      const __m256 ki = _mm256_set1_ps(k[i]);
      for (int n = 0; n < NV; ++n) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * n), dd);
        _mm256_storeu_ps(row + 8 * n, s);
        ks[n] = _mm256_fmadd_ps(s, ki, ks[n]);
      }
    }
  }
  for (int64_t t = 0; t < g.T; ++t) {
    const float* vt = v + (t * g.hv + h) * dv + j0;
    const __m256 bb = _mm256_set1_ps(beta[t * g.hv + h]);
    for (int n = 0; n < NV; ++n) {
      u[n] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(vt + 8 * n), ks[n]), bb);
      oo[n] = _mm256_setzero_ps();
    }
    const float *k = key(t), *q = qn + (t * g.hk + kh) * dk;
    if (t + 1 < g.T) {  // this token's second half, the next one's first half
      const float* k2 = key(t + 1);
      const __m256 dd = _mm256_set1_ps(decay[(t + 1) * g.hv + h]);
      for (int n = 0; n < NV; ++n) ks[n] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv + j0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]), k2i = _mm256_set1_ps(k2[i]);
        for (int n = 0; n < NV; ++n) {
          __m256 s = _mm256_fmadd_ps(ki, u[n], _mm256_loadu_ps(row + 8 * n));
          oo[n] = _mm256_fmadd_ps(s, qi, oo[n]);
          s = _mm256_mul_ps(s, dd);
          _mm256_storeu_ps(row + 8 * n, s);
          ks[n] = _mm256_fmadd_ps(s, k2i, ks[n]);
        }
      }
    } else {
      for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv + j0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        for (int n = 0; n < NV; ++n) {
          const __m256 s = _mm256_fmadd_ps(ki, u[n], _mm256_loadu_ps(row + 8 * n));
          _mm256_storeu_ps(row + 8 * n, s);
          oo[n] = _mm256_fmadd_ps(s, qi, oo[n]);
        }
      }
    }
    float* ot = o + (t * g.hv + h) * dv + j0;
    for (int n = 0; n < NV; ++n) _mm256_storeu_ps(ot + 8 * n, oo[n]);
  }
}

// columns [8 c0, 8 c1) of value head h's state (c: 8-column groups), two groups at a time
DFLASH_SIMD_AVX2 void head_cols_avx2(const Gdn& g, int64_t h, int64_t c0, int64_t c1,
                                                        const float* qn, const float* kn, const float* v,
                                                        const float* beta, const float* decay, float* S, float* o) {
  int64_t c = c0;
  for (; c + 2 <= c1; c += 2) head_block_avx2<2>(g, h, 8 * c, qn, kn, v, beta, decay, S, o);
  for (; c < c1; ++c) head_block_avx2<1>(g, h, 8 * c, qn, kn, v, beta, decay, S, o);
}


// SiLU with the kernels' own exp (simd.h), so the vector phases below give the scalar bits
DFLASH_INLINE float silu(float x) { return dflash::simd::silu_mul_one(x, 1.f); }

// l2-normalise n floats in place (sum of squares in index order), times ``scale``
DFLASH_INLINE void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// The pointers of one call, shared by its phases.
template <typename T>
struct Call {
  const Gdn& g;
  const T* mx;       // the block's projection rows (T, width)
  const T* cs;       // the old conv window (conv_dim, K-1)
  const float* wp;   // conv weights (conv_dim, K)
  const float* na;   // -A (hv)
  const float* db;   // dt_bias (hv)
  const float* nw;   // the gated norm's weight (dv)
  float* y;          // conv + SiLU output (T, conv_dim)
  T* nc;             // the new conv window
  float *qn, *kn, *v, *beta, *decay, *o;
  T* out;
};

// The per-element phases (conv, gates and norms, the gated RMSNorm), each compiled twice from
// one body: with FMA instructions and for any x86-64 (where std::fma is a libm call, ~20x
// slower); fma rounds once either way, so both builds give the same bits.
// Channels [c0, c1) of the conv window over the block: [old window | the block's pre-conv rows].
template <typename T>
DFLASH_INLINE void conv_channels(const Call<T>& a, int64_t c0, int64_t c1) {
  const Gdn& g = a.g;
  const int64_t kw = g.K - 1;
  std::vector<T> win(kw + g.T);
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t i = 0; i < kw; ++i) win[i] = a.cs[c * kw + i];
    for (int64_t t = 0; t < g.T; ++t) win[kw + t] = a.mx[t * g.width + c];
    const float* wc = a.wp + c * g.K;
    for (int64_t t = 0; t < g.T; ++t) {
      float acc = 0.f;
      for (int64_t i = 0; i < g.K; ++i) acc = std::fma(wc[i], f(win[t + i]), acc);
      // rounded to the activation dtype as the conv's output is, then SiLU, rounded again
      a.y[t * g.conv_dim + c] = f(static_cast<T>(silu(f(static_cast<T>(acc)))));
    }
    for (int64_t i = 0; i < kw; ++i) a.nc[c * kw + i] = win[g.T + i];
  }
}

// rows [t0, t1): q, k (L2-normalised; q scaled by dk^-0.5) per key head, v per value head,
// the gates per value head
template <typename T>
DFLASH_INLINE void gate_rows(const Call<T>& a, int64_t t0, int64_t t1) {
  const Gdn& g = a.g;
  const int64_t kd = g.hk * g.dk;
  const float qscale = 1.f / std::sqrt(static_cast<float>(g.dk));
  for (int64_t t = t0; t < t1; ++t) {
    const float* yt = a.y + t * g.conv_dim;
    for (int64_t i = 0; i < kd; ++i) {
      a.qn[t * kd + i] = yt[i];
      a.kn[t * kd + i] = yt[kd + i];
    }
    for (int64_t h = 0; h < g.hk; ++h) {
      l2norm(a.qn + t * kd + h * g.dk, g.dk, qscale);
      l2norm(a.kn + t * kd + h * g.dk, g.dk, 1.f);
    }
    for (int64_t i = 0; i < g.value_dim; ++i) a.v[t * g.value_dim + i] = yt[2 * kd + i];
    const T* ba = a.mx + t * g.width + g.conv_dim + g.value_dim;  // b (hv), then a (hv)
    for (int64_t h = 0; h < g.hv; ++h) {
      const float b = f(ba[h]), x = f(ba[g.hv + h]) + a.db[h];
      a.beta[t * g.hv + h] = 1.f / (1.f + std::exp(-b));
      const float sp = x > 20.f ? x : std::log1p(std::exp(x));  // softplus (torch's threshold)
      a.decay[t * g.hv + h] = std::exp(a.na[h] * sp);
    }
  }
}

// 1 / rms of a value head's output (sum of squares in index order)
DFLASH_INLINE float inv_rms(const float* oh, int64_t dv, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) ss = std::fma(oh[j], oh[j], ss);
  return 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
}

// rows [t0, t1): the gated RMSNorm per value head (fp32), times silu(z), in the activation dtype
template <typename T>
DFLASH_INLINE void norm_rows(const Call<T>& a, int64_t t0, int64_t t1) {
  const Gdn& g = a.g;
  for (int64_t t = t0; t < t1; ++t) {
    const T* z = a.mx + t * g.width + g.conv_dim;
    for (int64_t h = 0; h < g.hv; ++h) {
      const float* oh = a.o + t * g.value_dim + h * g.dv;
      const float inv = inv_rms(oh, g.dv, g.eps);
      for (int64_t j = 0; j < g.dv; ++j)
        a.out[t * g.value_dim + h * g.dv + j] = static_cast<T>(oh[j] * inv * a.nw[j] * silu(f(z[h * g.dv + j])));
    }
  }
}

// 8 fp32 values rounded to T and back (T = float: as they are; bf16: c10's rounding)
template <typename T>
DFLASH_SIMD_AVX2 inline __m256 round8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[8];
    dflash::simd::store8(x, tmp);
    return dflash::simd::load8(tmp);
  }
}

// The conv over rows [t0, t1), 8 channels at a time (conv_channels' arithmetic: per channel the
// taps in order, one fma each, the same roundings and SiLU), for T = float or bf16 and a
// channel count that is a multiple of 8. ``head``: the old window as rows (K-1, conv_dim).
template <typename T>
DFLASH_SIMD_AVX2 void conv_rows_avx2(const Call<T>& a, const T* head, const float* wt, int64_t t0, int64_t t1) {
  const Gdn& g = a.g;
  const int64_t kw = g.K - 1;
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < g.conv_dim; c += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < g.K; ++i) {
        const int64_t r = t + i - kw;  // the window's row: the old window before the block's rows
        const T* x = r < 0 ? head + (r + kw) * g.conv_dim + c : a.mx + r * g.width + c;
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + i * g.conv_dim + c), dflash::simd::load8(x), acc);
      }
      _mm256_storeu_ps(a.y + t * g.conv_dim + c, round8<T>(dflash::simd::silu_mul8(round8<T>(acc), one)));
    }
}

// norm_rows' arithmetic with the elementwise part 8 at a time (same T and width conditions)
template <typename T>
DFLASH_SIMD_AVX2 void norm_rows_avx2(const Call<T>& a, int64_t t0, int64_t t1) {
  const Gdn& g = a.g;
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t t = t0; t < t1; ++t) {
    const T* z = a.mx + t * g.width + g.conv_dim;
    for (int64_t h = 0; h < g.hv; ++h) {
      const float* oh = a.o + t * g.value_dim + h * g.dv;
      const __m256 inv = _mm256_set1_ps(inv_rms(oh, g.dv, g.eps));
      for (int64_t j = 0; j < g.dv; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(oh + j), inv), _mm256_loadu_ps(a.nw + j));
        const __m256 r = _mm256_mul_ps(x, dflash::simd::silu_mul8(dflash::simd::load8(z + h * g.dv + j), one));
        T* dst = a.out + t * g.value_dim + h * g.dv + j;
        if constexpr (std::is_same_v<T, float>)
          _mm256_storeu_ps(dst, r);
        else
          dflash::simd::store8(r, dst);
      }
    }
  }
}

#define GDN_PHASE(NAME)                                                                                    \
  template <typename T>                                                                                    \
  DFLASH_SIMD_AVX2 void NAME##_fma(const Call<T>& a, int64_t x0, int64_t x1) {                             \
    NAME(a, x0, x1);                                                                                       \
  }                                                                                                        \
  template <typename T>                                                                                    \
  void NAME##_portable(const Call<T>& a, int64_t x0, int64_t x1) {                                        \
    NAME(a, x0, x1);                                                                                       \
  }
GDN_PHASE(conv_channels)
GDN_PHASE(gate_rows)
GDN_PHASE(norm_rows)
#undef GDN_PHASE

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const Gdn& g, const at::Tensor& mixed, const at::Tensor& conv,
                                                   const at::Tensor& w, const at::Tensor& neg_a,
                                                   const at::Tensor& dt_bias, const at::Tensor& norm_w,
                                                   const at::Tensor& ssm, bool fast) {
  const int64_t kd = g.hk * g.dk;
  std::vector<float> y(g.T * g.conv_dim), qn(g.T * kd), kn(g.T * kd), v(g.T * g.value_dim), beta(g.T * g.hv),
      decay(g.T * g.hv), o(g.T * g.value_dim);
  auto new_conv = at::empty({1, g.conv_dim, g.K - 1}, conv.options());
  auto out = at::empty({1, g.T, g.value_dim}, mixed.options());
  const Call<T> a{g, mixed.data_ptr<T>(), conv.data_ptr<T>(), w.data_ptr<float>(), neg_a.data_ptr<float>(),
                  dt_bias.data_ptr<float>(), norm_w.data_ptr<float>(), y.data(), new_conv.data_ptr<T>(), qn.data(),
                  kn.data(), v.data(), beta.data(), decay.data(), o.data(), out.data_ptr<T>()};
  // vector phases for fp32 / bf16 activations and widths of whole vectors (dv % 8 == 0 with fast)
  const bool vec = fast && !std::is_same_v<T, c10::Half> && g.conv_dim % 8 == 0;
  if (vec) {
    const int64_t kw = g.K - 1;
    std::vector<T> head(kw * g.conv_dim);  // the old window as rows, the weights tap-major
    std::vector<float> wt(g.K * g.conv_dim);
    for (int64_t c = 0; c < g.conv_dim; ++c) {
      for (int64_t i = 0; i < kw; ++i) head[i * g.conv_dim + c] = a.cs[c * kw + i];
      for (int64_t i = 0; i < g.K; ++i) wt[i * g.conv_dim + c] = a.wp[c * g.K + i];
      for (int64_t i = 0; i < kw; ++i) {  // the new window: the last K-1 rows of [old window | block]
        const int64_t r = g.T + i - kw;
        a.nc[c * kw + i] = r < 0 ? head[(r + kw) * g.conv_dim + c] : a.mx[r * g.width + c];
      }
    }
    at::parallel_for(0, g.T, std::max<int64_t>(1, 65536 / (g.conv_dim * g.K)), [&](int64_t t0, int64_t t1) {
      if constexpr (!std::is_same_v<T, c10::Half>) conv_rows_avx2(a, head.data(), wt.data(), t0, t1);
    });
  } else {
    at::parallel_for(0, g.conv_dim, 64, [&](int64_t c0, int64_t c1) {
      fast ? conv_channels_fma(a, c0, c1) : conv_channels_portable(a, c0, c1);
    });
  }
  at::parallel_for(0, g.T, 8, [&](int64_t t0, int64_t t1) {
    fast ? gate_rows_fma(a, t0, t1) : gate_rows_portable(a, t0, t1);
  });
  auto new_ssm = ssm.clone();
  float* S = new_ssm.data_ptr<float>();
  if (fast) {  // (head, 8-column group) items: independent slices of the state, split over the threads
    const int64_t groups = g.dv / 8, items = g.hv * groups;
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(groups, 16384 / std::max<int64_t>(1, g.T * g.dk)));
    at::parallel_for(0, items, grain, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1;) {  // runs of groups within one head
        const int64_t h = w / groups, c0 = w % groups, c1 = std::min(groups, c0 + (w1 - w));
        head_cols_avx2(g, h, c0, c1, a.qn, a.kn, a.v, a.beta, a.decay, S + h * g.dk * g.dv, a.o);
        w += c1 - c0;
      }
    });
  } else {
    at::parallel_for(0, g.hv, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h)
        head_rows_portable(g, h, a.qn, a.kn, a.v, a.beta, a.decay, S + h * g.dk * g.dv, a.o);
    });
  }
  at::parallel_for(0, g.T, 8, [&](int64_t t0, int64_t t1) {
    if constexpr (!std::is_same_v<T, c10::Half>) {
      if (vec) return norm_rows_avx2(a, t0, t1);
    }
    fast ? norm_rows_fma(a, t0, t1) : norm_rows_portable(a, t0, t1);
  });
  return {out, new_conv, new_ssm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_step(const at::Tensor& mixed_in, const at::Tensor& conv_in,
                                                        const at::Tensor& conv_w, const at::Tensor& neg_a,
                                                        const at::Tensor& dt_bias, const at::Tensor& norm_w,
                                                        double eps, const at::Tensor& ssm_in, int64_t hk, int64_t hv,
                                                        int64_t dk, int64_t dv, bool portable) {
  TORCH_CHECK(mixed_in.device().is_cpu() && mixed_in.dim() == 3 && mixed_in.size(0) == 1,
              "dflash::gdn_step: mixed must be (1, T, width) on the CPU");
  TORCH_CHECK(hk > 0 && hv > 0 && hv % hk == 0 && dk > 0 && dv > 0, "dflash::gdn_step: bad head counts");
  const int64_t conv_dim = 2 * hk * dk + hv * dv, value_dim = hv * dv;
  TORCH_CHECK(mixed_in.size(2) == conv_dim + value_dim + 2 * hv, "dflash::gdn_step: mixed width does not match heads");
  TORCH_CHECK(conv_w.dim() == 2 && conv_w.size(0) == conv_dim && conv_w.size(1) >= 2,
              "dflash::gdn_step: conv weight must be (conv_dim, K)");
  const int64_t K = conv_w.size(1);
  TORCH_CHECK(conv_in.dim() == 3 && conv_in.size(0) == 1 && conv_in.size(1) == conv_dim && conv_in.size(2) == K - 1 &&
                  conv_in.scalar_type() == mixed_in.scalar_type(),
              "dflash::gdn_step: conv state must be (1, conv_dim, K-1) in mixed's dtype");
  TORCH_CHECK(ssm_in.scalar_type() == at::kFloat && ssm_in.dim() == 4 && ssm_in.size(0) == 1 && ssm_in.size(1) == hv &&
                  ssm_in.size(2) == dk && ssm_in.size(3) == dv,
              "dflash::gdn_step: state must be fp32 (1, hv, dk, dv)");
  TORCH_CHECK(neg_a.numel() == hv && dt_bias.numel() == hv && norm_w.numel() == dv,
              "dflash::gdn_step: A, dt_bias (hv) and norm weight (dv) sizes");
  Gdn g{mixed_in.size(1), hk, hv, dk, dv, K, conv_dim, value_dim, mixed_in.size(2), static_cast<float>(eps)};
  auto mixed = mixed_in.contiguous();
  auto conv = conv_in.contiguous();
  auto w = conv_w.to(at::kFloat).contiguous();
  auto na = neg_a.to(at::kFloat).contiguous(), db = dt_bias.to(at::kFloat).contiguous();
  auto nw = norm_w.to(at::kFloat).contiguous();
  auto ssm = ssm_in.contiguous();
  const bool fast = !portable && dv % 8 == 0 && dflash::simd::has_avx2();
  switch (mixed.scalar_type()) {
    case at::kFloat: return run<float>(g, mixed, conv, w, na, db, nw, ssm, fast);
    case at::kBFloat16: return run<c10::BFloat16>(g, mixed, conv, w, na, db, nw, ssm, fast);
    case at::kHalf: return run<c10::Half>(g, mixed, conv, w, na, db, nw, ssm, fast);
    default: TORCH_CHECK(false, "dflash::gdn_step: mixed must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("gdn_step(Tensor mixed, Tensor conv, Tensor conv_w, Tensor neg_a, Tensor dt_bias, Tensor norm_w, float eps, "
        "Tensor ssm, int hk, int hv, int dk, int dv, bool portable=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) { m.impl("gdn_step", &gdn_step); }
