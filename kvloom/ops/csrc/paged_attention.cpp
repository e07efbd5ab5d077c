// Paged attention on the CPU: a step's whole flat batch (decodes and prefill chunks) in one call.
//
// Request i owns query rows [query_start_loc[i], query_start_loc[i+1]); they are the last q_len
// positions of its seq_lens[i]-long sequence and attend causally (and within the sliding window)
// to keys read in place from the paged cache:
//
//     slot(pos) = block_table[i, pos / block_size] * block_size + pos % block_size
//
// A work item is (request, range of kv heads, tile of query positions). Its rows are the tile's
// positions times the g query heads of each kv head, so one pass over the keys serves all of them
// and each cached K/V row is read once per item, never copied out of the cache. A decode item
// takes every kv head of its request when there are enough requests to keep the threads busy:
// it then reads whole slots, which the memory system streams much faster than one head's rows.
//
// Keys go by in tiles of kKeyTile (64 with AVX-512), the next tile prefetched. Per kv head:
// S = Q K^T as broadcast FMAs over a K tile with the keys along the vectors (no horizontal sums;
// bf16 pairs by vdpbf16ps where the CPU has AVX512-BF16), then an online softmax per row, then
// O += P V with V read straight from the cache. Everything accumulates in fp32.
//
// Two layouts of the caches:
//   rows   keys and values [num_blocks, block_size, Hkv, D]: each K tile is transposed into a small
//          buffer first, which costs about as much as the scores themselves at decode;
//   pairs  (bf16 with vdpbf16ps, block_size % 16 == 0, D % 32 == 0) keys [num_blocks, Hkv, D / 2,
//          block_size, 2]: per block and kv head, the words (K[j][2p], K[j][2p+1]) of its keys j side
//          by side for each pair p, so 16 keys of one pair are one vector read in place; values
//          [num_blocks, Hkv, block_size / 2, D, 2]: the words (V[2i][d], V[2i+1][d]) of each pair of
//          keys, so that O += P V multiplies pairs of keys by vdpbf16ps too (P rounded to bf16, as HF
//          rounds the probabilities). The KV write (fused_ops.cpp) lays them out so; nothing is
//          transposed or converted at attention time.

#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"
#include "transpose.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using kvloom::parallel_chunks;
using kvloom::pool_threads;
#if defined(CPU_CAPABILITY_AVX512)
using kvloom::transpose_16x16;
#elif defined(CPU_CAPABILITY_AVX2)
using kvloom::transpose_8x8;
#endif

using Vec = at::vec::Vectorized<float>;
constexpr int kVecSize = Vec::size();
constexpr int kKeyVecs = 4;                                // vectors per row of a key tile
constexpr int kKeyTile = kKeyVecs * kVecSize;              // keys per tile; S and K tiles stay in L1
constexpr int kTargetRows = 48;                            // rows (positions x group) per prefill item
constexpr int kMaxHeadDim = 256;
constexpr int kRegisters = kVecSize >= 16 ? 32 : 16;       // vector registers
constexpr int kRowBlock = kVecSize >= 16 ? 8 : 4;          // rows in registers at once for O += P V
constexpr int kAccumulators = kRegisters / 2;              // registers a block of O += P V accumulates in
constexpr int kScoreRows = std::max(1, (kRegisters - kKeyVecs - 2) / kKeyVecs);  // the same for S = Q K^T
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline Vec load_float(const T* p) {
  Vec v;
  at::vec::load_to_float<T>(p, v);
  return v;
}

template <>
inline Vec load_float<float>(const float* p) {
  return Vec::loadu(p);
}

// int8 KV codes (kv_cache_dtype="int8"), widened exactly; the row's scale is applied to the scores and the
// probabilities instead (see run_item).
template <>
inline Vec load_float<int8_t>(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float values[kVecSize];
  for (int i = 0; i < kVecSize; ++i) values[i] = static_cast<float>(p[i]);
  return Vec::loadu(values);
#endif
}

// An int8 KV row is head_dim codes and then its scale as fp16 (2 bytes, unaligned): kvloom/ops/reference.py
// quantize_kv_rows says how it is made.
inline float int8_row_scale(const int8_t* row, int head_dim) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Calls fn(std::integral_constant<int, R>()) for R = rows, 1 <= rows <= kRowBlock.
template <typename F>
inline void with_row_count(int rows, F&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
#if defined(CPU_CAPABILITY_AVX512)
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    case 8: fn(std::integral_constant<int, 8>()); break;
#endif
    default: break;
  }
}

// ---- S = Q K^T: two layouts of the K tile, both with the keys along the vectors ---------------

// Any dtype: key_t[d][j] = K[j][d] as fp32, and query rows as fp32.
struct FloatKeys {
  static int words(int head_dim) { return head_dim; }  // 32-bit words per query row

  template <typename T>
  static void pack_query(const T* q, int head_dim, float* words) {
    for (int d = 0; d < head_dim; ++d) words[d] = static_cast<float>(q[d]);
  }

