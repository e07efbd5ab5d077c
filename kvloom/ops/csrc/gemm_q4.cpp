// 4-, 5- and 6-bit weights kept in their blocks: y[M, N] = x[M, K] W[N, K]^T (+ bias) for a weight stored as GGUF
// Q4_0 / Q4_1 (/ Q4_K, Q5_0, Q5_1, Q5_K, GPTQ, AWQ) blocks, W[n, k] = q[n, k] * d[n, b] + m[n, b] with q in 0..15
// (or 0..31) and b = k / 32 (Q4_0 is m = -8 d); Q6_K: q in 0..63 with d and m per 16 k.
// kvloom/ops/q4.py says what the product means; q4_linear_reference is the oracle the tests compare with.
//
// The product is llama.cpp's (vec_dot_q4_1_q8_1): x is quantized per (row, block of 32 k) to s8 codes with an
// fp32 scale dx, as quantize_per_block does (the W8A8 products' quantizer: gemm_int8.cpp), and per block
//
//     y[m, n] += d[n, b] * dx[m, b] * S + m[n, b] * dx[m, b] * sum_k qx[m, k],   S = sum_k q[n, k] qx[m, k]
//
// with S exact in integers. On AVX2 vpmaddubsw multiplies the u8 nibbles by the s8 codes: each 16-bit pair
// is at most 2 * 15 * 127 = 3810, so a whole block's 8 groups of 4 k add up in 16 bits (8 * 3810 < 32768)
// before one vpmaddwd widens them; no sign trick, half the work of an 8-bit weight per k. With AVX512-VNNI
// (vpdpbusd in its 256-bit AVX512VL form) each 4 products go straight into an int32 lane: the same exact sums.
// With AMX-INT8, 16 rows at a time take tiles (q4_amx_rows below): again the same sums and fp32 steps.
// With AMX-BF16, bf16 activations of kBf16MinRows rows or more take another product: the weight dequantized into
// bf16 tiles, fp32 sums, no activation quantization (q4_bf16_amx below, csrc/amx_bf16.h); on a 4-bit weight with fp16
// scales per 32 the table product instead, at every row count (q4_lut_amx below: KVLOOM_Q4_ACTIVATIONS=bf16).
//
// The weight is packed once (kvloom/ops/q4.py, pack_q4_weight) into panels of kPanel = 8 output columns:
// packed[panel][block][pair][8][4] bytes, where byte (c, i) of pair j holds q[n0 + c, 32 b + 8 j + i] in its
// low nibble and q[n0 + c, 32 b + 8 j + 4 + i] in its high one; so one 32-byte load gives two groups of 4 k
// of 8 columns, vpdpbusd's layout once the nibbles are split. The block scales are packed beside it as
// scales[panel][block][2][8] (d, then m, per column; zero past N), in fp16 where every value is one (GGUF Q4_0 /
// Q4_1, GPTQ and AWQ store fp16: 2 bytes a block less to stream, widened by vcvtph2ps) and fp32 otherwise (Q4_K's
// products of two scales). 5- and 6-bit codes (GGUF Q5_1 / Q5_K, Q6_K) keep their low 4 bits in the same panels and
// their upper bits in planes beside them (pack_high_bits: high[panel][block][plane][32], bit 2 j + h of byte 4 c + i
// is bit 4 + plane of the code in nibble h of pair j's byte (c, i)), OR-ed into the nibbles in registers. Q6_K has a
// scale and an offset per 16 k: its scales are packed [panel][block][4][8] (d0, d1, m0, m1), pairs 0-1 and 2-3 of a
// block sum apart, and sx comes per half block. The k-quants' scales (Q4_K / Q5_K / Q6_K) are kept in their two
// levels instead (SplitScale below, kvloom/ops/q4.py pack_split_scales): per super-block of 8 blocks an fp16 D and M
// per column and per block int8 sub-scales s (and t), d = D s and m = M t in fp32, exact (an 11-bit times an 8-bit
// significand): the fp32 scales' values, at 4.6 bits a weight for 4-bit codes instead of 6. Without AVX2 the same
// layout is read
// by plain loops (`portable=True` runs those anywhere): the same integers and fp32 steps, bit for bit.

#include "avx2_columns.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"
#include "q4_panels.h"
#include "transpose.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVLOOM_Q4_AVX2
#endif

// AMX-INT8 tiles (Intel Xeon 4th gen on, with AVX-512 for the epilogue) where the build has them.
#include "amx.h"
#include "amx_bf16.h"
#if defined(KVLOOM_Q4_AVX2) && defined(KVLOOM_AMX_INT8)
#define KVLOOM_Q4_AMX
#endif

namespace {

using kvloom::parallel_for;

constexpr int64_t kPanel = 8;              // output columns per panel: one vector of 8 fp32 sums
constexpr int64_t kBlock = 32;             // k per scale (a GGUF block)
constexpr int64_t kPairs = 4;              // 32-byte loads per panel and block (each two groups of 4 k)
constexpr int64_t kBlockBytes = kPanel * kBlock / 2;
constexpr int64_t kHighBytes = kPanel * kBlock / 8;  // one bit plane (bit 4 or 5 of the codes) per panel and block
// Rows per micro-kernel call: their sums stay in registers while a panel's codes are unpacked once for all of them.
// With VNNI (an AVX-512 build: 32 vector registers) 8 rows x (2 int32 sums, 1 fp32 sum); else 4 x (16-bit sums,
// 2 int32 sums, fp32 sums) in AVX2's 16.
#if defined(KVLOOM_VNNI_DOT)
constexpr int64_t kRows = 8;
#else
constexpr int64_t kRows = 4;
#endif
constexpr int64_t kRowChunk = 256;         // rows whose codes stay in L2 while panels stream

// Two-level scales (S = SplitScale, addressed in bytes): per panel and super-block of kSuper blocks, the fp16 D and
// M of its 8 columns (kSplitHead bytes), then per block `rows` x 8 int8 sub-scales: each group's s (d = D s), then
// each group's t (m = M t); with rows == groups (Q6_K, m = -32 d) the offsets take the scales' s (M = -32 D).
struct SplitScale {
  uint8_t byte;
};
constexpr int64_t kSuper = 8;
constexpr int64_t kSplitHead = 2 * kPanel * 2;
constexpr int64_t split_super_bytes(int rows) { return kSplitHead + kSuper * rows * kPanel; }

// S values per panel: blocks x rows x 8 scales, or the two-level bytes.
template <typename S>
int64_t panel_scales_size(int64_t blocks, int rows) {
  if constexpr (std::is_same_v<S, SplitScale>) {
    return blocks / kSuper * split_super_bytes(rows);
  } else {
    return blocks * rows * kPanel;
  }
}

// Block b, group g (of `groups`: 2 for 6-bit codes), column c of a panel's scales: d and m in fp32.
template <typename S>
inline void block_scale(const S* s, int64_t b, int rows, int groups, int g, int64_t c, float& d, float& m) {
  if constexpr (std::is_same_v<S, SplitScale>) {
    const uint8_t* p = &s->byte + b / kSuper * split_super_bytes(rows);
    c10::Half top[2];
    std::memcpy(&top[0], p + 2 * c, 2);
    std::memcpy(&top[1], p + 2 * (kPanel + c), 2);
    const int8_t* sub = reinterpret_cast<const int8_t*>(p + kSplitHead) + b % kSuper * rows * kPanel;
    const float sd = sub[g * kPanel + c];
    d = static_cast<float>(top[0]) * sd;
    m = static_cast<float>(top[1]) * (rows == groups ? sd : static_cast<float>(sub[(groups + g) * kPanel + c]));
  } else {
    const S* sb = s + b * rows * kPanel;
    d = static_cast<float>(sb[g * kPanel + c]);
    m = static_cast<float>(sb[(groups + g) * kPanel + c]);
  }
}

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

// 8 int8 sub-scales as fp32.
inline __m256 load_sub_scales(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A panel's scales read block after block (the kernel's loop): block b, group g's d and m of its 8 columns
// (block_scale's values); a two-level super-block's D and M are widened once for its 8 blocks.
template <typename S>
struct ScaleReader {
  const S* s;
  int rows, groups;
  inline void at(int64_t b, int g, __m256& d, __m256& m) {
    const S* sb = s + b * rows * kPanel;
    d = load_scales(sb + g * kPanel);
    m = load_scales(sb + (groups + g) * kPanel);
  }
};

template <>
struct ScaleReader<SplitScale> {
  const SplitScale* s;
  int rows, groups;
  int64_t super = -1;
  __m256 top_d = _mm256_setzero_ps(), top_m = _mm256_setzero_ps();
  const int8_t* subs = nullptr;

