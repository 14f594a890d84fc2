// Quantized matmul for 1..64 (or more) rows on GGUF block formats: y = x @ W^T.
//
// Weights stay in their GGUF blocks of 32 (Q4_0, Q4_1, Q8_0), repacked once at load into
// a lossless, kernel-friendly layout per output row: 4-bit codes as bytes 0..15 (or int8),
// then the fp16 block scales d and offsets e. Activations are quantized to int8 per block
// of 32 inside the op (scale = max|x| / 127, as llama.cpp's q8 activations).
//
// Per block b of one (row m, output n):   sum_i w_i x_i  ~=  dx * (dw * dot + e * sx)
//   Q4_0: w = dw * (q - 8)   -> e = -8 dw     Q4_1: w = dw * q + m  -> e = m
//   Q8_0: w = dw * q         -> e = 0          dot = sum_i q_i xq_i (exact int32), sx = sum_i xq_i
//
// Row-count invariance: every (m, n) is computed by the same sequence of operations
// whatever the number of rows: 8 int32 lanes (4 consecutive products each, exact), a
// float accumulator per lane updated block by block with one fused multiply-add, a scalar
// accumulator for the offset term, then a fixed summation order. The row loop only
// interleaves independent computations; threads split the outputs n, never the reduction.
// No -ffast-math: the compiler may not reorder. The AVX2, AVX-VNNI, AVX-512 VNNI and
// portable paths give bit-identical results (same integer lanes, same float sequence).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

constexpr int QK = 32;  // values per block
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml type ids

bool is_4bit(int64_t t) { return t == Q4_0 || t == Q4_1; }

// bytes of one repacked row: codes, then fp16 d[nb], then fp16 e[nb] (4-bit types only)
int64_t code_bytes(int64_t qtype, int64_t k) { return is_4bit(qtype) ? k / 2 : k; }
int64_t row_bytes(int64_t qtype, int64_t k) {
  int64_t nb = k / QK;
  return code_bytes(qtype, k) + 2 * nb + (is_4bit(qtype) ? 2 * nb : 0);
}

float h2f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
uint16_t f2h(float f) { return c10::Half(f).x; }

// ---- activations ------------------------------------------------------------------------
struct Acts {
  const int8_t* q;   // (M, K)
  const float* d;    // (M, nb)
  const int32_t* s;  // (M, nb): sum of the block's codes
};

template <typename T>
void quantize_rows(const T* x, int64_t m_rows, int64_t k, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = k / QK;
  at::parallel_for(0, m_rows, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const T* xb = x + m * k + b * QK;
        float v[QK], amax = 0.f;
        for (int i = 0; i < QK; ++i) {
          v[i] = static_cast<float>(xb[i]);
          amax = std::fmax(amax, std::fabs(v[i]));
        }
        const float db = amax / 127.f;
        const float id = db != 0.f ? 1.f / db : 0.f;
        int32_t sum = 0;
        int8_t* qb = q + m * k + b * QK;
        for (int i = 0; i < QK; ++i) {
          const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * id));
          qb[i] = static_cast<int8_t>(c < -127 ? -127 : (c > 127 ? 127 : c));
          sum += qb[i];
        }
        d[m * nb + b] = db;
        s[m * nb + b] = sum;
      }
    }
  });
}

// ---- the shared float part -----------------------------------------------------------------
inline float finish(const float lanes[8], float acc_e) {
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) + acc_e;
}

// ---- portable path ------------------------------------------------------------------------
template <int MR>
void rows_portable(int64_t qtype, const uint8_t* w, int64_t k, const Acts& a, int64_t m0, float* out[MR]) {
  const int64_t nb = k / QK;
  const uint8_t* codes = w;
  const uint16_t* dw = reinterpret_cast<const uint16_t*>(w + code_bytes(qtype, k));
  const uint16_t* ew = is_4bit(qtype) ? dw + nb : nullptr;
  float lanes[MR][8] = {};
  float acc_e[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t wq[QK];
    if (is_4bit(qtype)) {
      const uint8_t* p = codes + b * 16;
      for (int i = 0; i < 16; ++i) { wq[i] = p[i] & 0x0F; wq[i + 16] = p[i] >> 4; }
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(codes) + b * QK;
      for (int i = 0; i < QK; ++i) wq[i] = p[i];
    }
    const float d = h2f(dw[b]);
    const float e = ew ? h2f(ew[b]) : 0.f;
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = a.q + m * k + b * QK;
      const float dx = a.d[m * nb + b];
      const float scale = d * dx;
      for (int j = 0; j < 8; ++j) {
        int32_t lane = 0;
        for (int i = 0; i < 4; ++i) lane += wq[4 * j + i] * xq[4 * j + i];
        lanes[r][j] = std::fma(static_cast<float>(lane), scale, lanes[r][j]);
      }
      if (ew) acc_e[r] = std::fma(e * dx, static_cast<float>(a.s[m * nb + b]), acc_e[r]);
    }
  }
  for (int r = 0; r < MR; ++r) *out[r] = finish(lanes[r], acc_e[r]);
}

// ---- x86 paths: one template, three integer dot products ---------------------------------------
enum class Dot { AVX2, AVXVNNI, AVX512VNNI };

