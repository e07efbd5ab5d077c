// Every decoder layer of a Llama model in one call: the same kernels, in the same order, on the same
// buffers as kvloom/models/llama.py's LlamaDecoderLayer runs them one torch op at a time, so the
// result is bit-identical; what goes away is the Python between them. A decode step of SmolLM2-135M
// makes ~300 kernel calls through Python modules and the dispatcher (~5-10 us each: 2-3 ms a step),
// which at a few sequences is a tenth or more of the step.
//
// Per layer (weights packed for gemm_bf16, no biases; kvloom/ops/cpu.py LlamaLayerStack says when a
// model qualifies and builds the argument lists):
//
//     layer 0:  residual = hidden; hidden = rms_norm(hidden)         later: hidden, residual =
//               add_rms_norm(hidden, residual), in place
//     qkv = hidden W_qkv^T; rotate q and k in place; write k, v to the caches
//     out = paged_attention(q, caches)
//     hidden, residual = add_rms_norm(out W_o^T, residual)
//     hidden = silu_and_mul(hidden W_gate_up^T) W_down^T
//
// and returns (hidden, residual) for the final norm.

#include "cpu_capability.h"
#include "kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#if defined(KVLOOM_BF16_DOT)

namespace {

namespace k = kvloom::kernels;

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

// hidden: [T, H] (the embeddings; they become the residual stream, updated in place as the Python layers
// update theirs); positions, slot_mapping: [T]; cos, sin: the rotary
// tables; weights: kWeightsPerLayer per layer in the order above (norm weights as they are, projections
// packed); key_caches, value_caches: one per layer; the rest as paged_attention takes them.
std::tuple<at::Tensor, at::Tensor> llama_layers(
    const at::Tensor& hidden_in, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList weights, at::TensorList key_caches, at::TensorList value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate_size, double eps, double scale, int64_t sliding_window) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(value_caches.size()) == layers,
              "llama_layers: expected ", kWeightsPerLayer, " weights and two caches per layer, got ",
              weights.size(), " weights and ", key_caches.size(), " / ", value_caches.size(), " caches");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous() && hidden_in.scalar_type() == at::kBFloat16,
              "llama_layers: hidden must be a contiguous bfloat16 [T, H]");
  const int64_t tokens = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto options = hidden_in.options();
  at::Tensor residual = hidden_in;
  at::Tensor hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    if (layer == 0) {
      hidden = at::empty({tokens, hidden_size}, options);
      k::rms_norm(hidden, residual, w[0], eps);
    } else {
      k::fused_add_rms_norm(hidden, residual, w[0], eps);
    }
    at::Tensor qkv = at::empty({tokens, q_size + 2 * kv_size}, options);
    k::gemm_bf16(qkv, hidden, w[1], c10::nullopt);
    at::Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim});
    k::rotary_embedding(heads.narrow(1, 0, num_heads + num_kv_heads), positions, cos, sin);
    at::Tensor query = heads.narrow(1, 0, num_heads);
    k::write_kv_cache(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads,
                                                                              num_kv_heads),
                      key_caches[layer], value_caches[layer], slot_mapping);
    at::Tensor attended = at::empty({tokens, num_heads, head_dim}, options);
    k::paged_attention(attended, query, key_caches[layer], value_caches[layer], block_table, seq_lens,
                       query_start_loc, scale, sliding_window);
    at::Tensor projected = at::empty({tokens, hidden_size}, options);
    k::gemm_bf16(projected, attended.view({tokens, q_size}), w[2], c10::nullopt);
    k::fused_add_rms_norm(projected, residual, w[3], eps);
    at::Tensor gate_up = at::empty({tokens, 2 * intermediate_size}, options);
    k::gemm_bf16(gate_up, projected, w[4], c10::nullopt);
    at::Tensor activated = at::empty({tokens, intermediate_size}, options);
    k::silu_and_mul(activated, gate_up);
    hidden = at::empty({tokens, hidden_size}, options);
    k::gemm_bf16(hidden, activated, w[5], c10::nullopt);
  }
  if (layers == 0) hidden = hidden_in;
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("llama_layers(Tensor hidden, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, "
        "int intermediate_size, float eps, float scale, int sliding_window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("llama_layers", &llama_layers);
}

#endif  // KVLOOM_BF16_DOT
