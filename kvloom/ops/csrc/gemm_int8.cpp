// int8 linear layers for the CPU: y[M, N] = x[M, K] W[N, K]^T (+ bias) with W stored as int8 q[N, K]
// and one fp32 scale per output column, or per column and block of 32 k (a GGUF Q8_0 weight kept as it
// is stored). kvloom/ops/int8.py says what each product means; its references are the oracles the tests
// compare with. Three products read the same packed weight:
//
// - W8A8 (gemm_w8a8): each row of x is quantized to int8 with its own scale, as quantize_per_token
//   does (the same fp32 division and round-half-to-even, so the same integers), shifted to u8 (+128)
//   for vpdpbusd (u8 x s8, 4 products summed into each int32 lane), and the shift taken back out
//   with compensation[n] = 128 * sum_k q[n, k], computed once at pack time. The int32 sums are exact;
//   x_scale * w_scale (+ bias) is applied once at the end, in fp32.
// - weight-only (gemm_int8_weight_only): the int8 weight is widened to bf16 in registers (exact:
//   |q| <= 127) and fed to vdpbf16ps with x's bf16 values, summed in fp32 and scaled at the end, as
//   int8_linear_reference does. An fp32 x is split into bf16 hi + lo parts (x - hi is exact in fp32
//   and its bf16 rounding is 2^-17 of x), two dot products per weight vector.
// - W8A8 on blocks (gemm_w8a8_blocks), for block-scaled weights: x quantized per (row, block of 32 k) as
//   quantize_per_block does (llama.cpp's vec_dot_q8_0_q8_0), and vpdpbusd sums each block exactly into
//   int32; then the fp32 sum gains (int32 sum) * x_scale * w_scale, one FMA per block. Here the shift
//   to u8 is on the weight (packed as q + 128, the same panels with each byte's top bit flipped) and x
//   stays s8: what the shift adds, 128 * the block's sum of x's codes, is one number per row and block,
//   so each block's int32 sums start from minus it, and no per-column compensation is streamed with the
//   weight. Block scales are packed per panel, [panels][blocks][48], in fp16 where every one is exactly one (a
//   GGUF Q8_0's own d: 8.5 bits a weight streamed, as the file holds them, where fp32 scales made it 9) and widened
//   to fp32 in registers (exact, so the same sums as fp32 scales), else in fp32.
//
// The weight is packed once (kvloom/ops/cpu.py, pack_int8_weight) into panels of kPanel = 48 output
// columns: packed[panel][K/4][48][4] int8, so that one group of 4 k of 16 columns is one 64-byte
// vector, as vpdpbusd wants it. The weight-only kernel reads the same vector as two bf16 vectors
// whose 32-bit lanes hold (column c, k pair p) for 8 columns each; a broadcast 64-bit x word gives
// lane p its own pair, and the two lanes of each column are added at the end.
//
// On AVX2 (no VNNI, no BF16) each product has its own micro-kernel. Both W8A8 ones keep x's codes s8 and
// move the weight's sign onto them, so vpmaddubsw's 16-bit pair sums cannot saturate and vpmaddwd adds
// each 4 k into an int32 lane: the same exact sums as vpdpbusd, with no compensation. The weight-only one
// widens 8 bytes of a group (2 columns x 4 k) to one fp32 vector, FMAs it with a broadcast of the group's
// 4 x values, and adds each column's 4 lanes at the end. Without these instructions the same packed
// layout is read by plain loops; `portable=True` runs those anywhere, so tests pin both against the references. All three
// products walk the panels with one loop (for_each_panel) and differ only in their micro-kernels.
//
// With AMX-BF16 (csrc/amx_bf16.h), bf16 activations of enough rows take neither: the weight is dequantized per call
// into bf16 tiles (int8 codes as they are, exact; Q8_0 blocks times their scale) and multiplied with fp32 sums over
// K, the per-row scale applied at the end: the weight-only product's arithmetic (see kBf16MinRows below).

#include "avx2_columns.h"
#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"
#include "part_rows.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "amx_bf16.h"

namespace {

using kvloom::parallel_for;

constexpr int64_t kPanelVecs = 3;             // 16-column vectors per panel
constexpr int64_t kPanel = 16 * kPanelVecs;   // output columns per panel (as csrc/gemm.cpp)
constexpr int64_t kGroup = 4;                 // k per int32 lane of vpdpbusd
constexpr int64_t kGroupBytes = kPanel * kGroup;
constexpr int64_t kRowsW8A8 = 8;              // rows per W8A8 micro-kernel: 8 x 3 int32 sums
constexpr int64_t kRowsWeightOnly = 4;        // rows per weight-only micro-kernel: 4 x 6 fp32 sums
constexpr int64_t kRowsBlocks = 4;            // rows per W8A8-on-blocks micro-kernel: 4 x 3 int32 + 4 x 3 fp32 sums
constexpr int64_t kBlock = 32;                // k per scale of a block-scaled weight (a Q8_0 block)
constexpr int64_t kGroupsPerBlock = kBlock / kGroup;
constexpr int64_t kRowChunk = 256;            // rows whose x stays in L2 while panels stream
constexpr int32_t kShift = 128;               // s8 -> u8 for vpdpbusd's unsigned operand
constexpr float kQmax = 127.0f;
// The u8 x s8 sums reach 255 * 127 * K before the compensation is taken out: K up to this fits int32.
constexpr int64_t kMaxW8A8K = 2147483647LL / (255 * 127);

struct Shapes {
  int64_t M, K, N, groups, panels;
};

// A block scale as fp32 (S: float, or c10::Half widened exactly).
inline float scale_value(float s) { return s; }
inline float scale_value(c10::Half s) { return static_cast<float>(s); }
#if defined(CPU_CAPABILITY_AVX512)
inline __m512 load_scales16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}
#endif

// The loop every product shares: threads split the panels; rows go in chunks of kRowChunk (their
// activations stay in L2 while the panels stream past), each chunk in calls of at most `step` rows:
// body(m, rows, panel, n0, columns) writes y[m, m + rows) x [n0, n0 + columns).
template <typename Body>
void for_each_panel(const Shapes& s, int64_t step, const Body& body) {
  parallel_for(0, s.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < s.M; m0 += kRowChunk) {
      const int64_t m1 = std::min(s.M, m0 + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanel, columns = std::min(kPanel, s.N - n0);
        for (int64_t m = m0; m < m1; m += step) body(m, std::min(step, m1 - m), panel, n0, columns);
      }
    }
  });
}

template <typename F>
void dispatch_float(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    default: TORCH_CHECK(false, name, ": x must be float32 or bfloat16, got ", t.scalar_type());
  }
}

// The checks every product shares; returns the shapes and the bias pointer (or nullptr). The scales: fp32 [N], or
// the packed blocks' panels * blocks * 48 in fp32 or fp16.
Shapes check_arguments(const char* name, const at::Tensor& y, const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scale, bool blocks, const c10::optional<at::Tensor>& bias,
                       const float** bias_ptr) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.is_contiguous() && packed.is_contiguous(),
              name, ": x must be [M, K] with contiguous rows and y [M, N] contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), name, ": y must have x's dtype");
  TORCH_CHECK(packed.scalar_type() == at::kChar, name, ": the packed weight must be int8");
  Shapes s{x.size(0), x.size(1), y.size(1), 0, 0};
  s.groups = (s.K + kGroup - 1) / kGroup;
  s.panels = (s.N + kPanel - 1) / kPanel;
  TORCH_CHECK(y.size(0) == s.M && packed.numel() == s.panels * s.groups * kGroupBytes, name,
              ": the packed weight does not match x [", s.M, ", ", s.K, "] and y [", y.size(0), ", ", s.N, "]");
  if (blocks) {
    TORCH_CHECK(s.K % kBlock == 0, name, ": K = ", s.K, " must be a multiple of ", kBlock, " (one scale per block)");
    TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) && scale.is_contiguous() &&
                    scale.numel() == s.panels * (s.K / kBlock) * kPanel,
                name, ": scale must be the contiguous float32 or float16 block scales packed [panels, K / 32, 48]");
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == s.N,
                name, ": scale must be a contiguous float32 [N]");
  }
  *bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == s.N,
                name, ": bias must be a contiguous float32 [N]");
    *bias_ptr = bias->data_ptr<float>();
  }
  return s;
}

