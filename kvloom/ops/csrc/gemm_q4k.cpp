// GGUF Q4_K and Q6_K weights on the file's own super-blocks, at the file's bits a weight (4.5 and 6.5625): y[M, N] =
// x[M, K] W[N, K]^T (+ bias). kvloom/ops/q4k.py says what the product means; q4k_linear_reference is the oracle the
// tests compare with.
//
// A Q4_K row holds per super-block of 256 inputs (144 bytes) an fp16 d and dmin, 12 bytes of 6-bit sub-scales sc
// and mins mn for its 8 blocks of 32 (ggml's get_scale_min_k4), and 128 bytes of 4-bit codes q:
//
//     W[n, k] = q * (d * sc[b]) - dmin * mn[b],   b = (k % 256) / 32
//
// A Q6_K row holds per super-block (210 bytes) 6-bit codes (their low 4 bits in ql, the top 2 in qh), an int8 scale
// s per group of 16 inputs and an fp16 d: W[n, k] = (q - 32) * d * s[g], g = (k % 256) / 16.
//
// pack_q4k / pack_q6k rearrange the file's bytes, without decoding them, into panels of kPanel = 8 rows: per panel
// and super-block 8 x 144 (Q4_K) or 8 x 210 (Q6_K) bytes,
//
//     Q4_K head: d[8] fp16 | dmin[8] fp16 | the 12 scale bytes transposed, byte j of row c at 8 j + c  (128 bytes)
//     Q6_K head: d[8] fp16 | the 16 int8 scales transposed, scale g of row c at 8 g + c               (144 bytes)
//     per block of 32, codes in gemm_q4.cpp's panel layout: 4 pairs x 8 rows x 4 bytes, byte (c, i) of pair j
//          holding the low 4 bits of code (c, 8 j + i) in its low nibble and of (c, 8 j + 4 + i) in its high one
//          (128 bytes); Q6_K then the codes' top 2 bits, 2 x 8 rows x 4 bytes: byte (c, i) of half t holds those of
//          code (c, 8 j + 4 h + i) at bits 2 (2 (j % 2) + h), j = 2 t + j % 2 (64 bytes)
//
// the same bytes as the file's, so the product streams exactly the file's bits. The kernels decode a super-block's
// sub-scales of its 8 rows with a few vector operations once per super-block and call.
//
// The product is gemm_q4.cpp's (llama.cpp's vec_dot_q4_1_q8_1 per block): x is quantized per (row, block of 32) to
// s8 codes with an fp32 scale dx (quantize_per_block), and per block (Q6_K: per group of 16, the codes unsigned
// 0..63 and the offset -32 d s folded into the second term)
//
//     y[m, n] += (d sc) * dx[m, b] * S + (-dmin mn) * dx[m, b] * sum_k qx[m, k],   S = sum_k q[n, k] qx[m, k]
//
// with S an exact int32 (vpmaddubsw: each pair of products at most 2 * 63 * 127, 16-bit sums widened in time) and
// each group's scale and offset exact in fp32 (an 11-bit times a 6- or 8-bit significand): the values, and the fp32
// operations in their order, of gemm_q4.cpp on the same weight decoded into Q4Blocks (Q6_K per 16), so the result is
// bit for bit that product's (with or without AVX2), at every row count. A projection may be Q4_K rows then Q6_K
// ones (a Q4_K_M file's q and k beside a Q6_K v): each panel is read by its own kernel in one pass. Without AVX2
// (or `portable=True`) the same layout is read by plain loops: the same integers and fp32 steps.

#include "avx2_columns.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"
#include "part_rows.h"
#include "q4_panels.h"

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
// Q6_K's panel super-block: d[8] and 16 x 8 scales, then per block 128 bytes of nibbles and 64 of top bits.
constexpr int64_t kQ6FileBytes = 210;
constexpr int64_t kQ6HeadBytes = kPanel * (2 + 16);                 // 144
constexpr int64_t kQ6BlockBytes = kBlockBytes + kPanel * kBlock / 4;  // 192
constexpr int64_t kQ6SuperBytes = kPanel * kQ6FileBytes;            // 1680 = kQ6HeadBytes + 8 * kQ6BlockBytes
// Rows of x per micro-kernel call: with VNNI (an AVX-512 build: 32 vector registers) 8 rows of int32 and fp32 sums,
// else 4 of 16-bit, int32 and fp32 sums in AVX2's 16 (gemm_q4.cpp's kernels alike).
#if defined(KVLOOM_VNNI_DOT)
constexpr int64_t kRows = 8;
#else
constexpr int64_t kRows = 4;
#endif
// Software prefetch: a panel is one sequential stream (heads between its blocks), read kSuperBytes / 8 (Q6_K:
// kQ6SuperBytes / 8) bytes a block; each block prefetches as many whole cache lines or more, this far ahead.
constexpr int64_t kPrefetchAhead = 1024;
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

