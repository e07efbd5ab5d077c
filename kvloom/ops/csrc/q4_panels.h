// gemm_q4.cpp's code-block product on a weight kept in another layout: gemm_q4k.cpp's panels of the file's k-quant
// super-blocks, each panel of 8 rows unpacked into the code-block layout in a thread's scratch as the product reaches
// it (its codes are already in that layout; its two-level scales are multiplied out to fp32, the same values the
// k-quant kernels compute), then read by the code-block kernels: VNNI's 8-row kernel and AMX-INT8 tiles, which the
// k-quant kernels lack. The unpacking is paid once per panel and call, so it is for calls of several rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvloom::q4 {

constexpr int64_t kPanel = 8;    // rows of W per panel
constexpr int64_t kBlock = 32;   // inputs per block
constexpr int64_t kCodeBytes = kPanel * kBlock / 2;  // a panel's block of codes: 128 bytes
constexpr int64_t kPlaneBytes = kPanel * kBlock / 8;  // a panel's block of one upper-bit plane: 32 bytes

// Scale rows per block: d and m per group of 32 (codes of 4 or 5 bits) or of 16 (6 bits: d0, d1, m0, m1).
constexpr int scale_rows(int bits) { return bits == 6 ? 4 : 2; }

// Where a panel's codes already lie in the code-block layout: runs of `blocks` blocks (kCodeBytes each), `stride`
// bytes apart, the first at `first` (null: nowhere).
struct CodeRuns {
  const uint8_t* first = nullptr;
  int64_t blocks = 0;
  int64_t stride = 0;
};

// A weight's panels as the code-block kernels read them, produced on demand.
class PanelSource {
 public:
  virtual ~PanelSource() = default;
  // Panel p: its codes [blocks][kCodeBytes] in gemm_q4.cpp's nibble pairs (`codes` null: not wanted, the tiles read
  // them where they lie), its upper-bit planes
  // [blocks][bits - 4][kPlaneBytes] (pack_high_bits' layout; nothing for 4-bit codes) and its fp32 scales
  // [blocks][scale_rows(bits)][8] (each group's d, then each group's m, per row of W).
  virtual void unpack(int64_t p, uint8_t* codes, uint8_t* high, float* scales) const = 0;
  // Panel p's bytes fetched toward L2 (the dequantizing AMX-BF16 product's next units).
  virtual void prefetch(int64_t p) const = 0;
  virtual CodeRuns codes_in_place(int64_t) const { return {}; }
};

// y[:, col0 : col0 + cols] = x W^T (+ bias, float32 [cols]) for a weight [cols, K] of `bits`-bit codes whose panels
// `source` gives. x: [M, K] float32 or bfloat16 rows, y: [M, N] contiguous in x's dtype. Only where
// unpacked_product_fast(): the fast kernels, by the same integers and fp32 steps as gemm_q4 on the same values; with
// `bf16_tiles`, bf16 x of unpacked_bf16_tiles_from() rows or more takes gemm_q4's dequantizing AMX-BF16 product
// instead (another arithmetic: only where batch-dependent products are allowed).
void unpacked_product(at::Tensor& y, const at::Tensor& x, int64_t col0, int64_t cols, int bits,
                      const PanelSource& source, const float* bias, bool bf16_tiles);
// Whether this build has the kernels unpacked_product runs (AVX2 at least).
bool unpacked_product_fast();
// From how many rows unpacked_product takes AMX-INT8 tiles for codes of 4 or 5 bits; 0: never (no such tiles in this
// build or CPU).
int64_t unpacked_int8_tiles_from();
// From how many rows bf16_tiles takes the AMX-BF16 tiles here; 0: never (no such tiles in this build or CPU).
int64_t unpacked_bf16_tiles_from();

}  // namespace kvloom::q4
