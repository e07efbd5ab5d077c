// The LoRA delta of a batch mixing adapters, fused on the CPU (BGMV: each token by its own adapter). Shapes and
// layouts: lora.h. Used by the op lora_bgmv (a projection run as a module) and by the layer stack
// (decoder.cpp, every projection of every layer in one call).
//
// The step's adapter tokens come grouped by slot in chunks of a few tokens (TokenGroups); a chunk:
//   shrink: its rows widened to fp32 [n, in], then for each rank r the dot products A[s][r] . x[t] (A's row
//           read once from memory, then from L1 for each token);
//   expand: per shard and per tile of 4 vectors of that shard's outputs, each token's tile summed over the
//           shard's ranks in registers (sum_r shrunk[t][r] * B^T[s][r][tile]) and added to y, rounded once.
//           B^T's rows are contiguous in the outputs, so the tile is a handful of vector FMAs per rank with
//           no horizontal sums, and B's zeros outside a shard's outputs are never read.
// Chunks are claimed by kvloom's parallel loop (its own pool with KVLOOM_CPU_THREAD_POOL=1), as every other
// kernel of the step. ops/lora.py's add_lora_reference is the oracle (tests/unit/test_lora.py).
#include "cpu_capability.h"
#include "lora.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace kvloom::lora {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kTile = 4;  // output vectors a token's expand keeps in registers

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

// sum_k w[k] * x[k] in fp32, four vector accumulators so consecutive FMAs do not wait on each other.
template <typename W>
inline float dot(const W* w, const float* x, int64_t n) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t k = 0;
  for (; k + 4 * kVec <= n; k += 4 * kVec) {
    s0 = at::vec::fmadd(load(w + k), Vec::loadu(x + k), s0);
    s1 = at::vec::fmadd(load(w + k + kVec), Vec::loadu(x + k + kVec), s1);
    s2 = at::vec::fmadd(load(w + k + 2 * kVec), Vec::loadu(x + k + 2 * kVec), s2);
    s3 = at::vec::fmadd(load(w + k + 3 * kVec), Vec::loadu(x + k + 3 * kVec), s3);
  }
  for (; k + kVec <= n; k += kVec) s0 = at::vec::fmadd(load(w + k), Vec::loadu(x + k), s0);
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, (s0 + s1) + (s2 + s3));
  for (; k < n; ++k) sum += float(w[k]) * x[k];
  return sum;
}

struct Shape {
  int64_t in, out, rank, shards;
  const std::vector<int64_t>* out_offsets;
};

// One chunk: the tokens rows[begin:end], all of slot `slot`.
template <typename T, typename W>
void delta_chunk(T* y, const T* x, const W* a, const W* b_t, const int64_t* rows, const TokenGroups::Chunk& chunk,
                 const Shape& s) {
  const int64_t n = chunk.end - chunk.begin;
  thread_local std::vector<float> xs, shrunk;  // [n, in], [n, rank]
  xs.resize(n * s.in);
  shrunk.resize(n * s.rank);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + rows[chunk.begin + i] * s.in;
    for (int64_t k = 0; k < s.in; ++k) xs[i * s.in + k] = float(row[k]);
  }
  const W* as = a + chunk.slot * s.rank * s.in;
  for (int64_t r = 0; r < s.rank; ++r)
    for (int64_t i = 0; i < n; ++i) shrunk[i * s.rank + r] = dot(as + r * s.in, xs.data() + i * s.in, s.in);
  const W* bs = b_t + chunk.slot * s.rank * s.out;
  const int64_t shard_rank = s.rank / s.shards;
  for (int64_t j = 0; j < s.shards; ++j) {
    const int64_t first = j * shard_rank, begin = (*s.out_offsets)[j], end = (*s.out_offsets)[j + 1];
    int64_t col = begin;
    for (; col + kTile * kVec <= end; col += kTile * kVec) {
      for (int64_t i = 0; i < n; ++i) {  // the tile of B^T (shard_rank x kTile vectors) stays in L1 across tokens
        const float* coefficients = shrunk.data() + i * s.rank + first;
        Vec acc[kTile] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
        for (int64_t r = 0; r < shard_rank; ++r) {
          const Vec c(coefficients[r]);
          const W* brow = bs + (first + r) * s.out + col;
          for (int64_t v = 0; v < kTile; ++v) acc[v] = at::vec::fmadd(c, load(brow + v * kVec), acc[v]);
        }
        float sums[kTile * kVec];
        for (int64_t v = 0; v < kTile; ++v) acc[v].store(sums + v * kVec);
        T* yt = y + rows[chunk.begin + i] * s.out + col;
        for (int64_t k = 0; k < kTile * kVec; ++k) yt[k] = T(float(yt[k]) + sums[k]);
      }
    }
    for (; col < end; ++col) {  // the shard's last outputs, fewer than a tile
      for (int64_t i = 0; i < n; ++i) {
        const float* coefficients = shrunk.data() + i * s.rank + first;
        float sum = 0.f;
        for (int64_t r = 0; r < shard_rank; ++r) sum += coefficients[r] * float(bs[(first + r) * s.out + col]);
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