// Panel super-block `out` (kSuperBytes) from the file's super-blocks at rows[c] + offset, c < count (the rest of the
// panel zero: d = dmin = 0 and codes 0, so those columns are 0).
void pack_super(const uint8_t* const* rows, int64_t offset, int64_t count, uint8_t* out) {
  std::memset(out, 0, kSuperBytes);
  for (int64_t c = 0; c < count; ++c) {
    const uint8_t* f = rows[c] + offset;
    std::memcpy(out + 2 * c, f, 2);                   // d
    std::memcpy(out + 2 * (kPanel + c), f + 2, 2);    // dmin
    for (int64_t j = 0; j < kScaleBytes; ++j) out[4 * kPanel + j * kPanel + c] = f[4 + j];
    // The file's codes: element 32 b + l of the super-block is the low (b even) or high (b odd) nibble of byte
    // 32 (b / 2) + l; the panel's byte (c, i) of pair j holds codes 8 j + i and 8 j + 4 + i of a block.
    const uint8_t* qs = f + 4 + kScaleBytes;
    for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* chunk = qs + 32 * (b / 2);
      const int shift = 4 * static_cast<int>(b % 2);
      uint8_t* block = out + kHeadBytes + b * kBlockBytes + 4 * c;
      for (int64_t j = 0; j < 4; ++j) {
        uint32_t lo, hi;  // 4 bytes each: codes 8 j + i and 8 j + 4 + i in their `shift` nibbles
        std::memcpy(&lo, chunk + 8 * j, 4);
        std::memcpy(&hi, chunk + 8 * j + 4, 4);
        const uint32_t word = ((lo >> shift) & 0x0F0F0F0Fu) | (((hi >> shift) & 0x0F0F0F0Fu) << 4);
        std::memcpy(block + 32 * j, &word, 4);
      }
    }
  }
}

// Q6_K: panel super-block `out` (kQ6SuperBytes) from the file's super-blocks at rows[c] + offset, c < count.
void pack_super_q6(const uint8_t* const* rows, int64_t offset, int64_t count, uint8_t* out) {
  std::memset(out, 0, kQ6SuperBytes);
  for (int64_t c = 0; c < count; ++c) {
    const uint8_t* f = rows[c] + offset;
    const uint8_t *ql = f, *qh = f + 128, *scales = f + 192;
    std::memcpy(out + 2 * c, f + 208, 2);  // d
    for (int64_t g = 0; g < 16; ++g) out[2 * kPanel + g * kPanel + c] = scales[g];
    // The file's code of element e = 128 n + 32 q + l: low 4 bits in ql[64 n + 32 (q % 2) + l] (low nibble for q < 2,
    // high for q >= 2), top 2 bits at bit 2 q of qh[32 n + l] (ggml's dequantize_row_q6_K). Block b holds elements
    // 32 b + l (n = b / 4, q = b % 4); its byte (c, i) of pair j the low bits of codes 8 j + i and 8 j + 4 + i, and
    // byte (c, i) of half j / 2 their top bits at bit 2 (2 (j % 2) + h): four codes a 32-bit word at a time.
    for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* low = ql + 64 * (b / 4) + 32 * (b % 2);
      const uint8_t* top = qh + 32 * (b / 4);
      const int low_shift = 4 * static_cast<int>((b % 4) / 2), top_shift = 2 * static_cast<int>(b % 4);
      uint8_t* block = out + kQ6HeadBytes + b * kQ6BlockBytes + 4 * c;
      for (int64_t j = 0; j < 4; ++j) {
        uint32_t lo, hi, top_lo, top_hi, tops;
        std::memcpy(&lo, low + 8 * j, 4);
        std::memcpy(&hi, low + 8 * j + 4, 4);
        std::memcpy(&top_lo, top + 8 * j, 4);
        std::memcpy(&top_hi, top + 8 * j + 4, 4);
        const uint32_t nibbles = ((lo >> low_shift) & 0x0F0F0F0Fu) | (((hi >> low_shift) & 0x0F0F0F0Fu) << 4);
        std::memcpy(block + 32 * j, &nibbles, 4);
        const int at = 4 * static_cast<int>(j % 2);
        uint8_t* half = block + kBlockBytes + 32 * (j / 2);
        std::memcpy(&tops, half, 4);
        tops |= (((top_lo >> top_shift) & 0x03030303u) << at) | (((top_hi >> top_shift) & 0x03030303u) << (at + 2));
        std::memcpy(half, &tops, 4);
      }
    }
  }
}