  inline void at(int64_t b, int g, __m256& d, __m256& m) {
    if (b / kSuper != super) {
      super = b / kSuper;
      const uint8_t* p = &s->byte + super * split_super_bytes(rows);
      top_d = load_scales(reinterpret_cast<const c10::Half*>(p));
      top_m = load_scales(reinterpret_cast<const c10::Half*>(p) + kPanel);
      subs = reinterpret_cast<const int8_t*>(p + kSplitHead);
    }
    const int8_t* sub = subs + b % kSuper * rows * kPanel;
    const __m256 sd = load_sub_scales(sub + g * kPanel);
    d = _mm256_mul_ps(top_d, sd);
    m = _mm256_mul_ps(top_m, rows == groups ? sd : load_sub_scales(sub + (groups + g) * kPanel));
  }
};

// One block's scales, read without a reader's state (the AMX paths, which visit a panel's blocks once each).
template <typename S>
inline void block_scales(const S* s, int64_t b, int rows, int groups, int g, __m256& d, __m256& m) {
  ScaleReader<S>{s, rows, groups}.at(b, g, d, m);
}

// Bit t (slot t = 2 j + h: pair j, its low h = 0 or high h = 1 nibbles) of each byte of a bit plane moved to bit
// `to` (4: a code's fifth bit, 5: its sixth), the rest masked off; a 16-bit shift keeps a byte's own bit there.
template <int t, int to>
inline __m256i plane_bits(__m256i plane) {
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << to));
  if constexpr (t < to) return _mm256_and_si256(_mm256_slli_epi16(plane, to - t), bit);
  if constexpr (t == to) return _mm256_and_si256(plane, bit);
  if constexpr (t > to) return _mm256_and_si256(_mm256_srli_epi16(plane, t - to), bit);
}

// Pair j's codes (low and high nibbles) with their bits above the fourth from the planes.
template <int Bits, int j>
inline void add_planes(__m256i& lo, __m256i& hi, const __m256i* planes) {
  if constexpr (Bits >= 5) {
    lo = _mm256_or_si256(lo, plane_bits<2 * j, 4>(planes[0]));
    hi = _mm256_or_si256(hi, plane_bits<2 * j + 1, 4>(planes[0]));
  }
  if constexpr (Bits == 6) {
    lo = _mm256_or_si256(lo, plane_bits<2 * j, 5>(planes[1]));
    hi = _mm256_or_si256(hi, plane_bits<2 * j + 1, 5>(planes[1]));
  }
}

// Pair j's 8 columns x 4 codes of its low (lo) and high (hi) nibbles, upper bits included, from its 32 bytes at w.
template <int Bits>
inline void pair_codes(const uint8_t* w, int j, const __m256i* planes, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
  lo = _mm256_and_si256(bytes, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  switch (j) {  // j is a constant of the callers' unrolled loops: one arm is compiled in each copy
    case 0: add_planes<Bits, 0>(lo, hi, planes); break;
    case 1: add_planes<Bits, 1>(lo, hi, planes); break;
    case 2: add_planes<Bits, 2>(lo, hi, planes); break;
    default: add_planes<Bits, 3>(lo, hi, planes); break;
  }
}

// Bits: 4, 5 or 6 (the codes' low 4 bits in the panel, the rest in Bits - 4 planes of 32 bytes per block after
// it in `high`). 6-bit codes come with a scale and an offset per 16 k (Q6_K's sub-blocks, "halves"): scales
// [blocks][4][8] (d0, d1, m0, m1) and sx per (row, half block), stride lds = 2 blocks. The 16-bit sums are widened
// into each half's int32 sums before they can overflow: a pair reaches 2 * 15 * 127 (4 bits), 2 * 31 * 127 or
// 2 * 63 * 127 = 16002 (6 bits).
template <int R, int Bits, typename T, typename S>
inline void q4_kernel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, int64_t lds,
                      const uint8_t* panel, const uint8_t* high, const S* scales, int rows, int64_t blocks,
                      const float* bias, T* y, int64_t ldy, int64_t columns) {
  constexpr int kPlanes = Bits - 4;
  constexpr bool Halves = Bits == 6;
  ScaleReader<S> reader{scales, rows, Halves ? 2 : 1};
#if !defined(KVLOOM_VNNI_DOT)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[R];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = panel + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * kBlockBytes + 64), _MM_HINT_T0);
    __m256i planes[kPlanes > 0 ? kPlanes : 1];
    KVLOOM_UNROLL
    for (int p = 0; p < kPlanes; ++p) {
      const uint8_t* h = high + (b * kPlanes + p) * kHighBytes;
      planes[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
      _mm_prefetch(reinterpret_cast<const char*>(h + 4 * kPlanes * kHighBytes), _MM_HINT_T0);
    }
    // int32 sums per column, two per row: pairs 0-1 and 2-3 (with 6-bit codes Q6_K's two groups of 16, kept apart);
    // with 4- and 5-bit codes any split of the block's products (their sum is what counts).
    __m256i part[R][2];
#if defined(KVLOOM_VNNI_DOT)
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
#else
    __m256i sums[R];  // 16-bit pair sums, widened into part before they can overflow
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) sums[r] = part[r][0] = part[r][1] = _mm256_setzero_si256();
#endif
    const int8_t* xb = xq + b * kBlock;
    KVLOOM_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      __m256i lo, hi;
      pair_codes<Bits>(w, j, planes, lo, hi);
#if defined(KVLOOM_VNNI_DOT)
      // vpdpbusd adds each 4 u8 x s8 products straight into an int32 lane: exact, nothing to widen. Two
      // dependency chains per row: a block's halves (6-bit codes), else the low and the high nibbles.
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * ldq + 8 * j;
        __m256i& low_sums = part[r][Halves ? j / 2 : 0];
        __m256i& high_sums = part[r][Halves ? j / 2 : 1];
        low_sums = _mm256_dpbusd_epi32(low_sums, lo, broadcast_word(xr));
        high_sums = _mm256_dpbusd_epi32(high_sums, hi, broadcast_word(xr + 4));
      }
#else
      const bool widen = Bits == 6 || j == 3 || (j == 1 && Bits == 5);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * ldq + 8 * j;
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast_word(xr)));
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast_word(xr + 4)));
        if (widen) {
          part[r][j / 2] = _mm256_add_epi32(part[r][j / 2], _mm256_madd_epi16(sums[r], ones));
          sums[r] = _mm256_setzero_si256();
        }
      }
