// GGUF Q4_K weights on the file's own super-blocks, at the file's 4.5 bits a weight: y[M, N] = x[M, K] W[N, K]^T
// (+ bias). kvloom/ops/q4k.py says what the product means; q4k_linear_reference is the oracle the tests compare with.
//
// A Q4_K row holds per super-block of 256 inputs (144 bytes) an fp16 d and dmin, 12 bytes of 6-bit sub-scales sc
// and mins mn for its 8 blocks of 32 (ggml's get_scale_min_k4), and 128 bytes of 4-bit codes q:
//
//     W[n, k] = q * (d * sc[b]) - dmin * mn[b],   b = (k % 256) / 32
//
// pack_q4k rearranges the file's bytes, without decoding them, into panels of kPanel = 8 rows: per panel and
// super-block kSuperBytes = 8 x 144 bytes,
//
//     head:  d[8] fp16 | dmin[8] fp16 | the 12 scale bytes transposed, byte j of row c at 8 j + c  (128 bytes)
//     codes: per block of 32, gemm_q4.cpp's panel layout: 4 pairs x 8 rows x 4 bytes, byte (c, i) of pair j
//            holding code (c, 8 j + i) in its low nibble and (c, 8 j + 4 + i) in its high one  (8 x 128 bytes)
//
// the same bytes as the file's, so the product streams exactly the file's bits. The kernel decodes a super-block's
// 6-bit sub-scales of its 8 rows with a few byte shifts and masks in three 32-byte vectors (unpack_sub_scales), once
// per super-block and call.
//
// The product is gemm_q4.cpp's (llama.cpp's vec_dot_q4_1_q8_1 per block): x is quantized per (row, block of 32) to
// s8 codes with an fp32 scale dx (quantize_per_block), and per block
//
//     y[m, n] += (d sc) * dx[m, b] * S + (-dmin mn) * dx[m, b] * sum_k qx[m, k],   S = sum_k q[n, k] qx[m, k]
//
// with S an exact int32 (vpmaddubsw: each pair of products at most 2 * 15 * 127, a block's 8 such in 16 bits) and
// the block's scale d sc and offset -dmin mn exact in fp32 (an 11-bit times a 6-bit significand): the values, and
// the fp32 operations in their order, of gemm_q4.cpp on the same weight decoded into Q4Blocks, so the result is
// bit for bit that product's (with or without AVX2), at every row count. Without AVX2 (or `portable=True`) the same
// layout is read by plain loops: the same integers and fp32 steps.

#include "avx2_columns.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVLOOM_Q4K_AVX2
#endif

