// bf16 linear layers for the CPU: y[M, N] = x[M, K] W[N, K]^T (+ bias), products summed in fp32
// and rounded once to bf16, as F.linear does. Written for the batches that decoding runs (M up
// to a few hundred rows), where oneDNN reaches 35-70% of the machine's bf16 peak at this model's
// shapes: the weight is streamed once per step and each panel of it is reused from L2 by every
// row of the batch.
//
// The weight is packed once (kvloom/ops/cpu.py, pack_gemm_weight) into panels of kPanel output columns
// (48 with AVX512-BF16, 16 with AVX2: gemm_panel() says which): packed[panel][K/2][kPanel][2], so that one k
// pair of the panel's columns is kPanel contiguous 32-bit (column, pair) words and a whole panel is one
// sequential stream. Two micro-kernels read that layout:
//
// - AVX512-BF16: vdpbf16ps multiplies a broadcast pair of x by 16 such words and adds both products
//   into 16 fp32 sums.
// - AVX2 + FMA (any x86-64-v3 CPU, and AVX-512 ones without BF16): the words of 8 columns give the
//   even k's weights as fp32 by a shift left of 16 bits and the odd k's by masking the low half (bf16
//   is the top half of an fp32: both exact), and 8-wide FMAs add x (converted to fp32 once per call)
//   times them. Half the weight bytes of an fp32 GEMM, the same fp32 arithmetic.
//
// - AMX-BF16 (an AVX512-BF16 build on a CPU with AMX tiles, KVLOOM_CPU_AMX not 0): every row count instead reads the
//   panels in place as B tiles (amx_bf16.h panel_product; K a multiple of 32). tdpbf16ps rounds otherwise than
//   vdpbf16ps, so a weight takes one of the two for every batch, never both.
//
// Without either the op is not registered and callers keep oneDNN / F.linear.

#include "amx_bf16.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {
// What this build of the library was compiled for (cpu_capability.h), for kvloom env and the tests.
std::string compiled_isa() { return KVLOOM_COMPILED_ISA; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("compiled_isa() -> str", &compiled_isa);
}

#if defined(KVLOOM_BF16_GEMM)
#include <immintrin.h>

namespace {

using kvloom::parallel_for;

constexpr int64_t kRowChunk = 256;                // rows whose x stays in L2 while panels stream

#if defined(KVLOOM_BF16_DOT)
constexpr int64_t kPanelVecs = 3;                 // 16-column vectors per panel
constexpr int64_t kPanel = 16 * kPanelVecs;       // output columns per panel
constexpr int64_t kRows = 8;                      // rows per micro-kernel call: 8 x 3 = 24 sums

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
#else
constexpr int64_t kPanelVecs = 2;                 // 8-column vectors per panel
constexpr int64_t kPanel = 8 * kPanelVecs;        // output columns per panel: one 64-byte line per k pair
constexpr int64_t kRows = 4;                      // rows per micro-kernel call: 4 x 2 = 8 sums of 8 columns
constexpr int64_t kPrefetch = 16;                 // k pairs (64-byte lines) the weight is requested ahead

// R rows of y for one panel of 16 columns: 4 x 2 sums, 2 weight vectors, a broadcast x and the odd mask fit
// the 16 registers (4 x 3 sums did not: GCC spilled three, and their store-to-load chains held the kernel to a
// third of the FMA peak), and a panel is one sequential stream of lines, which the prefetcher follows from
// memory (48-column panels read in three passes of 16 were half as fast at a decode's few rows). x: fp32 rows
// of 2 * pairs values (zero past K), stride ldx.
template <int R>
inline void panel_kernel(const float* x, int64_t ldx, const c10::BFloat16* panel, int64_t K, const float* bias,
                         c10::BFloat16* y, int64_t ldy, int64_t columns) {
  const int64_t pairs = (K + 1) / 2;
  const auto* w = reinterpret_cast<const int32_t*>(panel);
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][kPanelVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += kPanel) {
    // A decode's few rows leave the loads waiting on memory: ask for the line kPrefetch pairs ahead (past the
    // panel's end it is the next panel's, which this thread usually takes next).
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kPanel), _MM_HINT_T0);
    __m256 wv[kPanelVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v)
      wv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(w + 8 * v)), 16));
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v)
      wv[v] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(w + 8 * v)), odd_mask));
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r) {
    alignas(32) float sums[kPanel];
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) _mm256_store_ps(sums + 8 * v, acc[r][v]);
    for (int64_t c = 0; c < columns; ++c)  // c10's rounding: to nearest even, NaN kept
      y[r * ldy + c] = c10::BFloat16(sums[c] + (bias ? bias[c] : 0.0f));
  }
}

using PanelKernel = void (*)(const float*, int64_t, const c10::BFloat16*, int64_t, const float*, c10::BFloat16*,
                             int64_t, int64_t);
constexpr PanelKernel kKernels[kRows + 1] = {nullptr, &panel_kernel<1>, &panel_kernel<2>, &panel_kernel<3>,
                                             &panel_kernel<4>};

// x's rows [m0, m1) as fp32, 2 * pairs values a row (the odd K's pad zero), for the AVX2 kernel's broadcasts.
void widen_rows(const c10::BFloat16* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t pairs, float* out) {
  kvloom::parallel_for(m0, m1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = out + (m - m0) * 2 * pairs;
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x[m * ldx + k]);
      if (K % 2) row[K] = 0.0f;
    }
  });
}
#endif

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
#if defined(KVLOOM_BF16_DOT) && defined(KVLOOM_AMX_BF16)
  // With AMX-BF16 (KVLOOM_CPU_AMX not 0) every row count takes the tiles, the panels read in place: one formula per
  // row whatever the batch (the dot-product kernel below sums in another order, so the two never mix for a weight).
  if (K % 32 == 0 && kvloom::amx::ready()) {
    kvloom::amx::panel_product(ys, xs, ldx, M, K, N, ws, kPanel, bs);
    return;
  }
#endif
#if !defined(KVLOOM_BF16_DOT)
  std::vector<float> widened(std::min(M, kRowChunk) * 2 * pairs);
#endif
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m1 = std::min(M, m0 + kRowChunk);
#if defined(KVLOOM_BF16_DOT)
    const c10::BFloat16* rows_x = xs + m0 * ldx;
    const int64_t ld = ldx;
#else
    widen_rows(xs, ldx, m0, m1, K, pairs, widened.data());
    const float* rows_x = widened.data();
    const int64_t ld = 2 * pairs;
#endif
    // Whole panels per thread: each streams its share of the weight once per row chunk.
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, N - n0);
        for (int64_t m = m0; m < m1; m += kRows) {
          const int64_t rows = std::min(kRows, m1 - m);
          kKernels[rows](rows_x + (m - m0) * ld, ld, ws + panel * panel_size, K, bs ? bs + n0 : nullptr,
                         ys + m * N + n0, N, columns);
        }
      }
    });
  }
}

}  // namespace

namespace kvloom::kernels {
void gemm_bf16(at::Tensor y, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  ::gemm_bf16(y, x, packed, bias);
}
}  // namespace kvloom::kernels

static int64_t gemm_panel() { return kPanel; }

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gemm_bf16(Tensor(a!) y, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("gemm_panel() -> int", &gemm_panel);  // output columns per packed panel (pack_gemm_weight's panel)
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gemm_bf16", &gemm_bf16);
}

#endif  // KVLOOM_BF16_GEMM