// The panels of a k-quant weight whose rows are the rows of `parts` in turn (each uint8 [n_i, in_features / 256 *
// file bytes], a row's bytes contiguous, rows any stride apart: the file's mapped tensors, shards of a fused
// projection) written into `out` (uint8, contiguous, ceil(sum n_i / 8) x in_features / 256 panel super-blocks): one
// pass over the file's bytes, no copy in between, parallel over panel super-blocks.
// The bytes of one type: a row's super-block in the file and a panel's, and the op's name for its messages.
struct KQuantFormat {
  const char* name;
  const char* type;
  int64_t file_bytes, super_bytes;
};
KQuantFormat format_of(bool six_bits) {
  return six_bits ? KQuantFormat{"pack_q6k", "Q6_K", kQ6FileBytes, kQ6SuperBytes}
                  : KQuantFormat{"pack_q4k", "Q4_K", kFileBytes, kSuperBytes};
}

void pack_kquant_parts(at::Tensor out, at::TensorList parts, int64_t in_features, bool six_bits) {
  const auto [name, type, file_bytes, super_bytes] = format_of(six_bits);
  TORCH_CHECK(in_features > 0 && in_features % kSuper == 0, name, ": in_features must be a positive multiple of ",
              kSuper, ", got ", in_features);
  const int64_t supers = in_features / kSuper;
  std::vector<const uint8_t*> rows = kvloom::part_rows(parts, supers * file_bytes, in_features, name);
  const int64_t count = static_cast<int64_t>(rows.size()), panels = (count + kPanel - 1) / kPanel;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == panels * supers * super_bytes,
              name, ": out must be contiguous uint8 of ", panels * supers * super_bytes, " bytes, got ", out.numel());
  rows.resize(panels * kPanel, nullptr);
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint8_t* const* table = rows.data();
  parallel_for(0, panels * supers, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / supers, s = i % supers, n = std::min(kPanel, count - p * kPanel);
      if (six_bits) {
        pack_super_q6(table + p * kPanel, s * file_bytes, n, dst + i * super_bytes);
      } else {
        pack_super(table + p * kPanel, s * file_bytes, n, dst + i * super_bytes);
      }
    }
  });
}

// The file's bytes of a [rows, in_features] weight (uint8, rows after rows, as GGUF stores them) -> its panels
// uint8 [ceil(rows / 8), in_features / 256, kSuperBytes (Q6_K: kQ6SuperBytes)].
at::Tensor pack_kquant(at::Tensor raw, int64_t rows, int64_t in_features, bool six_bits) {
  const auto [name, type, file_bytes, super_bytes] = format_of(six_bits);
  TORCH_CHECK(rows > 0 && in_features > 0 && in_features % kSuper == 0, name, ": a ", type,
              " weight needs rows > 0 and in_features a positive multiple of ", kSuper, ", got [", rows, ", ",
              in_features, "]");
  const int64_t supers = in_features / kSuper;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == rows * supers * file_bytes,
              name, ": raw must be the contiguous uint8 bytes of a ", type, " [", rows, ", ",
              in_features, "] weight (", rows * supers * file_bytes, " bytes), got ", raw.numel(), " ",
              raw.scalar_type(), " values");
  at::Tensor out = at::empty({(rows + kPanel - 1) / kPanel, supers, super_bytes}, raw.options());
  pack_kquant_parts(out, {raw.view({rows, supers * file_bytes})}, in_features, six_bits);
  return out;
}

at::Tensor pack_q4k(at::Tensor raw, int64_t rows, int64_t in_features) {
  return pack_kquant(raw, rows, in_features, false);
}

at::Tensor pack_q6k(at::Tensor raw, int64_t rows, int64_t in_features) {
  return pack_kquant(raw, rows, in_features, true);
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
  const __m256i low = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
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
      const int64_t block = s * kBlocksPerSuper + b;
      const char* ahead =
          reinterpret_cast<const char*>(panel + block * (kSuperBytes / kBlocksPerSuper) + kPrefetchAhead);
      KVLOOM_UNROLL
      for (int line = 0; line < 3; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);  // 144 bytes a block
      const int8_t* xb = xq + block * kBlock;
#if defined(KVLOOM_VNNI_DOT)
      // vpdpbusd: each 4 u8 x s8 products straight into an int32 lane, the low and the high nibbles' chains apart.
      __m256i part[R][2];
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
#else
      __m256i sums[R];  // 16-bit: a block's 8 pair sums of at most 2 * 15 * 127 each
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#endif
      KVLOOM_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        const __m256i lo = _mm256_and_si256(bytes, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * ldq + 8 * j;
#if defined(KVLOOM_VNNI_DOT)
          part[r][0] = _mm256_dpbusd_epi32(part[r][0], lo, broadcast_word(xr));
          part[r][1] = _mm256_dpbusd_epi32(part[r][1], hi, broadcast_word(xr + 4));
#else
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast_word(xr)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast_word(xr + 4)));
#endif
        }
      }
      const __m256 d = _mm256_mul_ps(top_d, widen_bytes(subs[b / 4] + 8 * (b % 4)));
      const __m256 m = _mm256_mul_ps(top_m, widen_bytes(subs[2 + b / 4] + 8 * (b % 4)));
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
#if defined(KVLOOM_VNNI_DOT)
        const __m256 total = _mm256_cvtepi32_ps(_mm256_add_epi32(part[r][0], part[r][1]));
