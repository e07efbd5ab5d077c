// Every decoder layer of a Llama model in one call: the same kernels, in the same order, on the same
// buffers as kvloom/models/llama.py's LlamaDecoderLayer runs them one torch op at a time, so the
// result is bit-identical; what goes away is the Python between them. A decode step of SmolLM2-135M
// makes ~300 kernel calls through Python modules and the dispatcher (~5-10 us each: 2-3 ms a step),
// which at a few sequences is a tenth or more of the step.
//
// Per layer (kvloom/ops/cpu.py LlamaLayerStack says when a model qualifies and builds the plan), each
// projection the product its Linear would call: kvloom's bf16 GEMM, an int8 one (W8A8 from a number
// of rows on, else weight-only; or W8A8 on Q8_0 blocks), the code-block one (a GGUF's Q4 / Q5 / Q6_K blocks) or
// the k-quants' one on the file's super-blocks (Q4_K and Q6_K rows, gemm_q4k.cpp):
//
//     layer 0:  residual = hidden; hidden = rms_norm(hidden) (without an input norm, EAGLE-1's first
//               layer: hidden as it is)
//     later:    hidden, residual = add_rms_norm(hidden, residual), in place
//     qkv = hidden W_qkv^T; rotate q and k in place; write k, v to the caches
//     out = paged_attention(q, caches)
//     hidden, residual = add_rms_norm(out W_o^T, residual)
//     hidden = silu_and_mul(hidden W_gate_up^T) W_down^T
//
// and returns (hidden, residual) for the final norm. With LoRA adapters (set_lora, then forward_lora with each
// token's compute slot): each projection's output gets its tokens' deltas (lora.h) right after the product,
// as the per-op path's hooks add them (kvloom/lora/model_manager.py), the tokens grouped by slot once a step.

#include "cpu_capability.h"
#include "kernels.h"
#include "lora.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(KVLOOM_BF16_GEMM)

namespace {

namespace k = kvloom::kernels;

// Each kernel call shows in torch.profiler under its op's name, as it does when the modules call it
// (benchmarks/profile_step.py); free when no profiler runs.
#define KVLOOM_PROFILED(name, call)                           \
  do {                                                        \
    RECORD_FUNCTION(name, std::vector<c10::IValue>());        \
    call;                                                     \
  } while (0)

// One projection: which product, and its tensors as the Python objects hold them (cpu.py stack_args).
struct Projection {
  enum Kind : int64_t { kBf16 = 0, kInt8Rows = 1, kInt8Blocks = 2, kQ4 = 3, kKQuant = 4 };
  int64_t kind = kBf16;
  at::Tensor packed, compensation, scale;
  at::Tensor q6_k;  // kKQuant: the Q6_K rows' panels after packed's Q4_K ones (either may be empty)
  c10::optional<at::Tensor> bias, high;  // high: a 5-bit code-block weight's fifth bits (kQ4)
  int64_t w8a8_min_rows = 0;  // int8 rows: W8A8 from this many rows on, weight-only below
  // Whether bf16 activations may take the dequantizing AMX-BF16 tiles (a product whose arithmetic changes with the
  // row count): the Python weight's own bf16_tiles, so that the stack and the module path agree.
  bool bf16_tiles = false;
  int64_t out_features = 0;

  // y [M, out] = x [M, in] W^T (+ b), in x's dtype.
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = at::empty({x.size(0), out_features}, x.options());
    switch (kind) {
      case kBf16: KVLOOM_PROFILED("kvloom::gemm_bf16", k::gemm_bf16(y, x, packed, bias)); break;
      case kInt8Rows:
        if (x.size(0) >= w8a8_min_rows) {
          KVLOOM_PROFILED("kvloom::gemm_w8a8",
                          k::gemm_w8a8(y, x, packed, compensation, scale, bias, false, bf16_tiles));
        } else {
          KVLOOM_PROFILED("kvloom::gemm_int8_weight_only",
                          k::gemm_int8_weight_only(y, x, packed, scale, bias, false, bf16_tiles));
        }
        break;
      case kInt8Blocks:
        KVLOOM_PROFILED("kvloom::gemm_w8a8_blocks",
                        k::gemm_w8a8_blocks(y, x, packed, scale, bias, false, bf16_tiles));
        break;
      case kQ4:
        KVLOOM_PROFILED("kvloom::gemm_q4", k::gemm_q4(y, x, packed, scale, bias, false, high, bf16_tiles));
        break;
      case kKQuant:
        KVLOOM_PROFILED("kvloom::gemm_kquant", k::gemm_kquant(y, x, packed, q6_k, bias, false, -1, bf16_tiles));
        break;
      default: TORCH_CHECK(false, "LlamaLayerStack: unknown projection kind ", kind);
    }
    return y;
  }
};