  template <typename T>
  static void pack_keys(const T* const* rows, int head_dim, float* key_t) {
    int d = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; d + 16 <= head_dim; d += 16) {
      for (int j0 = 0; j0 < kKeyTile; j0 += 16) {
        __m512 r[16];
        KVLOOM_UNROLL
        for (int j = 0; j < 16; ++j) r[j] = load_float(rows[j0 + j] + d);
        transpose_16x16(r);
        KVLOOM_UNROLL
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(key_t + (d + i) * kKeyTile + j0, r[i]);
      }
    }
#elif defined(CPU_CAPABILITY_AVX2)
    for (; d + 8 <= head_dim; d += 8) {
      for (int j0 = 0; j0 < kKeyTile; j0 += 8) {
        __m256 r[8];
        KVLOOM_UNROLL
        for (int j = 0; j < 8; ++j) r[j] = load_float(rows[j0 + j] + d);
        transpose_8x8(r);
        KVLOOM_UNROLL
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(key_t + (d + i) * kKeyTile + j0, r[i]);
      }
    }
#endif
    for (; d < head_dim; ++d)
      for (int j = 0; j < kKeyTile; ++j) key_t[d * kKeyTile + j] = static_cast<float>(rows[j][d]);
  }

  // query: R rows of head_dim words; keys[v] + d * stride: the kVecSize keys of vector v at dimension d;
  // scores: R rows of kKeyTile.
  template <int R>
  static void score(const float* query, const float* const* keys, int64_t stride, int head_dim, float* scores) {
    Vec acc[R][kKeyVecs];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = Vec(0.0f);
    for (int d = 0; d < head_dim; ++d) {
      Vec k[kKeyVecs];
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) k[v] = Vec::loadu(keys[v] + d * stride);
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
};

#if defined(KVLOOM_BF16_DOT)
// bf16 with vdpbf16ps: key_t[p][j] = the pair K[j][2p], K[j][2p+1] as one 32-bit word, and query
// rows as pairs too. Half the transposing and half the multiply instructions of FloatKeys, and
// no conversions; the products are exact and summed in fp32. Needs head_dim % 32 == 0.
struct PairKeys {
  static int words(int head_dim) { return head_dim / 2; }

  static void pack_query(const c10::BFloat16* q, int head_dim, float* words) {
    std::memcpy(words, q, head_dim * sizeof(c10::BFloat16));
  }

  static void pack_keys(const c10::BFloat16* const* rows, int head_dim, float* key_t) {
    for (int p = 0; p < head_dim / 2; p += 16) {
      for (int j0 = 0; j0 < kKeyTile; j0 += 16) {
        __m512 r[16];
        KVLOOM_UNROLL
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows[j0 + j] + 2 * p);
        transpose_16x16(r);
        KVLOOM_UNROLL
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(key_t + (p + i) * kKeyTile + j0, r[i]);
      }
    }
  }

  // keys[v] + p * stride: the 16 words of pair p of vector v's keys (the buffer or the paired cache).
  template <int R>
  static void score(const float* query, const float* const* keys, int64_t stride, int head_dim, float* scores) {
    const auto* q = reinterpret_cast<const int32_t*>(query);
    const int pairs = head_dim / 2;
    __m512 acc[R][kKeyVecs];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
      __m512bh k[kKeyVecs];
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) k[v] = (__m512bh)_mm512_loadu_ps(keys[v] + p * stride);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const auto qp = (__m512bh)_mm512_set1_epi32(q[r * pairs + p]);
        KVLOOM_UNROLL
        for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qp, k[v]);
      }
    }
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) _mm512_storeu_ps(scores + r * kKeyTile + v * 16, acc[r][v]);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
// bf16 on AVX2: the same pair words (K[j][2p], K[j][2p+1]) of 8 keys per vector, read as fp32 by a shift left
// of 16 bits (the even dimension) and a mask of the high half (the odd one): both exact, and no transposes
// in the pairs layout (in the rows layout, half those of FloatKeys). Query rows are fp32 (head_dim words),
// broadcast per dimension. Needs head_dim % 32 == 0.
struct PairKeys {
  static int words(int head_dim) { return head_dim; }

  static void pack_query(const c10::BFloat16* q, int head_dim, float* words) {
    for (int d = 0; d < head_dim; ++d) words[d] = static_cast<float>(q[d]);
  }

  // key_t[p][j]: the pair word p of key j, as 8 x 8 transposes of 32-bit words.
  static void pack_keys(const c10::BFloat16* const* rows, int head_dim, float* key_t) {
    for (int p = 0; p < head_dim / 2; p += 8) {
      for (int j0 = 0; j0 < kKeyTile; j0 += 8) {
        __m256 r[8];
        KVLOOM_UNROLL
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[j0 + j] + 2 * p));
        transpose_8x8(r);
        KVLOOM_UNROLL
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(key_t + (p + i) * kKeyTile + j0, r[i]);
      }
    }
  }

  // keys[v] + p * stride: the 8 words of pair p of vector v's keys (the buffer or the paired cache).
  template <int R>
  static void score(const float* query, const float* const* keys, int64_t stride, int head_dim, float* scores) {
    const __m256i odd_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    __m256 acc[R][kKeyVecs];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int p = 0; p < head_dim / 2; ++p) {
      __m256 q_even[R], q_odd[R];
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        q_even[r] = _mm256_broadcast_ss(query + r * head_dim + 2 * p);
        q_odd[r] = _mm256_broadcast_ss(query + r * head_dim + 2 * p + 1);
      }
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) {
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys[v] + p * stride));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, odd_mask));
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(q_odd[r], odd, _mm256_fmadd_ps(q_even[r], even, acc[r][v]));
      }
    }
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int v = 0; v < kKeyVecs; ++v) _mm256_storeu_ps(scores + r * kKeyTile + v * kVecSize, acc[r][v]);
  }
};
#endif

// ---- O += P V ---------------------------------------------------------------------------------