namespace {

using kvloom::parallel_for;

constexpr int64_t kPanel = 8;                          // rows of W (output columns of y) per panel
constexpr int64_t kBlock = 32;                         // inputs per sub-scale (and per activation scale)
constexpr int64_t kSuper = 256;                        // inputs per super-block
constexpr int64_t kBlocksPerSuper = kSuper / kBlock;   // 8
constexpr int64_t kFileBytes = 144;                    // a row's super-block in the file
constexpr int64_t kScaleBytes = 12;                    // its 6-bit sub-scales and mins
constexpr int64_t kHeadBytes = kPanel * (4 + kScaleBytes);  // d, dmin and scale bytes of 8 rows: 128
constexpr int64_t kBlockBytes = kPanel * kBlock / 2;   // a block's codes of 8 rows: 128
constexpr int64_t kSuperBytes = kPanel * kFileBytes;   // 1152 = kHeadBytes + 8 * kBlockBytes
constexpr int64_t kRows = 4;                           // rows of x per micro-kernel call (AVX2's 16 registers)
constexpr int64_t kRowChunk = 256;                     // rows of x whose codes stay in L2 while panels stream

// Sub-block j's 6-bit scale and min of the 12 bytes q (ggml's get_scale_min_k4); q[i] at p[i * stride].
inline void scale_min(const uint8_t* p, int64_t stride, int j, int& sc, int& mn) {
  auto q = [&](int i) { return static_cast<int>(p[i * stride]); };
  if (j < 4) {
    sc = q(j) & 63;
    mn = q(j + 4) & 63;
  } else {
    sc = (q(j + 4) & 0x0F) | ((q(j - 4) >> 6) << 4);
    mn = (q(j + 4) >> 4) | ((q(j) >> 6) << 4);
  }
}

// ---- packing ---------------------------------------------------------------------------------------------------

// Panel super-block `out` (kSuperBytes) from the file's super-blocks of rows n0 .. n0 + count (`stride` bytes apart;
// the rest of the panel zero: d = dmin = 0 and codes 0, so those columns are 0).
void pack_super(const uint8_t* file, int64_t stride, int64_t count, uint8_t* out) {
  std::memset(out, 0, kSuperBytes);
  for (int64_t c = 0; c < count; ++c) {
    const uint8_t* f = file + c * stride;
    std::memcpy(out + 2 * c, f, 2);                   // d
    std::memcpy(out + 2 * (kPanel + c), f + 2, 2);    // dmin
    for (int64_t j = 0; j < kScaleBytes; ++j) out[4 * kPanel + j * kPanel + c] = f[4 + j];
    // The file's codes: element 32 b + l of the super-block is the low (b even) or high (b odd) nibble of byte
    // 32 (b / 2) + l.
    const uint8_t* qs = f + 4 + kScaleBytes;
    for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* chunk = qs + 32 * (b / 2);
      const int shift = 4 * static_cast<int>(b % 2);
      uint8_t* block = out + kHeadBytes + b * kBlockBytes;
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t i = 0; i < 4; ++i) {
          const int lo = (chunk[8 * j + i] >> shift) & 0x0F, hi = (chunk[8 * j + 4 + i] >> shift) & 0x0F;
          block[32 * j + 4 * c + i] = static_cast<uint8_t>(lo | (hi << 4));
        }
    }
  }
}

// The file's Q4_K bytes of a [rows, in_features] weight (uint8, rows after rows, as GGUF stores them) -> the panels
// uint8 [ceil(rows / 8), in_features / 256, kSuperBytes].
at::Tensor pack_q4k(at::Tensor raw, int64_t rows, int64_t in_features) {
  TORCH_CHECK(rows > 0 && in_features > 0 && in_features % kSuper == 0,
              "pack_q4k: a Q4_K weight needs rows > 0 and in_features a positive multiple of ", kSuper, ", got [",
              rows, ", ", in_features, "]");
  const int64_t supers = in_features / kSuper, panels = (rows + kPanel - 1) / kPanel;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == rows * supers * kFileBytes,
              "pack_q4k: raw must be the contiguous uint8 bytes of a Q4_K [", rows, ", ", in_features, "] weight (",
              rows * supers * kFileBytes, " bytes), got ", raw.numel(), " ", raw.scalar_type(), " values");
  at::Tensor out = at::empty({panels, supers, kSuperBytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = supers * kFileBytes;
  parallel_for(0, panels * supers, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / supers, s = i % supers;
      pack_super(src + p * kPanel * row_bytes + s * kFileBytes, row_bytes, std::min(kPanel, rows - p * kPanel),
                 dst + i * kSuperBytes);
    }
  });
  return out;
}

// ---- the product -----------------------------------------------------------------------------------------------

#if defined(KVLOOM_Q4K_AVX2)
using kvloom::avx2::broadcast_word;
using kvloom::avx2::load_columns;
using kvloom::avx2::store_columns;

// A super-block's 12 scale bytes of 8 rows (byte j of row c at p[8 j + c]) -> the 6-bit values as bytes
// out[half][8 (j % 4) + c]: half 0, 1 the scales of sub-blocks 0-3, 4-7; half 2, 3 their mins.
inline void unpack_sub_scales(const uint8_t* p, uint8_t out[4][32]) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));       // q[0..3]
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));  // q[4..7]
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));  // q[8..11]
  const __m256i six = _mm256_set1_epi8(63), four = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  // (q >> 6) << 4 is (q >> 2) & 0x30; a 16-bit shift's bits from the neighbouring byte fall outside the masks.
  _mm256_store_si256(reinterpret_cast<__m256i*>(out[0]), _mm256_and_si256(a, six));
  _mm256_store_si256(reinterpret_cast<__m256i*>(out[1]),
                     _mm256_or_si256(_mm256_and_si256(c, four), _mm256_and_si256(_mm256_srli_epi16(a, 2), top)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(out[2]), _mm256_and_si256(b, six));
  _mm256_store_si256(reinterpret_cast<__m256i*>(out[3]),
                     _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), four),
                                     _mm256_and_si256(_mm256_srli_epi16(b, 2), top)));
}