#endif
    }
    if constexpr (Halves) {
      __m256 d0, d1, m0, m1;
      reader.at(b, 0, d0, m0);
      reader.at(b, 1, d1, m1);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(dx[r * blocks + b]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r][0]), _mm256_mul_ps(d0, scale), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r][1]), _mm256_mul_ps(d1, scale), acc[r]);
        acc[r] = _mm256_fmadd_ps(m0, _mm256_set1_ps(sx[r * lds + 2 * b]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m1, _mm256_set1_ps(sx[r * lds + 2 * b + 1]), acc[r]);
      }
    } else {
      __m256 d, m;
      reader.at(b, 0, d, m);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(part[r][0], part[r][1]));
        acc[r] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * blocks + b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * lds + b]), acc[r]);
      }
    }
  }
  const __m256 bv = bias ? load_columns(bias, columns) : _mm256_setzero_ps();
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, _mm256_add_ps(acc[r], bv), columns);
}

template <typename T, typename S>
using Q4Kernel = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t, const uint8_t*,
                          const uint8_t*, const S*, int, int64_t, const float*, T*, int64_t, int64_t);

// The kernel for each row count 1..kRows (index 0 unused).
template <int Bits, typename T, typename S, int... R>
constexpr std::array<Q4Kernel<T, S>, kRows + 1> q4_kernels(std::integer_sequence<int, R...>) {
  return {nullptr, &q4_kernel<R + 1, Bits, T, S>...};
}
template <int Bits, typename T, typename S>
constexpr std::array<Q4Kernel<T, S>, kRows + 1> kQ4Kernels =
    q4_kernels<Bits, T, S>(std::make_integer_sequence<int, kRows>{});
#endif

// Where panel p's bytes are in the packed weight: its nibbles, its upper-bit planes (null for 4-bit codes) and its
// scales (S: float, c10::Half or SplitScale).
template <typename S>
struct Panels {
  const uint8_t* packed;
  const uint8_t* high;
  const S* scales;
  int64_t blocks;
  int planes;
  int rows;             // scale rows per block (block_scale)
  int64_t scales_size;  // S values per panel: panel_scales_size

  const uint8_t* codes(int64_t p) const { return packed + p * blocks * kBlockBytes; }
  const uint8_t* bits(int64_t p) const { return planes ? high + p * blocks * planes * kHighBytes : nullptr; }
  const S* scales_of(int64_t p) const { return scales + p * scales_size; }
};

#if defined(KVLOOM_Q4_AMX)
// With AMX, 16 rows at a time take tiles: per block of 32 k and two panels (16 columns), one tdpbsud multiplies
// the rows' s8 codes (tile A, 16 x 32 bytes, read in place) by the columns' codes (tile B: 8 quads of k x 16
// columns x 4 bytes, unpacked once per panel pair from the nibbles and bit planes) into 16 x 16 exact int32 sums,
// which the same fp32 FMAs as the AVX2 kernel's, in the same order, scale into the rows' sums: bit for bit its
// result. 4- and 5-bit codes (scales per 32); 6-bit ones (per 16) and the last rows short of 16 keep the kernel
// above.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kTileBytes = 8 * 64;  // one block's B tile

// Two panels' codes as B tiles, one per block: row 2 j + h holds, for each of the 16 columns, the 4 codes of pair
// j's low (h = 0) or high (h = 1) nibbles with their upper bits (panel1 null: its 8 columns zero).
template <int Bits>
void unpack_tiles(const uint8_t* panel0, const uint8_t* high0, const uint8_t* panel1, const uint8_t* high1,
                  int64_t blocks, uint8_t* out) {
  constexpr int kPlanes = Bits - 4;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int half = 0; half < 2; ++half) {
      const uint8_t* w = half ? panel1 : panel0;
      uint8_t* tile = out + b * kTileBytes + 32 * half;
      if (w == nullptr) {
        for (int row = 0; row < 8; ++row) std::memset(tile + 64 * row, 0, 32);
        continue;
      }
      w += b * kBlockBytes;
      __m256i planes[kPlanes > 0 ? kPlanes : 1];
      KVLOOM_UNROLL
      for (int p = 0; p < kPlanes; ++p)
        planes[p] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>((half ? high1 : high0) + (b * kPlanes + p) * kHighBytes));
      KVLOOM_UNROLL
      for (int j = 0; j < kPairs; ++j) {
        __m256i lo, hi;
        pair_codes<Bits>(w, j, planes, lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 64 * (2 * j)), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 64 * (2 * j + 1)), hi);
      }
    }
  }
}

// Block b's d and m of 16 columns (8 per panel, groups of 32) as two vectors; a missing second panel gives zeros.
template <typename S>
inline void block_scales16(const S* first, const S* second, int64_t b, int rows, __m512& d, __m512& m) {
  __m256 d0, m0, d1 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  block_scales(first, b, rows, 1, 0, d0, m0);
  if (second) block_scales(second, b, rows, 1, 0, d1, m1);
  d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
  m = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
}

// 16 rows of y for two panels (columns [0, cols0) and [8, 8 + cols1)).
template <typename T, typename S>
void q4_amx_rows(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, int64_t lds, const uint8_t* tiles,
                 const S* scales0, const S* scales1, int rows, int64_t blocks, const float* bias0,
                 const float* bias1, T* y, int64_t ldy, int64_t cols0, int64_t cols1) {
  __m512 acc[kAmxRows];
  KVLOOM_UNROLL
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t sums[kAmxRows][16];
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_zero(0);
    _tile_loadd(1, xq + b * kBlock, ldq);
    _tile_loadd(2, tiles + b * kTileBytes, 64);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, sums, 64);
    __m512 d, m;
    block_scales16(scales0, scales1, b, rows, d, m);
    KVLOOM_UNROLL
    for (int r = 0; r < kAmxRows; ++r) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
      acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * lds + b]), acc[r]);
    }
  }
  const __m256 b0 = bias0 ? load_columns(bias0, cols0) : _mm256_setzero_ps();
  const __m256 b1 = bias1 ? load_columns(bias1, cols1) : _mm256_setzero_ps();
  for (int r = 0; r < kAmxRows; ++r) {
    store_columns(y + r * ldy, _mm256_add_ps(_mm512_castps512_ps256(acc[r]), b0), cols0);
    if (cols1 > 0) store_columns(y + r * ldy + kPanel, _mm256_add_ps(_mm512_extractf32x8_ps(acc[r], 1), b1), cols1);
  }
}
#endif

// Where a panel's bytes are read from: the packed weight itself (InPlace), or a PanelSource (q4_panels.h) that
// unpacks each panel into a thread's scratch as it is needed (Unpacked: fp32 block scales). A slot is one of the two
// panels the AMX tiles take at a time.
template <typename S>
struct PanelView {
  const uint8_t* w;
  const uint8_t* h;
  const S* sc;
};

template <typename S>
struct InPlace {
  using Scale = S;
  Panels<S> at;
  struct Scratch {
    void fit(const InPlace&) {}
  };
  PanelView<S> view(int64_t p, Scratch&, int, bool = true) const {
    return {at.codes(p), at.bits(p), at.scales_of(p)};
  }
  kvloom::q4::CodeRuns runs(int64_t p, const uint8_t*) const { return {at.codes(p), at.blocks, 0}; }
  // Panels [p0, p0 + count) toward L2 (the dequantizing product's next units).
  void prefetch(int64_t p0, int64_t count) const {
#if defined(KVLOOM_Q4_AMX_BF16)
    kvloom::amx::prefetch_l2(at.codes(p0), count * at.blocks * kBlockBytes);
    kvloom::amx::prefetch_l2(at.scales_of(p0), count * at.scales_size * static_cast<int64_t>(sizeof(S)));
    if (at.planes) kvloom::amx::prefetch_l2(at.bits(p0), count * at.blocks * at.planes * kHighBytes);
#endif
  }
};

