// A Gated DeltaNet mixer (Qwen3.5 / Qwen3.6 linear attention) for a decode or verify block, after
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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
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

// the recurrence of one value head over all rows; q/k/v rows already prepared (fp32). Two
// builds of one arithmetic: per output element the same operations in the same order.
#define GDN_HEAD_PROLOGUE                                                     \
  const int64_t kh = h / (g.hv / g.hk), dv = g.dv, dk = g.dk;                 \
  std::vector<float> ks(dv), u(dv);

void head_rows_portable(const Gdn& g, int64_t h, const float* qn, const float* kn, const float* v, const float* beta,
                        const float* decay, float* S, float* o) {
  GDN_HEAD_PROLOGUE
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

__attribute__((target("avx2,fma"))) void head_rows_avx2(const Gdn& g, int64_t h, const float* qn, const float* kn,
                                                        const float* v, const float* beta, const float* decay,
                                                        float* S, float* o) {
  GDN_HEAD_PROLOGUE
  for (int64_t t = 0; t < g.T; ++t) {
    const float* q = qn + (t * g.hk + kh) * dk;
    const float* k = kn + (t * g.hk + kh) * dk;
    const float* vt = v + (t * g.hv + h) * dv;
    const __m256 dd = _mm256_set1_ps(decay[t * g.hv + h]), bb = _mm256_set1_ps(beta[t * g.hv + h]);
    float* ot = o + (t * g.hv + h) * dv;
    for (int64_t j = 0; j < dv; j += 8) _mm256_storeu_ps(ks.data() + j, _mm256_setzero_ps());
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      const __m256 ki = _mm256_set1_ps(k[i]);
      for (int64_t j = 0; j < dv; j += 8) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), dd);
        _mm256_storeu_ps(row + j, s);
        _mm256_storeu_ps(ks.data() + j, _mm256_fmadd_ps(s, ki, _mm256_loadu_ps(ks.data() + j)));
      }
    }
    for (int64_t j = 0; j < dv; j += 8) {
      _mm256_storeu_ps(u.data() + j,
                       _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(vt + j), _mm256_loadu_ps(ks.data() + j)), bb));
      _mm256_storeu_ps(ot + j, _mm256_setzero_ps());
    }
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
      for (int64_t j = 0; j < dv; j += 8) {
        const __m256 s = _mm256_fmadd_ps(ki, _mm256_loadu_ps(u.data() + j), _mm256_loadu_ps(row + j));
        _mm256_storeu_ps(row + j, s);
        _mm256_storeu_ps(ot + j, _mm256_fmadd_ps(s, qi, _mm256_loadu_ps(ot + j)));
      }
    }
  }
}

bool avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

DFLASH_INLINE float silu(float x) { return x / (1.f + std::exp(-x)); }

// l2-normalise n floats in place (sum of squares in index order), times ``scale``
DFLASH_INLINE void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const Gdn& g, const at::Tensor& mixed, const at::Tensor& conv,
                                                   const at::Tensor& w, const at::Tensor& neg_a,
                                                   const at::Tensor& dt_bias, const at::Tensor& norm_w,
                                                   const at::Tensor& ssm, bool fast) {
  const T* mx = mixed.data_ptr<T>();
  const T* cs = conv.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  const int64_t kw = g.K - 1;
  // the conv window over the block: [old window | the block's pre-conv rows], channel-major
  std::vector<float> y(g.T * g.conv_dim);
  auto new_conv = at::empty({1, g.conv_dim, kw}, conv.options());
  T* nc = new_conv.data_ptr<T>();
  at::parallel_for(0, g.conv_dim, 64, [&](int64_t c0, int64_t c1) {
    std::vector<T> win(kw + g.T);
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t i = 0; i < kw; ++i) win[i] = cs[c * kw + i];
      for (int64_t t = 0; t < g.T; ++t) win[kw + t] = mx[t * g.width + c];
      const float* wc = wp + c * g.K;
      for (int64_t t = 0; t < g.T; ++t) {
        float acc = 0.f;
        for (int64_t i = 0; i < g.K; ++i) acc = std::fma(wc[i], f(win[t + i]), acc);
        // rounded to the activation dtype as the conv's output is, then SiLU, rounded again
        y[t * g.conv_dim + c] = f(static_cast<T>(silu(f(static_cast<T>(acc)))));
      }
      for (int64_t i = 0; i < kw; ++i) nc[c * kw + i] = win[g.T + i];
    }
  });
  // q, k (L2-normalised; q scaled by dk^-0.5) per key head, v per value head, gates per value head
  const int64_t kd = g.hk * g.dk;
  std::vector<float> qn(g.T * kd), kn(g.T * kd), v(g.T * g.value_dim), beta(g.T * g.hv), decay(g.T * g.hv);
  const float* na = neg_a.data_ptr<float>();
  const float* db = dt_bias.data_ptr<float>();
  const float qscale = 1.f / std::sqrt(static_cast<float>(g.dk));
  for (int64_t t = 0; t < g.T; ++t) {
    const float* yt = y.data() + t * g.conv_dim;
    for (int64_t i = 0; i < kd; ++i) {
      qn[t * kd + i] = yt[i];
      kn[t * kd + i] = yt[kd + i];
    }
    for (int64_t h = 0; h < g.hk; ++h) {
      l2norm(qn.data() + t * kd + h * g.dk, g.dk, qscale);
      l2norm(kn.data() + t * kd + h * g.dk, g.dk, 1.f);
    }
    for (int64_t i = 0; i < g.value_dim; ++i) v[t * g.value_dim + i] = yt[2 * kd + i];
    const T* ba = mx + t * g.width + g.conv_dim + g.value_dim;  // b (hv), then a (hv)
    for (int64_t h = 0; h < g.hv; ++h) {
      const float b = f(ba[h]), a = f(ba[g.hv + h]) + db[h];
      beta[t * g.hv + h] = 1.f / (1.f + std::exp(-b));
      const float sp = a > 20.f ? a : std::log1p(std::exp(a));  // softplus (torch's threshold)
      decay[t * g.hv + h] = std::exp(na[h] * sp);
    }
  }
  auto new_ssm = ssm.clone();
  float* S = new_ssm.data_ptr<float>();
  std::vector<float> o(g.T * g.value_dim);
  at::parallel_for(0, g.hv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      float* Sh = S + h * g.dk * g.dv;
      if (fast)
        head_rows_avx2(g, h, qn.data(), kn.data(), v.data(), beta.data(), decay.data(), Sh, o.data());
      else
        head_rows_portable(g, h, qn.data(), kn.data(), v.data(), beta.data(), decay.data(), Sh, o.data());
    }
  });
  // gated RMSNorm per value head (fp32), times silu(z), in the activation dtype
  auto out = at::empty({1, g.T, g.value_dim}, mixed.options());
  T* op = out.data_ptr<T>();
  const float* nw = norm_w.data_ptr<float>();
  for (int64_t t = 0; t < g.T; ++t) {
    const T* z = mx + t * g.width + g.conv_dim;
    for (int64_t h = 0; h < g.hv; ++h) {
      const float* oh = o.data() + t * g.value_dim + h * g.dv;
      float ss = 0.f;
      for (int64_t j = 0; j < g.dv; ++j) ss = std::fma(oh[j], oh[j], ss);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(g.dv) + g.eps);
      for (int64_t j = 0; j < g.dv; ++j)
        op[t * g.value_dim + h * g.dv + j] = static_cast<T>(oh[j] * inv * nw[j] * silu(f(z[h * g.dv + j])));
    }
  }
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
  const bool fast = !portable && dv % 8 == 0 && avx2_fma();
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