// 8 unsigned bytes as fp32.
inline __m256 widen_bytes(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One panel of y for rows [0, R): xq s8 codes (stride ldq), dx and sx = dx * code sum per (row, block) (stride
// blocks); panel: its supers x kSuperBytes.
template <int R, typename T>
void q4k_kernel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, const uint8_t* panel,
                int64_t supers, const float* bias, T* y, int64_t ldy, int64_t columns) {
  const int64_t blocks = supers * kBlocksPerSuper;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc[R];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  alignas(32) uint8_t subs[4][32];
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* head = panel + s * kSuperBytes;
    const __m256 top_d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
    const __m256 top_m =  // -dmin: the offsets' sign folded in once
        _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * kPanel))), sign);
    unpack_sub_scales(head + 4 * kPanel, subs);
    for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* w = head + kHeadBytes + b * kBlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes + 64), _MM_HINT_T0);
      const int64_t block = s * kBlocksPerSuper + b;
      const int8_t* xb = xq + block * kBlock;
      __m256i sums[R];  // 16-bit: a block's 8 pair sums of at most 2 * 15 * 127 each
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      KVLOOM_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        const __m256i lo = _mm256_and_si256(bytes, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * ldq + 8 * j;
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast_word(xr)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast_word(xr + 4)));
        }
      }
      const __m256 d = _mm256_mul_ps(top_d, widen_bytes(subs[b / 4] + 8 * (b % 4)));
      const __m256 m = _mm256_mul_ps(top_m, widen_bytes(subs[2 + b / 4] + 8 * (b % 4)));
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 total = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
        acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * blocks + block])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * blocks + block]), acc[r]);
      }
    }
  }
  const __m256 bv = bias ? load_columns(bias, columns) : _mm256_setzero_ps();
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, _mm256_add_ps(acc[r], bv), columns);
}

template <typename T>
using Q4KKernel = void (*)(const int8_t*, int64_t, const float*, const float*, const uint8_t*, int64_t, const float*,
                           T*, int64_t, int64_t);

template <typename T, int... R>
constexpr std::array<Q4KKernel<T>, kRows + 1> q4k_kernels(std::integer_sequence<int, R...>) {
  return {nullptr, &q4k_kernel<R + 1, T>...};
}
template <typename T>
constexpr std::array<Q4KKernel<T>, kRows + 1> kQ4KKernels = q4k_kernels<T>(std::make_integer_sequence<int, kRows>{});
#endif

// The same integers and fp32 operations in the same order, by plain loops.
template <typename T>
void q4k_portable_panel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, const uint8_t* panel,
                        int64_t supers, const float* bias, T* y, int64_t ldy, int64_t rows, int64_t columns) {
  const int64_t blocks = supers * kBlocksPerSuper;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* head = panel + s * kSuperBytes;
      float top_d[kPanel], top_m[kPanel];
      for (int64_t c = 0; c < kPanel; ++c) {
        c10::Half h[2];
        std::memcpy(&h[0], head + 2 * c, 2);
        std::memcpy(&h[1], head + 2 * (kPanel + c), 2);
        top_d[c] = static_cast<float>(h[0]);
        top_m[c] = -static_cast<float>(h[1]);
      }
      for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
        const int64_t block = s * kBlocksPerSuper + b;
        const uint8_t* w = head + kHeadBytes + b * kBlockBytes;
        const int8_t* xr = xq + r * ldq + block * kBlock;
        for (int64_t c = 0; c < kPanel; ++c) {
          int32_t sum = 0;
          for (int64_t j = 0; j < 4; ++j)
            for (int64_t i = 0; i < 4; ++i) {
              const int32_t byte = w[32 * j + 4 * c + i];
              sum += (byte & 0x0F) * xr[8 * j + i] + (byte >> 4) * xr[8 * j + 4 + i];
            }
          int sc, mn;
          scale_min(head + 4 * kPanel + c, kPanel, static_cast<int>(b), sc, mn);
          const float d = top_d[c] * static_cast<float>(sc), m = top_m[c] * static_cast<float>(mn);
          acc[c] = std::fma(static_cast<float>(sum), d * dx[r * blocks + block], acc[c]);
          acc[c] = std::fma(m, sx[r * blocks + block], acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < columns; ++c) y[r * ldy + c] = static_cast<T>(acc[c] + (bias ? bias[c] : 0.0f));
  }
}

