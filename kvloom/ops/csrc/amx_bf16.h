// The dequantizing product on AMX-BF16 tiles, shared by the code-block weights (gemm_q4.cpp) and the int8 ones, Q8_0
// blocks and per-row (gemm_int8.cpp): y[M, N] = x[M, K] W[N, K]^T * scale (+ bias) for bf16 x, where W is
// dequantized per call, a unit of columns at a time, into bf16 B tiles by the caller's `dequantize`, and tdpbf16ps
// multiplies the rows of x, read in place as A tiles, into fp32 sums that run the whole K (no per-block epilogue, no
// activation quantization). The result is x times the weight rounded to bf16, summed in fp32, then scaled per column
// (where the caller has a scale apart from W) and biased in fp32 with one FMA, and rounded once to bf16.
//
// Layout: a B tile is one block of 32 k by 16 columns: row r holds (W[n, 32 b + 2 r], W[n, 32 b + 2 r + 1]) for each
// of the 16 columns n, 64 bytes. A unit's tiles are [blocks][groups of 16 columns][512 bf16 words].
//
// Loop: threads split the units; per pass over about kChunkBytes of x's rows (they stay in L2) each unit is
// dequantized once and multiplied by every 32 (then 16) rows of the pass, two groups of 16 columns at a time (2 x 2
// C tiles: four chains of products side by side, and as many tile loads as products), while the next units' weight
// bytes are fetched toward L2. The last M % 16 rows go through a zero-padded copy (a tile reads 16 rows).
//
// A bf16 weight takes the same loop with nothing to dequantize (panel_product): gemm.cpp's panels hold a block's 16 k
// pairs of 16 columns as 16 rows of 64 bytes, the panel's width apart, which tileloadd reads in place. On 2 cores of
// an AMX Xeon, SmolLM2's 30 layers of projections streaming from memory take 11.2 / 11.2 / 16.1 / 35.1 ms at 1 / 8 /
// 64 / 256 rows, where the AVX512-BF16 dot-product kernel takes 11.6 / 18.8 / 73.9 / 268 ms: a bf16 weight takes the
// tiles at every row count (one formula whatever the batch; tdpbf16ps and vdpbf16ps round differently, so the two
// are never mixed for a weight). The dequantizing products stay behind the int8 ones below 16 rows (4-bit at 1 row:
// 10.5 ms against 2.6 for VNNI; the dequantization is the cost), so they are taken only where batch-dependent products
// are allowed.
#pragma once

#include <cstdint>

#include "amx.h"

namespace kvloom::amx {

// min_rows where this build and this process run the AMX-BF16 tiles, else 0 (no AMX-BF16 in the build, or the tiles
// refused / KVLOOM_CPU_AMX=0): the products' `*_bf16_tiles_min_rows` ops and their dispatch.
inline int64_t bf16_tiles_from(int64_t min_rows) {
#if defined(KVLOOM_AMX_BF16)
  return ready() ? min_rows : 0;
#else
  (void)min_rows;
  return 0;
#endif
}

// Whether a product of `rows` bf16 rows takes the tiles (its caller's `portable` and `bf16_tiles` allowing).
inline bool takes_bf16_tiles(bool portable, bool bf16_tiles, int64_t rows, int64_t min_rows) {
  const int64_t from = portable || !bf16_tiles ? 0 : bf16_tiles_from(min_rows);
  return from > 0 && rows >= from;
}

}  // namespace kvloom::amx

#if defined(KVLOOM_AMX_BF16)
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"

namespace kvloom::amx {

constexpr int64_t kTileWords = 16 * 32;     // one B tile, in bf16 words
constexpr int64_t kChunkBytes = 1 << 20;    // x's rows per pass over the units: about this many bytes
constexpr int64_t kMaxUnitGroups = 6;       // groups of 16 columns a unit may have
constexpr int64_t kAheadUnits = 2;          // units whose weight bytes are fetched ahead

// [p, p + bytes) toward L2 (the weight streams from memory; the tiles' products leave the loads time to land). As
// volatile asm: GCC 12 deleted a loop of _mm_prefetch with a run-time trip count as code without effect (checked in
// the object code: no prefetcht1 left; the weights then came no earlier than without it, 30% slower from memory).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) asm volatile("prefetcht1 %0" : : "m"(c[i]));
}