#else
        const __m256 total = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
#endif
        acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * blocks + block])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * blocks + block]), acc[r]);
      }
    }
  }
  const __m256 bv = bias ? load_columns(bias, columns) : _mm256_setzero_ps();
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, _mm256_add_ps(acc[r], bv), columns);
}

// Q6_K: pair j's top 2 bits of its low (h = 0) or high (h = 1) codes from their half's 32 bytes, moved to bits 4-5
// (a 16-bit shift's bits from the neighbouring byte fall outside the mask).
template <int j, int h>
inline __m256i top_bits(__m256i half) {
  constexpr int shift = 2 * (2 * (j % 2) + h);
  const __m256i mask = _mm256_set1_epi8(0x30);
  if constexpr (shift < 4) return _mm256_and_si256(_mm256_slli_epi16(half, 4 - shift), mask);
  if constexpr (shift == 4) return _mm256_and_si256(half, mask);
  if constexpr (shift > 4) return _mm256_and_si256(_mm256_srli_epi16(half, shift - 4), mask);
}

// Q6_K pair j of a block: its 6-bit codes times the rows' s8 codes into the rows' int32 sums of group j / 2. A pair's
// two 16-bit sums reach 2 * 2 * 63 * 127 = 32004 at most: widened at once.
template <int R, int j>
inline void q6_pair(const uint8_t* w, const __m256i* tops, const int8_t* xb, int64_t ldq, __m256i (*part)[2]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, low), top_bits<j, 0>(tops[j / 2]));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), top_bits<j, 1>(tops[j / 2]));
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xb + r * ldq + 8 * j;
#if defined(KVLOOM_VNNI_DOT)
    part[r][j / 2] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(part[r][j / 2], lo, broadcast_word(xr)), hi,
                                         broadcast_word(xr + 4));
#else
    const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast_word(xr)),
                                          _mm256_maddubs_epi16(hi, broadcast_word(xr + 4)));
    part[r][j / 2] = _mm256_add_epi32(part[r][j / 2], _mm256_madd_epi16(sums, ones));
#endif
  }
}

// 8 int8 values as fp32.
inline __m256 widen_signed_bytes(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One Q6_K panel of y for rows [0, R): sx per (row, group of 16) (stride 2 blocks); the rest as q4k_kernel.
template <int R, typename T>
void q6k_kernel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, const uint8_t* panel,
                int64_t supers, const float* bias, T* y, int64_t ldy, int64_t columns) {
  const int64_t blocks = supers * kBlocksPerSuper;
  const __m256 minus32 = _mm256_set1_ps(-32.0f);
  __m256 acc[R];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* head = panel + s * kQ6SuperBytes;
    const __m256 top_d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
    const __m256 top_m = _mm256_mul_ps(top_d, minus32);  // the offset -32 d s: exact
    const uint8_t* scales = head + 2 * kPanel;
    for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* w = head + kQ6HeadBytes + b * kQ6BlockBytes;
      const int64_t block = s * kBlocksPerSuper + b;
      const char* ahead =
          reinterpret_cast<const char*>(panel + block * (kQ6SuperBytes / kBlocksPerSuper) + kPrefetchAhead);
      KVLOOM_UNROLL
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);  // 210 bytes a block
      const int8_t* xb = xq + block * kBlock;
      const __m256i tops[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockBytes)),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockBytes + 32))};
      __m256i part[R][2];  // int32 sums of the block's two groups of 16
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
      q6_pair<R, 0>(w, tops, xb, ldq, part);
      q6_pair<R, 1>(w, tops, xb, ldq, part);
      q6_pair<R, 2>(w, tops, xb, ldq, part);
      q6_pair<R, 3>(w, tops, xb, ldq, part);
      const __m256 s0 = widen_signed_bytes(scales + 2 * b * kPanel), s1 = widen_signed_bytes(scales + (2 * b + 1) * kPanel);
      const __m256 d0 = _mm256_mul_ps(top_d, s0), d1 = _mm256_mul_ps(top_d, s1);
      const __m256 m0 = _mm256_mul_ps(top_m, s0), m1 = _mm256_mul_ps(top_m, s1);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(dx[r * blocks + block]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r][0]), _mm256_mul_ps(d0, scale), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r][1]), _mm256_mul_ps(d1, scale), acc[r]);
        acc[r] = _mm256_fmadd_ps(m0, _mm256_set1_ps(sx[r * 2 * blocks + 2 * block]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m1, _mm256_set1_ps(sx[r * 2 * blocks + 2 * block + 1]), acc[r]);
      }
    }
  }
  const __m256 bv = bias ? load_columns(bias, columns) : _mm256_setzero_ps();
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, _mm256_add_ps(acc[r], bv), columns);
}

