// 4- and 5-bit weights kept in their blocks: y[M, N] = x[M, K] W[N, K]^T (+ bias) for a weight stored as GGUF
// Q4_0 / Q4_1 (/ Q4_K, Q5_1, Q5_K, GPTQ, AWQ) blocks, W[n, k] = q[n, k] * d[n, b] + m[n, b] with q in 0..15 (or
// 0..31) and b = k / 32 (Q4_0 is m = -8 d).
// kvloom/ops/q4.py says what the product means; q4_linear_reference is the oracle the tests compare with.
//
// The product is llama.cpp's (vec_dot_q4_1_q8_1): x is quantized per (row, block of 32 k) to s8 codes with an
// fp32 scale dx, as quantize_per_block does (the W8A8 products' quantizer: gemm_int8.cpp), and per block
//
//     y[m, n] += d[n, b] * dx[m, b] * S + m[n, b] * dx[m, b] * sum_k qx[m, k],   S = sum_k q[n, k] qx[m, k]
//
// with S exact in integers. On AVX2 vpmaddubsw multiplies the u8 nibbles by the s8 codes: each 16-bit pair
// is at most 2 * 15 * 127 = 3810, so a whole block's 8 groups of 4 k add up in 16 bits (8 * 3810 < 32768)
// before one vpmaddwd widens them; no sign trick, half the work of an 8-bit weight per k.
//
// The weight is packed once (kvloom/ops/q4.py, pack_q4_weight) into panels of kPanel = 8 output columns:
// packed[panel][block][pair][8][4] bytes, where byte (c, i) of pair j holds q[n0 + c, 32 b + 8 j + i] in its
// low nibble and q[n0 + c, 32 b + 8 j + 4 + i] in its high one; so one 32-byte load gives two groups of 4 k
// of 8 columns, vpdpbusd's layout once the nibbles are split. The block scales are packed beside it as
// scales[panel][block][2][8] (d, then m, per column; zero past N), in fp16 where every value is one (GGUF Q4_0 /
// Q4_1, GPTQ and AWQ store fp16: 2 bytes a block less to stream, widened by vcvtph2ps) and fp32 otherwise (Q4_K's
// products of two scales). 5-bit codes (GGUF Q5_1 / Q5_K) keep their low 4 bits in the same panels and their fifth
// bits in a plane beside them (pack_q5_high: high[panel][block][32], bit 2 j + h of byte 4 c + i is the fifth bit of
// the code in nibble h of pair j's byte (c, i)), OR-ed into the nibbles in registers; their 16-bit sums are widened
// every two pairs (a pair reaches 2 * 31 * 127 = 7874). Without AVX2 the same layout is read
// by plain loops (`portable=True` runs those anywhere): the same integers and fp32 steps, bit for bit.

#include "avx2_columns.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVLOOM_Q4_AVX2
#endif