// 8 fp32 values per lane group spread as 16: v's lanes [4 q, 4 q + 4) each 4 times (q = 0..3 picks which four).
inline __m512 spread4(__m512 v, int q) {
  const __m512i index = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                         _mm512_set1_epi32(4 * q));
  return _mm512_permutexvar_ps(index, v);
}

// Two vectors of 16 fp32 values, each 4 columns x 4 k (a column's 4 k in a row), as bf16 (RNE) words: word 2 c + p
// holds column c's k pair p (columns 0-3 from lo, 4-7 from hi).
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512bh words = _mm512_cvtne2ps_pbh(hi, lo);
  return reinterpret_cast<const __m512i&>(words);
}

// Rows 2 r and 2 r + 1 of a B tile from the words of columns 0-7 (a) and 8-15 (b) for k pairs r (p = 0) and r + 1
// (p = 1), as bf16_pairs gives them.
inline void store_pair_rows(uint16_t* row, __m512i a, __m512i b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  _mm512_storeu_si512(row, _mm512_permutex2var_epi32(a, even, b));
  _mm512_storeu_si512(row + 32, _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b));
}

// Tiles 0-3: C, 16 rows x 16 fp32 sums; 4-5: A, 16 rows x 32 bf16 (a block of 32 k); 6-7: B. Per thread, before
// its first tile instruction.
inline void configure_bf16() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Where a product's B tiles lie: block b's tile of column group v at tiles + b * stride + v * group words, its 16 rows
// (k pairs) ldb bytes apart. A dequantizing product's buffer: stride S groups' tiles, group kTileWords, ldb 64; a
// bf16 weight's panels read in place (panel_product): a block's 16 pairs of the panel's words, ldb the panel's width.
struct TileLayout {
  int64_t stride, group, ldb;
};

// Rows [0, 16 G) of x (G = 1 or 2 groups of 16) times V = 1 or 2 groups of 16 columns (tiles: the first group's
// first block, laid out as `at` says) into y. scale, bias, count: per group, its 16 columns' scales (or null: 1),
// bias (or null) and how many of them are real; y = sums * scale + bias in fp32 (one FMA). Each row's sums are those
// of its own x and W alone, in one order over k whatever G and `rows` are: the product does not depend on the batch.
template <int G, int V>
void tile_rows(const c10::BFloat16* x, int64_t ldx, const uint16_t* tiles, TileLayout at, int64_t blocks,
               const float* const* scale, const float* const* bias, const int64_t* count, c10::BFloat16* y,
               int64_t ldy, int64_t rows) {
  _tile_zero(0);
  if constexpr (G == 2) _tile_zero(1);
  if constexpr (V == 2) _tile_zero(2);
  if constexpr (G == 2 && V == 2) _tile_zero(3);
  const int64_t bytes = ldx * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* tile = tiles + b * at.stride;
    // Each load as late as it can be, so it overlaps the products before it; x's rows are read once per unit
    // (stream loads: they need not stay in L1, the B tiles should).
    _tile_stream_loadd(4, x + b * 32, bytes);
    _tile_loadd(6, tile, at.ldb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (V == 2) {
      _tile_loadd(7, tile + at.group, at.ldb);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (G == 2) {
      _tile_stream_loadd(5, x + 16 * ldx + b * 32, bytes);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (V == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[V][G][16][16];  // [column group][row group]: tile 2 v + g
  _tile_stored(0, sums[0][0], 64);
  if constexpr (G == 2) _tile_stored(1, sums[0][G - 1], 64);
  if constexpr (V == 2) _tile_stored(2, sums[V - 1][0], 64);
  if constexpr (G == 2 && V == 2) _tile_stored(3, sums[V - 1][G - 1], 64);
  for (int v = 0; v < V; ++v) {
    if (count[v] <= 0) continue;
    const __mmask16 mask = count[v] >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count[v]) - 1);
    const __m512 bv = bias[v] ? _mm512_maskz_loadu_ps(mask, bias[v]) : _mm512_setzero_ps();
    const __m512 sv = scale[v] ? _mm512_maskz_loadu_ps(mask, scale[v]) : _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_load_ps(sums[v][r / 16][r % 16]), sv, bv));
      if (count[v] >= 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16 * v), reinterpret_cast<const __m256i&>(out));
      } else {
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask, reinterpret_cast<const __m256i&>(out));
      }
    }
  }
}