// probs: R rows of kKeyTile; values: n row pointers, read at [column, column + C * kVecSize);
// out: R rows of stride out_stride, the same columns.
template <int R, int C, typename T>
inline void value_block(const float* probs, const T* const* values, int n, int column, float* out,
                        int out_stride) {
  Vec acc[R][C];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::loadu(out + r * out_stride + column + c * kVecSize);
  for (int j = 0; j < n; ++j) {
    Vec v[C];
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) v[c] = load_float(values[j] + column + c * kVecSize);
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
    for (int c = 0; c < C; ++c) acc[r][c].store(out + r * out_stride + column + c * kVecSize);
}

template <typename T>
void add_probs_times_values(const float* probs, int rows, const T* const* values, int n, int head_dim,
                            float* out, int out_stride) {
  const int full_columns = head_dim / kVecSize * kVecSize;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int block = std::min(kRowBlock, rows - r0);
    const float* p = probs + r0 * kKeyTile;
    float* o = out + r0 * out_stride;
    with_row_count(block, [&](auto r) {
      constexpr int R = decltype(r)::value;
      constexpr int C = R * 4 <= kAccumulators ? 4 : kAccumulators / R;  // column vectors at once
      int column = 0;
      for (; column + C * kVecSize <= full_columns; column += C * kVecSize)
        value_block<R, C>(p, values, n, column, o, out_stride);
      for (; column < full_columns; column += kVecSize) value_block<R, 1>(p, values, n, column, o, out_stride);
    });
    // Head sizes that are not a multiple of the vector width: the last columns one by one.
    for (int r = 0; r < block; ++r)
      for (int j = 0; j < n; ++j)
        for (int d = full_columns; d < head_dim; ++d)
          o[r * out_stride + d] += p[r * kKeyTile + j] * static_cast<float>(values[j][d]);
  }
}

#if defined(KVLOOM_BF16_DOT)
// The pairs layout's O += P V: P rounded to bf16 (as HF rounds the probabilities before its product
// with V) and pairs of keys multiplied by vdpbf16ps, half the instructions of the fp32 FMAs and no
// conversions of V. probs: R rows of `stride` words, word i = (P[r][2i], P[r][2i+1]);
// value_pairs[i]: head_dim words, word d = (V[2i][d], V[2i+1][d]).
template <int R, int C>
inline void value_pair_block(const int32_t* probs, int stride, const float* const* value_pairs, int pairs,
                             int column, float* out, int out_stride) {
  __m512 acc[R][C];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(out + r * out_stride + column + c * 16);
  for (int i = 0; i < pairs; ++i) {
    __m512bh v[C];
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_ps(value_pairs[i] + column + c * 16);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const auto p = (__m512bh)_mm512_set1_epi32(probs[r * stride + i]);
      KVLOOM_UNROLL
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * out_stride + column + c * 16, acc[r][c]);
}

// probs: `rows` rows of kKeyTile fp32 (keys [0, n) used; head_dim % 32 == 0); value_pairs: ceil(n / 2) pair rows.
// An odd last key has no partner in the tile (its slot's partner may hold anything, even a non-finite
// value), so it is added alone.
inline void add_probs_times_value_pairs(const float* probs, int rows, const float* const* value_pairs, int n,
                                        int head_dim, float* out, int out_stride, int32_t* probs_bf16) {
  constexpr int kStride = kKeyTile / 2;
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < kKeyVecs; v += 2) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + r * kKeyTile + (v + 1) * 16),
                                                _mm512_loadu_ps(probs + r * kKeyTile + v * 16));
      _mm512_storeu_si512(probs_bf16 + r * kStride + v * 8, (__m512i)pair);
    }
  const int pairs = n / 2;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int block = std::min(kRowBlock, rows - r0);
    const int32_t* p = probs_bf16 + r0 * kStride;
    float* o = out + r0 * out_stride;
    with_row_count(block, [&](auto r) {
      constexpr int R = decltype(r)::value;
      constexpr int C = R * 4 <= kAccumulators ? 4 : kAccumulators / R;
      int column = 0;
      for (; column + C * 16 <= head_dim; column += C * 16)
        value_pair_block<R, C>(p, kStride, value_pairs, pairs, column, o, out_stride);
      for (; column < head_dim; column += 16) value_pair_block<R, 1>(p, kStride, value_pairs, pairs, column, o, out_stride);
    });
    if (n % 2 == 1) {
      const auto* last = reinterpret_cast<const c10::BFloat16*>(value_pairs[pairs]);  // V[n - 1][d] at 2 d
      for (int r = 0; r < block; ++r) {
        const float prob = static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p + r * kStride)[n - 1]);
        for (int d = 0; d < head_dim; ++d) o[r * out_stride + d] += prob * static_cast<float>(last[2 * d]);
      }
    }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// The pairs layout's O += P V on AVX2: each value word (V[2i][d], V[2i+1][d]) read as two fp32 by a shift and a
// mask, times P[r][2i] and P[r][2i+1] kept in fp32. probs: R rows of kKeyTile; value_pairs[i]: head_dim words.
template <int R, int C>
inline void value_pair_block(const float* probs, const float* const* value_pairs, int pairs, int column, float* out,
                             int out_stride) {
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][C];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_loadu_ps(out + r * out_stride + column + c * 8);
  for (int i = 0; i < pairs; ++i) {
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) {
      const __m256i words =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_pairs[i] + column + c * 8));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, odd_mask));
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(probs + r * kKeyTile + 2 * i + 1), odd,
                                    _mm256_fmadd_ps(_mm256_broadcast_ss(probs + r * kKeyTile + 2 * i), even, acc[r][c]));
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * out_stride + column + c * 8, acc[r][c]);
}