// ---- activations ----------------------------------------------------------------------------------
// x[begin, K) to q + shift by scalar steps (a true fp32 division, rounding to even, the clamp), zeros (q =
// shift) over [K, Kp); returns the sum of those q.
template <typename T>
int32_t quantize_codes(const T* x, int64_t begin, int64_t K, int64_t Kp, float scale, int32_t shift, uint8_t* q) {
  int32_t sum = 0;
  for (int64_t k = begin; k < K; ++k) {
    const float r = std::min(kQmax, std::max(-kQmax, std::nearbyint(static_cast<float>(x[k]) / scale)));
    sum += static_cast<int32_t>(r);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(r) + shift);
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = static_cast<uint8_t>(shift);
  return sum;
}

// One row of x to q + shift (u8 q + 128, or the s8 q itself with shift 0) and its scale, as
// quantize_per_token: scale = amax / 127 (1 for a zero row), q = round_half_even(x / scale) clamped to
// +-127. Columns K..Kp-1 get q = 0. The division is a true fp32 division (not a product with 1 / scale),
// so q is the reference's integer. code_sum (if not null) gets the sum of the q.
#if defined(CPU_CAPABILITY_AVX512)
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

inline __m512 load_lanes(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load_lanes(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
float quantize_row_avx512(const T* x, int64_t K, int64_t Kp, int32_t shift, uint8_t* q, int32_t* code_sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_lanes(x + k, lanes(K - k))));
  const float row_max = _mm512_reduce_max_ps(amax);
  const float scale = row_max > 0.0f ? row_max / kQmax : 1.0f;
  const __m512 vscale = _mm512_set1_ps(scale), hi = _mm512_set1_ps(kQmax), lo = _mm512_set1_ps(-kQmax);
  const __m512i vshift = _mm512_set1_epi32(shift);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 16) {
    const __m512 v = load_lanes(x + k, k < K ? lanes(K - k) : __mmask16(0));  // zeros past K
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
    sums = _mm512_add_epi32(sums, i);
    _mm512_mask_cvtepi32_storeu_epi8(q + k, lanes(Kp - k), _mm512_add_epi32(i, vshift));
  }
  if (code_sum) *code_sum = _mm512_reduce_add_epi32(sums);
  return scale;
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KVLOOM_QUANTIZE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// quantize_row_portable's integers, 8 at a time: the same true division, rounding to even and clamp.
template <typename T>
float quantize_row_avx2(const T* x, int64_t K, int64_t Kp, int32_t shift, uint8_t* q, int32_t* code_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t K8 = K - K % 8;
  __m256 amax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float row_max = 0.0f;
  for (float v : lanes) row_max = std::max(row_max, v);
  for (int64_t k = K8; k < K; ++k) row_max = std::max(row_max, std::fabs(static_cast<float>(x[k])));
  const float scale = row_max > 0.0f ? row_max / kQmax : 1.0f;
  const __m256 vscale = _mm256_set1_ps(scale), hi = _mm256_set1_ps(kQmax), lo = _mm256_set1_ps(-kQmax);
  const __m256i vshift = _mm256_set1_epi32(shift);
  // Byte 0 of each int32 lane, gathered into the low 8 bytes.
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i halves = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  __m256i sums = _mm256_setzero_si256();
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(load8(x + k), vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    sums = _mm256_add_epi32(sums, i);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_add_epi32(i, vshift), low_bytes), halves);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(bytes));
  }
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sums);
  int32_t sum = quantize_codes(x, K8, K, Kp, scale, shift, q);
  for (int32_t v : parts) sum += v;
  if (code_sum) *code_sum = sum;
  return scale;
}
#endif

template <typename T>
float quantize_row_portable(const T* x, int64_t K, int64_t Kp, int32_t shift, uint8_t* q, int32_t* code_sum) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float scale = amax > 0.0f ? amax / kQmax : 1.0f;
  const int32_t sum = quantize_codes(x, 0, K, Kp, scale, shift, q);
  if (code_sum) *code_sum = sum;
  return scale;
}

// Every row of x to rows of Kp = 4 * groups bytes of q + shift. block == 0: one scale per row
// (scales[m]); otherwise one per block of `block` k (K a multiple of it, so Kp = K): scales[m * K / block
// + b], and code_sums (if not null) the same places' sums of q.
template <typename T>
void quantize_rows(const at::Tensor& x, const Shapes& s, int64_t block, int32_t shift, uint8_t* q, float* scales,
                   int32_t* code_sums, bool portable) {
  const T* xs = x.data_ptr<T>();
  const int64_t ldx = x.stride(0), Kp = s.groups * kGroup;
  const int64_t width = block ? block : s.K, padded = block ? block : Kp, per_row = s.K / width;
#if !defined(CPU_CAPABILITY_AVX512) && !defined(KVLOOM_QUANTIZE_AVX2)
  (void)portable;
#endif
  parallel_for(0, s.M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < per_row; ++b) {
        const T* xr = xs + m * ldx + b * width;
        uint8_t* qr = q + m * Kp + b * padded;
        int32_t* sum = code_sums ? code_sums + m * per_row + b : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
        if (!portable) {
          scales[m * per_row + b] = quantize_row_avx512(xr, width, padded, shift, qr, sum);
          continue;
        }
#elif defined(KVLOOM_QUANTIZE_AVX2)
        if (!portable) {
          scales[m * per_row + b] = quantize_row_avx2(xr, width, padded, shift, qr, sum);
          continue;
        }
#endif
        scales[m * per_row + b] = quantize_row_portable(xr, width, padded, shift, qr, sum);
      }
    }
  });
}

// ---- the output ----------------------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
inline void store_columns(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }

inline void store_columns(c10::BFloat16* y, __mmask16 mask, __m512 v) {
#if defined(KVLOOM_BF16_DOT)
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));  // to nearest even, as c10::BFloat16
#else
  // Round to nearest even on the bits, as c10::BFloat16(float) does; NaN stays a quiet NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(rounded));
#endif
}
#endif

// ---- W8A8 -----------------------------------------------------------------------------------------
#if defined(KVLOOM_VNNI_DOT)
// R rows of y for one panel. xq: u8 rows of Kp = 4 * groups bytes; columns: the panel's real columns.
template <int R, typename T>
inline void w8a8_kernel(const uint8_t* xq, int64_t ldq, const float* x_scale, const int8_t* panel, int64_t groups,
                        const int32_t* compensation, const float* w_scale, const float* bias, T* y, int64_t ldy,
                        int64_t columns) {
  __m512i acc[R][kPanelVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[kPanelVecs];
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = _mm512_loadu_si512(panel + g * kGroupBytes + v * 64);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t word;
      std::memcpy(&word, xq + r * ldq + g * kGroup, sizeof(word));
      const __m512i xv = _mm512_set1_epi32(word);
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xv, wv[v]);
    }
  }
  KVLOOM_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t left = columns - v * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512i comp = _mm512_maskz_loadu_epi32(mask, compensation + v * 16);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, w_scale + v * 16);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], comp));
      const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[r]));
      store_columns(y + r * ldy + v * 16, mask, _mm512_fmadd_ps(sums, s, b));
    }
  }
}