// Rows [m0, m1) of x times one unit of `columns` columns (groups of 16, its tiles laid out as `at` says) into y
// (rows ldy apart, the unit's first column n0): 32 rows at a time where whole, then 16; the rows from `whole` on
// (M's last, short of 16) are read from `tail`, their copy padded with zero rows (K apart).
inline void unit_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* tail, int64_t K, int64_t M,
                      int64_t whole, int64_t m0, int64_t m1, const uint16_t* tiles, TileLayout at, int64_t blocks,
                      int64_t n0, int64_t columns, const float* scale, const float* bias, c10::BFloat16* y,
                      int64_t ldy) {
  const int64_t groups = (columns + 15) / 16, full = std::min(m1, whole);
  const float* ss[kMaxUnitGroups] = {};
  const float* bs[kMaxUnitGroups] = {};
  int64_t count[kMaxUnitGroups] = {};
  for (int64_t v = 0; v < groups; ++v) {
    ss[v] = scale ? scale + n0 + 16 * v : nullptr;
    bs[v] = bias ? bias + n0 + 16 * v : nullptr;
    count[v] = std::min<int64_t>(16, columns - 16 * v);
  }
  for (int64_t v = 0; v < groups; v += 2) {
    const uint16_t* t = tiles + v * at.group;
    c10::BFloat16* yv = y + n0 + 16 * v;
    const bool two = v + 1 < groups;
    int64_t m = m0;
    for (; m + 32 <= full; m += 32) {
      if (two) {
        tile_rows<2, 2>(x + m * ldx, ldx, t, at, blocks, ss + v, bs + v, count + v, yv + m * ldy, ldy, 32);
      } else {
        tile_rows<2, 1>(x + m * ldx, ldx, t, at, blocks, ss + v, bs + v, count + v, yv + m * ldy, ldy, 32);
      }
    }
    for (; m < m1; m += 16) {
      const bool last = m >= whole;  // the tail's zero-padded copy
      const c10::BFloat16* xm = last ? tail : x + m * ldx;
      const int64_t ld = last ? K : ldx, rows = last ? M - m : 16;
      if (two) {
        tile_rows<1, 2>(xm, ld, t, at, blocks, ss + v, bs + v, count + v, yv + m * ldy, ldy, rows);
      } else {
        tile_rows<1, 1>(xm, ld, t, at, blocks, ss + v, bs + v, count + v, yv + m * ldy, ldy, rows);
      }
    }
  }
}

// x's last M % 16 rows copied into 16 zero-padded rows (K apart), as unit_rows reads them; empty where none.
inline std::vector<c10::BFloat16> tail_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t whole = M - M % 16;
  std::vector<c10::BFloat16> tail(whole < M ? 16 * K : 0, c10::BFloat16(0.0f));
  for (int64_t r = whole; r < M; ++r)
    std::memcpy(tail.data() + (r - whole) * K, x + r * ldx, K * sizeof(c10::BFloat16));
  return tail;
}

// Rows of x per pass over a thread's units: x's chunk (~kChunkBytes) stays in L2 while the weight streams.
inline int64_t row_chunk(int64_t K) { return std::max<int64_t>(32, kChunkBytes / (K * 2) / 32 * 32); }