template <typename T>
using KQuantKernel = void (*)(const int8_t*, int64_t, const float*, const float*, const uint8_t*, int64_t,
                              const float*, T*, int64_t, int64_t);

// The kernel for each row count 1..kRows (index 0 unused).
template <typename T, int... R>
constexpr std::array<KQuantKernel<T>, kRows + 1> q4k_kernels(std::integer_sequence<int, R...>) {
  return {nullptr, &q4k_kernel<R + 1, T>...};
}
template <typename T, int... R>
constexpr std::array<KQuantKernel<T>, kRows + 1> q6k_kernels(std::integer_sequence<int, R...>) {
  return {nullptr, &q6k_kernel<R + 1, T>...};
}
template <typename T>
constexpr std::array<KQuantKernel<T>, kRows + 1> kQ4KKernels =
    q4k_kernels<T>(std::make_integer_sequence<int, kRows>{});
template <typename T>
constexpr std::array<KQuantKernel<T>, kRows + 1> kQ6KKernels =
    q6k_kernels<T>(std::make_integer_sequence<int, kRows>{});
#endif

// The same integers and fp32 operations in the same order, by plain loops: Q4_K panels.
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

// Q6_K panels by plain loops; sx per (row, group of 16).
template <typename T>
void q6k_portable_panel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, const uint8_t* panel,
                        int64_t supers, const float* bias, T* y, int64_t ldy, int64_t rows, int64_t columns) {
  const int64_t blocks = supers * kBlocksPerSuper;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* head = panel + s * kQ6SuperBytes;
      const int8_t* scales = reinterpret_cast<const int8_t*>(head + 2 * kPanel);
      for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
        const int64_t block = s * kBlocksPerSuper + b;
        const uint8_t* w = head + kQ6HeadBytes + b * kQ6BlockBytes;
        const int8_t* xr = xq + r * ldq + block * kBlock;
        for (int64_t c = 0; c < kPanel; ++c) {
          int32_t sums[2] = {};
          for (int64_t j = 0; j < 4; ++j)
            for (int64_t i = 0; i < 4; ++i) {
              const int32_t byte = w[32 * j + 4 * c + i], tops = w[kBlockBytes + 32 * (j / 2) + 4 * c + i];
              const int shift = static_cast<int>(2 * (2 * (j % 2)));
              const int32_t lo = (byte & 0x0F) | (((tops >> shift) & 3) << 4);
              const int32_t hi = (byte >> 4) | (((tops >> (shift + 2)) & 3) << 4);
              sums[j / 2] += lo * xr[8 * j + i] + hi * xr[8 * j + 4 + i];
            }
          c10::Half half;
          std::memcpy(&half, head + 2 * c, 2);
          const float top_d = static_cast<float>(half), top_m = top_d * -32.0f;
          const float s0 = scales[2 * b * kPanel + c], s1 = scales[(2 * b + 1) * kPanel + c];
          const float scale = dx[r * blocks + block];
          acc[c] = std::fma(static_cast<float>(sums[0]), top_d * s0 * scale, acc[c]);
          acc[c] = std::fma(static_cast<float>(sums[1]), top_d * s1 * scale, acc[c]);
          acc[c] = std::fma(top_m * s0, sx[r * 2 * blocks + 2 * block], acc[c]);
          acc[c] = std::fma(top_m * s1, sx[r * 2 * blocks + 2 * block + 1], acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < columns; ++c) y[r * ldy + c] = static_cast<T>(acc[c] + (bias ? bias[c] : 0.0f));
  }
}

// y's columns [0, 8 panels4) from the Q4_K panels, the rest from the Q6_K ones (either may be absent); panels
// [first_panel, last_panel) alone (the others written by another product).
template <typename T>
void kquant_typed(at::Tensor& y, const at::Tensor& x, const uint8_t* q4k, int64_t panels4, const uint8_t* q6k,
                  const float* bias, int64_t M, int64_t K, int64_t N, bool portable, int64_t first_panel,
                  int64_t last_panel) {
  const int64_t blocks = K / kBlock, supers = K / kSuper, panels = (N + kPanel - 1) / kPanel;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * blocks), sx(panels4 > first_panel ? M * blocks : 0);
  std::vector<float> sx16(last_panel > panels4 ? 2 * M * blocks : 0);
  std::vector<int32_t> code_sums(M * blocks);
  kvloom::kernels::quantize_blocks_s8(x, xq.data(), dx.data(), code_sums.data(), portable);
  for (size_t i = 0; i < sx.size(); ++i) sx[i] = dx[i] * static_cast<float>(code_sums[i]);
  for (size_t i = 0; i < sx16.size(); ++i) {  // per group of 16 (Q6_K's)
    const int8_t* q = xq.data() + i * (kBlock / 2);
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock / 2; ++k) sum += q[k];
    sx16[i] = dx[i / 2] * static_cast<float>(sum);
  }
  T* ys = y.data_ptr<T>();