template <typename T>
void q4k_typed(at::Tensor& y, const at::Tensor& x, const uint8_t* packed, const float* bias, int64_t M, int64_t K,
               int64_t N, bool portable) {
  const int64_t blocks = K / kBlock, supers = K / kSuper, panels = (N + kPanel - 1) / kPanel;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * blocks), sx(M * blocks);
  std::vector<int32_t> code_sums(M * blocks);
  kvloom::kernels::quantize_blocks_s8(x, xq.data(), dx.data(), code_sums.data(), portable);
  for (int64_t i = 0; i < M * blocks; ++i) sx[i] = dx[i] * static_cast<float>(code_sums[i]);
  T* ys = y.data_ptr<T>();
#if defined(KVLOOM_Q4K_AVX2)
  const bool fast = !portable;
#else
  const bool fast = false;
#endif
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        const uint8_t* wp = packed + panel * supers * kSuperBytes;
        const float* bp = bias ? bias + n0 : nullptr;
        if (fast) {
#if defined(KVLOOM_Q4K_AVX2)
          for (int64_t m = m0; m < m1; m += kRows)
            kQ4KKernels<T>[std::min(kRows, m1 - m)](xq.data() + m * K, K, dx.data() + m * blocks,
                                                    sx.data() + m * blocks, wp, supers, bp, ys + m * N + n0, N,
                                                    columns);
#endif
          continue;
        }
        q4k_portable_panel(xq.data() + m0 * K, K, dx.data() + m0 * blocks, sx.data() + m0 * blocks, wp, supers, bp,
                           ys + m0 * N + n0, N, m1 - m0, columns);
      }
    }
  });
}

// y = the Q4_K product (+ bias). x: [M, K] float32 or bfloat16 (K a multiple of 256), rows contiguous; packed:
// pack_q4k's uint8 [ceil(N / 8), K / 256, 1152]; bias: float32 [N]; y: [M, N] contiguous, in x's dtype.
void gemm_q4k(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.is_contiguous() && packed.is_contiguous(),
              "gemm_q4k: x must be [M, K] with contiguous rows and y [M, N] contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gemm_q4k: x and y must both be float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  TORCH_CHECK(K % kSuper == 0, "gemm_q4k: K = ", K, " must be a multiple of ", kSuper, " (one Q4_K super-block)");
  const int64_t panels = (N + kPanel - 1) / kPanel, supers = K / kSuper;
  TORCH_CHECK(y.size(0) == M && packed.scalar_type() == at::kByte && packed.numel() == panels * supers * kSuperBytes,
              "gemm_q4k: the packed weight does not match x [", M, ", ", K, "] and y [", y.size(0), ", ", N, "]");
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gemm_q4k: bias must be a contiguous float32 [N]");
    bs = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  if (x.scalar_type() == at::kFloat) {
    q4k_typed<float>(y, x, packed.data_ptr<uint8_t>(), bs, M, K, N, portable);
  } else {
    q4k_typed<c10::BFloat16>(y, x, packed.data_ptr<uint8_t>(), bs, M, K, N, portable);
  }
}

}  // namespace

namespace kvloom::kernels {
void gemm_q4k(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, bool portable) {
  ::gemm_q4k(y, x, packed, bias, portable);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("pack_q4k(Tensor raw, int rows, int in_features) -> Tensor");
  m.def("gemm_q4k(Tensor(a!) y, Tensor x, Tensor packed, Tensor? bias, bool portable=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("pack_q4k", &pack_q4k);
  m.impl("gemm_q4k", &gemm_q4k);
}
