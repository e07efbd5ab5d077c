// The LoRA delta of a batch mixing adapters, fused on the CPU (BGMV: each token by its own adapter):
//
//   y[t, :] += B[s] (A[s] x[t, :])   for every token t whose slot s = token_slots[t] >= 0 (-1: the base model)
//
//   y [T, out] (fp32 / bf16 / fp16, rows contiguous), x [T, in] (y's dtype), token_slots [T] int64,
//   lora_a [S, R, in] fp32, lora_b [S, out, R] fp32 (kvloom/ops/lora.py's layout: the scaling in B, a fused
//   projection's B block-diagonal, ranks zero-padded to R).
//
// One pass per token: its row widened to fp32, R dot products over `in` (the shrink, kept in registers'
// reach: R <= kMaxRank), then `out` dot products over R (the expand), added to y and rounded once. Tokens are
// split over kvloom's parallel loop (its own pool with KVLOOM_CPU_THREAD_POOL=1), like every other kernel of
// the step, rather than torch's BLAS threads. ops/lora.py's add_lora_reference is the oracle (tests/unit/test_lora.py).
#include "cpu_capability.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kMaxRank = 1024;  // shards * max_lora_rank: 3 * 320 for the largest rank vLLM takes

// sum_k a[k] * b[k] in fp32, four vector accumulators so consecutive FMAs do not wait on each other.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t k = 0;
  for (; k + 4 * kVec <= n; k += 4 * kVec) {
    s0 = at::vec::fmadd(Vec::loadu(a + k), Vec::loadu(b + k), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + k + kVec), Vec::loadu(b + k + kVec), s1);
    s2 = at::vec::fmadd(Vec::loadu(a + k + 2 * kVec), Vec::loadu(b + k + 2 * kVec), s2);
    s3 = at::vec::fmadd(Vec::loadu(a + k + 3 * kVec), Vec::loadu(b + k + 3 * kVec), s3);
  }
  for (; k + kVec <= n; k += kVec) s0 = at::vec::fmadd(Vec::loadu(a + k), Vec::loadu(b + k), s0);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, (s0 + s1) + (s2 + s3));
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

template <typename T>
void lora_rows(T* y, const T* x, const float* a, const float* b, const int64_t* slots, int64_t begin, int64_t end,
               int64_t in, int64_t out, int64_t rank) {
  std::vector<float> row(in);
  float shrunk[kMaxRank];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const T* xt = x + t * in;
    for (int64_t k = 0; k < in; ++k) row[k] = float(xt[k]);
    const float* as = a + slot * rank * in;
    for (int64_t r = 0; r < rank; ++r) shrunk[r] = dot(as + r * in, row.data(), in);
    const float* bs = b + slot * out * rank;
    T* yt = y + t * out;
    for (int64_t n = 0; n < out; ++n) yt[n] = T(float(yt[n]) + dot(bs + n * rank, shrunk, rank));
  }
}

void lora_bgmv(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b, at::Tensor token_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() && y.is_contiguous(),
              "lora_bgmv: x [T, in] and y [T, out] must be contiguous with the same rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_bgmv: x and y must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat && lora_a.is_contiguous() &&
                  lora_b.is_contiguous() && lora_a.dim() == 3 && lora_b.dim() == 3,
              "lora_bgmv: lora_a [S, R, in] and lora_b [S, out, R] must be contiguous float32");
  const int64_t tokens = x.size(0), in = x.size(1), out = y.size(1), rank = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(1) == out && lora_b.size(2) == rank && lora_b.size(0) == lora_a.size(0),
              "lora_bgmv: lora_a / lora_b do not match x / y");
  TORCH_CHECK(rank <= kMaxRank, "lora_bgmv: rank ", rank, " above ", kMaxRank);
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.numel() == tokens && token_slots.is_contiguous(),
              "lora_bgmv: token_slots must be int64 [T]");
  const float* a = lora_a.data_ptr<float>();
  const float* b = lora_b.data_ptr<float>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  // A token's work is about rank * (in + out) FMAs: a few tokens a chunk keep the loop's overhead small.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rank * (in + out) / 16));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    T* ys = static_cast<T*>(y.data_ptr());
    const T* xs = static_cast<const T*>(x.data_ptr());
    kvloom::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      lora_rows<T>(ys, xs, a, b, slots, begin, end, in, out, rank);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float()); break;
    case at::kBFloat16: run(c10::BFloat16()); break;
    case at::kHalf: run(c10::Half()); break;
    default: TORCH_CHECK(false, "lora_bgmv: dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