#define DFLASH_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DFLASH_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define DFLASH_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// 8 int32 lanes, lane j = sum of u[4j..4j+3] * s[4j..4j+3] (u unsigned bytes, s signed)
template <Dot D>
inline __m256i dot_us(__m256i u, __m256i s);

template <>
DFLASH_TARGET_AVX2 inline __m256i dot_us<Dot::AVX2>(__m256i u, __m256i s) {
  // u <= 255, |s| <= 127 in pairs: 2 * 255 * 127 overflows int16 saturation only for u > 128;
  // callers pass 4-bit codes or |w| <= 127, so the pair sums are exact
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
template <>
DFLASH_TARGET_AVXVNNI inline __m256i dot_us<Dot::AVXVNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
template <>
DFLASH_TARGET_AVX512 inline __m256i dot_us<Dot::AVX512VNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

#define DFLASH_ROWS_BODY(D)                                                                          \
  const int64_t nb = k / QK;                                                                         \
  const uint8_t* codes = w;                                                                          \
  const uint16_t* dw = reinterpret_cast<const uint16_t*>(w + code_bytes(qtype, k));                 \
  const bool four = is_4bit(qtype);                                                                  \
  const uint16_t* ew = four ? dw + nb : nullptr;                                                     \
  __m256 acc[MR];                                                                                    \
  float acc_e[MR];                                                                                   \
  for (int r = 0; r < MR; ++r) { acc[r] = _mm256_setzero_ps(); acc_e[r] = 0.f; }                     \
  const __m256i low4 = _mm256_set1_epi8(0x0F);                                                       \
  for (int64_t b = 0; b < nb; ++b) {                                                                 \
    __m256i wv;                                                                                      \
    if (four) {                                                                                      \
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 16));           \
      wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);                        \
    } else {                                                                                         \
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * QK));                     \
    }                                                                                                \
    const __m256i wabs = four ? wv : _mm256_sign_epi8(wv, wv);                                       \
    const float d = _cvtsh_ss(dw[b]);                                                                \
    const float e = four ? _cvtsh_ss(ew[b]) : 0.f;                                                   \
    for (int r = 0; r < MR; ++r) {                                                                   \
      const int64_t m = m0 + r;                                                                      \
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + m * k + b * QK));       \
      if (!four) xv = _mm256_sign_epi8(xv, wv);                                                      \
      const __m256i lane = dot_us<D>(wabs, xv);                                                      \
      const float dx = a.d[m * nb + b];                                                              \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane), _mm256_set1_ps(d * dx), acc[r]);           \
      if (four) acc_e[r] = std::fma(e * dx, static_cast<float>(a.s[m * nb + b]), acc_e[r]);         \
    }                                                                                                \
  }                                                                                                  \
  for (int r = 0; r < MR; ++r) {                                                                     \
    float lanes[8];                                                                                  \
    _mm256_storeu_ps(lanes, acc[r]);                                                                 \
    *out[r] = finish(lanes, acc_e[r]);                                                               \
  }

template <int MR>
DFLASH_TARGET_AVX2 void rows_avx2(int64_t qtype, const uint8_t* w, int64_t k, const Acts& a, int64_t m0,
                                  float* out[MR]) {
  DFLASH_ROWS_BODY(Dot::AVX2)
}
template <int MR>
DFLASH_TARGET_AVXVNNI void rows_avxvnni(int64_t qtype, const uint8_t* w, int64_t k, const Acts& a, int64_t m0,
                                        float* out[MR]) {
  DFLASH_ROWS_BODY(Dot::AVXVNNI)
}
template <int MR>
DFLASH_TARGET_AVX512 void rows_avx512(int64_t qtype, const uint8_t* w, int64_t k, const Acts& a, int64_t m0,
                                      float* out[MR]) {
  DFLASH_ROWS_BODY(Dot::AVX512VNNI)
}

enum class Isa { Portable, AVX2, AVXVNNI, AVX512VNNI };

bool supported(Isa isa) {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::AVX512VNNI:
      return base && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw");
    case Isa::AVXVNNI: return base && __builtin_cpu_supports("avxvnni");
    case Isa::AVX2: return base;
    default: return true;
  }
}

Isa detect() {
  for (Isa isa : {Isa::AVX512VNNI, Isa::AVXVNNI, Isa::AVX2})
    if (supported(isa)) return isa;
  return Isa::Portable;
}

Isa active_isa = detect();

template <int MR>
void rows(Isa isa, int64_t qtype, const uint8_t* w, int64_t k, const Acts& a, int64_t m0, float* out[MR]) {
  switch (isa) {
    case Isa::AVX512VNNI: return rows_avx512<MR>(qtype, w, k, a, m0, out);
    case Isa::AVXVNNI: return rows_avxvnni<MR>(qtype, w, k, a, m0, out);
    case Isa::AVX2: return rows_avx2<MR>(qtype, w, k, a, m0, out);
    default: return rows_portable<MR>(qtype, w, k, a, m0, out);
  }
}