#if defined(KVLOOM_Q4K_AVX2)
  const bool fast = !portable;
#else
  const bool fast = false;
#endif
  parallel_for(first_panel, last_panel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        const bool six = panel >= panels4;
        const uint8_t* wp = six ? q6k + (panel - panels4) * supers * kQ6SuperBytes : q4k + panel * supers * kSuperBytes;
        const float* sp = six ? sx16.data() : sx.data();
        const int64_t lds = six ? 2 * blocks : blocks;
        const float* bp = bias ? bias + n0 : nullptr;
        if (fast) {
#if defined(KVLOOM_Q4K_AVX2)
          const KQuantKernel<T>* kernels = six ? kQ6KKernels<T>.data() : kQ4KKernels<T>.data();
          for (int64_t m = m0; m < m1; m += kRows)
            kernels[std::min(kRows, m1 - m)](xq.data() + m * K, K, dx.data() + m * blocks, sp + m * lds, wp, supers,
                                             bp, ys + m * N + n0, N, columns);
#endif
          continue;
        }
        (six ? q6k_portable_panel<T> : q4k_portable_panel<T>)(xq.data() + m0 * K, K, dx.data() + m0 * blocks,
                                                              sp + m0 * lds, wp, supers, bp, ys + m0 * N + n0, N,
                                                              m1 - m0, columns);
      }
    }
  });
}

// ---- the code-block kernels' view of the panels --------------------------------------------------------------

// With AMX-INT8 tiles, calls of 16 rows or more unpack each Q4_K panel into gemm_q4.cpp's code-block layout and take
// its tile product (q4_panels.h; its 6-bit codes keep vector kernels, so Q6_K panels stay here). The same integers
// and fp32 steps either way: bit for bit the same y. Below 16 rows (and without AMX) the kernels here read the
// panels as they lie, with VNNI where the build has it: unpacking costs a copy per panel and call, measured
// 1.1-1.5x slower than reading in place at 1-8 rows (benchmarks/q4k_micro.py).

#if defined(KVLOOM_Q4K_AVX2)
// Q4_K panels: the codes copied as they lie (already the code-block layout), d = D sc and m = -dmin mn in fp32 (the
// values q4k_kernel computes).
class Q4KPanels final : public kvloom::q4::PanelSource {
 public:
  Q4KPanels(const uint8_t* panels, int64_t supers) : panels_(panels), supers_(supers) {}
  void unpack(int64_t p, uint8_t* codes, uint8_t*, float* scales) const override {
    const uint8_t* panel = panels_ + p * supers_ * kSuperBytes;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    alignas(32) uint8_t subs[4][32];
    for (int64_t s = 0; s < supers_; ++s) {
      const uint8_t* head = panel + s * kSuperBytes;
      constexpr int64_t kCodes = kBlocksPerSuper * kBlockBytes;
      if (codes) std::memcpy(codes + s * kCodes, head + kHeadBytes, kCodes);
      const __m256 top_d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
      const __m256 top_m =
          _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * kPanel))), sign);
      unpack_sub_scales(head + 4 * kPanel, subs);
      float* out = scales + s * kBlocksPerSuper * 2 * kPanel;
      for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
        _mm256_storeu_ps(out + 2 * b * kPanel, _mm256_mul_ps(top_d, widen_bytes(subs[b / 4] + 8 * (b % 4))));
        _mm256_storeu_ps(out + (2 * b + 1) * kPanel, _mm256_mul_ps(top_m, widen_bytes(subs[2 + b / 4] + 8 * (b % 4))));
      }
    }
  }

  void prefetch(int64_t p) const override {
    const char* at = reinterpret_cast<const char*>(panels_ + p * supers_ * kSuperBytes);
    for (int64_t line = 0; line < supers_ * kSuperBytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T1);
  }
  kvloom::q4::CodeRuns codes_in_place(int64_t p) const override {
    return {panels_ + p * supers_ * kSuperBytes + kHeadBytes, kBlocksPerSuper, kSuperBytes};
  }

 private:
  const uint8_t* panels_;
  int64_t supers_;
};

// Bits 0, 2, 4, 6 of each byte as its bits 0-3 (the 16-bit shifts' bits from the next byte fall outside the masks).
inline __m256i even_bits(__m256i v) {
  v = _mm256_and_si256(v, _mm256_set1_epi8(0x55));
  v = _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi16(v, 1)), _mm256_set1_epi8(0x33));
  return _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi16(v, 2)), _mm256_set1_epi8(0x0F));
}