template <typename T>
using W8A8Kernel = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, const int32_t*,
                            const float*, const float*, T*, int64_t, int64_t);

template <typename T>
constexpr W8A8Kernel<T> kW8A8Kernels[kRowsW8A8 + 1] = {
    nullptr, &w8a8_kernel<1, T>, &w8a8_kernel<2, T>, &w8a8_kernel<3, T>, &w8a8_kernel<4, T>,
    &w8a8_kernel<5, T>, &w8a8_kernel<6, T>, &w8a8_kernel<7, T>, &w8a8_kernel<8, T>};
#elif defined(KVLOOM_QUANTIZE_AVX2)
// Without VNNI, AVX2's vpmaddubsw multiplies u8 by s8 into 16-bit pair sums that saturate past 32767, so
// u8 activations (q + 128) could overflow them. Here x's codes stay s8 and the weight's sign moves onto
// them (vpsignb), its magnitude being the u8 operand: every pair is at most 2 * 127 * 127 = 32258, exact;
// vpmaddwd by ones sums the pairs of each 4 k into an int32 lane, as vpdpbusd does in one instruction.
#define KVLOOM_W8A8_AVX2
constexpr int64_t kRowsW8A8Avx2 = 4;  // 4 rows x 16 columns: 8 int32 sums, 2 weight vectors and their magnitudes

inline __m256i dot_groups(__m256i acc, __m256i w_abs, __m256i w, __m256i x, __m256i ones) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)), ones));
}

using kvloom::avx2::broadcast_word;
using kvloom::avx2::load_columns;

// R rows of y for one panel, 16 columns at a time. xq: s8 rows of Kp = 4 * groups codes; the epilogue is
// w8a8_portable_panel's (the same int32 sums, the same fp32 operations).
template <int R, typename T>
inline void w8a8_avx2_kernel(const int8_t* xq, int64_t ldq, const float* x_scale, const int8_t* panel, int64_t groups,
                             const float* w_scale, const float* bias, T* y, int64_t ldy, int64_t columns) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c0 = 0; c0 < columns; c0 += 16) {
    __m256i acc[R][2];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* w = panel + c0 * kGroup;
    for (int64_t g = 0; g < groups; ++g, w += kGroupBytes) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast_word(xq + r * ldq + g * kGroup);
        acc[r][0] = dot_groups(acc[r][0], a0, w0, xv, ones);
        acc[r][1] = dot_groups(acc[r][1], a1, w1, xv, ones);
      }
    }
    KVLOOM_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int64_t c = c0 + 8 * h, count = std::min<int64_t>(8, columns - c);
      if (count <= 0) break;
      const __m256 ws = load_columns(w_scale + c, count);
      const __m256 b = bias ? load_columns(bias + c, count) : _mm256_setzero_ps();
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(x_scale[r]));
        const __m256 sums = _mm256_cvtepi32_ps(acc[r][h]);
        kvloom::avx2::store_columns(y + r * ldy + c, _mm256_fmadd_ps(sums, s, b), count);
      }
    }
  }
}

template <typename T>
using W8A8Avx2Kernel = void (*)(const int8_t*, int64_t, const float*, const int8_t*, int64_t, const float*,
                                const float*, T*, int64_t, int64_t);

template <typename T>
constexpr W8A8Avx2Kernel<T> kW8A8Avx2Kernels[kRowsW8A8Avx2 + 1] = {
    nullptr, &w8a8_avx2_kernel<1, T>, &w8a8_avx2_kernel<2, T>, &w8a8_avx2_kernel<3, T>, &w8a8_avx2_kernel<4, T>};
#endif

// The same sums by plain loops over the packed layout, and the same fp32 epilogue (bit for bit).
template <typename T>
void w8a8_portable_panel(const uint8_t* xq, int64_t ldq, const float* x_scale, const int8_t* panel, int64_t groups,
                         const int32_t* compensation, const float* w_scale, const float* bias, T* y, int64_t ldy,
                         int64_t rows, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    int32_t acc[kPanel] = {};
    const uint8_t* xr = xq + r * ldq;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* w = panel + g * kGroupBytes;
      for (int64_t c = 0; c < kPanel; ++c)
        for (int64_t i = 0; i < kGroup; ++i) acc[c] += int32_t(xr[g * kGroup + i]) * int32_t(w[c * kGroup + i]);
    }
    for (int64_t c = 0; c < columns; ++c) {
      const float sums = static_cast<float>(acc[c] - compensation[c]);
      y[r * ldy + c] = static_cast<T>(std::fma(sums, w_scale[c] * x_scale[r], bias ? bias[c] : 0.0f));
    }
  }
}

// With AMX-BF16 and bf16 activations, from kBf16MinRows rows the block-scaled weight is dequantized instead
// (amx_bf16.h): per panel and block, W[n, k] = q d in fp32 rounded to bf16 into B tiles, multiplied by the
// unquantized activations with fp32 sums over K (w8a8_blocks_dequantized_reference), not llama.cpp's product.
// On 2 cores of an AMX Xeon, SmolLM2's head (49,152 x 576, the default model's Q8_0 embedding; medians of 15, two
// runs): 2.65-2.72 vs 2.19-2.21 ms (VNNI) at 32 rows, 3.15-3.38 vs 2.62-2.65 at 40, 2.76-2.87 vs 3.02-3.11 at 48,
// 3.23-3.29 vs 3.90-4.02 at 64.
constexpr int64_t kBf16MinRows = 48;
// The per-row int8 weight (gemm_w8a8 and gemm_int8_weight_only) the same way, its codes exact in bf16 and its scale
// in the epilogue: int8_linear_reference's arithmetic (the weight-only product's). There W8A8 on VNNI (one scale per
// row and column, no per-block epilogue) keeps up longer: 30 SmolLM2 layers streaming from memory took 12.4 ms on the
// tiles against 9.9 for W8A8 at 16 rows, 18.8 against 18.1 at 64; on one hot weight the tiles were ahead from 128
// rows (3072 x 576: 0.25 against 0.31 ms, 576 x 1536: 0.16 against 0.26) to 2,048 (4.5 against 6.5, 2.1 against
// 4.1): the prefill's chunks.
constexpr int64_t kBf16RowsMinRows = 128;
constexpr int64_t kBf16UnitPanels = 2;  // 96 columns: 6 groups of 16

#if defined(KVLOOM_AMX_BF16)

// One panel's block b (its 8 groups of 4 k x 48 columns) dequantized to 3 B tiles (`out`, one per 16 columns,
// kvloom::amx::kTileWords apart). Blocks: codes stored as u8 q + 128 (the W8A8-on-blocks packing), times their
// block's scale (q d in fp32, rounded to bf16); else s8 codes as they are (exact in bf16: the per-row scale comes in
// the epilogue).
template <bool Blocks, typename S>
inline void dequantize_block_tiles(const uint8_t* panel, const S* scales, int64_t b, uint16_t* out) {
  using kvloom::amx::spread4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  KVLOOM_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    __m512 dq[4];
    if constexpr (Blocks) {
      const __m512 d = load_scales16(scales + b * kPanel + 16 * v);
      KVLOOM_UNROLL
      for (int i = 0; i < 4; ++i) dq[i] = spread4(d, i);
    }
    KVLOOM_UNROLL
    for (int j = 0; j < kGroupsPerBlock; ++j) {  // k = 4 j .. 4 j + 3: rows 2 j and 2 j + 1
      __m512i codes = _mm512_loadu_si512(panel + (b * kGroupsPerBlock + j) * kGroupBytes + 64 * v);
      if constexpr (Blocks) codes = _mm512_xor_si512(codes, flip);
      __m512 w[4];  // columns 4 i .. 4 i + 3, 4 k each
      KVLOOM_UNROLL
      for (int i = 0; i < 4; ++i) {
        w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, i)));
        if constexpr (Blocks) w[i] = _mm512_mul_ps(w[i], dq[i]);
      }
      kvloom::amx::store_pair_rows(out + v * kvloom::amx::kTileWords + 64 * j, kvloom::amx::bf16_pairs(w[0], w[1]),
                                   kvloom::amx::bf16_pairs(w[2], w[3]));
    }
  }
}

