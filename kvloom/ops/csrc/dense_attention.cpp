// Dense attention on the CPU: out = softmax(scale * Q K^T) V with no mask (a vision tower's attention within a
// tile: every patch attends to every patch).
//
//     query [B, H, Lq, D], key and value [B, H, Lk, D], out [B, H, Lq, D]
//
// Any strides, each row contiguous: the tower passes views of its fused qkv projection ([B, L, 3, H, D]) and
// writes into an out laid out [B, Lq, H, D], so nothing is copied before or after the op.
//
// A work item is (b, h, a range of query rows). It packs its head's keys and values once, then runs flash-style
// over blocks of kQueryBlock query rows x tiles of kKeyTile keys: S = Q K^T for a few rows at a time in
// registers, the online softmax of those rows in fp32 (exp by a vector polynomial), O += P V into fp32
// accumulators that stay in L1 while the tile's keys and values do, and once the last tile is done O / sum is
// written in the input's dtype. Items run on kvloom's loops (parallel.h), several per (b, h) only when there are
// too few heads to keep the threads busy (each then packs the head's keys and values itself).
//
// Two kernels:
//   pairs  bf16 with AVX512-BF16, D even. Keys packed per tile as [D / 2][kKeyTile] 32-bit words
//          (K[j][2p], K[j][2p + 1]): the tile's keys of one dimension pair are kKeyTile / 16 vectors, each
//          multiplied by a broadcast query pair with vdpbf16ps (exact products, fp32 sums). Values packed in key
//          pairs, [Lk / 2][D] words (V[2i][d], V[2i + 1][d]), and P rounded to bf16 (as torch's flash attention
//          rounds it for its bf16 P V product), so O += P V is vdpbf16ps too, on broadcast probability pairs.
//   float  any dtype (fp32, fp16, bf16 without AVX512-BF16), widened to fp32: keys packed per tile as
//          [D][kKeyTile] floats, values as rows of floats; broadcast FMAs on at::vec (AVX-512, AVX2 or scalar).

#include "cpu_capability.h"
#include "parallel.h"
#include "transpose.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kVecSize = Vec::size();
constexpr int kKeyVecs = 4;                              // vectors per row of a key tile
constexpr int kKeyTile = kKeyVecs * kVecSize;            // keys per tile: 64 with AVX-512, 32 with AVX2
constexpr int kQueryBlock = 48;                          // query rows per sweep over the key tiles
constexpr int kMaxHeadDim = 256;
constexpr int kRegisters = kVecSize >= 16 ? 32 : 16;
// Rows of S (and of O) held in registers at once: R x kKeyVecs accumulators, kKeyVecs keys and a broadcast.
constexpr int kRows = std::max(1, (kRegisters - kKeyVecs - 2) / kKeyVecs);
constexpr int kColumns = 4;  // vectors of O's columns per pass of O += P V (R x kColumns accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kQueryBlock % kRows == 0 || kRows > kQueryBlock, "the query block splits into whole row groups");

// Calls fn(std::integral_constant<int, R>()) for R = rows, 1 <= rows <= kRows.
template <typename F>
inline void with_rows(int rows, F&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>()); break;
#if defined(CPU_CAPABILITY_AVX512)
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
#else
    case 2: fn(std::integral_constant<int, 2>()); break;
#endif
    default: break;
  }
}
static_assert(kRows == (kVecSize >= 16 ? 6 : 2), "with_rows covers 1..kRows");