struct Unpacked {
  using Scale = float;
  const kvloom::q4::PanelSource* source;
  int64_t blocks;
  int planes;
  // Two panels' codes, planes and scales (resized to the weight at hand: a thread's scratch lives across calls).
  struct Scratch {
    std::vector<uint8_t> codes, high;
    std::vector<float> scales;
    void fit(const Unpacked& u) {
      codes.resize(2 * u.blocks * kBlockBytes);
      high.resize(2 * u.blocks * std::max(u.planes, 1) * kHighBytes);
      scales.resize(2 * u.blocks * kvloom::q4::scale_rows(4 + u.planes) * kPanel);
    }
  };
  // `codes`: whether the kernels read the codes from the scratch (the tiles may take them where they lie: runs).
  PanelView<float> view(int64_t p, Scratch& s, int slot, bool codes = true) const {
    uint8_t* w = s.codes.data() + slot * blocks * kBlockBytes;
    uint8_t* h = s.high.data() + slot * blocks * std::max(planes, 1) * kHighBytes;
    float* sc = s.scales.data() + slot * blocks * kvloom::q4::scale_rows(4 + planes) * kPanel;
    codes = codes || source->codes_in_place(p).first == nullptr;
    source->unpack(p, codes ? w : nullptr, h, sc);
    return {codes ? w : nullptr, planes ? h : nullptr, sc};
  }
  // Where the tiles read panel p's codes: in place where the source has them so, else the scratch `view` filled.
  kvloom::q4::CodeRuns runs(int64_t p, const uint8_t* viewed) const {
    return viewed ? kvloom::q4::CodeRuns{viewed, blocks, 0} : source->codes_in_place(p);
  }
  void prefetch(int64_t p0, int64_t count) const {
    for (int64_t p = p0; p < p0 + count; ++p) source->prefetch(p);
  }
};

// With AMX-BF16 and bf16 activations, from kBf16MinRows rows the weight is dequantized instead (in registers, for
// larger batches; amx_bf16.h): per panel pair and block, W[n, k] = q d + m in fp32 (one FMA), rounded to bf16 into a
// B tile, multiplied by the unquantized activations with fp32 sums over the whole K: the product of x and the weight
// rounded to bf16, as the same weight dequantized at load would give (q4_dequantized_linear_reference), not
// llama.cpp's. On 2 cores of an AMX Xeon, SmolLM2's 30 layers of projections with their weights streaming from
// memory (each used once, as in a step; two runs) took 8.8-8.9 ms against 9.8-9.9 for the AMX-INT8 tiles at 16 rows
// and 15.6 against 27.4 at 64 (oneDNN's bf16 products of the dequantized weights: 14.8, 19.5); at 8 and 12 rows the
// VNNI kernel stays ahead (6.9-7.0 against 9.2-9.8, 8.5-8.8 against 9.3-10.0).
constexpr int64_t kBf16MinRows = 16;

#if defined(KVLOOM_Q4_AMX) && defined(KVLOOM_AMX_BF16)
#define KVLOOM_Q4_AMX_BF16
constexpr int64_t kBf16Unit = 32;  // columns per unit of the dequantized product: two panel pairs

// Two panels' weights (panel w[1] null: its 8 columns zero) dequantized to bf16 B tiles, one per block (`stride`
// words apart). Bits: 4, 5 or 6 (6: a scale and an offset per 16 k).
template <int Bits, typename S>
void dequantize_tiles(const uint8_t* const w[2], const uint8_t* const h[2], const S* const sc[2], int rows,
                      int64_t blocks, uint16_t* out, int64_t stride) {
  using kvloom::amx::spread4;
  constexpr int kPlanes = Bits - 4;
  constexpr bool Halves = Bits == 6;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i words[2][kPairs][2];  // [panel][pair j][low / high nibbles]: kvloom::amx::bf16_pairs' words
    for (int panel = 0; panel < 2; ++panel) {
      if (w[panel] == nullptr) {
        for (int j = 0; j < kPairs; ++j) words[panel][j][0] = words[panel][j][1] = _mm512_setzero_si512();
        continue;
      }
      __m256i planes[kPlanes > 0 ? kPlanes : 1];
      KVLOOM_UNROLL
      for (int p = 0; p < kPlanes; ++p)
        planes[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h[panel] + (b * kPlanes + p) * kHighBytes));
      // d and m [half of the block (Q6_K's pairs 0-1 and 2-3 have their own)][columns 0-3, 4-7], each 4 times.
      __m512 d[2][2], m[2][2];
      KVLOOM_UNROLL
      for (int g = 0; g < (Halves ? 2 : 1); ++g) {
        __m256 d8, m8;
        block_scales(sc[panel], b, rows, Halves ? 2 : 1, g, d8, m8);
        const __m512 dg = _mm512_castps256_ps512(d8), mg = _mm512_castps256_ps512(m8);
        KVLOOM_UNROLL
        for (int q = 0; q < 2; ++q) d[g][q] = spread4(dg, q), m[g][q] = spread4(mg, q);
      }
      if constexpr (!Halves) d[1][0] = d[0][0], d[1][1] = d[0][1], m[1][0] = m[0][0], m[1][1] = m[0][1];
      const uint8_t* wb = w[panel] + b * kBlockBytes;
      KVLOOM_UNROLL
      for (int j = 0; j < kPairs; ++j) {
        __m256i codes[2];
        pair_codes<Bits>(wb, j, planes, codes[0], codes[1]);
        const int g = j / 2;
        KVLOOM_UNROLL
        for (int half = 0; half < 2; ++half) {  // the pair's low and high nibbles, 8 columns x 4 codes each
          const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes[half])));
          const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes[half], 1)));
          words[panel][j][half] = kvloom::amx::bf16_pairs(_mm512_fmadd_ps(q0, d[g][0], m[g][0]),
                                                          _mm512_fmadd_ps(q1, d[g][1], m[g][1]));
        }
      }
    }
    // Pair j's low nibbles are k = 8 j + 0..3 (rows 4 j, 4 j + 1), its high ones 8 j + 4..7 (rows 4 j + 2, 4 j + 3).
    uint16_t* tile = out + b * stride;
    KVLOOM_UNROLL
    for (int j = 0; j < kPairs; ++j)
      KVLOOM_UNROLL
      for (int half = 0; half < 2; ++half)
        kvloom::amx::store_pair_rows(tile + 32 * (4 * j + 2 * half), words[0][j][half], words[1][j][half]);
  }
}

// y = x W^T (+ bias) on bf16 tiles, a unit of two panel pairs at a time.
template <typename Src>
void q4_bf16_amx(c10::BFloat16* y, int64_t ldy, const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t N,
                 const Src& src, int planes, int rows, const float* bias) {
  using S = typename Src::Scale;
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  constexpr int64_t kUnitPanels = kBf16Unit / kPanel;
  auto dequantize = [&](int64_t unit, uint16_t* tiles) {
    thread_local typename Src::Scratch scratch;
    scratch.fit(src);
    const int64_t p0 = unit * kUnitPanels, count = std::min(kUnitPanels, panels - p0), pairs = (count + 1) / 2;
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const uint8_t* w[2] = {};
      const uint8_t* h[2] = {};
      const S* sc[2] = {};
      for (int64_t i = 0; i < 2 && 2 * pair + i < count; ++i) {
        const PanelView<S> v = src.view(p0 + 2 * pair + i, scratch, static_cast<int>(i));
        w[i] = v.w, h[i] = v.h, sc[i] = v.sc;
      }
      uint16_t* out = tiles + pair * kvloom::amx::kTileWords;
      const int64_t stride = pairs * kvloom::amx::kTileWords;
      switch (planes) {
        case 0: dequantize_tiles<4>(w, h, sc, rows, blocks, out, stride); break;
        case 1: dequantize_tiles<5>(w, h, sc, rows, blocks, out, stride); break;
        default: dequantize_tiles<6>(w, h, sc, rows, blocks, out, stride); break;
      }
    }
    return pairs;
  };
  auto prefetch = [&](int64_t unit) {
    src.prefetch(unit * kUnitPanels, std::min(kUnitPanels, panels - unit * kUnitPanels));
  };
  kvloom::amx::dequantized_product(y, ldy, x, ldx, M, K, N, kBf16Unit, nullptr, bias, dequantize, prefetch);
}
#endif