// The int8 weight (s8 codes, or Blocks: u8 q + 128 with block scales w_scale [panels][blocks][48]) dequantized into
// bf16 tiles, two panels (96 columns) a unit, times x; col_scale: the per-row weight's scales [N] (or null).
template <bool Blocks, typename S>
void int8_bf16_amx(c10::BFloat16* y, const c10::BFloat16* x, int64_t ldx, const uint8_t* packed,
                   const S* w_scale, const float* col_scale, const float* bias, const Shapes& s) {
  const int64_t blocks = s.K / kBlock, panel_size = s.groups * kGroupBytes, scales_size = Blocks ? blocks * kPanel : 0;
  auto dequantize = [&](int64_t unit, uint16_t* tiles) {
    const int64_t p0 = unit * kBf16UnitPanels, count = std::min(kBf16UnitPanels, s.panels - p0);
    const int64_t stride = count * kPanelVecs * kvloom::amx::kTileWords;
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < count; ++i)
        dequantize_block_tiles<Blocks>(packed + (p0 + i) * panel_size, Blocks ? w_scale + (p0 + i) * scales_size
                                                                              : nullptr,
                                       b, tiles + b * stride + i * kPanelVecs * kvloom::amx::kTileWords);
    return count * kPanelVecs;
  };
  auto prefetch = [&](int64_t unit) {
    const int64_t p0 = unit * kBf16UnitPanels, count = std::min(kBf16UnitPanels, s.panels - p0);
    kvloom::amx::prefetch_l2(packed + p0 * panel_size, count * panel_size);
    if constexpr (Blocks) kvloom::amx::prefetch_l2(w_scale + p0 * scales_size, count * scales_size * sizeof(S));
  };
  kvloom::amx::dequantized_product(y, s.N, x, ldx, s.M, s.K, s.N, kBf16UnitPanels * kPanel, col_scale, bias, dequantize,
                                   prefetch);
}

#endif

// Runs the product on AMX-BF16 tiles and returns true where bf16 x of these shapes takes them (from min_rows rows, K
// whole blocks of 32, the tiles allowed); else false, and the caller runs its own product.
template <bool Blocks, typename T, typename S = float>
bool ran_on_bf16_tiles(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed, const S* w_scale,
                       const float* bias, const Shapes& s, bool portable, bool bf16_tiles, int64_t min_rows) {
#if defined(KVLOOM_AMX_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (s.K % kBlock == 0 && kvloom::amx::takes_bf16_tiles(portable, bf16_tiles, s.M, min_rows)) {
      const auto* weight = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
      if constexpr (Blocks) {
        int8_bf16_amx<true, S>(y.data_ptr<T>(), x.data_ptr<T>(), x.stride(0), weight, w_scale, nullptr, bias, s);
      } else {
        int8_bf16_amx<false, S>(y.data_ptr<T>(), x.data_ptr<T>(), x.stride(0), weight, nullptr, w_scale, bias, s);
      }
      return true;
    }
  }
#endif
  return false;
}

template <typename T>
void w8a8_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed, const int32_t* compensation,
                const float* w_scale, const float* bias, const Shapes& s, bool portable, bool bf16_tiles) {
  if (ran_on_bf16_tiles<false, T>(y, x, packed, w_scale, bias, s, portable, bf16_tiles, kBf16RowsMinRows)) return;
  const int64_t Kp = s.groups * kGroup;
#if defined(KVLOOM_VNNI_DOT)
  const bool fast = !portable;
  const int32_t shift = kShift;  // u8 codes for vpdpbusd, the shift taken out by the compensation
  const int64_t step = kRowsW8A8;
#elif defined(KVLOOM_W8A8_AVX2)
  const bool fast = !portable;
  const int32_t shift = fast ? 0 : kShift;  // s8 codes: the AVX2 kernel needs no compensation
  const int64_t step = kRowsW8A8Avx2;
#else
  const bool fast = false;
  const int32_t shift = kShift;
  const int64_t step = kRowChunk;
#endif
  std::vector<uint8_t> xq(s.M * Kp);
  std::vector<float> x_scale(s.M);
  quantize_rows<T>(x, s, 0, shift, xq.data(), x_scale.data(), nullptr, portable);
  const auto* ws = packed.data_ptr<int8_t>();
  T* ys = y.data_ptr<T>();
  const int64_t panel_size = s.groups * kGroupBytes;
  for_each_panel(s, fast ? step : kRowChunk, [&](int64_t m, int64_t rows, int64_t panel, int64_t n0,
                                                 int64_t columns) {
    const int8_t* wp = ws + panel * panel_size;
    const float* bp = bias ? bias + n0 : nullptr;
#if defined(KVLOOM_VNNI_DOT)
    if (fast) {
      kW8A8Kernels<T>[rows](xq.data() + m * Kp, Kp, x_scale.data() + m, wp, s.groups, compensation + n0,
                            w_scale + n0, bp, ys + m * s.N + n0, s.N, columns);
      return;
    }
#elif defined(KVLOOM_W8A8_AVX2)
    if (fast) {
      kW8A8Avx2Kernels<T>[rows](reinterpret_cast<const int8_t*>(xq.data()) + m * Kp, Kp, x_scale.data() + m, wp,
                                s.groups, w_scale + n0, bp, ys + m * s.N + n0, s.N, columns);
      return;
    }
#endif
    w8a8_portable_panel(xq.data() + m * Kp, Kp, x_scale.data() + m, wp, s.groups, compensation + n0, w_scale + n0,
                        bp, ys + m * s.N + n0, s.N, rows, columns);
  });
}

// y = dequantized(W8A8 product) (+ bias). x: [M, K] float32 or bfloat16, rows contiguous; packed:
// pack_int8_weight's [N, K] layout; compensation: int32 [N]; scale, bias: float32 [N]; y: [M, N] in x's dtype.
void gemm_w8a8(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor compensation, at::Tensor scale,
               c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles) {
  const float* bs;
  const Shapes s = check_arguments("gemm_w8a8", y, x, packed, scale, false, bias, &bs);
  TORCH_CHECK(compensation.scalar_type() == at::kInt && compensation.is_contiguous() && compensation.numel() == s.N,
              "gemm_w8a8: compensation must be a contiguous int32 [N]");
  TORCH_CHECK(s.K <= kMaxW8A8K, "gemm_w8a8: K = ", s.K, " is more than the ", kMaxW8A8K,
              " whose int32 sums cannot overflow; use gemm_int8_weight_only");
  if (s.M == 0 || s.N == 0) return;
  dispatch_float(x, "gemm_w8a8", [&](auto tag) {
    using T = decltype(tag);
    w8a8_typed<T>(y, x, packed, compensation.data_ptr<int32_t>(), scale.data_ptr<float>(), bs, s, portable,
                  bf16_tiles);
  });
}

// ---- weight-only ----------------------------------------------------------------------------------
#if defined(KVLOOM_BF16_DOT)
// 32 int8 of the packed layout (8 columns x 4 k) as bf16, in the same order: exact conversions.
inline __m512bh widen_int8(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
}

inline __m512bh broadcast_group(const c10::BFloat16* x) {
  int64_t word;
  std::memcpy(&word, x, sizeof(word));
  return (__m512bh)_mm512_set1_epi64(word);
}