// Calls fn(std::integral_constant<int, C>()) for C = columns, 1 <= columns <= kColumns.
template <typename F>
inline void with_columns(int columns, F&& fn) {
  switch (columns) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    default: break;
  }
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Row r of out = o[r] / sum[r] in T, for `rows` rows of head_dim values (o's rows `o_stride` apart).
template <typename T>
void write_rows(const float* o, int o_stride, const float* sum, int rows, int head_dim, T* out, int64_t out_stride) {
  for (int r = 0; r < rows; ++r) {
    const Vec inv(1.0f / sum[r]);
    const float* src = o + static_cast<int64_t>(r) * o_stride;
    T* dst = out + r * out_stride;
    if constexpr (std::is_same_v<T, float>) {
      for (int d = 0; d < head_dim; d += kVecSize)
        (Vec::loadu(src + d) * inv).store(dst + d, std::min(kVecSize, head_dim - d));
    } else {
      // Two float vectors make one of T; o's rows are padded to whole vectors, so both can be read.
      for (int d = 0; d < head_dim; d += 2 * kVecSize) {
        const Vec a = Vec::loadu(src + d) * inv;
        const Vec b = d + kVecSize < head_dim ? Vec::loadu(src + d + kVecSize) * inv : Vec(0.0f);
        at::vec::convert_from_float<T>(a, b).store(dst + d, std::min(2 * kVecSize, head_dim - d));
      }
    }
  }
}

// What an item needs to know about the problem.
template <typename T>
struct Problem {
  const T* query;
  const T* key;
  const T* value;
  T* out;
  int64_t heads, query_len, key_len;
  int head_dim;
  float scale;
  // Element strides: [batch, head, row] of each tensor.
  int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3];
};

// The online softmax state of one row and the tile's probabilities: scores [kKeyTile] (raw S, -inf past the
// tile's n keys) become exp(scale * s - new max) in place; returns the correction of the row's earlier output,
// exp(old max - new max), 0 on the first tile.
inline float softmax_row(float* scores, float scale, bool first, float& row_max, float& row_sum) {
  Vec tile_max = Vec::loadu(scores);
  KVLOOM_UNROLL
  for (int v = 1; v < kKeyVecs; ++v) tile_max = at::vec::maximum(tile_max, Vec::loadu(scores + v * kVecSize));
  const float max_score =
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, tile_max) * scale;
  const float new_max = first ? max_score : std::max(row_max, max_score);
  const float correction = first ? 0.0f : std::exp(row_max - new_max);
  const Vec scale_vec(scale), shift(-new_max);
  Vec sum(0.0f);
  KVLOOM_UNROLL
  for (int v = 0; v < kKeyVecs; ++v) {
    const Vec p = at::vec::fmadd(Vec::loadu(scores + v * kVecSize), scale_vec, shift).exp_u20();
    p.store(scores + v * kVecSize);
    sum = sum + p;
  }
  const float tile_sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  row_sum = first ? tile_sum : row_sum * correction + tile_sum;
  row_max = new_max;
  return correction;
}

// ---- float: everything widened to fp32 --------------------------------------------------------------------