#if defined(KVLOOM_Q4_AMX_BF16)
// The table product: bf16 activations times 4-bit weights with one level of scales (GGUF Q4_0 / Q4_1, GPTQ, AWQ) on
// AMX-BF16 tiles at every row count, one formula whatever the batch (where the caller allows bf16 tiles:
// KVLOOM_Q4_ACTIVATIONS=bf16 / q4_activations "bf16", or KVLOOM_BATCH_INVARIANT=0). The roles of the dequantizing
// product above are swapped: the weight is the A tile, 16 columns x 32 k of a block, each column's row looked up in a
// 16-entry table of its bf16 values q d + m (one FMA in fp32, rounded once: q4_dequantized_linear_reference's values)
// by vpermw, with its codes' nibbles as the indices; the activations are the B tile, 16 k pairs x 16 rows, packed once
// per call; C holds 16 columns x 16 rows of fp32 sums over all of K. So a row's sums are those of its own x and the
// weight alone, in one order over k, whether it comes alone or with 255 others: at 1 row the tiles cost what reading
// the weight costs, and no activation is quantized. A column's codes are read from the panels as packed (a block's four
// 4-byte runs of a column gathered by two dword permutes per panel), in the order that makes the indices one shift and
// mask away (lut_k); x's k are permuted to match.

// Whether bf16 rows take the table product (where the caller allows bf16 tiles and the scales are fp16: GGUF Q4_0 /
// Q4_1, GPTQ, AWQ): the fast kernels, 4-bit codes with a d and m per 32 k (scale rows 2), and the AMX-BF16 tiles
// granted (KVLOOM_CPU_AMX not 0).
inline bool takes_lut(bool portable, int planes, int rows) {
  return !portable && planes == 0 && rows == 2 && kvloom::amx::bf16_tiles_from(1) > 0;
}

constexpr int64_t kLutUnitPanels = 4;  // columns per unit: two A tiles of 16
constexpr int64_t kLutRows = 32;       // rows per pass of a unit's blocks: two B tiles of 16
constexpr int64_t kLutAhead = 4;       // blocks whose codes and scales are fetched ahead, as the VNNI kernel's

// A column's table row lane l (0..31) holds k = lut_k(l) of its block: lane 8 s + 2 j + h is nibble s of the column's
// 16-bit word h of its dword j (pair j's 4 bytes: byte i holds k = 8 j + i low and 8 j + 4 + i high).
constexpr int lut_k(int l) {
  const int s = l / 8, j = (l % 8) / 2, h = l % 2;
  return 8 * j + (s == 0 ? 2 * h : s == 1 ? 4 + 2 * h : s == 2 ? 2 * h + 1 : 5 + 2 * h);
}

// Block b of two panels (the second null: its 8 columns zero) as an A tile: row c = column c's 32 bf16 values in lut_k
// order.
template <typename S>
inline void lut_tile(const uint8_t* const w[2], const S* const sc[2], int rows, int64_t b, uint16_t* tile) {
  alignas(64) uint8_t codes[16][16];  // [column][its 4 dwords, j = 0..3]
  alignas(64) float d[16], m[16];
  __m512 dv, mv;
  block_scales16(sc[0], sc[1], b, rows, dv, mv);
  _mm512_store_ps(d, dv);
  _mm512_store_ps(m, mv);
  // Dword 8 j + c of a panel's pairs 0-1 (and 2-3) to dword 4 c + j: columns 0-3, then 4-7.
  const __m512i gather = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  for (int panel = 0; panel < 2; ++panel) {
    uint8_t* out = codes[8 * panel];
    if (w[panel] == nullptr) {
      std::memset(out, 0, 128);
      continue;
    }
    const uint8_t* wb = w[panel] + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + kLutAhead * kBlockBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + kLutAhead * kBlockBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sc[panel] + (b + kLutAhead) * rows * kPanel), _MM_HINT_T0);
    const __m512i pairs01 = _mm512_loadu_si512(wb), pairs23 = _mm512_loadu_si512(wb + 64);
    _mm512_store_si512(out, _mm512_permutex2var_epi32(pairs01, gather, pairs23));
    _mm512_store_si512(out + 64, _mm512_permutex2var_epi32(pairs01, _mm512_add_epi32(gather, _mm512_set1_epi32(4)),
                                                           pairs23));
  }
  // The columns' bytes and scales are read back from memory one column at a time (broadcast loads, not shuffles).
  asm volatile("" : : "r"(codes), "r"(d), "r"(m) : "memory");
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0x0008000800080008,
                                           0x0008000800080008, 0x000C000C000C000C, 0x000C000C000C000C);
  const __m512i low4 = _mm512_set1_epi16(15), upper = _mm512_set1_epi16(16);
  KVLOOM_UNROLL
  for (int c = 0; c < 16; c += 2) {
    // Columns c and c + 1's tables in one register: words 0-15 and 16-31.
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[c]), _mm512_set1_ps(m[c]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[c + 1]), _mm512_set1_ps(m[c + 1]));
    const __m512bh pair = _mm512_cvtne2ps_pbh(t1, t0);
    const __m512i table = reinterpret_cast<const __m512i&>(pair);
    const __m512i w0 = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(codes[c])));
    const __m512i w1 = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(codes[c + 1])));
    const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi16(w0, shifts), low4);
    const __m512i i1 = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(w1, shifts), low4, upper, 0xEA);  // a & b | c
    _mm512_store_si512(tile + 32 * c, _mm512_permutexvar_epi16(i0, table));
    _mm512_store_si512(tile + 32 * (c + 1), _mm512_permutexvar_epi16(i1, table));
  }
}

// x's rows [16 g, 16 g + 16) (past M: zero) as B tiles, one per block: row kk holds (x[m, lut_k(2 kk)],
// x[m, lut_k(2 kk + 1)]) of the block for each of the 16 rows m: [groups][blocks][16][16] dwords.
inline void lut_pack_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t blocks, int64_t g, uint32_t* out) {
  alignas(64) static constexpr uint16_t kOrder[32] = {
      lut_k(0),  lut_k(1),  lut_k(2),  lut_k(3),  lut_k(4),  lut_k(5),  lut_k(6),  lut_k(7),
      lut_k(8),  lut_k(9),  lut_k(10), lut_k(11), lut_k(12), lut_k(13), lut_k(14), lut_k(15),
      lut_k(16), lut_k(17), lut_k(18), lut_k(19), lut_k(20), lut_k(21), lut_k(22), lut_k(23),
      lut_k(24), lut_k(25), lut_k(26), lut_k(27), lut_k(28), lut_k(29), lut_k(30), lut_k(31)};
  const __m512i order = _mm512_load_si512(kOrder);
  const int64_t rows = std::min<int64_t>(16, M - 16 * g);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 r[16];
    KVLOOM_UNROLL
    for (int i = 0; i < 16; ++i) {
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_permutexvar_epi16(
                            order, _mm512_loadu_si512(x + (16 * g + i) * ldx + b * kBlock)))
                      : _mm512_setzero_ps();
    }
    kvloom::transpose_16x16(r);
    uint32_t* tile = out + (g * blocks + b) * 256;
    KVLOOM_UNROLL
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(tile + 16 * i), r[i]);
  }
}