void check_args(const at::Tensor& w, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dflash::qmm: unsupported block type ", qtype);
  TORCH_CHECK(k > 0 && k % QK == 0, "dflash::qmm: K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "dflash::qmm: weights must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n && w.size(1) == row_bytes(qtype, k),
              "dflash::qmm: weights of shape ", w.sizes(), " do not hold ", n, " rows of ", k, " values");
}

// y (M, N) = x (M, K) @ dequant(w)^T; x fp32 / bf16 / fp16, y in x's dtype
at::Tensor qmm(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, int64_t isa_override) {
  check_args(w, qtype, n, k);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.size(-1) == k, "dflash::qmm: x must be (..., ", k, ") on the CPU");
  auto x = x_in.reshape({-1, k}).contiguous();
  const int64_t m_rows = x.size(0);
  const int64_t nb = k / QK;
  auto q = at::empty({m_rows, k}, x.options().dtype(at::kChar));
  auto d = at::empty({m_rows, nb}, x.options().dtype(at::kFloat));
  auto s = at::empty({m_rows, nb}, x.options().dtype(at::kInt));
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows(x.data_ptr<float>(), m_rows, k, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                                   s.data_ptr<int32_t>()); break;
    case at::kBFloat16: quantize_rows(x.data_ptr<c10::BFloat16>(), m_rows, k, q.data_ptr<int8_t>(),
                                      d.data_ptr<float>(), s.data_ptr<int32_t>()); break;
    case at::kHalf: quantize_rows(x.data_ptr<c10::Half>(), m_rows, k, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                                  s.data_ptr<int32_t>()); break;
    default: TORCH_CHECK(false, "dflash::qmm: x must be float32, bfloat16 or float16");
  }
  auto y = at::empty({m_rows, n}, x.options().dtype(at::kFloat));
  const Acts a{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>()};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t rb = row_bytes(qtype, k);
  // another path may be asked for (tests compare them); never one the CPU lacks
  TORCH_CHECK(isa_override < 4, "dflash::qmm: unknown isa ", isa_override);
  const Isa isa = isa_override < 0 ? active_isa : static_cast<Isa>(isa_override);
  TORCH_CHECK(supported(isa), "dflash::qmm: this CPU cannot run isa ", isa_override);
  // each thread owns whole output columns: the weights of a column are read once per call
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, nb * m_rows));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* wr = wp + j * rb;
      int64_t m = 0;
      for (; m + 4 <= m_rows; m += 4) {
        float* o[4] = {yp + m * n + j, yp + (m + 1) * n + j, yp + (m + 2) * n + j, yp + (m + 3) * n + j};
        rows<4>(isa, qtype, wr, k, a, m, o);
      }
      for (; m < m_rows; ++m) {
        float* o[1] = {yp + m * n + j};
        rows<1>(isa, qtype, wr, k, a, m, o);
      }
    }
  });
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  return (x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type())).reshape(out_shape);
}

// GGUF blocks (N, nb * block bytes) -> the repacked layout (N, row_bytes)
at::Tensor repack(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dflash::repack: unsupported block type ", qtype);
  TORCH_CHECK(k > 0 && k % QK == 0, "dflash::repack: K must be a positive multiple of 32, got ", k);
  const int64_t nb = k / QK;
  const int64_t bsize = qtype == Q4_0 ? 18 : (qtype == Q4_1 ? 20 : 34);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.numel() == n * nb * bsize,
              "dflash::repack: expected ", n * nb * bsize, " contiguous CPU bytes");
  auto out = at::empty({n, row_bytes(qtype, k)}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t rb = row_bytes(qtype, k), cb = code_bytes(qtype, k);
  bool overflow = false;
  for (int64_t j = 0; j < n; ++j) {
    uint8_t* row = dst + j * rb;
    uint16_t* d = reinterpret_cast<uint16_t*>(row + cb);
    uint16_t* e = d + nb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = src + (j * nb + b) * bsize;
      uint16_t dh;
      std::memcpy(&dh, blk, 2);
      d[b] = dh;
      if (qtype == Q8_0) {
        std::memcpy(row + b * QK, blk + 2, QK);
        continue;
      }
      if (qtype == Q4_1) {
        std::memcpy(&e[b], blk + 2, 2);
      } else {
        const float eb = -8.f * h2f(dh);
        e[b] = f2h(eb);
        overflow |= h2f(e[b]) != eb;
      }
      std::memcpy(row + b * 16, blk + (qtype == Q4_1 ? 4 : 2), 16);
    }
  }
  TORCH_CHECK(!overflow, "dflash::repack: a Q4_0 scale does not fit the fp16 offset");
  return out;
}

int64_t isa_level() { return static_cast<int64_t>(active_isa); }
bool isa_supported(int64_t isa) { return isa >= 0 && isa < 4 && supported(static_cast<Isa>(isa)); }

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def("qmm(Tensor x, Tensor w, int qtype, int n, int k, int isa=-1) -> Tensor");
  m.def("repack(Tensor blocks, int qtype, int n, int k) -> Tensor");
  m.def("isa() -> int", &isa_level);
  m.def("isa_supported(int isa) -> bool", &isa_supported);
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("qmm", &qmm);
  m.impl("repack", &repack);
}