namespace float_kernel {

// keys [n] rows (`stride` elements apart) -> tile[d][j] = K[j][d], zero past n.
template <typename T>
void pack_keys(const T* key, int64_t stride, int n, int head_dim, float* tile) {
  for (int d = 0; d < head_dim; ++d) {
    float* dst = tile + d * kKeyTile;
    for (int j = 0; j < n; ++j) dst[j] = to_float(key[j * stride + d]);
    std::fill(dst + n, dst + kKeyTile, 0.0f);
  }
}

// values [n] rows -> kKeyTile rows of `width` floats (head_dim padded to whole vectors), zero past n and head_dim.
template <typename T>
void pack_values(const T* value, int64_t stride, int n, int head_dim, int width, float* tile) {
  for (int j = 0; j < kKeyTile; ++j) {
    float* dst = tile + j * width;
    int d = 0;
    if (j < n)
      for (; d < head_dim; ++d) dst[d] = to_float(value[j * stride + d]);
    std::fill(dst + d, dst + width, 0.0f);
  }
}

// R query rows (fp32, head_dim apart) against one key tile: S into scores (R rows of kKeyTile).
template <int R>
inline void score(const float* query, const float* keys, int head_dim, float* scores) {
  Vec acc[R][kKeyVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = Vec(0.0f);
  for (int d = 0; d < head_dim; ++d) {
    Vec k[kKeyVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) k[v] = Vec::loadu(keys + d * kKeyTile + v * kVecSize);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec q(query[r * head_dim + d]);
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = at::vec::fmadd(q, k[v], acc[r][v]);
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) acc[r][v].store(scores + r * kKeyTile + v * kVecSize);
}

// o[r][columns] = o[r][columns] * correction[r] + sum_j probs[r][j] V[j][columns] (o zeroed first on the first
// tile), C vectors of columns from `column`.
template <int R, int C>
inline void add_values(const float* probs, const float* values, int n, int width, int column, const float* correction,
                       bool first, float* o) {
  Vec acc[R][C];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? Vec(0.0f) : Vec::loadu(o + r * width + column + c * kVecSize) * Vec(correction[r]);
  for (int j = 0; j < n; ++j) {
    Vec v[C];
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) v[c] = Vec::loadu(values + j * width + column + c * kVecSize);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec p(probs[r * kKeyTile + j]);
      KVLOOM_UNROLL
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(p, v[c], acc[r][c]);
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c].store(o + r * width + column + c * kVecSize);
}

template <typename T>
void run_item(const Problem<T>& pb, int64_t b, int64_t h, int64_t q_begin, int64_t q_end) {
  const int head_dim = pb.head_dim;
  const int width = (head_dim + kVecSize - 1) / kVecSize * kVecSize;  // o's and the values' padded rows
  const int64_t tiles = (pb.key_len + kKeyTile - 1) / kKeyTile;
  thread_local std::vector<float> keys, values, query, o, scores;
  keys.resize(tiles * head_dim * kKeyTile);
  values.resize(tiles * kKeyTile * width);
  query.resize(kQueryBlock * head_dim);
  o.resize(kQueryBlock * width);
  scores.resize(kRows * kKeyTile);
  alignas(64) float row_max[kQueryBlock], row_sum[kQueryBlock], correction[kRows];

  const T* key = pb.key + b * pb.k_stride[0] + h * pb.k_stride[1];
  const T* value = pb.value + b * pb.v_stride[0] + h * pb.v_stride[1];
  for (int64_t t = 0; t < tiles; ++t) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, pb.key_len - t * kKeyTile));
    pack_keys(key + t * kKeyTile * pb.k_stride[2], pb.k_stride[2], n, head_dim, keys.data() + t * head_dim * kKeyTile);
    pack_values(value + t * kKeyTile * pb.v_stride[2], pb.v_stride[2], n, head_dim, width,
                values.data() + t * kKeyTile * width);
  }
  for (int64_t q0 = q_begin; q0 < q_end; q0 += kQueryBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kQueryBlock, q_end - q0));
    const T* q = pb.query + b * pb.q_stride[0] + h * pb.q_stride[1] + q0 * pb.q_stride[2];
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < head_dim; ++d) query[r * head_dim + d] = to_float(q[r * pb.q_stride[2] + d]);
    for (int64_t t = 0; t < tiles; ++t) {
      const int n = static_cast<int>(std::min<int64_t>(kKeyTile, pb.key_len - t * kKeyTile));
      const float* tile_keys = keys.data() + t * head_dim * kKeyTile;
      const float* tile_values = values.data() + t * kKeyTile * width;
      for (int r0 = 0; r0 < rows; r0 += kRows) {
        with_rows(std::min(kRows, rows - r0), [&](auto rc) {
          constexpr int R = decltype(rc)::value;
          score<R>(query.data() + r0 * head_dim, tile_keys, head_dim, scores.data());
          for (int r = 0; r < R; ++r) {
            float* s = scores.data() + r * kKeyTile;
            std::fill(s + n, s + kKeyTile, kNegInf);
            correction[r] = softmax_row(s, pb.scale, t == 0, row_max[r0 + r], row_sum[r0 + r]);
          }
          float* out_rows = o.data() + r0 * width;
          for (int column = 0; column < width; column += kColumns * kVecSize)
            with_columns(std::min(kColumns, (width - column) / kVecSize), [&](auto cc) {
              constexpr int C = decltype(cc)::value;
              add_values<R, C>(scores.data(), tile_values, n, width, column, correction, t == 0, out_rows);
            });
        });
      }
    }
    write_rows(o.data(), width, row_sum, rows, head_dim,
               pb.out + b * pb.o_stride[0] + h * pb.o_stride[1] + q0 * pb.o_stride[2], pb.o_stride[2]);
  }
}

}  // namespace float_kernel