// One pass: rows [16 g0, 16 g0 + 16 G) of the packed x times the unit's A tiles (V = 1 or 2 groups of 16 columns;
// a_tile(b) gives block b's, the second group's 512 words after) into y, columns n0 on (count[v] real per group).
template <int G, int V, typename ATile>
void lut_pass(const uint32_t* xb, int64_t blocks, int64_t g0, int64_t M, const ATile& a_tile, const float* bias,
              const int64_t* count, c10::BFloat16* y, int64_t ldy, int64_t n0) {
  _tile_zero(0);
  if constexpr (V == 2) _tile_zero(1);
  if constexpr (G == 2) _tile_zero(2);
  if constexpr (G == 2 && V == 2) _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* a = a_tile(b);
    _tile_loadd(6, xb + (g0 * blocks + b) * 256, 64);
    _tile_loadd(4, a, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (V == 2) {
      _tile_loadd(5, a + kvloom::amx::kTileWords, 64);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (G == 2) {
      _tile_loadd(7, xb + ((g0 + 1) * blocks + b) * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (V == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[G][V][16][16];  // [row group][column group]: tile 2 g + v, [column][row]
  _tile_stored(0, sums[0][0], 64);
  if constexpr (V == 2) _tile_stored(1, sums[0][V - 1], 64);
  if constexpr (G == 2) _tile_stored(2, sums[G - 1][0], 64);
  if constexpr (G == 2 && V == 2) _tile_stored(3, sums[G - 1][V - 1], 64);
  for (int g = 0; g < G; ++g) {
    const int64_t m0 = 16 * (g0 + g), rows = std::min<int64_t>(16, M - m0);
    for (int v = 0; v < V; ++v) {
      if (count[v] <= 0) continue;
      const __mmask16 mask = count[v] >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count[v]) - 1);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * v) : _mm512_setzero_ps();
      __m512 r[16];
      KVLOOM_UNROLL
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(sums[g][v][i]);
      kvloom::transpose_16x16(r);
      for (int64_t i = 0; i < rows; ++i) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(r[i], bv));
        _mm256_mask_storeu_epi16(y + (m0 + i) * ldy + n0 + 16 * v, mask, reinterpret_cast<const __m256i&>(out));
      }
    }
  }
}

// y = x W^T (+ bias) by the table product, for a 4-bit weight with one-level scales read in place.
template <typename S>
void q4_lut_amx(c10::BFloat16* y, int64_t ldy, const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t N,
                const InPlace<S>& src, int rows, const float* bias) {
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  const int64_t groups = (M + 15) / 16, units = (panels + kLutUnitPanels - 1) / kLutUnitPanels;
  // x's B tiles in the calling thread's buffer (kept across calls; the lambdas below run on other threads).
  thread_local std::vector<uint32_t> packed_rows;
  packed_rows.resize(std::max<size_t>(packed_rows.size(), groups * blocks * 256));
  uint32_t* xb = packed_rows.data();
  if (groups <= 2) {
    for (int64_t g = 0; g < groups; ++g) lut_pack_rows(x, ldx, M, blocks, g, xb);
  } else {
    parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) lut_pack_rows(x, ldx, M, blocks, g, xb);
    });
  }
  // One pass over a unit's blocks (M <= kLutRows) makes each A tile as it goes, into a ring of 4 slots; more rows keep
  // all the unit's tiles for the passes after the first.
  const int64_t slots = M <= kLutRows ? 4 : blocks;
  parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    kvloom::amx::configure_bf16();
    thread_local std::vector<uint16_t> storage;
    storage.resize(std::max<size_t>(storage.size(), slots * 2 * kvloom::amx::kTileWords + 32));
    uint16_t* buffer = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                                                   ~uintptr_t{63});
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t p0 = unit * kLutUnitPanels, count_panels = std::min(kLutUnitPanels, panels - p0);
      const int64_t n0 = p0 * kPanel;
      // The unit's bytes (a thread's first) and the next unit's toward L2: a unit reads its four panels' blocks side by
      // side, short runs the hardware's prefetcher does not follow early enough.
      if (unit == begin) src.prefetch(p0, count_panels);
      if (unit + 1 < end) src.prefetch(p0 + kLutUnitPanels, std::min(kLutUnitPanels, panels - p0 - kLutUnitPanels));
      const uint8_t* w[2][2] = {};
      const S* sc[2][2] = {};
      for (int64_t i = 0; i < count_panels; ++i) {
        w[i / 2][i % 2] = src.at.codes(p0 + i);
        sc[i / 2][i % 2] = src.at.scales_of(p0 + i);
      }
      const int V = count_panels > 2 ? 2 : 1;
      int64_t count[2] = {std::min<int64_t>(16, N - n0), std::min<int64_t>(16, N - n0 - 16)};
      auto make = [&](int64_t b, uint16_t* a) {
        lut_tile(w[0], sc[0], rows, b, a);
        if (V == 2) lut_tile(w[1], sc[1], rows, b, a + kvloom::amx::kTileWords);
      };
      auto slot = [&](int64_t b) { return buffer + b % slots * 2 * kvloom::amx::kTileWords; };
      auto fresh = [&](int64_t b) {
        uint16_t* a = slot(b);
        make(b, a);
        return static_cast<const uint16_t*>(a);
      };
      auto kept = [&](int64_t b) { return static_cast<const uint16_t*>(slot(b)); };
      // Rows [16 g, 16 g + 32) (or + 16 where `two` is false): the first pass makes the A tiles, the later ones reuse.
      auto pass = [&](const auto& a_tile, int64_t g, bool two) {
        if (V == 2) {
          two ? lut_pass<2, 2>(xb, blocks, g, M, a_tile, bias, count, y, ldy, n0)
              : lut_pass<1, 2>(xb, blocks, g, M, a_tile, bias, count, y, ldy, n0);
        } else {
          two ? lut_pass<2, 1>(xb, blocks, g, M, a_tile, bias, count, y, ldy, n0)
              : lut_pass<1, 1>(xb, blocks, g, M, a_tile, bias, count, y, ldy, n0);
        }
      };
      for (int64_t g = 0; g < groups; g += 2) {
        if (g == 0) {
          pass(fresh, g, g + 1 < groups);
        } else {
          pass(kept, g, g + 1 < groups);
        }
      }
    }
    _tile_release();
  });
}
#endif

// The same integers and fp32 operations in the same order, by plain loops.
template <typename T, typename S>
void q4_portable_panel(const int8_t* xq, int64_t ldq, const float* dx, const float* sx, int64_t lds,
                       const uint8_t* panel, const uint8_t* high, int planes, const S* scales, int scale_rows,
                       int64_t blocks, const float* bias, T* y, int64_t ldy, int64_t rows, int64_t columns) {
  const bool halves = planes == 2;  // 6-bit codes: a scale and an offset per 16 k
  const int groups = halves ? 2 : 1;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sums[2][kPanel] = {};
      for (int64_t j = 0; j < kPairs; ++j) {
        const uint8_t* w = panel + b * kBlockBytes + 32 * j;
        const int8_t* xr = xq + r * ldq + b * kBlock + 8 * j;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t byte = 4 * c + i;
            int32_t lo = w[byte] & 0x0F, hi = w[byte] >> 4;
            for (int p = 0; p < planes; ++p) {
              const int32_t bits = high[(b * planes + p) * kHighBytes + byte];
              lo |= ((bits >> (2 * j)) & 1) << (4 + p);
              hi |= ((bits >> (2 * j + 1)) & 1) << (4 + p);
            }
            sums[j / 2][c] += lo * xr[i] + hi * xr[4 + i];
          }
      }
      for (int64_t c = 0; c < kPanel; ++c) {
        float d0, m0;
        block_scale(scales, b, scale_rows, groups, 0, c, d0, m0);
        if (halves) {
          float d1, m1;
          block_scale(scales, b, scale_rows, groups, 1, c, d1, m1);
          const float scale = dx[r * blocks + b];
          acc[c] = std::fma(static_cast<float>(sums[0][c]), d0 * scale, acc[c]);
          acc[c] = std::fma(static_cast<float>(sums[1][c]), d1 * scale, acc[c]);
          acc[c] = std::fma(m0, sx[r * lds + 2 * b], acc[c]);
          acc[c] = std::fma(m1, sx[r * lds + 2 * b + 1], acc[c]);
        } else {
          acc[c] = std::fma(static_cast<float>(sums[0][c] + sums[1][c]), d0 * dx[r * blocks + b], acc[c]);
          acc[c] = std::fma(m0, sx[r * lds + b], acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < columns; ++c) y[r * ldy + c] = static_cast<T>(acc[c] + (bias ? bias[c] : 0.0f));
  }
}

