// The LoRA delta of a batch mixing adapters, fused on the CPU (BGMV: each token by its own adapter). Shapes and
// layouts: lora.h. Used by the op lora_bgmv (a projection run as a module) and by the layer stack
// (decoder.cpp, every projection of every layer in one call).
//
// The step's adapter tokens come grouped by slot in chunks of a few tokens (TokenGroups); a chunk:
//   shrink: its rows widened to fp32 [n, in]; then blocks of 2 ranks x 4 tokens, 8 vector accumulators over
//           `in`, so each A vector (widened from bf16 once) feeds 4 FMAs and each x vector 2;
//   expand: per shard, per block of 2 vectors of that shard's outputs and 4 tokens, the sums over the shard's
//           ranks (sum_r shrunk[t][r] * B^T[s][r][block]) in 8 registers, added to y and rounded once. B^T's
//           rows are contiguous in the outputs, so the block needs no horizontal sums, each B vector feeds 4
//           tokens' FMAs, and B's zeros outside a shard's outputs are never read.
// Chunks are claimed by kvloom's parallel loop (its own pool with KVLOOM_CPU_THREAD_POOL=1), as every other
// kernel of the step. ops/lora.py's add_lora_reference is the oracle (tests/unit/test_lora.py).
#include "cpu_capability.h"
#include "lora.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace kvloom::lora {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kCols = 2 * kVec;  // a token's outputs in an expand block: two fp32 vectors, one of y's dtype
constexpr int kTokens = 4;           // tokens in a register block (shrink: 2 ranks x 4 tokens, expand: 4 x kCols)

// kVec weights as fp32: bf16 widened by a shift (its bits are fp32's upper half).
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
#else
  float widened[kVec];
  for (int64_t k = 0; k < kVec; ++k) widened[k] = float(p[k]);
  return Vec::loadu(widened);
#endif
}

// y[0:kCols] = T(float(y) + (lo, hi)): rounded once, to nearest even, as T(float) rounds.
inline void add_to(float* y, const Vec& lo, const Vec& hi) {
  (Vec::loadu(y) + lo).store(y);
  (Vec::loadu(y + kVec) + hi).store(y + kVec);
}
template <typename T>
inline void add_to(T* y, const Vec& lo, const Vec& hi) {
  auto [y0, y1] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(y));
  at::vec::convert_from_float<T>(y0 + lo, y1 + hi).store(y);
}

// A row of x widened to fp32.
template <typename T>
inline void widen(float* out, const T* x, int64_t n) {
  int64_t k = 0;
  if constexpr (!std::is_same_v<T, float>) {
    for (; k + kVec <= n; k += kVec) {
      Vec v;
      at::vec::load_to_float<T>(x + k, v);
      v.store(out + k);
    }
  }
  for (; k < n; ++k) out[k] = float(x[k]);
}

// shrunk[t][r + q] = A[r + q] . x[t] for NR ranks (rows of a, `in` apart) and NT tokens (rows of xs, `in`
// apart): NR * NT vector accumulators, each A and x vector loaded once for all the products it enters.
template <int NR, int NT, typename W>
inline void shrink_block(float* shrunk, int64_t rank, const W* a, const float* xs, int64_t in) {
  Vec acc[NR][NT];
  for (int q = 0; q < NR; ++q)
    for (int t = 0; t < NT; ++t) acc[q][t] = Vec(0.f);
  int64_t k = 0;
  for (; k + kVec <= in; k += kVec) {
    Vec w[NR];
    for (int q = 0; q < NR; ++q) w[q] = load(a + q * in + k);
    for (int t = 0; t < NT; ++t) {
      const Vec xv = Vec::loadu(xs + t * in + k);
      for (int q = 0; q < NR; ++q) acc[q][t] = at::vec::fmadd(w[q], xv, acc[q][t]);
    }
  }
  for (int q = 0; q < NR; ++q) {
    for (int t = 0; t < NT; ++t) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc[q][t]);
      for (int64_t kk = k; kk < in; ++kk) sum += float(a[q * in + kk]) * xs[t * in + kk];
      shrunk[t * rank + q] = sum;
    }
  }
}

