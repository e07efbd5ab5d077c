// The LoRA delta on the CPU (lora.cpp), shared by its op (lora_bgmv) and the layer stack (decoder.cpp):
//
//   y[t, :] += B[s] (A[s] x[t, :])   for every token t whose slot s = token_slots[t] >= 0 (-1: the base model)
//
//   x [T, in], y [T, out] (one dtype: fp32 / bf16 / fp16, rows contiguous)
//   lora_a   [S, R, in]   the shrink of each compute slot (fp32, or bf16 with a bf16 model)
//   lora_b_t [S, R, out]  the expand, stored transposed (rank-major: row r is what rank r adds to each output,
//                         so the expand streams whole rows) with the scaling folded in; lora_a's dtype
//   out_offsets           a fused projection's shards (q|k|v, gate|up): shard j owns ranks
//                         j*R/shards..(j+1)*R/shards and outputs out_offsets[j]..out_offsets[j+1]; its other
//                         outputs are zeros in B, so only its own are read. {0, out} for a plain projection.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvloom::lora {

// A step's adapter tokens grouped by slot, built once a step (the layer stack builds it once for all its
// layers): chunks of at most kChunkTokens tokens of one slot, so a chunk reads its slot's A and B once and
// reuses them from cache for each of its tokens, and the chunks spread over the threads.
struct TokenGroups {
  static constexpr int64_t kChunkTokens = 8;
  struct Chunk {
    int64_t slot, begin, end;  // rows[begin:end] all run this slot
  };
  std::vector<int64_t> rows;  // the adapter tokens' rows, grouped by slot
  std::vector<Chunk> chunks;

  // token_slots: [T] int64 (-1: none).
  static TokenGroups build(const at::Tensor& token_slots, int64_t num_slots);
  bool empty() const { return chunks.empty(); }
};

// Checks the shapes and dtypes (TORCH_CHECK) and adds the delta of every grouped token to y.
void add_delta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
               const std::vector<int64_t>& out_offsets, const TokenGroups& groups);

}  // namespace kvloom::lora