// probs: `rows` rows of kKeyTile fp32 (keys [0, n) used; head_dim % 32 == 0); value_pairs: ceil(n / 2) pair rows.
// An odd last key has no partner in the tile (its slot's partner may hold anything, even a non-finite value),
// so it is added alone.
inline void add_probs_times_value_pairs(const float* probs, int rows, const float* const* value_pairs, int n,
                                        int head_dim, float* out, int out_stride, int32_t* /*unused*/) {
  const int pairs = n / 2;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int block = std::min(kRowBlock, rows - r0);
    const float* p = probs + r0 * kKeyTile;
    float* o = out + r0 * out_stride;
    with_row_count(block, [&](auto r) {
      constexpr int R = decltype(r)::value;
      constexpr int C = R * 4 <= kAccumulators ? 4 : kAccumulators / R;
      int column = 0;
      for (; column + C * 8 <= head_dim; column += C * 8)
        value_pair_block<R, C>(p, value_pairs, pairs, column, o, out_stride);
      for (; column < head_dim; column += 8) value_pair_block<R, 1>(p, value_pairs, pairs, column, o, out_stride);
    });
    if (n % 2 == 1) {
      const auto* last = reinterpret_cast<const c10::BFloat16*>(value_pairs[pairs]);  // V[n - 1][d] at 2 d
      for (int r = 0; r < block; ++r)
        for (int d = 0; d < head_dim; ++d)
          o[r * out_stride + d] += p[r * kKeyTile + n - 1] * static_cast<float>(last[2 * d]);
    }
  }
}
#endif

// ---- the work ---------------------------------------------------------------------------------

struct WorkItem {
  int64_t request;
  int64_t first_kv_head, num_kv_heads;
  int64_t first_query, num_queries;  // the tile, as indices into the request's queries
  int64_t cost;                      // rows x visible keys, to hand out the longest items first
};

struct Problem {
  int64_t group, head_dim, block_size;
  int64_t sliding_window;  // <= 0: none
  float scale;
  float logit_softcap;  // <= 0: none; else scores become cap * tanh(scale * s / cap) (Gemma 2)
  const int64_t* block_table;
  int64_t block_table_stride;
  const int64_t* seq_lens;
  const int64_t* query_start_loc;
  int64_t query_stride_token, query_stride_head;
  int64_t out_stride_token, out_stride_head;
  bool paired;                                     // the layout of both caches (see the top)
  int64_t stride_block, stride_slot, stride_head;  // rows: the same in both caches
  int64_t key_stride_block, key_stride_head;       // pairs, in elements
  int64_t value_stride_block, value_stride_head;
};

// Per-thread buffers, kept across calls so that steady-state calls allocate nothing.
struct Scratch {
  std::vector<float> query, out, scores, key_t, row_max, row_sum, new_max, correction;
  std::vector<int32_t> probs_bf16;
  std::vector<const void*> key_rows, value_rows;
};

template <typename T>
const T* zero_row() {
  alignas(64) static const T zeros[kMaxHeadDim] = {};
  return zeros;
}

// Online softmax over one tile for `rows` rows of raw scores (kKeyTile each): hides the keys a row
// may not see, turns the scores into exp(scale * s - running max) in place, and rescales the
// row's running sum and output where its max grew. Row r sees keys [lo, hi) of visible(r, lo, hi).
template <typename Visible>
inline void softmax_tile(float* scores, int rows, float scale, int64_t k0, Visible&& visible, float* row_max,
                         float* row_sum, float* out, int out_stride, float* new_max, float* correction) {
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * kKeyTile;
    int64_t lo, hi;
    visible(r, lo, hi);
    lo = std::min(std::max(lo, k0), k0 + kKeyTile);
    hi = std::max(std::min(hi, k0 + kKeyTile), lo);
    std::fill(s, s + (lo - k0), kNegInf);
    std::fill(s + (hi - k0), s + kKeyTile, kNegInf);
    Vec tile_max = Vec::loadu(s);
    KVLOOM_UNROLL
    for (int v = 1; v < kKeyVecs; ++v) tile_max = at::vec::maximum(tile_max, Vec::loadu(s + v * kVecSize));
    const float max_score =
        at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, tile_max);
    new_max[r] = std::max(row_max[r], max_score * scale);  // -inf while the row has seen nothing
  }
  // correction = exp(old max - new max), for kVecSize rows at once; 1 where both are -inf.
  for (int r = 0; r < rows; r += kVecSize) {
    const int count = std::min(kVecSize, rows - r);
    const Vec before = Vec::loadu(row_max + r, count), after = Vec::loadu(new_max + r, count);
    const Vec seen = after != Vec(kNegInf);
    Vec::blendv(Vec(0.0f), before - after, seen).exp_u20().store(correction + r, count);
  }
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * kKeyTile;
    if (new_max[r] == kNegInf) {
      std::fill(s, s + kKeyTile, 0.0f);
      continue;
    }
    const Vec scale_vec(scale), shift(-new_max[r]);
    Vec sum(0.0f);
    KVLOOM_UNROLL
    for (int v = 0; v < kKeyVecs; ++v) {
      const Vec p = at::vec::fmadd(Vec::loadu(s + v * kVecSize), scale_vec, shift).exp_u20();
      p.store(s + v * kVecSize);
      sum = sum + p;
    }
    row_sum[r] = row_sum[r] * correction[r] +
                 at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
    row_max[r] = new_max[r];
    if (correction[r] != 1.0f) {
      float* o = out + r * out_stride;
      const Vec c(correction[r]);
      for (int d = 0; d < out_stride; d += kVecSize) (Vec::loadu(o + d) * c).store(o + d);
    }
  }
}