namespace {

using kvloom::parallel_for;

constexpr int64_t kPanel = 8;              // output columns per panel: one vector of 8 fp32 sums
constexpr int64_t kBlock = 32;             // k per scale (a GGUF block)
constexpr int64_t kPairs = 4;              // 32-byte loads per panel and block (each two groups of 4 k)
constexpr int64_t kBlockBytes = kPanel * kBlock / 2;
constexpr int64_t kHighBytes = kPanel * kBlock / 8;  // a 5-bit weight's fifth bits per panel and block
constexpr int64_t kRows = 4;               // rows per micro-kernel: 4 x (16-bit sums, fp32 sums)
constexpr int64_t kRowChunk = 256;         // rows whose codes stay in L2 while panels stream

// One panel's block of y for rows [0, R): xq s8 codes (stride ldq), dx scales and sx = dx * code sum per
// (row, block) (stride lds); panel: the panel's packed bytes; scales: its [blocks][2][8] (S: float or c10::Half).
#if defined(KVLOOM_Q4_AVX2)
using kvloom::avx2::broadcast_word;
using kvloom::avx2::load_columns;
using kvloom::avx2::store_columns;

// 8 scales as fp32: as stored, or widened from fp16 (exactly).
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The fifth bits of slot t = 2 j + h (pair j, its low h = 0 or high h = 1 nibbles) as 0x10 in each byte: bit t of
// the panel's high-bit vector moved to bit 4 (a 16-bit shift keeps a byte's own bit there; the mask drops the rest).
template <int t>
inline __m256i fifth_bits(__m256i high) {
  const __m256i bit = _mm256_set1_epi8(0x10);
  if constexpr (t < 4) return _mm256_and_si256(_mm256_slli_epi16(high, 4 - t), bit);
  if constexpr (t == 4) return _mm256_and_si256(high, bit);
  if constexpr (t > 4) return _mm256_and_si256(_mm256_srli_epi16(high, t - 4), bit);
}

// Five: 5-bit codes (the nibbles plus a fifth bit from `high`, one 32-byte vector per panel and block). A 16-bit
// pair sum is then at most 2 * 31 * 127 = 7874, so the 16-bit sums are widened every two pairs, not once a block.
template <int R, bool Five, typename T, typename S>
inline void q4_kernel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, int64_t lds,
                      const uint8_t* panel, const uint8_t* high, const S* scales, int64_t blocks, const float* bias,
                      T* y, int64_t ldy, int64_t columns) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = panel + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes + 64), _MM_HINT_T0);
    __m256i hb = _mm256_setzero_si256();
    if constexpr (Five) {
      hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + b * kHighBytes));
      _mm_prefetch(reinterpret_cast<const char*>(high + (b + 4) * kHighBytes), _MM_HINT_T0);
    }
    __m256i sums[R], wide[R];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) sums[r] = wide[r] = _mm256_setzero_si256();
    const int8_t* xb = xq + b * kBlock;
    KVLOOM_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      if constexpr (Five) {
        switch (j) {  // j is a constant of the unrolled loop: one arm is compiled in each copy
          case 0: lo = _mm256_or_si256(lo, fifth_bits<0>(hb)), hi = _mm256_or_si256(hi, fifth_bits<1>(hb)); break;
          case 1: lo = _mm256_or_si256(lo, fifth_bits<2>(hb)), hi = _mm256_or_si256(hi, fifth_bits<3>(hb)); break;
          case 2: lo = _mm256_or_si256(lo, fifth_bits<4>(hb)), hi = _mm256_or_si256(hi, fifth_bits<5>(hb)); break;
          default: lo = _mm256_or_si256(lo, fifth_bits<6>(hb)), hi = _mm256_or_si256(hi, fifth_bits<7>(hb)); break;
        }
      }
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * ldq + 8 * j;
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast_word(xr)));
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast_word(xr + 4)));
        if (Five && j == 1) {
          wide[r] = _mm256_madd_epi16(sums[r], ones);
          sums[r] = _mm256_setzero_si256();
        }
      }
    }
    const __m256 d = load_scales(scales + b * 2 * kPanel), m = load_scales(scales + b * 2 * kPanel + kPanel);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      __m256i total = _mm256_madd_epi16(sums[r], ones);
      if constexpr (Five) total = _mm256_add_epi32(total, wide[r]);
      const __m256 s = _mm256_cvtepi32_ps(total);
      acc[r] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * lds + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * lds + b]), acc[r]);
    }
  }
  const __m256 bv = bias ? load_columns(bias, columns) : _mm256_setzero_ps();
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, _mm256_add_ps(acc[r], bv), columns);
}

template <typename T, typename S>
using Q4Kernel = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t, const uint8_t*,
                          const uint8_t*, const S*, int64_t, const float*, T*, int64_t, int64_t);

template <bool Five, typename T, typename S>
constexpr Q4Kernel<T, S> kQ4Kernels[kRows + 1] = {nullptr, &q4_kernel<1, Five, T, S>, &q4_kernel<2, Five, T, S>,
                                                  &q4_kernel<3, Five, T, S>, &q4_kernel<4, Five, T, S>};
#endif

// The same integers and fp32 operations in the same order, by plain loops.
template <typename T, typename S>
void q4_portable_panel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, int64_t lds,
                       const uint8_t* panel, const uint8_t* high, const S* scales, int64_t blocks, const float* bias,
                       T* y, int64_t ldy, int64_t rows, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sums[kPanel] = {};
      for (int64_t j = 0; j < kPairs; ++j) {
        const uint8_t* w = panel + b * kBlockBytes + 32 * j;
        const int8_t* xr = xq + r * ldq + b * kBlock + 8 * j;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t byte = 4 * c + i;
            const int32_t h = high ? high[b * kHighBytes + byte] : 0;
            const int32_t lo = (w[byte] & 0x0F) | (((h >> (2 * j)) & 1) << 4);
            const int32_t hi = (w[byte] >> 4) | (((h >> (2 * j + 1)) & 1) << 4);
            sums[c] += lo * xr[i] + hi * xr[4 + i];
          }
      }
      const S* d = scales + b * 2 * kPanel;
      const S* m = d + kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        acc[c] = std::fma(static_cast<float>(sums[c]), static_cast<float>(d[c]) * dx[r * lds + b], acc[c]);
        acc[c] = std::fma(static_cast<float>(m[c]), sx[r * lds + b], acc[c]);
      }
    }
    for (int64_t c = 0; c < columns; ++c) y[r * ldy + c] = static_cast<T>(acc[c] + (bias ? bias[c] : 0.0f));
  }
}