// ---- pairs: bf16 by vdpbf16ps ------------------------------------------------------------------------------

#if defined(KVLOOM_BF16_DOT)
namespace pairs_kernel {

using BF16 = c10::BFloat16;
constexpr int kPairStride = kKeyTile / 2;  // probability pair words per row of a tile

inline __mmask16 first_lanes(int count) {  // the lowest `count` of 16 lanes, count clamped to [0, 16]
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// keys [n] rows of 2 * pairs bf16 -> tile[p][j] = the word (K[j][2p], K[j][2p + 1]), zero past n: 16 x 16 word
// transposes.
void pack_keys(const BF16* key, int64_t stride, int n, int pairs, float* tile) {
  for (int p0 = 0; p0 < pairs; p0 += 16) {
    const __mmask16 lanes = first_lanes(pairs - p0);
    const int width = std::min(16, pairs - p0);
    for (int j0 = 0; j0 < kKeyTile; j0 += 16) {
      __m512 r[16];
      KVLOOM_UNROLL
      for (int j = 0; j < 16; ++j)
        r[j] = j0 + j < n ? _mm512_maskz_loadu_ps(lanes, reinterpret_cast<const float*>(key + (j0 + j) * stride) + p0)
                          : _mm512_setzero_ps();
      kvloom::transpose_16x16(r);
      for (int i = 0; i < width; ++i) _mm512_storeu_ps(tile + (p0 + i) * kKeyTile + j0, r[i]);
    }
  }
}

// values [n] rows of head_dim bf16 -> kPairStride rows of `width` words, row i word d = (V[2i][d], V[2i + 1][d]);
// zero past n and past head_dim.
void pack_values(const BF16* value, int64_t stride, int n, int head_dim, int width, float* tile) {
  // 16-bit lanes of the two rows x, y interleaved: words 0..15 of a 32-column block, then words 16..31.
  alignas(64) int16_t low[32], high[32];
  for (int e = 0; e < 32; ++e) {
    low[e] = static_cast<int16_t>((e % 2) * 32 + e / 2);
    high[e] = static_cast<int16_t>((e % 2) * 32 + 16 + e / 2);
  }
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int i = 0; i < kPairStride; ++i) {
    const BF16* x = 2 * i < n ? value + 2 * i * stride : nullptr;
    const BF16* y = 2 * i + 1 < n ? value + (2 * i + 1) * stride : nullptr;
    float* dst = tile + i * width;
    for (int d = 0; d < width; d += 32) {
      const int count = std::clamp(head_dim - d, 0, 32);
      const __mmask32 lanes = count >= 32 ? ~static_cast<__mmask32>(0) : (static_cast<__mmask32>(1) << count) - 1;
      const __m512i a = x ? _mm512_maskz_loadu_epi16(lanes, x + d) : _mm512_setzero_si512();
      const __m512i c = y ? _mm512_maskz_loadu_epi16(lanes, y + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, low_index, c));
      if (d + 16 < width) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, high_index, c));
    }
  }
}