// Q6_K panels: the low nibbles copied, the top 2 bits moved into pack_high_bits' planes (bit 2 j + h of plane p's
// byte (c, i) is bit 4 + p of code (c, 8 j + 4 h + i); the panel keeps it at bit 2 (2 (j % 2) + h) + p of half
// j / 2's byte (c, i)), d = D s and m = (-32 D) s per group of 16 in fp32 (q6k_kernel's values).
class Q6KPanels final : public kvloom::q4::PanelSource {
 public:
  Q6KPanels(const uint8_t* panels, int64_t supers) : panels_(panels), supers_(supers) {}
  void unpack(int64_t p, uint8_t* codes, uint8_t* high, float* scales) const override {
    const uint8_t* panel = panels_ + p * supers_ * kQ6SuperBytes;
    for (int64_t s = 0; s < supers_; ++s) {
      const uint8_t* head = panel + s * kQ6SuperBytes;
      const __m256 top_d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
      const __m256 top_m = _mm256_mul_ps(top_d, _mm256_set1_ps(-32.0f));
      const uint8_t* sub = head + 2 * kPanel;
      for (int64_t j = 0; j < kBlocksPerSuper; ++j) {
        const int64_t block = s * kBlocksPerSuper + j;
        const uint8_t* w = head + kQ6HeadBytes + j * kQ6BlockBytes;
        if (codes) std::memcpy(codes + block * kBlockBytes, w, kBlockBytes);
        const __m256i t0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockBytes));
        const __m256i t1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockBytes + 32));
        auto* planes = reinterpret_cast<__m256i*>(high + block * 2 * kvloom::q4::kPlaneBytes);
        _mm256_storeu_si256(planes, _mm256_or_si256(even_bits(t0), _mm256_slli_epi16(even_bits(t1), 4)));
        _mm256_storeu_si256(planes + 1, _mm256_or_si256(even_bits(_mm256_srli_epi16(t0, 1)),
                                                        _mm256_slli_epi16(even_bits(_mm256_srli_epi16(t1, 1)), 4)));
        float* out = scales + block * 4 * kPanel;  // d0, d1, m0, m1
        for (int g = 0; g < 2; ++g) {
          const __m256 sg = widen_signed_bytes(sub + (2 * j + g) * kPanel);
          _mm256_storeu_ps(out + g * kPanel, _mm256_mul_ps(top_d, sg));
          _mm256_storeu_ps(out + (2 + g) * kPanel, _mm256_mul_ps(top_m, sg));
        }
      }
    }
  }

  void prefetch(int64_t p) const override {
    const char* at = reinterpret_cast<const char*>(panels_ + p * supers_ * kQ6SuperBytes);
    for (int64_t line = 0; line < supers_ * kQ6SuperBytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T1);
  }

 private:
  const uint8_t* panels_;
  int64_t supers_;
};
#endif

// How many of a call's M rows (the first ones) take the unpacked Q4_K and Q6_K panels (unpacked_from: -1 this build's
// and CPU's choice, 0 never, else all rows from that many, Q6_K's too: the tests force both ways on every CPU). With
// AMX-INT8 tiles, Q4_K's whole groups of 16 rows (the rest read in place: unpacked, they would need the codes copied
// for the vector kernel); with bf16_tiles, every row and both kinds wherever those tiles take M bf16 rows.
struct Unpacking {
  int64_t q4_k = 0, q6_k = 0;
};
Unpacking unpacking(int64_t M, int64_t unpacked_from, bool portable, bool bf16_tiles) {
#if defined(KVLOOM_Q4K_AVX2)
  if (portable || !kvloom::q4::unpacked_product_fast()) return {};
  const int64_t tiles_from = kvloom::q4::unpacked_bf16_tiles_from();
  if (bf16_tiles && tiles_from > 0 && M >= tiles_from) return {M, M};
  if (unpacked_from > 0) return M >= unpacked_from ? Unpacking{M, M} : Unpacking{};
  const int64_t group = unpacked_from < 0 ? kvloom::q4::unpacked_int8_tiles_from() : 0;
  return {group > 0 ? M - M % group : 0, 0};
#else
  return {};
#endif
}