// R rows of y for one panel. x rows (and, with kSplit, their lo parts) are bf16 of Kp = 4 * groups
// values. acc[r][2v + h], lane 2c + p: column 16v + 8h + c, k pair p of each group.
template <int R, bool kSplit, typename T>
inline void weight_only_kernel(const c10::BFloat16* x_hi, const c10::BFloat16* x_lo, int64_t ldx,
                               const int8_t* panel, int64_t groups, const float* w_scale, const float* bias, T* y,
                               int64_t ldy, int64_t columns) {
  __m512 acc[R][2 * kPanelVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < 2 * kPanelVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) {
      const int8_t* w = panel + g * kGroupBytes + v * 64;
      const __m512bh w0 = widen_int8(w), w1 = widen_int8(w + 32);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = broadcast_group(x_hi + r * ldx + g * kGroup);
        acc[r][2 * v] = _mm512_dpbf16_ps(acc[r][2 * v], xv, w0);
        acc[r][2 * v + 1] = _mm512_dpbf16_ps(acc[r][2 * v + 1], xv, w1);
        if constexpr (kSplit) {
          const __m512bh xl = broadcast_group(x_lo + r * ldx + g * kGroup);
          acc[r][2 * v] = _mm512_dpbf16_ps(acc[r][2 * v], xl, w0);
          acc[r][2 * v + 1] = _mm512_dpbf16_ps(acc[r][2 * v + 1], xl, w1);
        }
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  KVLOOM_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t left = columns - v * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, w_scale + v * 16);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 a0 = acc[r][2 * v], a1 = acc[r][2 * v + 1];
      const __m512 sums = _mm512_add_ps(_mm512_permutex2var_ps(a0, even, a1), _mm512_permutex2var_ps(a0, odd, a1));
      store_columns(y + r * ldy + v * 16, mask, _mm512_fmadd_ps(sums, ws, b));
    }
  }
}

template <typename T>
using WeightOnlyKernel = void (*)(const c10::BFloat16*, const c10::BFloat16*, int64_t, const int8_t*, int64_t,
                                  const float*, const float*, T*, int64_t, int64_t);

template <bool kSplit, typename T>
constexpr WeightOnlyKernel<T> kWeightOnlyKernels[kRowsWeightOnly + 1] = {
    nullptr, &weight_only_kernel<1, kSplit, T>, &weight_only_kernel<2, kSplit, T>,
    &weight_only_kernel<3, kSplit, T>, &weight_only_kernel<4, kSplit, T>};
#elif defined(__AVX2__) && defined(__FMA__)
#define KVLOOM_INT8_WEIGHT_ONLY_AVX2
constexpr int64_t kRowsWeightOnlyAvx2 = 2;  // 2 x 4 sums, a weight vector and 2 x vectors in 16 registers

// R rows of y for one panel, 8 columns at a time. x: fp32 rows of Kp = 4 * groups values (zero past K).
// 8 bytes of the packed layout (2 columns x 4 k) widen to one fp32 vector; a broadcast of the group's 4 x
// values multiplies it, so acc[r][i], lane 4h + j, sums column 2i + h's products with k = 4g + j; the 4 lanes
// of each column are added at the end.
template <int R, typename T>
inline void weight_only_avx2_kernel(const float* x, int64_t ldx, const int8_t* panel, int64_t groups,
                                    const float* w_scale, const float* bias, T* y, int64_t ldy, int64_t columns) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t c0 = 0; c0 < columns; c0 += 8) {
    __m256 acc[R][4];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r)
      KVLOOM_UNROLL
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    const int8_t* w = panel + c0 * kGroup;
    for (int64_t g = 0; g < groups; ++g, w += kGroupBytes) {
      __m256 xv[R];
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x + r * ldx + g * kGroup));
      KVLOOM_UNROLL
      for (int i = 0; i < 4; ++i) {
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * i))));
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(xv[r], wv, acc[r][i]);
      }
    }
    const int64_t count = std::min<int64_t>(8, columns - c0);
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      // hadd pairs lanes within 128-bit halves: (c0 c2 c4 c6 | c1 c3 c5 c7), then back in column order.
      const __m256 h01 = _mm256_hadd_ps(acc[r][0], acc[r][1]), h23 = _mm256_hadd_ps(acc[r][2], acc[r][3]);
      const __m256 sums = _mm256_permutevar8x32_ps(_mm256_hadd_ps(h01, h23), order);
      alignas(32) float out[8];
      _mm256_store_ps(out, sums);
      for (int64_t c = 0; c < count; ++c)
        y[r * ldy + c0 + c] = static_cast<T>(std::fma(out[c], w_scale[c0 + c], bias ? bias[c0 + c] : 0.0f));
    }
  }
}

template <typename T>
using WeightOnlyAvx2Kernel = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, const float*, T*,
                                      int64_t, int64_t);
template <typename T>
constexpr WeightOnlyAvx2Kernel<T> kWeightOnlyAvx2Kernels[kRowsWeightOnlyAvx2 + 1] = {
    nullptr, &weight_only_avx2_kernel<1, T>, &weight_only_avx2_kernel<2, T>};
#endif

// Plain loops: fp32 products and sums (exact products for bf16 x), the same epilogue.
template <typename T>
void weight_only_portable_panel(const T* x, int64_t ldx, int64_t K, const int8_t* panel, const float* w_scale,
                                const float* bias, T* y, int64_t ldy, int64_t rows, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    const T* xr = x + r * ldx;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = static_cast<float>(xr[k]);
      const int8_t* w = panel + (k / kGroup) * kGroupBytes + k % kGroup;
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += xv * static_cast<float>(w[c * kGroup]);
    }
    for (int64_t c = 0; c < columns; ++c)
      y[r * ldy + c] = static_cast<T>(std::fma(acc[c], w_scale[c], bias ? bias[c] : 0.0f));
  }
}

template <typename T>
void weight_only_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed, const float* w_scale,
                       const float* bias, const Shapes& s, bool portable, bool bf16_tiles) {
  if (ran_on_bf16_tiles<false, T>(y, x, packed, w_scale, bias, s, portable, bf16_tiles, kBf16RowsMinRows)) return;
  const auto* ws = packed.data_ptr<int8_t>();
  const T* xs = x.data_ptr<T>();
  T* ys = y.data_ptr<T>();
  const int64_t panel_size = s.groups * kGroupBytes;
#if defined(KVLOOM_BF16_DOT)
  const int64_t Kp = s.groups * kGroup;
  constexpr bool kSplit = std::is_same_v<T, float>;
  // The kernel reads whole groups of 4 bf16: x itself when it is bf16 and K a multiple of 4, else
  // a zero-padded copy (for fp32 x: its bf16 hi part, and the lo part x - hi).
  const bool copy = kSplit || s.K % kGroup != 0;
  std::vector<c10::BFloat16> hi(copy && !portable ? s.M * Kp : 0), lo(kSplit && !portable ? s.M * Kp : 0);
  if (copy && !portable) {
    parallel_for(0, s.M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const T* xr = xs + m * x.stride(0);
        for (int64_t k = 0; k < Kp; k += 16) {
          const __mmask16 mask = lanes(Kp - k);
          const __m512 value = load_lanes(xr + k, k < s.K ? lanes(s.K - k) : __mmask16(0));  // zeros past K
          const __m256bh h = _mm512_cvtneps_pbh(value);
          _mm256_mask_storeu_epi16(hi.data() + m * Kp + k, mask, (__m256i)h);
          if constexpr (kSplit) {
            const __m512 rest = _mm512_sub_ps(value, _mm512_cvtpbh_ps(h));  // exact in fp32
            _mm256_mask_storeu_epi16(lo.data() + m * Kp + k, mask, (__m256i)_mm512_cvtneps_pbh(rest));
          }
        }
      }
    });
  }
  const auto* x_hi = copy ? hi.data() : reinterpret_cast<const c10::BFloat16*>(xs);
  const int64_t ld_hi = copy ? Kp : x.stride(0);
  const bool fast = !portable;
  const int64_t step = kRowsWeightOnly;
