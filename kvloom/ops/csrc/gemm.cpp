// bf16 linear layers for the CPU: y[M, N] = x[M, K] W[N, K]^T (+ bias), products summed in fp32
// and rounded once to bf16, as F.linear does. Written for the batches that decoding runs (M up
// to a few hundred rows), where oneDNN reaches 35-70% of the machine's bf16 peak at this model's
// shapes: the weight is streamed once per step and each panel of it is reused from L2 by every
// row of the batch.
//
// The weight is packed once (kvloom/layers/linear.py, pack_gemm_weight) into panels of kPanel
// output columns: packed[panel][K/2][kPanel][2], so that one k pair of kPanel columns is kPanelVecs
// contiguous vectors of 16 (column, pair) words and a whole panel is one sequential stream.
// vdpbf16ps multiplies a broadcast pair of x by such a vector and adds both products into 16
// fp32 sums. Without AVX512-BF16 the op is not registered and callers keep oneDNN / F.linear.

#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(KVLOOM_BF16_DOT)
#include <immintrin.h>

namespace {

using kvloom::parallel_for;

constexpr int64_t kPanelVecs = 3;                 // 16-column vectors per panel
constexpr int64_t kPanel = 16 * kPanelVecs;       // output columns per panel
constexpr int64_t kRows = 8;                      // rows per micro-kernel call: 8 x 3 = 24 sums
constexpr int64_t kRowChunk = 256;                // rows whose x stays in L2 while panels stream

inline int32_t load_pair(const c10::BFloat16* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// R rows of y for one panel. x rows have stride ldx; K may be odd (its last pair is (x, 0)).
template <int R>
inline void panel_kernel(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t K,
                         const float* bias, c10::BFloat16* y, int64_t ldy, int64_t columns) {
  __m512 acc[R][kPanelVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  const auto* w = reinterpret_cast<const int16_t*>(panel);
  for (int64_t p = 0; p < full_pairs; ++p) {
    __m512bh wv[kPanelVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * kPanelVecs + v) * 32);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const auto xv = (__m512bh)_mm512_set1_epi32(load_pair(x + r * ldx + 2 * p));
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  if (K % 2) {  // the packed weight's pad half is zero; x's must be too (its next element may be anything)
    __m512bh wv[kPanelVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (full_pairs * kPanelVecs + v) * 32);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      uint16_t last;
      std::memcpy(&last, x + r * ldx + K - 1, sizeof(last));
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(last));
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  KVLOOM_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t left = columns - v * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b));
      _mm256_mask_storeu_epi16(y + r * ldy + v * 16, mask, (__m256i)out);
    }
  }
}

using PanelKernel = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const float*,
                             c10::BFloat16*, int64_t, int64_t);
constexpr PanelKernel kKernels[kRows + 1] = {nullptr,          &panel_kernel<1>, &panel_kernel<2>,
                                             &panel_kernel<3>, &panel_kernel<4>, &panel_kernel<5>,
                                             &panel_kernel<6>, &panel_kernel<7>, &panel_kernel<8>};

// y = x packed^T (+ bias). x: [M, K] bf16, rows contiguous; packed: from pack_gemm_weight for an
// [N, K] weight; bias: [N] float32 or undefined; y: [M, N] bf16 contiguous.
void gemm_bf16(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.is_contiguous() && packed.is_contiguous(),
              "gemm_bf16: x must be [M, K] with contiguous rows and y [M, N] contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16, "gemm_bf16: x, y and the packed weight must be bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t pairs = (K + 1) / 2, panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(y.size(0) == M && packed.numel() == panels * pairs * kPanel * 2,
              "gemm_bf16: the packed weight does not match x [", M, ", ", K, "] and y [", y.size(0), ", ", N, "]");
  const float* bs = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gemm_bf16: bias must be a contiguous float32 [N]");
    bs = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const auto* xs = x.data_ptr<c10::BFloat16>();
  const auto* ws = packed.data_ptr<c10::BFloat16>();
  auto* ys = y.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), panel_size = pairs * kPanel * 2;
  // Whole panels per thread: each streams its share of the weight once per row chunk.
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        for (int64_t m = m0; m < m1; m += kRows) {
          const int64_t rows = std::min(kRows, m1 - m);
          kKernels[rows](xs + m * ldx, ldx, ws + panel * panel_size, K, bs ? bs + n0 : nullptr, ys + m * N + n0, N,
                         columns);
        }
      }
    }
  });
}

}  // namespace

namespace kvloom::kernels {
void gemm_bf16(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  ::gemm_bf16(y, x, packed, bias);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gemm_bf16(Tensor(a!) y, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gemm_bf16", &gemm_bf16);
}

#endif  // KVLOOM_BF16_DOT
