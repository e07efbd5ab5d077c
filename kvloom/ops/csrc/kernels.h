// The kernels' entry points, for C++ callers in this library (decoder.cpp): the same functions the
// torch ops of the same names run, called directly, without the dispatcher or Python in between.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace kvloom::kernels {

// fused_ops.cpp
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void silu_and_mul(at::Tensor out, at::Tensor x);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping);
// paged_attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window);
// gemm.cpp (built with AVX512-BF16 only: KVLOOM_BF16_DOT)
void gemm_bf16(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
// gemm_int8.cpp
void gemm_w8a8(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor compensation, at::Tensor scale,
               c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles = true);
void gemm_int8_weight_only(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale,
                           c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles = true);
void gemm_w8a8_blocks(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                      bool portable, bool bf16_tiles = true);

// x's rows quantized per block of 32 as kvloom.ops.int8.quantize_per_block does: s8 codes [M, K], fp32 scales
// and int32 code sums [M, K / 32] (the W8A8 products' own quantizer, for gemm_q4.cpp).
void quantize_blocks_s8(const at::Tensor& x, int8_t* q, float* scales, int32_t* code_sums, bool portable);
// gemm_q4.cpp
void gemm_q4(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> bias,
             bool portable, c10::optional<at::Tensor> high = c10::nullopt, bool bf16_tiles = true);
// gemm_q4k.cpp
void gemm_kquant(at::Tensor y, at::Tensor x, at::Tensor q4_k, at::Tensor q6_k, c10::optional<at::Tensor> bias,
                 bool portable, int64_t unpacked_from = -1, bool bf16_tiles = false);

}  // namespace kvloom::kernels