#elif defined(KVLOOM_INT8_WEIGHT_ONLY_AVX2)
  // The kernel reads whole groups of 4 fp32: x itself when it is fp32 and K a multiple of 4, else a widened,
  // zero-padded copy.
  const int64_t Kp = s.groups * kGroup;
  const bool fast = !portable;
  const bool copy = fast && (!std::is_same_v<T, float> || s.K % kGroup != 0);
  std::vector<float> widened(copy ? s.M * Kp : 0);
  if (copy) {
    parallel_for(0, s.M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const T* xr = xs + m * x.stride(0);
        float* row = widened.data() + m * Kp;
        for (int64_t k = 0; k < s.K; ++k) row[k] = static_cast<float>(xr[k]);
        for (int64_t k = s.K; k < Kp; ++k) row[k] = 0.0f;
      }
    });
  }
  const float* x_wide = copy ? widened.data() : reinterpret_cast<const float*>(xs);
  const int64_t ld_wide = copy ? Kp : x.stride(0);
  const int64_t step = kRowsWeightOnlyAvx2;
#else
  const bool fast = false;
  const int64_t step = kRowChunk;
  (void)portable;
#endif
  for_each_panel(s, fast ? step : kRowChunk, [&](int64_t m, int64_t rows, int64_t panel, int64_t n0,
                                                 int64_t columns) {
    const int8_t* wp = ws + panel * panel_size;
    const float* bp = bias ? bias + n0 : nullptr;
#if defined(KVLOOM_BF16_DOT)
    if (fast) {
      kWeightOnlyKernels<kSplit, T>[rows](x_hi + m * ld_hi, kSplit ? lo.data() + m * Kp : nullptr, ld_hi, wp,
                                          s.groups, w_scale + n0, bp, ys + m * s.N + n0, s.N, columns);
      return;
    }
#elif defined(KVLOOM_INT8_WEIGHT_ONLY_AVX2)
    if (fast) {
      kWeightOnlyAvx2Kernels<T>[rows](x_wide + m * ld_wide, ld_wide, wp, s.groups, w_scale + n0, bp,
                                      ys + m * s.N + n0, s.N, columns);
      return;
    }
#endif
    weight_only_portable_panel(xs + m * x.stride(0), x.stride(0), s.K, wp, w_scale + n0, bp, ys + m * s.N + n0, s.N,
                               rows, columns);
  });
}

// y = (x q^T) * scale (+ bias), summed in fp32. Arguments as gemm_w8a8's, without the compensation.
void gemm_int8_weight_only(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale,
                           c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles) {
  const float* bs;
  const Shapes s = check_arguments("gemm_int8_weight_only", y, x, packed, scale, false, bias, &bs);
  if (s.M == 0 || s.N == 0) return;
  dispatch_float(x, "gemm_int8_weight_only", [&](auto tag) {
    using T = decltype(tag);
    weight_only_typed<T>(y, x, packed, scale.data_ptr<float>(), bs, s, portable, bf16_tiles);
  });
}

// ---- W8A8 on blocks -------------------------------------------------------------------------------
// xq: s8 rows of K codes; x_scale, x_sum: the rows' block scales and sums of codes (ldxs = blocks a
// row); panel: the weight as u8 (q + 128) in pack_int8_weight's layout; w_scale: the panel's
// [blocks][48] (zero past the real columns), S: float or c10::Half.
#if defined(KVLOOM_VNNI_DOT)
template <int R, typename T, typename S>
inline void w8a8_blocks_kernel(const int8_t* xq, int64_t ldq, const float* x_scale, const int32_t* x_sum,
                               int64_t ldxs, const uint8_t* panel, int64_t blocks, const S* w_scale,
                               const float* bias, T* y, int64_t ldy, int64_t columns) {
  __m512 acc[R][kPanelVecs];
  KVLOOM_UNROLL
  for (int r = 0; r < R; ++r)
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i sums[R][kPanelVecs];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-kShift * x_sum[r * ldxs + b]);  // takes the weight's shift out
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) sums[r][v] = start;
    }
    const uint8_t* wb = panel + b * kGroupsPerBlock * kGroupBytes;
    KVLOOM_UNROLL
    for (int64_t j = 0; j < kGroupsPerBlock; ++j) {
      __m512i wv[kPanelVecs];
      KVLOOM_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) wv[v] = _mm512_loadu_si512(wb + j * kGroupBytes + v * 64);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * ldq + (b * kGroupsPerBlock + j) * kGroup, sizeof(word));
        const __m512i xv = _mm512_set1_epi32(word);
        KVLOOM_UNROLL
        for (int v = 0; v < kPanelVecs; ++v) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], wv[v], xv);
      }
    }
    KVLOOM_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) {
      const __m512 ws = load_scales16(w_scale + b * kPanel + v * 16);
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[r * ldxs + b]));
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][v]), s, acc[r][v]);
      }
    }
  }
  KVLOOM_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t left = columns - v * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) store_columns(y + r * ldy + v * 16, mask, _mm512_add_ps(acc[r][v], bv));
  }
}

template <typename T, typename S>
using W8A8BlocksKernel = void (*)(const int8_t*, int64_t, const float*, const int32_t*, int64_t, const uint8_t*,
                                  int64_t, const S*, const float*, T*, int64_t, int64_t);

template <typename T, typename S>
constexpr W8A8BlocksKernel<T, S> kW8A8BlocksKernels[kRowsBlocks + 1] = {
    nullptr, &w8a8_blocks_kernel<1, T, S>, &w8a8_blocks_kernel<2, T, S>, &w8a8_blocks_kernel<3, T, S>,
    &w8a8_blocks_kernel<4, T, S>};
#elif defined(KVLOOM_W8A8_AVX2)
constexpr int64_t kRowsBlocksAvx2 = 2;  // 2 rows x 16 columns: 4 int32 and 4 fp32 sums

// R rows of y for one panel, 16 columns at a time, as w8a8_avx2_kernel: the weight's u8 bytes (q + 128)
// flipped back to q, so each block's int32 sums start from zero; then w8a8_blocks_portable_panel's fp32 steps.
template <int R, typename T, typename S>
inline void w8a8_blocks_avx2_kernel(const int8_t* xq, int64_t ldq, const float* x_scale, int64_t ldxs,
                                    const uint8_t* panel, int64_t blocks, const S* w_scale, const float* bias,
                                    T* y, int64_t ldy, int64_t columns) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t c0 = 0; c0 < columns; c0 += 16) {
    __m256 acc[R][2];
    KVLOOM_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i sums[R][2];
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
      const uint8_t* w = panel + b * kGroupsPerBlock * kGroupBytes + c0 * kGroup;
      KVLOOM_UNROLL
      for (int64_t j = 0; j < kGroupsPerBlock; ++j, w += kGroupBytes) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)), flip);
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m256i xv = broadcast_word(xq + r * ldq + (b * kGroupsPerBlock + j) * kGroup);
          sums[r][0] = dot_groups(sums[r][0], a0, w0, xv, ones);
          sums[r][1] = dot_groups(sums[r][1], a1, w1, xv, ones);
        }
      }
      KVLOOM_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __m256 ws = load_scales8(w_scale + b * kPanel + c0 + 8 * h);  // zero past N within the panel
        KVLOOM_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(x_scale[r * ldxs + b]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), scale, acc[r][h]);
        }
      }
    }
    KVLOOM_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int64_t c = c0 + 8 * h, count = std::min<int64_t>(8, columns - c);
      if (count <= 0) break;
      const __m256 bv = bias ? load_columns(bias + c, count) : _mm256_setzero_ps();
      KVLOOM_UNROLL
      for (int r = 0; r < R; ++r)
        kvloom::avx2::store_columns(y + r * ldy + c, _mm256_add_ps(acc[r][h], bv), count);
    }
  }
}