// o[r][columns] = o[r][columns] * correction[r] + sum_i (P[r][2i], P[r][2i + 1]) . (V[2i][d], V[2i + 1][d]),
// C vectors of columns from `column` (o zeroed first on the first tile).
template <int R, int C>
inline void add_values(const int32_t* probs, const float* values, int pairs, int width, int column,
                       const float* correction, bool first, float* o) {
  __m512 acc[R][C];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps()
                  : correction ? _mm512_mul_ps(_mm512_loadu_ps(o + r * width + column + c * 16), _mm512_set1_ps(correction[r]))
                               : _mm512_loadu_ps(o + r * width + column + c * 16);
  for (int i = 0; i < pairs; ++i) {
    __m512bh v[C];
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_ps(values + i * width + column + c * 16);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const auto p = (__m512bh)_mm512_set1_epi32(probs[r * kPairStride + i]);
      KVLOOM_UNROLL
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * width + column + c * 16, acc[r][c]);
}

// 2^t for t <= 0, and 0 for t = -inf (a padding key): t = n + f with n = round(t), f in [-0.5, 0.5], 2^f by a
// degree-4 polynomial (relative error 2.7e-6, fitted to 2^f on that range; P is then rounded to bf16, 2^-9), times
// 2^n by vscalefps (0 where 2^n underflows). Half the instructions of at::vec's exp_u20.
inline __m512 exp2_probability(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // -inf - -inf is NaN, which vmaxps replaces by its second operand: any finite f, scaled by 2^-inf = 0.
  const __m512 f = _mm512_max_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(-0.5f));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009560510516166687f), f, _mm512_set1_ps(0.05591703951358795f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
  return _mm512_scalef_ps(p, n);
}

// R query rows (`pairs` words each) through one key tile of n keys: S in registers, the rows' online softmax,
// P rounded to bf16 pairs, then O += P V. scale includes log2(e), so row_max is in powers of 2; row_sum holds
// 16 partial sums per row.
template <int R>
inline void rows_through_tile(const int32_t* query, int pairs, const float* keys, const float* values, int n,
                              int width, float scale, bool first, float* row_max, float* row_sum, float* o) {
  __m512 acc[R][kKeyVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh k[kKeyVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) k[v] = (__m512bh)_mm512_loadu_ps(keys + p * kKeyTile + v * 16);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const auto q = (__m512bh)_mm512_set1_epi32(query[r * pairs + p]);
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], q, k[v]);
    }
  }
  if (n < kKeyTile) {  // the last tile: no probability for the padding keys
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) {
      const __mmask16 seen = first_lanes(n - v * 16);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_mask_mov_ps(neg_inf, seen, acc[r][v]);
    }
  }
  alignas(64) int32_t probs[R][kPairStride];
  float correction[R];
  bool rescale = first;
  const __m512 scale_vec = _mm512_set1_ps(scale);  // scale * log2(e): the exponents are powers of 2
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) {
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], scale_vec);
    // Only a tile holding a score above the row's max so far needs the horizontal max and a rescaling of the row's
    // output (after the first few tiles, few do): one vector compare per key vector tells.
    __mmask16 above = 0;
    if (!first) {
      const __m512 limit = _mm512_set1_ps(row_max[r]);
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) above |= _mm512_cmp_ps_mask(acc[r][v], limit, _CMP_GT_OQ);
    }
    correction[r] = 1.0f;
    if (first || above) {
      __m512 m = acc[r][0];
      KVLOOM_UNROLL
      for (int v = 1; v < kKeyVecs; ++v) m = _mm512_max_ps(m, acc[r][v]);
      const float max_score = _mm512_reduce_max_ps(m);
      const float new_max = first ? max_score : std::max(row_max[r], max_score);
      correction[r] = first ? 0.0f : std::exp2(row_max[r] - new_max);
      row_max[r] = new_max;
      rescale = true;
    }
    const __m512 shift = _mm512_set1_ps(row_max[r]);
    __m512 sum = _mm512_setzero_ps();
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) {
      acc[r][v] = exp2_probability(_mm512_sub_ps(acc[r][v], shift));
      sum = _mm512_add_ps(sum, acc[r][v]);
    }
    // The row's sum stays a vector of 16 partial sums until the row is written.
    _mm512_storeu_ps(row_sum + r * 16,
                     first ? sum : _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + r * 16), _mm512_set1_ps(correction[r]), sum));
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; v += 2)
      _mm512_store_si512(&probs[r][v * 8], (__m512i)_mm512_cvtne2ps_pbh(acc[r][v + 1], acc[r][v]));
  }
  const int used_pairs = (n + 1) / 2;  // an odd last key's partner has probability 0 and a zero value row
  for (int column = 0; column < width; column += kColumns * 16)
    with_columns(std::min(kColumns, (width - column) / 16), [&](auto cc) {
      constexpr int C = decltype(cc)::value;
      add_values<R, C>(&probs[0][0], values, used_pairs, width, column, rescale ? correction : nullptr, first, o);
    });
}

