// A weight held as the file's bytes in parts, read row by row: the packing passes' input (gemm_q4k.cpp's k-quant
// super-blocks, gemm_int8.cpp's Q8_0 blocks).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace kvloom {

// The rows of `parts` in turn (each uint8 [rows, row_bytes] of a [rows, in_features] weight, a row's bytes
// contiguous, rows any stride apart: the file's mapped tensors, the shards of a fused projection) as pointers to
// their bytes; `op` names the caller in its messages. At least one row.
inline std::vector<const uint8_t*> part_rows(at::TensorList parts, int64_t row_bytes, int64_t in_features,
                                             const char* op) {
  std::vector<const uint8_t*> rows;
  for (const at::Tensor& part : parts) {
    TORCH_CHECK(part.scalar_type() == at::kByte && part.dim() == 2 && part.size(1) == row_bytes &&
                    (part.size(0) <= 1 || part.stride(1) == 1) && part.device().is_cpu(),
                op, ": each part must be the uint8 bytes [rows, ", row_bytes, "] of a [rows, ", in_features,
                "] weight, each row's bytes contiguous; got ", part.sizes(), " ", part.scalar_type());
    const uint8_t* base = part.data_ptr<uint8_t>();
    for (int64_t r = 0; r < part.size(0); ++r) rows.push_back(base + r * part.stride(0));
  }
  TORCH_CHECK(!rows.empty(), op, ": a weight needs rows > 0");
  return rows;
}

}  // namespace kvloom