// y[t][0:kCols] += sum_r coefficients[t][r] * b[r][0:kCols] for NT tokens, the sums in 2 * NT registers:
// each pair of B^T vectors is loaded (and widened) once for all NT tokens.
template <int NT, typename T, typename W>
inline void expand_block(T* const* y, const float* const* coefficients, const W* b, int64_t out, int64_t ranks) {
  Vec lo[NT], hi[NT];
  for (int t = 0; t < NT; ++t) lo[t] = hi[t] = Vec(0.f);
  for (int64_t r = 0; r < ranks; ++r) {
    const W* row = b + r * out;
    const Vec b0 = load(row), b1 = load(row + kVec);
    for (int t = 0; t < NT; ++t) {
      const Vec c(coefficients[t][r]);
      lo[t] = at::vec::fmadd(c, b0, lo[t]);
      hi[t] = at::vec::fmadd(c, b1, hi[t]);
    }
  }
  for (int t = 0; t < NT; ++t) add_to(y[t], lo[t], hi[t]);
}

struct Shape {
  int64_t in, out, rank, shards;
  const std::vector<int64_t>* out_offsets;
};

template <int NT, typename W>
void shrink_tokens(float* shrunk, const W* a, const float* xs, const Shape& s) {
  int64_t r = 0;
  for (; r + 2 <= s.rank; r += 2) shrink_block<2, NT>(shrunk + r, s.rank, a + r * s.in, xs, s.in);
  if (r < s.rank) shrink_block<1, NT>(shrunk + r, s.rank, a + r * s.in, xs, s.in);
}

// One chunk: the tokens rows[begin:end] (at most TokenGroups::kChunkTokens), all of slot `slot`.
template <typename T, typename W>
void delta_chunk(T* y, const T* x, const W* a, const W* b_t, const int64_t* rows, const TokenGroups::Chunk& chunk,
                 const Shape& s) {
  const int64_t n = chunk.end - chunk.begin;
  thread_local std::vector<float> xs, shrunk;  // [n, in], [n, rank]
  xs.resize(n * s.in);
  shrunk.resize(n * s.rank);
  for (int64_t i = 0; i < n; ++i) widen(xs.data() + i * s.in, x + rows[chunk.begin + i] * s.in, s.in);
  const W* as = a + chunk.slot * s.rank * s.in;
  for (int64_t i = 0; i < n; i += kTokens) {
    float* out = shrunk.data() + i * s.rank;
    const float* xi = xs.data() + i * s.in;
    switch (std::min<int64_t>(kTokens, n - i)) {
      case 4: shrink_tokens<4>(out, as, xi, s); break;
      case 3: shrink_tokens<3>(out, as, xi, s); break;
      case 2: shrink_tokens<2>(out, as, xi, s); break;
      default: shrink_tokens<1>(out, as, xi, s); break;
    }
  }
  const W* bs = b_t + chunk.slot * s.rank * s.out;
  const int64_t shard_rank = s.rank / s.shards;
  for (int64_t j = 0; j < s.shards; ++j) {
    const int64_t first = j * shard_rank, begin = (*s.out_offsets)[j], end = (*s.out_offsets)[j + 1];
    const W* bj = bs + first * s.out;
    int64_t col = begin;
    for (; col + kCols <= end; col += kCols) {  // B^T's shard_rank x kCols tile stays in L1 across the tokens
      for (int64_t i = 0; i < n; i += kTokens) {
        T* yrows[kTokens];
        const float* coefficients[kTokens];
        const int64_t count = std::min<int64_t>(kTokens, n - i);
        for (int64_t t = 0; t < count; ++t) {
          yrows[t] = y + rows[chunk.begin + i + t] * s.out + col;
          coefficients[t] = shrunk.data() + (i + t) * s.rank + first;
        }
        switch (count) {
          case 4: expand_block<4>(yrows, coefficients, bj + col, s.out, shard_rank); break;
          case 3: expand_block<3>(yrows, coefficients, bj + col, s.out, shard_rank); break;
          case 2: expand_block<2>(yrows, coefficients, bj + col, s.out, shard_rank); break;
          default: expand_block<1>(yrows, coefficients, bj + col, s.out, shard_rank); break;
        }
      }
    }
    for (; col < end; ++col) {  // the shard's last outputs, fewer than a block
      for (int64_t i = 0; i < n; ++i) {
        const float* coefficients = shrunk.data() + i * s.rank + first;
        float sum = 0.f;
        for (int64_t r = 0; r < shard_rank; ++r) sum += coefficients[r] * float(bj[r * s.out + col]);
        T* yt = y + rows[chunk.begin + i] * s.out + col;
        *yt = T(float(*yt) + sum);
      }
    }
  }
}