void run_item(const Problem<BF16>& pb, int64_t b, int64_t h, int64_t q_begin, int64_t q_end) {
  const int head_dim = pb.head_dim;
  const int pairs = head_dim / 2;
  const int width = (head_dim + 15) / 16 * 16;
  const int64_t tiles = (pb.key_len + kKeyTile - 1) / kKeyTile;
  thread_local std::vector<float> keys, values, o;
  thread_local std::vector<int32_t> query;
  keys.resize(tiles * pairs * kKeyTile);
  values.resize(tiles * kPairStride * width);
  query.resize(kQueryBlock * pairs);
  o.resize(kQueryBlock * width);
  alignas(64) float row_max[kQueryBlock], row_sums[kQueryBlock * 16], row_sum[kQueryBlock];

  const BF16* key = pb.key + b * pb.k_stride[0] + h * pb.k_stride[1];
  const BF16* value = pb.value + b * pb.v_stride[0] + h * pb.v_stride[1];
  for (int64_t t = 0; t < tiles; ++t) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, pb.key_len - t * kKeyTile));
    pack_keys(key + t * kKeyTile * pb.k_stride[2], pb.k_stride[2], n, pairs, keys.data() + t * pairs * kKeyTile);
    pack_values(value + t * kKeyTile * pb.v_stride[2], pb.v_stride[2], n, head_dim, width,
                values.data() + t * kPairStride * width);
  }
  for (int64_t q0 = q_begin; q0 < q_end; q0 += kQueryBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kQueryBlock, q_end - q0));
    const BF16* q = pb.query + b * pb.q_stride[0] + h * pb.q_stride[1] + q0 * pb.q_stride[2];
    for (int r = 0; r < rows; ++r) std::memcpy(query.data() + r * pairs, q + r * pb.q_stride[2], head_dim * sizeof(BF16));
    for (int64_t t = 0; t < tiles; ++t) {
      const int n = static_cast<int>(std::min<int64_t>(kKeyTile, pb.key_len - t * kKeyTile));
      const float* tile_keys = keys.data() + t * pairs * kKeyTile;
      const float* tile_values = values.data() + t * kPairStride * width;
      for (int r0 = 0; r0 < rows; r0 += kRows)
        with_rows(std::min(kRows, rows - r0), [&](auto rc) {
          rows_through_tile<decltype(rc)::value>(query.data() + r0 * pairs, pairs, tile_keys, tile_values, n, width,
                                                  pb.scale * kLog2e, t == 0, row_max + r0, row_sums + r0 * 16,
                                                  o.data() + r0 * width);
        });
    }
    for (int r = 0; r < rows; ++r) row_sum[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(row_sums + r * 16));
    write_rows(o.data(), width, row_sum, rows, head_dim,
               pb.out + b * pb.o_stride[0] + h * pb.o_stride[1] + q0 * pb.o_stride[2], pb.o_stride[2]);
  }
}

}  // namespace pairs_kernel
#endif