template <typename T, typename S>
using W8A8BlocksAvx2Kernel = void (*)(const int8_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t,
                                      const S*, const float*, T*, int64_t, int64_t);

template <typename T, typename S>
constexpr W8A8BlocksAvx2Kernel<T, S> kW8A8BlocksAvx2Kernels[kRowsBlocksAvx2 + 1] = {
    nullptr, &w8a8_blocks_avx2_kernel<1, T, S>, &w8a8_blocks_avx2_kernel<2, T, S>};
#endif

// The same integers and the same fp32 operations in the same order (bit for bit).
template <typename T, typename S>
void w8a8_blocks_portable_panel(const int8_t* xq, int64_t ldq, const float* x_scale, const int32_t* x_sum,
                                int64_t ldxs, const uint8_t* panel, int64_t blocks, const S* w_scale,
                                const float* bias, T* y, int64_t ldy, int64_t rows, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    const int8_t* xr = xq + r * ldq;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sums[kPanel];
      std::fill(sums, sums + kPanel, -kShift * x_sum[r * ldxs + b]);
      for (int64_t g = b * kGroupsPerBlock; g < (b + 1) * kGroupsPerBlock; ++g) {
        const uint8_t* w = panel + g * kGroupBytes;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t i = 0; i < kGroup; ++i) sums[c] += int32_t(w[c * kGroup + i]) * int32_t(xr[g * kGroup + i]);
      }
      for (int64_t c = 0; c < kPanel; ++c) {
        const float s = scale_value(w_scale[b * kPanel + c]) * x_scale[r * ldxs + b];
        acc[c] = std::fma(static_cast<float>(sums[c]), s, acc[c]);
      }
    }
    for (int64_t c = 0; c < columns; ++c) y[r * ldy + c] = static_cast<T>(acc[c] + (bias ? bias[c] : 0.0f));
  }
}

template <typename T, typename S>
void w8a8_blocks_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& packed, const S* w_scale,
                       const float* bias, const Shapes& s, bool portable, bool bf16_tiles) {
  if (ran_on_bf16_tiles<true, T, S>(y, x, packed, w_scale, bias, s, portable, bf16_tiles, kBf16MinRows)) return;
  const int64_t blocks = s.K / kBlock;
  std::vector<int8_t> xq(s.M * s.K);
  std::vector<float> x_scale(s.M * blocks);
  std::vector<int32_t> x_sum(s.M * blocks);
  quantize_rows<T>(x, s, kBlock, 0, reinterpret_cast<uint8_t*>(xq.data()), x_scale.data(), x_sum.data(), portable);
  const auto* ws = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  T* ys = y.data_ptr<T>();
  const int64_t panel_size = s.groups * kGroupBytes, scales_size = blocks * kPanel;
#if defined(KVLOOM_VNNI_DOT)
  const bool fast = !portable;
  const int64_t step = kRowsBlocks;
#elif defined(KVLOOM_W8A8_AVX2)
  const bool fast = !portable;
  const int64_t step = kRowsBlocksAvx2;
#else
  const bool fast = false;
  const int64_t step = kRowChunk;
#endif
  for_each_panel(s, fast ? step : kRowChunk, [&](int64_t m, int64_t rows, int64_t panel, int64_t n0,
                                                 int64_t columns) {
    const uint8_t* wp = ws + panel * panel_size;
    const S* sp = w_scale + panel * scales_size;
    const float* bp = bias ? bias + n0 : nullptr;
#if defined(KVLOOM_VNNI_DOT)
    if (fast) {
      kW8A8BlocksKernels<T, S>[rows](xq.data() + m * s.K, s.K, x_scale.data() + m * blocks, x_sum.data() + m * blocks,
                                  blocks, wp, blocks, sp, bp, ys + m * s.N + n0, s.N, columns);
      return;
    }
#elif defined(KVLOOM_W8A8_AVX2)
    if (fast) {
      kW8A8BlocksAvx2Kernels<T, S>[rows](xq.data() + m * s.K, s.K, x_scale.data() + m * blocks, blocks, wp, blocks, sp,
                                      bp, ys + m * s.N + n0, s.N, columns);
      return;
    }
#endif
    w8a8_blocks_portable_panel(xq.data() + m * s.K, s.K, x_scale.data() + m * blocks, x_sum.data() + m * blocks,
                               blocks, wp, blocks, sp, bp, ys + m * s.N + n0, s.N, rows, columns);
  });
}

// y = the W8A8 product on blocks (+ bias). x: [M, K] float32 or bfloat16 (K a multiple of 32), rows
// contiguous; packed: pack_int8_weight's [N, K] layout of q + 128 (int8 storage of the u8 bits);
// scale: float32 or float16 block scales packed [panels, K / 32, 48]; bias: float32 [N]; y: [M, N] in x's dtype.
void gemm_w8a8_blocks(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                      bool portable, bool bf16_tiles) {
  const float* bs;
  const Shapes s = check_arguments("gemm_w8a8_blocks", y, x, packed, scale, true, bias, &bs);
  if (s.M == 0 || s.N == 0) return;
  dispatch_float(x, "gemm_w8a8_blocks", [&](auto tag) {
    using T = decltype(tag);
    if (scale.scalar_type() == at::kHalf) {
      w8a8_blocks_typed<T>(y, x, packed, scale.data_ptr<c10::Half>(), bs, s, portable, bf16_tiles);
    } else {
      w8a8_blocks_typed<T>(y, x, packed, scale.data_ptr<float>(), bs, s, portable, bf16_tiles);
    }
  });
}

// Which fast kernels this build holds: bit 0 the W8A8 ones, per token and on blocks (AVX512-VNNI, or AVX2),
// bit 1 the weight-only one (AVX512-BF16, or AVX2 + FMA). The ops run on plain loops wherever a bit is missing.
int64_t int8_gemm_kernels() {
  int64_t flags = 0;
#if defined(KVLOOM_VNNI_DOT) || defined(KVLOOM_W8A8_AVX2)
  flags |= 1;
#endif
#if defined(KVLOOM_BF16_DOT) || defined(KVLOOM_INT8_WEIGHT_ONLY_AVX2)
  flags |= 2;
#endif
  return flags;
}

// From how many rows bf16 activations take the dequantizing AMX-BF16 product on blocks (with bf16_tiles); 0: never
// (the build or this process has no AMX-BF16 tiles).
int64_t w8a8_blocks_bf16_tiles_min_rows() { return kvloom::amx::bf16_tiles_from(kBf16MinRows); }

// The same for the per-row int8 weight (gemm_w8a8, gemm_int8_weight_only; K a multiple of 32).
int64_t int8_rows_bf16_tiles_min_rows() { return kvloom::amx::bf16_tiles_from(kBf16RowsMinRows); }

// ---- packing ---------------------------------------------------------------------------------------------------