constexpr int64_t kProjections = 4;  // per layer: qkv, o, gate_up, down
constexpr int64_t kSlots = 4;        // tensors per projection in the plan's list

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;
};

// One projection's LoRA compute slots (lora.h's layout): A [S, R, in], B^T [S, R, out], the shards' outputs.
struct LoRAProjection {
  at::Tensor a, b_t;
  std::vector<int64_t> out_offsets;
};

// The plan, built once per model: every layer's norm weights and projections, the rotary tables and the
// shapes. forward() runs a step's flat batch through all the layers.
struct LlamaLayerStack : torch::CustomClassHolder {
  std::vector<Layer> layers;
  at::Tensor cos, sin;
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size, hidden_size;
  double eps, scale;
  // Per layer: qkv, o, gate_up, down (set_lora); empty: no adapters.
  std::vector<std::array<LoRAProjection, kProjections>> lora;

  // norms: 2 per layer (input, post-attention); projections: kSlots per projection, kProjections per layer
  // (bf16: packed, bias; int8 rows: packed, compensation, scale, bias; int8 blocks: packed, scales, bias; code
  // blocks: packed, scales, bias, the fifth bits of 5-bit codes; k-quant super-blocks: Q4_K panels, Q6_K panels, bias;
  // the rest None); kinds, min_rows, tiles (bf16_tiles, 0 or 1): one per projection; dims: num_heads, num_kv_heads,
  // head_dim, intermediate_size, hidden_size.
  LlamaLayerStack(std::vector<at::Tensor> norms, c10::List<c10::optional<at::Tensor>> projections,
                  std::vector<int64_t> kinds, std::vector<int64_t> min_rows, std::vector<int64_t> tiles,
                  at::Tensor cos_table, at::Tensor sin_table, std::vector<int64_t> dims, double rms_eps,
                  double attention_scale)
      : cos(std::move(cos_table)), sin(std::move(sin_table)), eps(rms_eps), scale(attention_scale) {
    TORCH_CHECK(dims.size() == 5, "LlamaLayerStack: dims must be (num_heads, num_kv_heads, head_dim, "
                "intermediate_size, hidden_size)");
    num_heads = dims[0], num_kv_heads = dims[1], head_dim = dims[2], intermediate_size = dims[3];
    hidden_size = dims[4];
    const int64_t count = static_cast<int64_t>(norms.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * count &&
                    static_cast<int64_t>(kinds.size()) == kProjections * count &&
                    static_cast<int64_t>(min_rows.size()) == kProjections * count &&
                    static_cast<int64_t>(tiles.size()) == kProjections * count &&
                    static_cast<int64_t>(projections.size()) == kSlots * kProjections * count,
                "LlamaLayerStack: expected 2 norms, ", kProjections, " projection kinds and ",
                kSlots * kProjections, " projection tensors per layer");
    const int64_t out_features[kProjections] = {(num_heads + 2 * num_kv_heads) * head_dim, hidden_size,
                                                2 * intermediate_size, hidden_size};
    for (int64_t i = 0; i < count; ++i) {
      Layer layer;
      layer.input_norm = norms[2 * i];
      TORCH_CHECK(i == 0 || layer.input_norm.numel() > 0, "LlamaLayerStack: only the first layer may have no "
                  "input norm");
      layer.post_norm = norms[2 * i + 1];
      Projection* slots[kProjections] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int64_t j = 0; j < kProjections; ++j) {
        const int64_t index = i * kProjections + j;
        auto slot = [&](int64_t n) { return projections.get((index * kSlots) + n); };
        Projection& p = *slots[j];
        p.kind = kinds[index];
        p.w8a8_min_rows = min_rows[index];
        p.bf16_tiles = tiles[index] != 0;
        p.out_features = out_features[j];
        TORCH_CHECK(slot(0).has_value(), "LlamaLayerStack: a projection has no packed weight");
        p.packed = *slot(0);
        switch (p.kind) {
          case Projection::kBf16: p.bias = slot(1); break;
          case Projection::kKQuant:
            TORCH_CHECK(slot(1).has_value(), "LlamaLayerStack: a k-quant projection needs its Q6_K panels (empty "
                        "where it has no Q6_K rows)");
            p.q6_k = *slot(1), p.bias = slot(2);
            break;
          case Projection::kInt8Rows:
            TORCH_CHECK(slot(1).has_value() && slot(2).has_value(), "LlamaLayerStack: an int8 projection needs "
                        "its compensation and scale");
            p.compensation = *slot(1), p.scale = *slot(2), p.bias = slot(3);
            break;
          case Projection::kInt8Blocks:
          case Projection::kQ4:
            TORCH_CHECK(slot(1).has_value(), "LlamaLayerStack: a block-scaled projection needs its scales");
            p.scale = *slot(1), p.bias = slot(2), p.high = slot(3);
            break;
          default: TORCH_CHECK(false, "LlamaLayerStack: unknown projection kind ", p.kind);
        }
      }
      layers.push_back(std::move(layer));
    }
  }

  // The adapters' compute slots, kept by reference (the runner fills them in place): per layer, lora_a and
  // lora_b_t of its qkv, o, gate_up and down projections in that order; shard_rank: the ranks of one shard
  // (max_lora_rank), so q|k|v's R is 3 * shard_rank and gate|up's 2 * shard_rank.
  void set_lora(std::vector<at::Tensor> lora_a, std::vector<at::Tensor> lora_b_t, int64_t shard_rank) {
    TORCH_CHECK(lora_a.size() == kProjections * layers.size() && lora_b_t.size() == lora_a.size(),
                "LlamaLayerStack.set_lora: expected ", kProjections, " lora_a and lora_b_t per layer");
    const int64_t q = num_heads * head_dim, kv = num_kv_heads * head_dim;
    const std::vector<int64_t> offsets[kProjections] = {
        {0, q, q + kv, q + 2 * kv}, {0, hidden_size}, {0, intermediate_size, 2 * intermediate_size}, {0, hidden_size}};
    std::vector<std::array<LoRAProjection, kProjections>> slots(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      for (int64_t j = 0; j < kProjections; ++j) {
        const at::Tensor& a = lora_a[i * kProjections + j];
        const int64_t shards = static_cast<int64_t>(offsets[j].size()) - 1;
        TORCH_CHECK(a.dim() == 3 && a.size(1) == shards * shard_rank, "LlamaLayerStack.set_lora: layer ", i,
                    " projection ", j, ": lora_a must be [S, ", shards * shard_rank, ", in]");
        slots[i][j] = {a, lora_b_t[i * kProjections + j], offsets[j]};
      }
    }
    lora = std::move(slots);
  }

  // hidden: [T, H] (the embeddings; they become the residual stream, updated in place as the Python layers
  // update theirs); positions, slot_mapping: [T]; key_caches, value_caches: one per layer; the rest as
  // paged_attention takes them. Returns (the last layer's output, the residual stream).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden_in, at::Tensor positions,
                                             std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                                             at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens,
                                             at::Tensor query_start_loc, int64_t sliding_window) {
    return run(hidden_in, positions, key_caches, value_caches, slot_mapping, block_table, seq_lens, query_start_loc,
               sliding_window, nullptr);
  }

  // forward with LoRA deltas: token_slots [T] int64, each token's compute slot (-1: the base model).
  std::tuple<at::Tensor, at::Tensor> forward_lora(at::Tensor hidden_in, at::Tensor positions,
                                                  std::vector<at::Tensor> key_caches,
                                                  std::vector<at::Tensor> value_caches, at::Tensor slot_mapping,
                                                  at::Tensor block_table, at::Tensor seq_lens,
                                                  at::Tensor query_start_loc, int64_t sliding_window,
                                                  at::Tensor token_slots) {
    TORCH_CHECK(!lora.empty(), "LlamaLayerStack.forward_lora: set_lora was never called");
    TORCH_CHECK(token_slots.numel() == hidden_in.size(0), "LlamaLayerStack.forward_lora: one slot per token");
    const auto groups = kvloom::lora::TokenGroups::build(token_slots, lora[0][0].a.size(0));
    return run(hidden_in, positions, key_caches, value_caches, slot_mapping, block_table, seq_lens, query_start_loc,
               sliding_window, groups.empty() ? nullptr : &groups);
  }

 private:
  // groups: the step's adapter tokens (null: none, or no adapters).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden_in, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& key_caches,
                                         const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
                                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc, int64_t sliding_window,
                                         const kvloom::lora::TokenGroups* groups) {
    // y [T, out] += the LoRA delta of x [T, in] for projection j of layer i, when the step has adapter tokens.
    auto add_lora = [&](size_t i, int64_t j, const at::Tensor& y, const at::Tensor& x) {
      if (groups == nullptr) return;
      const LoRAProjection& p = lora[i][j];
      KVLOOM_PROFILED("kvloom::lora_bgmv", kvloom::lora::add_delta(y, x, p.a, p.b_t, p.out_offsets, *groups));
    };
    TORCH_CHECK(key_caches.size() == layers.size() && value_caches.size() == layers.size(),
                "LlamaLayerStack: expected ", layers.size(), " key and value caches, got ", key_caches.size(),
                " and ", value_caches.size());
    TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(), "LlamaLayerStack: hidden must be a contiguous "
                "[T, H]");
    const int64_t tokens = hidden_in.size(0);
    at::Tensor residual = hidden_in;
    at::Tensor hidden = hidden_in;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      if (i == 0 && layer.input_norm.numel() == 0) {
        hidden = residual;  // no input norm (EAGLE-1's first layer): the layer reads the stream itself
      } else if (i == 0) {
        hidden = at::empty_like(residual);
        KVLOOM_PROFILED("kvloom::rms_norm", k::rms_norm(hidden, residual, layer.input_norm, eps));
      } else {
        KVLOOM_PROFILED("kvloom::fused_add_rms_norm", k::fused_add_rms_norm(hidden, residual, layer.input_norm, eps));
      }
      at::Tensor qkv = layer.qkv(hidden);
      add_lora(i, 0, qkv, hidden);
      at::Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim});
      KVLOOM_PROFILED("kvloom::rotary_embedding",
                      k::rotary_embedding(heads.narrow(1, 0, num_heads + num_kv_heads), positions, cos, sin));
      KVLOOM_PROFILED("kvloom::write_kv_cache",
                      k::write_kv_cache(heads.narrow(1, num_heads, num_kv_heads),
                                        heads.narrow(1, num_heads + num_kv_heads, num_kv_heads), key_caches[i],
                                        value_caches[i], slot_mapping));
      at::Tensor attended = at::empty({tokens, num_heads, head_dim}, hidden_in.options());
      KVLOOM_PROFILED("kvloom::paged_attention",
                      k::paged_attention(attended, heads.narrow(1, 0, num_heads), key_caches[i], value_caches[i],
                                         block_table, seq_lens, query_start_loc, scale, sliding_window));
      const at::Tensor attended_rows = attended.view({tokens, num_heads * head_dim});
      at::Tensor projected = layer.o(attended_rows);
      add_lora(i, 1, projected, attended_rows);
      KVLOOM_PROFILED("kvloom::fused_add_rms_norm", k::fused_add_rms_norm(projected, residual, layer.post_norm, eps));
      at::Tensor gate_up = layer.gate_up(projected);
      add_lora(i, 2, gate_up, projected);
      at::Tensor activated = at::empty({tokens, intermediate_size}, hidden_in.options());
      KVLOOM_PROFILED("kvloom::silu_and_mul", k::silu_and_mul(activated, gate_up));
      hidden = layer.down(activated);
      add_lora(i, 3, hidden, activated);
    }
    return {hidden, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.class_<LlamaLayerStack>("LlamaLayerStack")
      .def(torch::init<std::vector<at::Tensor>, c10::List<c10::optional<at::Tensor>>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, at::Tensor, at::Tensor, std::vector<int64_t>, double,
                       double>())
      .def("forward", &LlamaLayerStack::forward)
      .def("set_lora", &LlamaLayerStack::set_lora)
      .def("forward_lora", &LlamaLayerStack::forward_lora);
}

#endif  // KVLOOM_BF16_GEMM