// Whether the pairs kernel runs for this dtype and head size (else the float kernel).
bool uses_pairs(at::ScalarType dtype, int64_t head_dim) {
#if defined(KVLOOM_BF16_DOT)
  return dtype == at::kBFloat16 && head_dim % 2 == 0;
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

template <typename T>
void run(const Problem<T>& pb, int64_t batch) {
  // Query ranges per (b, h): one, unless there are too few heads for every thread to get several items.
  const int64_t heads = batch * pb.heads;
  const int64_t blocks = (pb.query_len + kQueryBlock - 1) / kQueryBlock;
  const int64_t wanted = (kvloom::pool_threads() * kvloom::kChunksPerThread + heads - 1) / heads;
  const int64_t splits = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(blocks, 1));
  const int64_t rows_per_split = (blocks + splits - 1) / splits * kQueryBlock;
  kvloom::parallel_chunks(heads * splits, [&](int64_t item) {
    const int64_t head = item / splits, split = item % splits;
    const int64_t b = head / pb.heads, h = head % pb.heads;
    const int64_t q_begin = split * rows_per_split, q_end = std::min(pb.query_len, q_begin + rows_per_split);
    if (q_begin >= q_end) return;
#if defined(KVLOOM_BF16_DOT)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (uses_pairs(at::kBFloat16, pb.head_dim)) {
        pairs_kernel::run_item(pb, b, h, q_begin, q_end);
        return;
      }
    }
#endif
    float_kernel::run_item(pb, b, h, q_begin, q_end);
  });
}

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 4, "dense_attention: ", name, " must be a 4-d CPU tensor "
              "[batch, heads, length, head_dim], got ", t.dim(), " dimensions on ", t.device());
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), "dense_attention: ", name, " is ", t.scalar_type(),
              ", query is ", query.scalar_type(), "; all four tensors must share one dtype");
  TORCH_CHECK(t.stride(3) == 1, "dense_attention: ", name, "'s rows must be contiguous (stride 1 in head_dim)");
  TORCH_CHECK(t.size(0) == query.size(0) && t.size(1) == query.size(1) && t.size(3) == query.size(3),
              "dense_attention: ", name, " has shape ", t.sizes(), ", query ", query.sizes(),
              "; batch, heads and head_dim must agree");
}

}  // namespace

// out [B, H, Lq, D] = softmax(scale * query key^T) value; key and value [B, H, Lk, D].
void dense_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     double scale) {
  check_operand(query, "query", query);
  check_operand(key, "key", query);
  check_operand(value, "value", query);
  check_operand(out, "out", query);
  TORCH_CHECK(key.size(2) == value.size(2), "dense_attention: key has ", key.size(2), " rows, value ", value.size(2));
  TORCH_CHECK(out.size(2) == query.size(2), "dense_attention: out has ", out.size(2), " rows, query ", query.size(2));
  TORCH_CHECK(query.size(3) >= 1 && query.size(3) <= kMaxHeadDim, "dense_attention: head_dim must be 1..",
              kMaxHeadDim, ", got ", query.size(3));
  TORCH_CHECK(key.size(2) >= 1, "dense_attention: there must be at least one key");
  if (query.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "dense_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "dense_attention: float64 is not supported; use float32, bfloat16 or float16");
    } else {
      Problem<scalar_t> pb{query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                           out.data_ptr<scalar_t>(), query.size(1), query.size(2), key.size(2),
                           static_cast<int>(query.size(3)), static_cast<float>(scale),
                           {query.stride(0), query.stride(1), query.stride(2)},
                           {key.stride(0), key.stride(1), key.stride(2)},
                           {value.stride(0), value.stride(1), value.stride(2)},
                           {out.stride(0), out.stride(1), out.stride(2)}};
      run(pb, query.size(0));
    }
  });
}

// Which kernel a call in `dtype` with `head_dim` runs: "pairs" (bf16 by vdpbf16ps) or "float".
std::string dense_attention_kernel(at::ScalarType dtype, int64_t head_dim) {
  return uses_pairs(dtype, head_dim) ? "pairs" : "float";
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("dense_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale) -> ()");
  m.def("dense_attention_kernel(ScalarType dtype, int head_dim) -> str", &dense_attention_kernel);
  m.def("dense_attention_max_head_dim() -> int", [] { return static_cast<int64_t>(kMaxHeadDim); });
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("dense_attention", &dense_attention);
}