// q int8 [N, K] (rows contiguous, any stride apart) -> pack_int8_weight's panels [ceil(N / 48), ceil(K / 4), 48, 4]
// (zero past N and K), each byte XOR-ed with `flip` (0x80: q + 128 as u8, the blocks product's weight): one pass,
// parallel over panels, where torch's pad, permute and XOR made three copies.
at::Tensor pack_int8_panels(at::Tensor q, bool flip) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && (q.size(0) <= 1 || q.stride(1) == 1) &&
                  q.device().is_cpu(),
              "pack_int8_panels: q must be an int8 [N, K] CPU tensor with contiguous rows, got ", q.sizes(), " ",
              q.scalar_type());
  const int64_t N = q.size(0), K = q.size(1), panels = (N + kPanel - 1) / kPanel, groups = (K + kGroup - 1) / kGroup;
  at::Tensor out = at::empty({panels, groups, kPanel, kGroup}, q.options());
  if (out.numel() == 0) return out;
  const int8_t* src = q.data_ptr<int8_t>();
  const int64_t ld = q.stride(0);
  const uint8_t mask = flip ? 0x80 : 0x00;
  const uint32_t word_mask = mask * 0x01010101u;
  auto* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  const int64_t whole = K / kGroup;  // groups of 4 inputs all inside K
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      // Written in order, a group of 4 inputs of the 48 columns at a time (each row read 4 bytes at a time: 48
      // streams the prefetchers follow).
      const int8_t* rows[kPanel] = {};
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) rows[c] = src + (p * kPanel + c) * ld;
      uint8_t* out_group = dst + p * groups * kPanel * kGroup;
      for (int64_t g = 0; g < groups; ++g, out_group += kPanel * kGroup) {
        for (int64_t c = 0; c < kPanel; ++c) {
          uint32_t word = 0;
          if (rows[c] != nullptr && g < whole) {
            std::memcpy(&word, rows[c] + g * kGroup, kGroup);
          } else if (rows[c] != nullptr) {
            for (int64_t i = 0; g * kGroup + i < K; ++i)
              word |= uint32_t{static_cast<uint8_t>(rows[c][g * kGroup + i])} << (8 * i);
          }
          word ^= word_mask;
          std::memcpy(out_group + c * kGroup, &word, kGroup);
        }
      }
    }
  });
  return out;
}

// A GGUF Q8_0 block as stored: fp16 d, then 32 int8 codes.
constexpr int64_t kQ8_0Bytes = 2 + kBlock;

// The file's Q8_0 bytes of a weight's parts (each uint8 [rows, K / 32 * 34], rows contiguous, any stride apart: the
// shards of a fused projection, in turn) -> PackedInt8BlocksWeight's panels in one pass, parallel over panels:
// codes [ceil(N / 48), K / 4, 48, 4] as q + 128 in u8 (zero past N, so 0x80), scales fp16 [ceil(N / 48), K / 32, 48]
// (zero past N). What decoding the blocks (gguf.q8_0_blocks), joining the shards and pack_int8_panels(flip) give,
// without those copies.
void pack_q8_0_parts(at::Tensor codes, at::Tensor scales, at::TensorList parts, int64_t in_features) {
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0,
              "pack_q8_0_parts: in_features must be a positive multiple of ", kBlock, ", got ", in_features);
  const int64_t blocks = in_features / kBlock;
  std::vector<const uint8_t*> rows = kvloom::part_rows(parts, blocks * kQ8_0Bytes, in_features, "pack_q8_0_parts");
  const int64_t count = static_cast<int64_t>(rows.size()), panels = (count + kPanel - 1) / kPanel;
  const int64_t code_count = panels * in_features * kPanel, scale_count = panels * blocks * kPanel;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.numel() == code_count,
              "pack_q8_0_parts: codes must be contiguous int8 of ", code_count, " values, got ", codes.numel(), " ",
              codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == scale_count,
              "pack_q8_0_parts: scales must be contiguous float16 of ", scale_count, " values, got ", scales.numel(),
              " ", scales.scalar_type());
  rows.resize(panels * kPanel, nullptr);
  auto* code_out = reinterpret_cast<uint8_t*>(codes.data_ptr<int8_t>());
  auto* scale_out = reinterpret_cast<uint16_t*>(scales.data_ptr<c10::Half>());
  const uint8_t* const* table = rows.data();
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* const* panel = table + p * kPanel;
      for (int64_t b = 0; b < blocks; ++b) {
        // A block of the 48 columns: its 8 groups of 4 inputs, 48 words each, and the 48 scales, written in order.
        uint8_t* out = code_out + (p * blocks + b) * kGroupsPerBlock * kGroupBytes;
        uint16_t* d = scale_out + (p * blocks + b) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) {
          uint16_t scale = 0;
          uint32_t words[kGroupsPerBlock];
          if (panel[c] != nullptr) {
            const uint8_t* block = panel[c] + b * kQ8_0Bytes;
            std::memcpy(&scale, block, 2);
            std::memcpy(words, block + 2, kBlock);
          } else {
            std::memset(words, 0, sizeof(words));
          }
          d[c] = scale;
          for (int64_t g = 0; g < kGroupsPerBlock; ++g) {
            const uint32_t word = words[g] ^ 0x80808080u;
            std::memcpy(out + g * kGroupBytes + c * kGroup, &word, kGroup);
          }
        }
      }
    }
  });
}

}  // namespace

namespace kvloom::kernels {
void quantize_blocks_s8(const at::Tensor& x, int8_t* q, float* scales, int32_t* code_sums, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kBlock == 0,
              "quantize_blocks_s8: x must be [M, K] with contiguous rows and K a multiple of ", kBlock);
  const Shapes s{x.size(0), x.size(1), 0, x.size(1) / kGroup, 0};
  dispatch_float(x, "quantize_blocks_s8", [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(x, s, kBlock, 0, reinterpret_cast<uint8_t*>(q), scales, code_sums, portable);
  });
}
void gemm_w8a8(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor compensation, at::Tensor scale,
               c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles) {
  ::gemm_w8a8(y, x, packed, compensation, scale, bias, portable, bf16_tiles);
}
void gemm_int8_weight_only(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale,
                           c10::optional<at::Tensor> bias, bool portable, bool bf16_tiles) {
  ::gemm_int8_weight_only(y, x, packed, scale, bias, portable, bf16_tiles);
}
void gemm_w8a8_blocks(at::Tensor y, at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                      bool portable, bool bf16_tiles) {
  ::gemm_w8a8_blocks(y, x, packed, scale, bias, portable, bf16_tiles);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gemm_w8a8(Tensor(a!) y, Tensor x, Tensor packed, Tensor compensation, Tensor scale, Tensor? bias, "
        "bool portable=False, bool bf16_tiles=True) -> ()");
  m.def("gemm_int8_weight_only(Tensor(a!) y, Tensor x, Tensor packed, Tensor scale, Tensor? bias, "
        "bool portable=False, bool bf16_tiles=True) -> ()");
  m.def("gemm_w8a8_blocks(Tensor(a!) y, Tensor x, Tensor packed, Tensor scale, Tensor? bias, bool portable=False, "
        "bool bf16_tiles=True) -> ()");
  m.def("w8a8_blocks_bf16_tiles_min_rows() -> int", &w8a8_blocks_bf16_tiles_min_rows);
  m.def("int8_rows_bf16_tiles_min_rows() -> int", &int8_rows_bf16_tiles_min_rows);
  m.def("int8_gemm_kernels() -> int", &int8_gemm_kernels);
  m.def("pack_int8_panels(Tensor q, bool flip=False) -> Tensor");
  m.def("pack_q8_0_parts(Tensor(a!) codes, Tensor(b!) scales, Tensor[] parts, int in_features) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gemm_w8a8", &gemm_w8a8);
  m.impl("gemm_int8_weight_only", &gemm_int8_weight_only);
  m.impl("gemm_w8a8_blocks", &gemm_w8a8_blocks);
  m.impl("pack_int8_panels", &pack_int8_panels);
  m.impl("pack_q8_0_parts", &pack_q8_0_parts);
}