// y[:, 0 : N) (row stride ldy) = x W^T (+ bias) for the weight's panels read through `src`.
template <typename T, typename Src>
void q4_typed(T* ys, int64_t ldy, const at::Tensor& x, const Src& src, int planes, int rows, const float* bias,
              int64_t M, int64_t K, int64_t N, bool portable, bool bf16_tiles) {
  using S = typename Src::Scale;
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  const bool halves = planes == 2;  // 6-bit codes: a scale and an offset per 16 k
#if defined(KVLOOM_Q4_AMX_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Src, InPlace<S>> && std::is_same_v<S, c10::Half>) {
    if (bf16_tiles && takes_lut(portable, planes, rows)) {
      q4_lut_amx(ys, ldy, x.data_ptr<T>(), x.stride(0), M, K, N, src, rows, bias);
      return;
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (kvloom::amx::takes_bf16_tiles(portable, bf16_tiles, M, kBf16MinRows)) {
      q4_bf16_amx(ys, ldy, x.data_ptr<T>(), x.stride(0), M, K, N, src, planes, rows, bias);
      return;
    }
  }
#endif
  const int64_t parts = halves ? 2 : 1, lds = parts * blocks;  // sx: per (row, block) or (row, half block)
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * blocks), sx(M * lds);
  std::vector<int32_t> code_sums(M * blocks);
  kvloom::kernels::quantize_blocks_s8(x, xq.data(), dx.data(), code_sums.data(), portable);
  if (halves) {
    for (int64_t i = 0; i < M * lds; ++i) {
      const int8_t* q = xq.data() + i * (kBlock / 2);
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock / 2; ++k) sum += q[k];
      sx[i] = dx[i / 2] * static_cast<float>(sum);
    }
  } else {
    for (int64_t i = 0; i < M * blocks; ++i) sx[i] = dx[i] * static_cast<float>(code_sums[i]);
  }
#if defined(KVLOOM_Q4_AVX2)
  const bool fast = !portable;
  const Q4Kernel<T, S>* kernels = planes == 2 ? kQ4Kernels<6, T, S>.data()
                                  : planes == 1 ? kQ4Kernels<5, T, S>.data() : kQ4Kernels<4, T, S>.data();
  // Two-level scales over more rows than one kernel call takes: a panel's scales widened to fp32 once (the same
  // values), not per call of 4 rows (prefill stays at the one-level kernel's speed; decode reads the compact bytes).
  const bool widen = fast && std::is_same_v<S, SplitScale> && M > kRows;
  const Q4Kernel<T, float>* wide_kernels = planes == 2   ? kQ4Kernels<6, T, float>.data()
                                           : planes == 1 ? kQ4Kernels<5, T, float>.data()
                                                         : kQ4Kernels<4, T, float>.data();
  const int groups = halves ? 2 : 1;
#else
  const bool fast = false;
#endif
  const int64_t step = fast ? kRows : kRowChunk;
#if defined(KVLOOM_Q4_AMX)
  if (fast && !halves && M >= kAmxRows && kvloom::amx::ready()) {
    const int64_t whole = M - M % kAmxRows;  // rows the tiles take; the rest go to the AVX2 kernel
    parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      kvloom::amx::configure();
      std::vector<uint8_t> tiles(blocks * kTileBytes);
      typename Src::Scratch scratch;
      scratch.fit(src);
      for (int64_t pair = begin; pair < end; ++pair) {
        // The pair's two panels (a last odd one alone: the second's pointers null, its columns 0).
        const int64_t p0 = 2 * pair, n0 = p0 * kPanel, count = std::min<int64_t>(2, panels - p0);
        const uint8_t* w[2] = {};
        const uint8_t* h[2] = {};
        const S* sc[2] = {};
        const float* bs[2] = {};
        int64_t cols[2] = {};
        kvloom::q4::CodeRuns run[2];
        for (int64_t i = 0; i < count; ++i) {
          // The codes into the scratch only where the vector kernel takes rows past the tiles'.
          const PanelView<S> v = src.view(p0 + i, scratch, static_cast<int>(i), whole < M);
          w[i] = v.w, h[i] = v.h, sc[i] = v.sc;
          run[i] = src.runs(p0 + i, v.w);
          const int64_t n = (p0 + i) * kPanel;
          bs[i] = bias ? bias + n : nullptr;
          cols[i] = std::min(kPanel, N - n);
        }
        for (int64_t b0 = 0; b0 < blocks; b0 += run[0].blocks) {
          const int64_t n = std::min(run[0].blocks, blocks - b0), r = b0 / run[0].blocks;
          const uint8_t* c0 = run[0].first + r * run[0].stride;
          const uint8_t* c1 = run[1].first ? run[1].first + r * run[1].stride : nullptr;
          const uint8_t* h0 = h[0] ? h[0] + b0 * planes * kHighBytes : nullptr;
          const uint8_t* h1 = h[1] ? h[1] + b0 * planes * kHighBytes : nullptr;
          if (planes) {
            unpack_tiles<5>(c0, h0, c1, h1, n, tiles.data() + b0 * kTileBytes);
          } else {
            unpack_tiles<4>(c0, h0, c1, h1, n, tiles.data() + b0 * kTileBytes);
          }
        }
        for (int64_t m = 0; m < whole; m += kAmxRows)
          q4_amx_rows(xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * lds, lds, tiles.data(), sc[0],
                      sc[1], rows, blocks, bs[0], bs[1], ys + m * ldy + n0, ldy, cols[0], cols[1]);
        for (int64_t i = 0; i < count; ++i)
          for (int64_t m = whole; m < M; m += kRows)
            kernels[std::min(kRows, M - m)](xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * lds, lds,
                                            w[i], h[i], sc[i], rows, blocks, bs[i], ys + m * ldy + n0 + i * kPanel,
                                            ldy, cols[i]);
      }
      _tile_release();
    });
    return;
  }
#endif
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
#if defined(KVLOOM_Q4_AVX2)
    std::vector<float> wide(widen ? blocks * 2 * groups * kPanel : 0);
#endif
    typename Src::Scratch scratch;
    scratch.fit(src);
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        const PanelView<S> v = src.view(panel, scratch, 0);
        const uint8_t* wp = v.w;
        const uint8_t* hp = v.h;
        const S* sp = v.sc;
        const float* bp = bias ? bias + n0 : nullptr;
#if defined(KVLOOM_Q4_AVX2)
        if (widen) {
          ScaleReader<S> reader{sp, rows, groups};
          for (int64_t b = 0; b < blocks; ++b)
            for (int g = 0; g < groups; ++g) {
              __m256 d, m;
              reader.at(b, g, d, m);
              _mm256_storeu_ps(wide.data() + (b * 2 * groups + g) * kPanel, d);
              _mm256_storeu_ps(wide.data() + (b * 2 * groups + groups + g) * kPanel, m);
            }
          for (int64_t m = m0; m < m1; m += step)
            wide_kernels[std::min(step, m1 - m)](xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * lds,
                                                 lds, wp, hp, wide.data(), 2 * groups, blocks, bp, ys + m * ldy + n0,
                                                 ldy, columns);
          continue;
        }