// T: the query's and out's dtype; C: the caches' (T itself, or int8_t: codes with a scale per row, which
// multiplies the row's scores after S = Q K^T and its probabilities before O += P V).
template <typename T, typename C, typename Keys>
void run_item(const Problem& pb, const WorkItem& item, const T* query, const C* key_cache, const C* value_cache,
              T* out, Scratch& scratch) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int head_dim = static_cast<int>(pb.head_dim);
  const int group = static_cast<int>(pb.group);
  const int words = Keys::words(head_dim);
  const int head_rows = static_cast<int>(item.num_queries) * group;  // rows per kv head
  const int rows = static_cast<int>(item.num_kv_heads) * head_rows;
  const int out_stride = (head_dim + kVecSize - 1) / kVecSize * kVecSize;
  scratch.query.resize(static_cast<size_t>(rows) * words);
  scratch.out.assign(static_cast<size_t>(rows) * out_stride, 0.0f);
  scratch.scores.resize(static_cast<size_t>(head_rows) * kKeyTile);
  scratch.key_t.resize(static_cast<size_t>(words) * kKeyTile);
  scratch.row_max.assign(rows, kNegInf);
  scratch.row_sum.assign(rows, 0.0f);
  scratch.new_max.resize(head_rows);
  scratch.correction.resize(head_rows);
  scratch.key_rows.resize(kKeyTile);
  scratch.value_rows.resize(kKeyTile);
  if (pb.paired) scratch.probs_bf16.resize(static_cast<size_t>(head_rows) * kKeyTile / 2);
  float* s_tile = scratch.scores.data();
  auto key_rows = reinterpret_cast<const C**>(scratch.key_rows.data());
  auto value_rows = reinterpret_cast<const C**>(scratch.value_rows.data());
  alignas(64) float key_scales[kKeyTile], value_scales[kKeyTile];
  auto value_pairs = reinterpret_cast<const float**>(scratch.value_rows.data());  // the pairs layout's rows

  const int64_t i = item.request;
  const int64_t seq_len = pb.seq_lens[i];
  const int64_t query_len = pb.query_start_loc[i + 1] - pb.query_start_loc[i];
  const int64_t first_token = pb.query_start_loc[i] + item.first_query;
  const int64_t first_pos = seq_len - query_len + item.first_query;
  const int64_t window = pb.sliding_window;
  const int64_t* blocks = pb.block_table + i * pb.block_table_stride;

  // Row r: kv head first_kv_head + r / head_rows, query token first_token + (r % head_rows) / group,
  // query head (kv head) * group + r % group.
  const auto token_of = [&](int r) { return first_token + (r % head_rows) / group; };
  const auto head_of = [&](int r) { return (item.first_kv_head + r / head_rows) * group + r % group; };
  for (int r = 0; r < rows; ++r)
    Keys::pack_query(query + token_of(r) * pb.query_stride_token + head_of(r) * pb.query_stride_head, head_dim,
                     scratch.query.data() + static_cast<size_t>(r) * words);
  // Every kv head has the same positions, hence the same visible keys (row r % head_rows of the first).
  const auto visible = [&](int r, int64_t& lo, int64_t& hi) {
    const int64_t pos = first_pos + r / group;
    lo = window > 0 ? pos - window + 1 : 0;
    hi = pos + 1;
  };

  // The rows layout: element offsets of the slots of positions [k0, k0 + n), the same in both caches.
  const auto find_slots = [&](int64_t k0, int n, int64_t* offsets) {
    int64_t block = k0 / pb.block_size, slot = k0 % pb.block_size;
    for (int j = 0; j < n; ++j) {
      offsets[j] = blocks[block] * pb.stride_block + slot * pb.stride_slot;
      if (++slot == pb.block_size) {
        slot = 0;
        ++block;
      }
    }
  };
  // The pairs layout: where the run of kVecSize keys from `pos` (a multiple of kVecSize, so within one
  // block) begins in each cache: one 64-byte line per pair of dimensions in the key cache, and
  // kVecSize / 2 rows of head_dim words in the value cache.
  const auto key_run = [&](int64_t pos, int64_t kv_head) {
    return key_cache + blocks[pos / pb.block_size] * pb.key_stride_block + kv_head * pb.key_stride_head +
           pos % pb.block_size * 2;
  };
  const auto value_pair = [&](int64_t pos, int64_t kv_head) {  // pos even
    return value_cache + blocks[pos / pb.block_size] * pb.value_stride_block + kv_head * pb.value_stride_head +
           pos % pb.block_size * head_dim;
  };
  // Blocks lie scattered over the cache, too far apart for the hardware prefetcher: ask for the
  // next tile's keys and values (the item's kv heads) while this tile is computed.
  const auto prefetch = [](const C* start, int64_t length) {
    const auto first = reinterpret_cast<uintptr_t>(start) & ~uintptr_t{63};
    const auto last = reinterpret_cast<uintptr_t>(start + length) - 1;
    for (uintptr_t line = first; line <= last; line += 64) __builtin_prefetch(reinterpret_cast<const void*>(line));
  };
  const int64_t heads_offset = item.first_kv_head * pb.stride_head;
  const int64_t heads_length = (item.num_kv_heads - 1) * pb.stride_head + head_dim;
  const auto prefetch_tile = [&](const int64_t* offsets, int64_t k0, int n) {
    if (!pb.paired) {
      for (int j = 0; j < n; ++j)
        for (const C* cache : {key_cache, value_cache}) prefetch(cache + offsets[j] + heads_offset, heads_length);
      return;
    }
    for (int j = 0; j < n; j += kVecSize)
      for (int64_t h = item.first_kv_head; h < item.first_kv_head + item.num_kv_heads; ++h) {
        const C* run = key_run(k0 + j, h);
        for (int p = 0; p < head_dim / 2; ++p) __builtin_prefetch(run + p * pb.block_size * 2);
        prefetch(value_pair(k0 + j, h), static_cast<int64_t>(kVecSize) * head_dim);
      }
  };

  int64_t key_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  // Paired runs start at multiples of kVecSize: begin there (the keys before key_begin are masked).
  if (pb.paired) key_begin -= key_begin % kVecSize;
  const int64_t key_end = first_pos + item.num_queries;
  const auto tile_size = [&](int64_t k0) { return static_cast<int>(std::min<int64_t>(kKeyTile, key_end - k0)); };
  int64_t offsets[2][kKeyTile];  // the rows layout: this tile's slots and the next's
  if (!pb.paired) find_slots(key_begin, tile_size(key_begin), offsets[0]);
  prefetch_tile(offsets[0], key_begin, tile_size(key_begin));
  const float* key_vectors[kKeyVecs];  // where S = Q K^T reads each vector of keys, and its stride
  int64_t key_stride = kKeyTile;
  for (int64_t k0 = key_begin, t = 0; k0 < key_end; k0 += kKeyTile, ++t) {
    const int n = tile_size(k0);
    const int64_t* slots = offsets[t % 2];
    if (k0 + kKeyTile < key_end) {
      if (!pb.paired) find_slots(k0 + kKeyTile, tile_size(k0 + kKeyTile), offsets[(t + 1) % 2]);
      prefetch_tile(offsets[(t + 1) % 2], k0 + kKeyTile, tile_size(k0 + kKeyTile));
    }
    for (int h = 0; h < item.num_kv_heads; ++h) {
      const int64_t kv_head = item.first_kv_head + h;
      if (pb.paired) {
        // Vectors past the tile's last key read the first one's keys again: their scores are masked.
        key_stride = pb.block_size;
        for (int v = 0; v < kKeyVecs; ++v)
          key_vectors[v] = reinterpret_cast<const float*>(key_run(k0 + (v * kVecSize < n ? v * kVecSize : 0), kv_head));
        for (int j = 0; j < n; j += 2) value_pairs[j / 2] = reinterpret_cast<const float*>(value_pair(k0 + j, kv_head));
      } else {
        const int64_t head_offset = kv_head * pb.stride_head;
        for (int j = 0; j < n; ++j) {
          key_rows[j] = key_cache + slots[j] + head_offset;
          value_rows[j] = value_cache + slots[j] + head_offset;
        }
        for (int j = n; j < kKeyTile; ++j) key_rows[j] = zero_row<C>();
        if constexpr (kInt8) {
          for (int j = 0; j < n; ++j) {
            key_scales[j] = int8_row_scale(key_rows[j], head_dim);
            value_scales[j] = int8_row_scale(value_rows[j], head_dim);
          }
          std::fill(key_scales + n, key_scales + kKeyTile, 0.0f);
        }
        Keys::pack_keys(key_rows, head_dim, scratch.key_t.data());
        for (int v = 0; v < kKeyVecs; ++v) key_vectors[v] = scratch.key_t.data() + v * kVecSize;
      }

      const float* q_head = scratch.query.data() + static_cast<size_t>(h) * head_rows * words;
      for (int r0 = 0; r0 < head_rows; r0 += kScoreRows) {
        with_row_count(std::min(kScoreRows, head_rows - r0), [&](auto r) {
          Keys::template score<decltype(r)::value>(q_head + r0 * words, key_vectors, key_stride, head_dim,
                                                   s_tile + r0 * kKeyTile);
        });
      }
      if constexpr (kInt8) {  // S[r][j] *= the scale of key j
        for (int r = 0; r < head_rows; ++r)
          for (int v = 0; v < kKeyVecs; ++v)
            (Vec::loadu(s_tile + r * kKeyTile + v * kVecSize) * Vec::loadu(key_scales + v * kVecSize))
                .store(s_tile + r * kKeyTile + v * kVecSize);
      }
      float score_scale = pb.scale;
      if (pb.logit_softcap > 0) {
        // Soft-capping is not linear in the scores, so it is applied to the scaled ones here (every column
        // of the [head_rows, kKeyTile] tile: those past n are masked by softmax_tile) and the softmax then
        // takes them with a scale of 1.
        const Vec inner(pb.scale / pb.logit_softcap), cap(pb.logit_softcap);
        for (int r = 0; r < head_rows; ++r)
          for (int v = 0; v < kKeyVecs; ++v) {
            float* s = s_tile + r * kKeyTile + v * kVecSize;
            ((Vec::loadu(s) * inner).tanh() * cap).store(s);
          }
        score_scale = 1.0f;
      }
      float* o_head = scratch.out.data() + static_cast<size_t>(h) * head_rows * out_stride;
      softmax_tile(s_tile, head_rows, score_scale, k0, visible, scratch.row_max.data() + h * head_rows,
                   scratch.row_sum.data() + h * head_rows, o_head, out_stride, scratch.new_max.data(),
                   scratch.correction.data());
#if defined(KVLOOM_BF16_DOT) || defined(CPU_CAPABILITY_AVX2)
      if (pb.paired) {
        add_probs_times_value_pairs(s_tile, head_rows, value_pairs, n, head_dim, o_head, out_stride,
                                    scratch.probs_bf16.data());
        continue;
      }
#endif
      if constexpr (kInt8) {  // P[r][j] *= the scale of value j (the row sums are taken already)
        for (int r = 0; r < head_rows; ++r)
          for (int j = 0; j < n; ++j) s_tile[r * kKeyTile + j] *= value_scales[j];
      }
      add_probs_times_values(s_tile, head_rows, value_rows, n, head_dim, o_head, out_stride);
    }
  }

  for (int r = 0; r < rows; ++r) {
    T* o = out + token_of(r) * pb.out_stride_token + head_of(r) * pb.out_stride_head;
    const float* o_row = scratch.out.data() + static_cast<size_t>(r) * out_stride;
    const float inverse = 1.0f / scratch.row_sum[r];
    for (int d = 0; d < head_dim; ++d) o[d] = static_cast<T>(o_row[d] * inverse);
  }
}