template <typename T, typename S>
void q4_typed(at::Tensor& y, const at::Tensor& x, const uint8_t* packed, const uint8_t* high, const S* scales,
              const float* bias, int64_t M, int64_t K, int64_t N, bool portable) {
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * blocks), sx(M * blocks);
  std::vector<int32_t> code_sums(M * blocks);
  kvloom::kernels::quantize_blocks_s8(x, xq.data(), dx.data(), code_sums.data(), portable);
  for (int64_t i = 0; i < M * blocks; ++i) sx[i] = dx[i] * static_cast<float>(code_sums[i]);
  T* ys = y.data_ptr<T>();
#if defined(KVLOOM_Q4_AVX2)
  const bool fast = !portable;
  const Q4Kernel<T, S>* kernels = high ? kQ4Kernels<true, T, S> : kQ4Kernels<false, T, S>;
#else
  const bool fast = false;
#endif
  const int64_t step = fast ? kRows : kRowChunk;
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        const uint8_t* wp = packed + panel * blocks * kBlockBytes;
        const uint8_t* hp = high ? high + panel * blocks * kHighBytes : nullptr;
        const S* sp = scales + panel * blocks * 2 * kPanel;
        const float* bp = bias ? bias + n0 : nullptr;
        for (int64_t m = m0; m < m1; m += step) {
          const int64_t rows = std::min(step, m1 - m);
#if defined(KVLOOM_Q4_AVX2)
          if (fast) {
            kernels[rows](xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * blocks, blocks, wp, hp, sp,
                          blocks, bp, ys + m * N + n0, N, columns);
            continue;
          }
#endif
          q4_portable_panel(xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * blocks, blocks, wp, hp, sp,
                            blocks, bp, ys + m * N + n0, N, rows, columns);
        }
      }
    }
  });
}

// y = the Q4 product (+ bias). x: [M, K] float32 or bfloat16 (K a multiple of 32), rows contiguous; packed:
// pack_q4_weight's uint8 [panels, K / 32, 128]; scales: float32 or float16 [panels, K / 32, 2, 8]; bias: float32 [N];
// high (5-bit codes): pack_q5_high's uint8 [panels, K / 32, 32], the codes' fifth bits; y: [M, N] in x's dtype.
void gemm_q4(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> bias,
             bool portable, c10::optional<at::Tensor> high) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.is_contiguous() && packed.is_contiguous(),
              "gemm_q4: x must be [M, K] with contiguous rows and y [M, N] contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gemm_q4: x and y must both be float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  TORCH_CHECK(K % kBlock == 0, "gemm_q4: K = ", K, " must be a multiple of ", kBlock, " (one scale per block)");
  const int64_t panels = (N + kPanel - 1) / kPanel, blocks = K / kBlock;
  TORCH_CHECK(y.size(0) == M && packed.scalar_type() == at::kByte && packed.numel() == panels * blocks * kBlockBytes,
              "gemm_q4: the packed weight does not match x [", M, ", ", K, "] and y [", y.size(0), ", ", N, "]");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.numel() == panels * blocks * 2 * kPanel,
              "gemm_q4: scales must be the contiguous float32 or float16 block scales packed [panels, K / 32, 2, 8]");
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gemm_q4: bias must be a contiguous float32 [N]");
    bs = bias->data_ptr<float>();
  }
  const uint8_t* hp = nullptr;
  if (high.has_value() && high->defined()) {
    TORCH_CHECK(high->scalar_type() == at::kByte && high->is_contiguous() &&
                    high->numel() == panels * blocks * kHighBytes,
                "gemm_q4: high must be the contiguous uint8 fifth bits packed [panels, K / 32, 32]");
    hp = high->data_ptr<uint8_t>();
  }
  if (M == 0 || N == 0) return;
  const auto* wp = packed.data_ptr<uint8_t>();
  auto run = [&](const auto* sp) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    if (x.scalar_type() == at::kFloat) {
      q4_typed<float, S>(y, x, wp, hp, sp, bs, M, K, N, portable);
    } else {
      q4_typed<c10::BFloat16, S>(y, x, wp, hp, sp, bs, M, K, N, portable);
    }
  };
  if (scales.scalar_type() == at::kHalf) {
    run(scales.data_ptr<c10::Half>());
  } else {
    run(scales.data_ptr<float>());
  }
}

// Whether this build holds the fast (AVX2) kernel; the op runs on plain loops without it.
bool q4_gemm_kernel() {
#if defined(KVLOOM_Q4_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace kvloom::kernels {
void gemm_q4(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> bias,
             bool portable, c10::optional<at::Tensor> high) {
  ::gemm_q4(y, x, packed, scales, bias, portable, high);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gemm_q4(Tensor(a!) y, Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool portable=False, "
        "Tensor? high=None) -> ()");
  m.def("q4_gemm_kernel() -> bool", &q4_gemm_kernel);
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gemm_q4", &gemm_q4);
}