#endif
        for (int64_t m = m0; m < m1; m += step) {
          const int64_t count = std::min(step, m1 - m);
#if defined(KVLOOM_Q4_AVX2)
          if (fast) {
            kernels[count](xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * lds, lds, wp, hp, sp, rows,
                           blocks, bp, ys + m * ldy + n0, ldy, columns);
            continue;
          }
#endif
          q4_portable_panel(xq.data() + m * K, K, dx.data() + m * blocks, sx.data() + m * lds, lds, wp, hp, planes,
                            sp, rows, blocks, bp, ys + m * ldy + n0, ldy, count, columns);
        }
      }
    }
  });
}

// y = the Q4 product (+ bias). x: [M, K] float32 or bfloat16 (K a multiple of 32), rows contiguous; packed:
// pack_q4_weight's uint8 [panels, K / 32, 128]; scales: float32 or float16 [panels, K / 32, 2, 8] (d, m per block of
// 32) or [panels, K / 32, 4, 8] (d0, d1, m0, m1 per 16: 6-bit codes), or the two-level uint8 [panels, K / 256,
// 32 + 64 rows] (SplitScale; rows 2, or 2 and 4 with 6-bit codes); bias: float32 [N]; high (5- and 6-bit codes):
// pack_high_bits' uint8 [panels, K / 32, planes, 32], the codes' fifth (and sixth) bits; y: [M, N] in x's dtype.
void gemm_q4(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> bias,
             bool portable, c10::optional<at::Tensor> high, bool bf16_tiles) {
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
  const bool split = scales.scalar_type() == at::kByte;
  TORCH_CHECK((split || scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.is_contiguous(),
              "gemm_q4: scales must be contiguous float32 or float16 block scales, or uint8 two-level ones");
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gemm_q4: bias must be a contiguous float32 [N]");
    bs = bias->data_ptr<float>();
  }
  const uint8_t* hp = nullptr;
  int planes = 0;
  if (high.has_value() && high->defined()) {
    TORCH_CHECK(high->scalar_type() == at::kByte && high->is_contiguous() &&
                    (high->numel() == panels * blocks * kHighBytes || high->numel() == panels * blocks * 2 * kHighBytes),
                "gemm_q4: high must be the contiguous uint8 bit planes packed [panels, K / 32, planes, 32], 1 or 2 "
                "planes");
    hp = high->data_ptr<uint8_t>();
    planes = static_cast<int>(high->numel() / (panels * blocks * kHighBytes));
  }
  const int groups = planes == 2 ? 2 : 1;  // 6-bit codes: a scale and an offset per 16 k
  int rows = 0;
  if (split) {
    const int64_t supers = panels * (blocks / kSuper);
    if (blocks % kSuper == 0 && scales.numel() == supers * split_super_bytes(2 * groups)) rows = 2 * groups;
    if (blocks % kSuper == 0 && groups == 2 && scales.numel() == supers * split_super_bytes(groups)) rows = groups;
    TORCH_CHECK(rows > 0, "gemm_q4: two-level scales must be packed [panels, K / 256, 32 + 64 rows] with K a multiple "
                "of 256 and rows 2 (codes of 4 or 5 bits) or 2 or 4 (6 bits), got ", scales.numel(), " bytes for ",
                panels, " panels, K = ", K, " and ", planes, " bit planes");
  } else {
    if (scales.numel() == panels * blocks * 2 * kPanel) rows = 2;
    if (scales.numel() == panels * blocks * 4 * kPanel) rows = 4;
    TORCH_CHECK(rows > 0, "gemm_q4: scales must be the block scales packed [panels, K / 32, 2, 8] (a scale and an "
                "offset per block of 32) or [panels, K / 32, 4, 8] (per 16)");
    TORCH_CHECK(rows == 2 * groups,
                "gemm_q4: 6-bit codes (two bit planes) go with scales per 16 k, and only they");
  }
  if (M == 0 || N == 0) return;
  const auto* wp = packed.data_ptr<uint8_t>();
  auto run = [&](const auto* sp) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    const InPlace<S> src{Panels<S>{wp, hp, sp, blocks, planes, rows, panel_scales_size<S>(blocks, rows)}};
    if (x.scalar_type() == at::kFloat) {
      q4_typed(y.data_ptr<float>(), N, x, src, planes, rows, bs, M, K, N, portable, bf16_tiles);
    } else {
      q4_typed(y.data_ptr<c10::BFloat16>(), N, x, src, planes, rows, bs, M, K, N, portable, bf16_tiles);
    }
  };
  if (split) {
    run(reinterpret_cast<const SplitScale*>(scales.data_ptr<uint8_t>()));
  } else if (scales.scalar_type() == at::kHalf) {
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

// Whether bf16 activations on a 4-bit weight with fp16 d and m per 32 k take the table product (at every row count)
// where the call allows bf16 tiles.
bool q4_table_product() {
#if defined(KVLOOM_Q4_AMX_BF16)
  return takes_lut(false, 0, 2);
#else
  return false;
#endif
}

// From how many rows bf16 activations take the dequantizing AMX-BF16 product (with bf16_tiles); 0: never (the build
// or this process has no AMX-BF16 tiles).
int64_t q4_bf16_tiles_min_rows() {
#if defined(KVLOOM_Q4_AMX_BF16)
  return kvloom::amx::bf16_tiles_from(kBf16MinRows);
#else
  return 0;
#endif
}

}  // namespace

namespace kvloom::kernels {
void gemm_q4(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> bias,
             bool portable, c10::optional<at::Tensor> high, bool bf16_tiles) {
  ::gemm_q4(y, x, packed, scales, bias, portable, high, bf16_tiles);
}
}  // namespace kvloom::kernels

namespace kvloom::q4 {
void unpacked_product(at::Tensor& y, const at::Tensor& x, int64_t col0, int64_t cols, int bits,
                      const PanelSource& source, const float* bias, bool bf16_tiles) {
  TORCH_CHECK(bits >= 4 && bits <= 6 && y.is_contiguous() && x.stride(1) == 1 && col0 >= 0 &&
                  col0 + cols <= y.size(1) && y.size(0) == x.size(0) && x.size(1) % kBlock == 0,
              "unpacked_product: bad arguments");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  if (M == 0 || cols == 0) return;
  const Unpacked src{&source, K / kBlock, bits - 4};
  const int rows = scale_rows(bits);
  if (x.scalar_type() == at::kFloat) {
    q4_typed(y.data_ptr<float>() + col0, N, x, src, bits - 4, rows, bias, M, K, cols, false, bf16_tiles);
  } else {
    q4_typed(y.data_ptr<c10::BFloat16>() + col0, N, x, src, bits - 4, rows, bias, M, K, cols, false, bf16_tiles);
  }
}

bool unpacked_product_fast() { return ::q4_gemm_kernel(); }

int64_t unpacked_bf16_tiles_from() { return ::q4_bf16_tiles_min_rows(); }

int64_t unpacked_int8_tiles_from() {
#if defined(KVLOOM_Q4_AMX)
  return kvloom::amx::ready() ? kAmxRows : 0;
#else
  return 0;
#endif
}
}  // namespace kvloom::q4

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gemm_q4(Tensor(a!) y, Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool portable=False, "
        "Tensor? high=None, bool bf16_tiles=True) -> ()");
  m.def("q4_gemm_kernel() -> bool", &q4_gemm_kernel);
  m.def("q4_bf16_tiles_min_rows() -> int", &q4_bf16_tiles_min_rows);
  m.def("q4_table_product() -> bool", &q4_table_product);
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gemm_q4", &gemm_q4);
}