template <typename T, typename W>
void run(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
         const TokenGroups& groups, const Shape& shape) {
  T* ys = static_cast<T*>(y.data_ptr());
  const T* xs = static_cast<const T*>(x.data_ptr());
  const W* a = static_cast<const W*>(lora_a.data_ptr());
  const W* b = static_cast<const W*>(lora_b_t.data_ptr());
  kvloom::parallel_chunks(static_cast<int64_t>(groups.chunks.size()), [&](int64_t c) {
    delta_chunk<T, W>(ys, xs, a, b, groups.rows.data(), groups.chunks[c], shape);
  });
}

template <typename T>
void run_weights(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                 const TokenGroups& groups, const Shape& shape) {
  if (lora_a.scalar_type() == at::kFloat) {
    run<T, float>(y, x, lora_a, lora_b_t, groups, shape);
  } else {
    run<T, c10::BFloat16>(y, x, lora_a, lora_b_t, groups, shape);
  }
}

}  // namespace

TokenGroups TokenGroups::build(const at::Tensor& token_slots, int64_t num_slots) {
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.dim() == 1 && token_slots.is_contiguous(),
              "lora: token_slots must be a contiguous int64 [T]");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t tokens = token_slots.numel();
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "lora: token slot ", slot, " beyond the ", num_slots, " compute slots");
    by_slot[slot].push_back(t);
  }
  TokenGroups groups;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    const auto& rows = by_slot[slot];
    for (size_t begin = 0; begin < rows.size(); begin += kChunkTokens) {
      const int64_t offset = static_cast<int64_t>(groups.rows.size());
      const int64_t count = std::min<int64_t>(kChunkTokens, static_cast<int64_t>(rows.size() - begin));
      groups.rows.insert(groups.rows.end(), rows.begin() + begin, rows.begin() + begin + count);
      groups.chunks.push_back({slot, offset, offset + count});
    }
  }
  return groups;
}

void add_delta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
               const std::vector<int64_t>& out_offsets, const TokenGroups& groups) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() && y.is_contiguous(),
              "lora: x [T, in] and y [T, out] must be contiguous with the same rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora: x and y must share a dtype");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b_t.dim() == 3 && lora_a.is_contiguous() && lora_b_t.is_contiguous() &&
                  lora_a.scalar_type() == lora_b_t.scalar_type() &&
                  (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == at::kBFloat16),
              "lora: lora_a [S, R, in] and lora_b_t [S, R, out] must be contiguous, both float32 or both bfloat16");
  const int64_t in = x.size(1), out = y.size(1), rank = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == in && lora_b_t.size(2) == out && lora_b_t.size(1) == rank &&
                  lora_b_t.size(0) == lora_a.size(0),
              "lora: lora_a ", lora_a.sizes(), " / lora_b_t ", lora_b_t.sizes(), " do not match x ", x.sizes(),
              " / y ", y.sizes());
  const int64_t shards = static_cast<int64_t>(out_offsets.size()) - 1;
  TORCH_CHECK(shards >= 1 && rank % shards == 0 && out_offsets.front() == 0 && out_offsets.back() == out,
              "lora: out_offsets must run from 0 to out (", out, ") with one entry per shard and more, and the "
              "shards must split the rank ", rank, " evenly");
  for (int64_t j = 0; j < shards; ++j)
    TORCH_CHECK(out_offsets[j] <= out_offsets[j + 1], "lora: out_offsets must not decrease");
  for (const auto& chunk : groups.chunks)
    TORCH_CHECK(chunk.slot < lora_a.size(0), "lora: token slot ", chunk.slot, " beyond the compute slots");
  if (groups.empty()) return;
  const Shape shape{in, out, rank, shards, &out_offsets};
  switch (x.scalar_type()) {
    case at::kFloat: run_weights<float>(y, x, lora_a, lora_b_t, groups, shape); break;
    case at::kBFloat16: run_weights<c10::BFloat16>(y, x, lora_a, lora_b_t, groups, shape); break;
    case at::kHalf: run_weights<c10::Half>(y, x, lora_a, lora_b_t, groups, shape); break;
    default: TORCH_CHECK(false, "lora: dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace kvloom::lora

namespace {

// The op: one projection's delta, its tokens grouped here (a layer stack groups them once for all its layers).
void lora_bgmv(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b_t, at::Tensor token_slots,
               std::vector<int64_t> out_offsets) {
  TORCH_CHECK(token_slots.numel() == x.size(0), "lora_bgmv: token_slots must hold one slot per row of x");
  const auto groups = kvloom::lora::TokenGroups::build(token_slots, lora_a.size(0));
  kvloom::lora::add_delta(y, x, lora_a, lora_b_t, out_offsets, groups);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b_t, Tensor token_slots, int[] out_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