// The items on kvloom's thread pool (parallel.h), longest first, handed out one at a time.
template <typename T, typename C, typename Keys>
void run_items(const Problem& pb, const std::vector<WorkItem>& items, const T* query, const C* key_cache,
               const C* value_cache, T* out) {
  parallel_chunks(static_cast<int64_t>(items.size()), [&](int64_t n) {
    static thread_local Scratch scratch;
    run_item<T, C, Keys>(pb, items[n], query, key_cache, value_cache, out, scratch);
  });
}

void check_index(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == dims, "paged_attention: ", name,
              " must be a CPU int64 tensor with ", dims, " dimension(s), got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
  TORCH_CHECK(t.stride(dims - 1) == 1, "paged_attention: ", name, " must be contiguous in its last dimension");
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.stride(-1) == 1, "paged_attention: ", name,
              " must be a CPU tensor contiguous in its last dimension");
}

}  // namespace

// Whether this build reads bf16 caches in the pairs layout for this head size and block size.
bool pairs_layout_supported(int64_t head_dim, int64_t block_size) {
#if defined(KVLOOM_BF16_DOT) || defined(CPU_CAPABILITY_AVX2)
  return head_dim % 32 == 0 && head_dim <= kMaxHeadDim && block_size % kVecSize == 0;
#else
  return false;
#endif
}