// y = (x W^T) * scale (+ bias), scale and bias per column (or null), W a unit of `unit_columns` columns (a multiple of
// 16, at most 16 kMaxUnitGroups) at a time: tiles_of(unit, buffer) gives the unit's B tiles and their TileLayout
// (written into `buffer`, buffer_words bf16 words 64-byte aligned, or found in place); prefetch(unit) fetches its
// weight bytes toward L2. x: rows ldx apart; y: [M, N], rows ldy apart; K a multiple of 32.
template <typename TilesOf, typename Prefetch>
void tiled_product(c10::BFloat16* y, int64_t ldy, const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K,
                   int64_t N, int64_t unit_columns, const float* scale, const float* bias, int64_t buffer_words,
                   const TilesOf& tiles_of, const Prefetch& prefetch) {
  const int64_t blocks = K / 32, units = (N + unit_columns - 1) / unit_columns;
  const int64_t whole = M - M % 16, chunk = row_chunk(K);
  const std::vector<c10::BFloat16> tail = tail_rows(x, ldx, M, K);
  kvloom::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    configure_bf16();
    std::vector<uint16_t> storage(buffer_words > 0 ? buffer_words + 32 : 0);
    uint16_t* buffer = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                                                   ~uintptr_t{63});
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t m1 = std::min(M, m0 + chunk);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t n0 = unit * unit_columns, columns = std::min(unit_columns, N - n0);
        const auto [tiles, at] = tiles_of(unit, buffer);
        // The units after this one toward L2 while these tiles multiply (the first of a thread's: two ahead).
        for (int64_t ahead = (unit == begin && m0 == 0) ? 1 : kAheadUnits; ahead <= kAheadUnits; ++ahead)
          if (unit + ahead < end) prefetch(unit + ahead);
        unit_rows(x, ldx, tail.data(), K, M, whole, m0, m1, tiles, at, blocks, n0, columns, scale, bias, y, ldy);
      }
    }
    _tile_release();
  });
}

// The dequantizing products: dequantize(unit, tiles) writes the unit's B tiles, [blocks][S groups of 16][kTileWords]
// (columns past N zero), and returns S (at least the unit's real columns / 16, rounded up).
template <typename Dequantize, typename Prefetch>
void dequantized_product(c10::BFloat16* y, int64_t ldy, const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K,
                         int64_t N, int64_t unit_columns, const float* scale, const float* bias,
                         const Dequantize& dequantize, const Prefetch& prefetch) {
  auto tiles_of = [&](int64_t unit, uint16_t* buffer) {
    return std::pair<const uint16_t*, TileLayout>{buffer, {dequantize(unit, buffer) * kTileWords, kTileWords, 64}};
  };
  tiled_product(y, ldy, x, ldx, M, K, N, unit_columns, scale, bias, K / 32 * (unit_columns / 16) * kTileWords,
                tiles_of, prefetch);
}

// y = x W^T (+ bias) for a bf16 weight in gemm.cpp's panels of `panel` columns (a multiple of 16, at most 16
// kMaxUnitGroups: packed[panel][K / 2][panel][2]), its B tiles read in place (a block's 16 k pairs of 16 columns are
// 16 rows of 64 bytes, the panel's width apart): the AMX-BF16 tiles at every row count, one formula per row whatever
// the batch (K a multiple of 32). The next panels are fetched toward L2 as the dequantizing products' units are.
inline void panel_product(c10::BFloat16* y, const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t N,
                          const c10::BFloat16* packed, int64_t panel, const float* bias) {
  const int64_t panel_words = K * panel;
  const auto* words = reinterpret_cast<const uint16_t*>(packed);
  auto tiles_of = [&](int64_t unit, uint16_t*) {
    return std::pair<const uint16_t*, TileLayout>{words + unit * panel_words, {32 * panel, 32, 4 * panel}};
  };
  auto prefetch = [&](int64_t unit) { prefetch_l2(words + unit * panel_words, panel_words * 2); };
  tiled_product(y, N, x, ldx, M, K, N, panel, nullptr, bias, 0, tiles_of, prefetch);
}

}  // namespace kvloom::amx
#endif