// y = the k-quant product (+ bias). x: [M, K] float32 or bfloat16 (K a multiple of 256), rows contiguous; q4_k:
// pack_q4k's uint8 [P, K / 256, 1152] for y's columns [0, 8 P), q6_k: pack_q6k's uint8 [ceil((N - 8 P) / 8),
// K / 256, 1680] for the rest (either empty where it has no rows; with both, the Q4_K rows fill whole panels); bias:
// float32 [N]; y: [M, N] contiguous, in x's dtype.
void gemm_kquant(at::Tensor y, at::Tensor x, at::Tensor q4_k, at::Tensor q6_k, c10::optional<at::Tensor> bias,
                 bool portable, int64_t unpacked_from, bool bf16_tiles) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.is_contiguous() && q4_k.is_contiguous() &&
                  q6_k.is_contiguous(),
              "gemm_kquant: x must be [M, K] with contiguous rows, y [M, N] and the packed weights contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gemm_kquant: x and y must both be float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  TORCH_CHECK(K % kSuper == 0, "gemm_kquant: K = ", K, " must be a multiple of ", kSuper, " (one super-block)");
  TORCH_CHECK(q4_k.scalar_type() == at::kByte && q6_k.scalar_type() == at::kByte,
              "gemm_kquant: the packed weights must be uint8");
  const int64_t panels = (N + kPanel - 1) / kPanel, supers = K / kSuper;
  const int64_t panels4 = supers > 0 ? q4_k.numel() / (supers * kSuperBytes) : 0;
  const int64_t panels6 = panels - panels4;
  const bool fits = y.size(0) == M && panels4 <= panels && q4_k.numel() == panels4 * supers * kSuperBytes &&
                    q6_k.numel() == panels6 * supers * kQ6SuperBytes && (q6_k.numel() == 0 || panels4 * kPanel <= N);
  TORCH_CHECK(fits, "gemm_kquant: the packed weights (", q4_k.numel(), " bytes of Q4_K panels, ", q6_k.numel(),
              " of Q6_K) do not match x [", M, ", ", K, "] and y [", y.size(0), ", ", N, "]");
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gemm_kquant: bias must be a contiguous float32 [N]");
    bs = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const uint8_t* w4 = q4_k.numel() ? q4_k.data_ptr<uint8_t>() : nullptr;
  const uint8_t* w6 = q6_k.numel() ? q6_k.data_ptr<uint8_t>() : nullptr;
  const bool tiles = bf16_tiles && x.scalar_type() == at::kBFloat16;
  [[maybe_unused]] const Unpacking unpack = unpacking(M, unpacked_from, portable, tiles);
  auto in_place = [&](int64_t m0, int64_t m1, int64_t first, int64_t last) {  // rows [m0, m1), panels [first, last)
    if (m0 >= m1 || first >= last) return;
    at::Tensor ys = y.narrow(0, m0, m1 - m0);
    const at::Tensor xs = x.narrow(0, m0, m1 - m0);
    if (x.scalar_type() == at::kFloat) {
      kquant_typed<float>(ys, xs, w4, panels4, w6, bs, m1 - m0, K, N, portable, first, last);
    } else {
      kquant_typed<c10::BFloat16>(ys, xs, w4, panels4, w6, bs, m1 - m0, K, N, portable, first, last);
    }
  };
#if defined(KVLOOM_Q4K_AVX2)
  const int64_t cols4 = std::min(N, panels4 * kPanel);
  const int64_t rows4 = w4 ? unpack.q4_k : 0, rows6 = w6 ? unpack.q6_k : 0;
  if (rows4 > 0) {
    at::Tensor ys = y.narrow(0, 0, rows4);
    kvloom::q4::unpacked_product(ys, x.narrow(0, 0, rows4), 0, cols4, 4, Q4KPanels(w4, supers), bs, tiles);
  }
  if (rows6 > 0) {
    at::Tensor ys = y.narrow(0, 0, rows6);
    kvloom::q4::unpacked_product(ys, x.narrow(0, 0, rows6), cols4, N - cols4, 6, Q6KPanels(w6, supers),
                                 bs ? bs + cols4 : nullptr, tiles);
  }
  // The rows the unpacked panels took skip them here (Q4_K's panels come first).
  in_place(std::max(rows4, rows6), M, 0, panels);
  in_place(rows6, rows4, panels4, panels);  // the Q4_K panels unpacked, the Q6_K ones not
  in_place(rows4, rows6, 0, panels4);       // the other way round
#else
  in_place(0, M, 0, panels);
#endif
}

}  // namespace

namespace kvloom::kernels {
void gemm_kquant(at::Tensor y, at::Tensor x, at::Tensor q4_k, at::Tensor q6_k, c10::optional<at::Tensor> bias,
                 bool portable, int64_t unpacked_from, bool bf16_tiles) {
  ::gemm_kquant(y, x, q4_k, q6_k, bias, portable, unpacked_from, bf16_tiles);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("pack_q4k(Tensor raw, int rows, int in_features) -> Tensor");
  m.def("pack_q6k(Tensor raw, int rows, int in_features) -> Tensor");
  m.def("pack_kquant_parts(Tensor(a!) out, Tensor[] parts, int in_features, bool six_bits) -> ()");
  m.def("gemm_kquant(Tensor(a!) y, Tensor x, Tensor q4_k, Tensor q6_k, Tensor? bias, bool portable=False, "
        "int unpacked_from=-1, bool bf16_tiles=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("pack_q4k", &pack_q4k);
  m.impl("pack_q6k", &pack_q6k);
  m.impl("pack_kquant_parts", &pack_kquant_parts);
  m.impl("gemm_kquant", &gemm_kquant);
}