// out, query: [T, Hq, D]; the caches in the rows layout, both [num_blocks, block_size, Hkv, D], or in the
// pairs layout (see the top), keys [num_blocks, Hkv, D / 2, block_size, 2] and values [num_blocks, Hkv,
// block_size / 2, D, 2]; block_table: [B, max_blocks]; seq_lens: [B]; query_start_loc: [B + 1];
// sliding_window <= 0: none; logit_softcap <= 0: none (else Gemma 2's cap * tanh(scale * s / cap)).
void paged_attention_softcap(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                             double logit_softcap) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "paged_attention: query and out must be "
              "[num_tokens, num_heads, head_dim] of one shape, got ", query.sizes(), " and ", out.sizes());
  const bool paired = key_cache.dim() == 5;
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(paired ? 1 : 2);
  const int64_t block_size = key_cache.size(paired ? 3 : 1);
  if (paired) {
    TORCH_CHECK(key_cache.sizes() == at::IntArrayRef({num_blocks, num_kv_heads, head_dim / 2, block_size, 2}) &&
                    value_cache.sizes() ==
                        at::IntArrayRef({num_blocks, num_kv_heads, block_size / 2, head_dim, 2}) &&
                    key_cache.is_contiguous() && value_cache.is_contiguous() &&
                    key_cache.scalar_type() == at::kBFloat16 && pairs_layout_supported(head_dim, block_size),
                "paged_attention: caches in the pairs layout must be contiguous bfloat16 keys [num_blocks, "
                "num_kv_heads, head_dim / 2, block_size, 2] and values [num_blocks, num_kv_heads, block_size / 2, "
                "head_dim, 2], of a head_dim and block_size this build pairs (pairs_layout_supported); got ",
                key_cache.sizes(), " and ", value_cache.sizes(), " for head_dim ", head_dim);
  } else {
    TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                    key_cache.strides() == value_cache.strides(),
                "paged_attention: key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, "
                "head_dim] of one shape and layout, got ", key_cache.sizes(), " and ", value_cache.sizes());
    const bool int8 = key_cache.scalar_type() == at::kChar;
    TORCH_CHECK(key_cache.size(3) == head_dim + (int8 ? 2 : 0), "paged_attention: head_dim must match the cache ",
                "(int8 rows: head_dim codes and a 2-byte scale), got ", head_dim, " and ", key_cache.size(3));
  }
  const auto dtype = query.scalar_type();
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(out.scalar_type() == dtype && (key_cache.scalar_type() == dtype || int8) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: query and out must share one dtype, and the caches it or int8");
  check_rows(out, "out");
  check_rows(query, "query");
  check_rows(key_cache, "key_cache");
  check_rows(value_cache, "value_cache");
  check_index(block_table, "block_table", 2);
  check_index(seq_lens, "seq_lens", 1);
  check_index(query_start_loc, "query_start_loc", 1);
  TORCH_CHECK(scale > 0, "paged_attention: scale must be positive, got ", scale);
  TORCH_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0,
              "paged_attention: logit_softcap must be positive (or 0: none), got ", logit_softcap);

  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, "paged_attention: head_dim must be in [1, ", kMaxHeadDim,
              "], got ", head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(query_start_loc.size(0) == batch + 1 && block_table.size(0) >= batch,
              "paged_attention: need B + 1 query_start_loc entries and B block-table rows for B = ", batch);

  Problem pb{};
  pb.group = num_heads / num_kv_heads;
  pb.head_dim = head_dim;
  pb.block_size = block_size;
  pb.sliding_window = sliding_window;
  pb.scale = static_cast<float>(scale);
  pb.logit_softcap = static_cast<float>(logit_softcap);
  pb.block_table = block_table.data_ptr<int64_t>();
  pb.block_table_stride = block_table.stride(0);
  pb.seq_lens = seq_lens.data_ptr<int64_t>();
  pb.query_start_loc = query_start_loc.data_ptr<int64_t>();
  pb.query_stride_token = query.stride(0);
  pb.query_stride_head = query.stride(1);
  pb.out_stride_token = out.stride(0);
  pb.out_stride_head = out.stride(1);
  pb.paired = paired;
  pb.stride_block = key_cache.stride(0);
  pb.stride_slot = key_cache.stride(1);
  pb.stride_head = key_cache.stride(2);
  pb.key_stride_block = key_cache.stride(0);
  pb.key_stride_head = key_cache.stride(1);
  pb.value_stride_block = value_cache.stride(0);
  pb.value_stride_head = value_cache.stride(1);

  // Check every index the items will follow (a bad one would read outside the cache).
  const int64_t max_blocks = block_table.size(1);
  int64_t num_decodes = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t begin = pb.query_start_loc[i], end = pb.query_start_loc[i + 1];
    const int64_t query_len = end - begin, seq_len = pb.seq_lens[i];
    TORCH_CHECK(begin >= 0 && query_len >= 0 && end <= num_tokens, "paged_attention: query_start_loc[", i, ":",
                i + 2, "] = [", begin, ", ", end, ") is not a range of the ", num_tokens, " tokens");
    TORCH_CHECK(seq_len >= query_len && seq_len <= max_blocks * block_size, "paged_attention: seq_lens[", i,
                "] = ", seq_len, " must be at least the query length ", query_len, " and fit the block table");
    const int64_t* blocks = pb.block_table + i * pb.block_table_stride;
    for (int64_t b = 0; query_len > 0 && b < (seq_len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < num_blocks, "paged_attention: block_table[", i, ", ", b, "] = ",
                  blocks[b], " is not a block of the cache (", num_blocks, " blocks)");
    num_decodes += query_len == 1;
  }

  // A decode item takes every kv head of its request (whole slots) unless that leaves fewer than
  // about four items per thread; then as many heads as still allow that.
  const int num_threads = pool_threads();
  int64_t decode_heads = num_kv_heads;
  while (decode_heads > 1 && num_decodes * (num_kv_heads / decode_heads) < 4 * num_threads) {
    do --decode_heads; while (num_kv_heads % decode_heads != 0);
  }
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t query_len = pb.query_start_loc[i + 1] - pb.query_start_loc[i], seq_len = pb.seq_lens[i];
    const int64_t tile = query_len == 1 ? 1 : std::max<int64_t>(1, kTargetRows / pb.group);
    const int64_t heads = query_len == 1 ? decode_heads : 1;
    for (int64_t first = 0; first < query_len; first += tile) {
      const int64_t count = std::min(tile, query_len - first);
      const int64_t first_pos = seq_len - query_len + first;
      const int64_t first_key = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) : 0;
      const int64_t cost = heads * count * pb.group * (first_pos + count - first_key);
      for (int64_t h = 0; h < num_kv_heads; h += heads) items.push_back({i, h, heads, first, count, cost});
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const auto run = [&](auto zero, auto keys) {
    using T = decltype(zero);
    if (int8) {
      run_items<T, int8_t, FloatKeys>(pb, items, query.data_ptr<T>(), key_cache.data_ptr<int8_t>(),
                                      value_cache.data_ptr<int8_t>(), out.data_ptr<T>());
      return;
    }
    run_items<T, T, decltype(keys)>(pb, items, query.data_ptr<T>(), key_cache.data_ptr<T>(),
                                    value_cache.data_ptr<T>(), out.data_ptr<T>());
  };
  if (int8) TORCH_CHECK(!paired, "paged_attention: int8 caches are in the rows layout");
  switch (dtype) {
    case at::kFloat: run(float(), FloatKeys()); break;
    case at::kBFloat16:
#if defined(KVLOOM_BF16_DOT) || defined(CPU_CAPABILITY_AVX2)
      if (head_dim % 32 == 0 && !int8) {
        run(c10::BFloat16(), PairKeys());
        break;
      }
#endif
      TORCH_CHECK(!paired, "paged_attention: no pairs-layout kernel in this build");
      run(c10::BFloat16(), FloatKeys());
      break;
    case at::kHalf: run(c10::Half(), FloatKeys()); break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16, got ", dtype);
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  paged_attention_softcap(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                          sliding_window, 0.0);
}

namespace kvloom::kernels {
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  ::paged_attention(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                    sliding_window);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window) -> ()");
  m.def("paged_attention_softcap(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
        "float logit_softcap) -> ()");
  m.def("pairs_layout_supported(int head_dim, int block_size) -> bool", &pairs_layout_supported);
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_softcap", &paged_attention_softcap);
}
