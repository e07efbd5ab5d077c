// Fused elementwise ops for the CPU: each is one pass over its rows instead of the 5-10 small
// torch ops (and their dispatch overhead) that the plain-torch references take. Everything is
// computed in fp32, a vector at a time (at::vec, for the ISA this file is compiled for), and rounded
// once to the tensor's dtype; the references in kvloom/layers/ say what each op means, and tests
// compare the two.

#include "cpu_capability.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

using kvloom::parallel_for;

template <typename T, typename F>
void dispatch(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    case at::kHalf: f(c10::Half()); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// kVec values of T at a time, computed on in fp32. narrow() rounds each value as T(float) does
// (to nearest even; only a NaN's bit pattern may differ) into a Packed, widen() converts back
// exactly: store(p, narrow(v)) is what `p[k] = T(v[k])` stores, widen(narrow(v)) is `float(T(v))`.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using Packed = Vec;
  static Vec load(const float* p) { return Vec::loadu(p); }
  static Packed narrow(const Vec& v) { return v; }
  static Vec widen(const Packed& v) { return v; }
  static void store(float* p, const Packed& v) { v.store(p); }
};

template <typename T>  // c10::BFloat16 or c10::Half
struct Lanes16 {
  static constexpr bool kBF16 = std::is_same_v<T, c10::BFloat16>;
#if defined(CPU_CAPABILITY_AVX512)
  using Packed = __m256i;
  static Packed narrow(const Vec& v) {
    if constexpr (kBF16) {
#if defined(KVLOOM_BF16_DOT)
      // vcvtneps2bf16 rounds to nearest even, as T(float) does, in one instruction; but it flushes
      // denormals to zero, so a vector holding one takes the exact integer path.
      if (C10_LIKELY(!_mm512_fpclass_ps_mask(__m512(v), 0x20))) return (__m256i)_mm512_cvtneps_pbh(__m512(v));
#endif
      return at::vec::cvtfp32_bf16(__m512(v));
    } else {
      return at::vec::cvtfp32_fp16(__m512(v));
    }
  }
  static Vec widen(const Packed& b) {
    __m512 v;
    if constexpr (kBF16) at::vec::cvtbf16_fp32(b, v);
    else at::vec::cvtfp16_fp32(b, v);
    return v;
  }
  static Packed load_packed(const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(T* p, const Packed& b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
#elif defined(CPU_CAPABILITY_AVX2)
  using Packed = __m128i;
  static Packed narrow(const Vec& v) {
    if constexpr (kBF16) return at::vec::cvtfp32_bf16(__m256(v));
    else return at::vec::cvtfp32_fp16(__m256(v));
  }
  static Vec widen(const Packed& b) {
    __m256 v;
    if constexpr (kBF16) at::vec::cvtbf16_fp32(b, v);
    else at::vec::cvtfp16_fp32(b, v);
    return v;
  }
  static Packed load_packed(const T* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static void store(T* p, const Packed& b) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b); }
#else  // no SIMD conversions: c10's scalar ones
  struct Packed {
    T v[kVec];
  };
  static Packed narrow(const Vec& v) {
    float f[kVec];
    v.store(f);
    Packed b;
    for (int64_t k = 0; k < kVec; ++k) b.v[k] = T(f[k]);
    return b;
  }
  static Vec widen(const Packed& b) {
    float f[kVec];
    for (int64_t k = 0; k < kVec; ++k) f[k] = float(b.v[k]);
    return Vec::loadu(f);
  }
  static Packed load_packed(const T* p) {
    Packed b;
    std::memcpy(b.v, p, sizeof(b.v));
    return b;
  }
  static void store(T* p, const Packed& b) { std::memcpy(p, b.v, sizeof(b.v)); }
#endif
  static Vec load(const T* p) { return widen(load_packed(p)); }
};

template <>
struct Lanes<c10::BFloat16> : Lanes16<c10::BFloat16> {};
template <>
struct Lanes<c10::Half> : Lanes16<c10::Half> {};

inline float sum_lanes(const Vec& v) {
  float f[kVec];
  v.store(f);
  float sum = 0.f;
  for (int64_t k = 0; k < kVec; ++k) sum += f[k];
  return sum;
}

// These ops are small (a few us at decode batch sizes), and handing half of one to a second thread
// costs about 1 us: rows are split between threads only when each gets at least min_elems / 2
// values (a crossover measured on a Zen 4 core; argmax's rows are always big enough).
inline int64_t grain_rows(int64_t row_elems, int64_t min_elems) {
  return std::max<int64_t>(1, min_elems / std::max<int64_t>(1, row_elems));
}

// Sum of the squares of hidden values (fp32 accumulation in kVec * 2 lanes, then the scalar tail).
// fused_add_rms_norm's first pass also stores T(x + residual) into the residual, and squares that.
template <typename T, bool kAdd>
float rms_first_pass(const T* xr, T* rr, int64_t hidden) {
  using L = Lanes<T>;
  auto value = [&](int64_t i) {
    if constexpr (kAdd) {
      const auto sum = L::narrow(L::load(xr + i) + L::load(rr + i));  // rounded as torch's add rounds
      L::store(rr + i, sum);
      return L::widen(sum);
    } else {
      return L::load(xr + i);
    }
  };
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kVec <= hidden; i += 2 * kVec) {
    const Vec v0 = value(i), v1 = value(i + kVec);
    acc0 = at::vec::fmadd(v0, v0, acc0);
    acc1 = at::vec::fmadd(v1, v1, acc1);
  }
  for (; i + kVec <= hidden; i += kVec) {
    const Vec v = value(i);
    acc0 = at::vec::fmadd(v, v, acc0);
  }
  float sum = sum_lanes(acc0 + acc1);
  for (; i < hidden; ++i) {
    float v;
    if constexpr (kAdd) {
      const T t = T(float(xr[i]) + float(rr[i]));
      rr[i] = t;
      v = float(t);
    } else {
      v = float(xr[i]);
    }
    sum += v * v;
  }
  return sum;
}

// out = T(w * float(T(x * scale))): HF rounds the normalized value to the dtype before the weight multiply.
template <typename T>
void rms_second_pass(const T* xr, const T* ws, T* orow, float scale, int64_t hidden) {
  using L = Lanes<T>;
  const Vec sv(scale);
  int64_t i = 0;
  for (; i + kVec <= hidden; i += kVec) {
    const Vec normed = L::widen(L::narrow(L::load(xr + i) * sv));
    L::store(orow + i, L::narrow(L::load(ws + i) * normed));
  }
  for (; i < hidden; ++i) orow[i] = T(float(ws[i]) * float(T(float(xr[i]) * scale)));
}

// residual = x + residual; x = weight * rms_norm(residual). Both [T, H] contiguous, in place.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm: tensors must be contiguous");
  const int64_t rows = x.numel() / x.size(-1), hidden = x.size(-1);
  dispatch<void>(x, "fused_add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    T* xs = x.data_ptr<T>();
    T* rs = residual.data_ptr<T>();
    const T* ws = weight.data_ptr<T>();
    parallel_for(0, rows, grain_rows(hidden, 16384), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xs + r * hidden;
        T* rr = rs + r * hidden;
        const float sum = rms_first_pass<T, true>(xr, rr, hidden);
        const float scale = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
        rms_second_pass<T>(rr, ws, xr, scale, hidden);
      }
    });
  });
}

// out = weight * rms_norm(x), rows of [T, H].
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(),
              "rms_norm: tensors must be contiguous");
  const int64_t rows = x.numel() / x.size(-1), hidden = x.size(-1);
  dispatch<void>(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T* xs = x.data_ptr<T>();
    T* os = out.data_ptr<T>();
    const T* ws = weight.data_ptr<T>();
    parallel_for(0, rows, grain_rows(hidden, 16384), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xs + r * hidden;
        const float sum = rms_first_pass<T, false>(xr, nullptr, hidden);
        const float scale = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
        rms_second_pass<T>(xr, ws, os + r * hidden, scale, hidden);
      }
    });
  });
}

// One token's heads, rotated in place: each head's row is [x1 | x2], halves of `half` values at
// x + h * head_stride; c, s: the token's cos and sin, shared by its heads.
template <typename T>
void rotary_token(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s) {
  using L = Lanes<T>;
  int64_t i = 0;
  for (; i + kVec <= half; i += kVec) {
    const Vec cv = Vec::loadu(c + i), sv = Vec::loadu(s + i);
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + h * head_stride + i;
      const Vec x1 = L::load(row), x2 = L::load(row + half);
      // The contractions GCC makes of the scalar loop below (and made of the loop before it was
      // vectorized by hand): the first product is fused, the second rounded.
      L::store(row, L::narrow(at::vec::fmsub(x1, cv, x2 * sv)));
      L::store(row + half, L::narrow(at::vec::fmadd(x2, cv, x1 * sv)));
    }
  }
  for (; i < half; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + h * head_stride;
      const float x1 = float(row[i]), x2 = float(row[i + half]);
      row[i] = T(x1 * c[i] - x2 * s[i]);
      row[i + half] = T(x2 * c[i] + x1 * s[i]);
    }
  }
}

// Rotate-half rotary embedding in place. x: [T, heads, D] (last dim contiguous, rows may be
// strided, e.g. the q|k part of a fused qkv); cos, sin: [max_pos, D/2] fp32; positions: [T].
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x must be [T, heads, D] with D contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "rotary_embedding: cos and sin must be contiguous float32");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  dispatch<void>(x, "rotary_embedding", [&](auto zero) {
    using T = decltype(zero);
    T* xs = x.data_ptr<T>();
    parallel_for(0, tokens, grain_rows(heads * dim, 16384), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotary_token(xs + t * token_stride, heads, head_stride, half, cs + pos[t] * half, sn + pos[t] * half);
      }
    });
  });
}

// Vectorized<float>::exp_u20 for AVX-512, the same operations less three: the exponent's integer is
// kept from the floor rather than recomputed from it, and the zeroing of underflows is folded into
// the shift (checked equal, bit for bit, to exp_u20 over all 2^32 inputs). silu_and_mul's time is
// mostly this function's.
inline Vec exp_u20(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = x;
  const __m512 lo = _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50));  // ln(FLT_MIN)
  const __m512 hi = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));  // ln(FLT_MAX)
  const __mmask16 keep = _mm512_cmp_ps_mask(v, lo, _CMP_NLT_US);           // exp_u20 gives 0 below lo
  const __m512 src = _mm512_max_ps(_mm512_min_ps(v, hi), lo);
  // n = floor(x * log2(e) + 0.5); r = x - n * ln(2); exp(x) = 2^n * p(r) = 2^(n-1) * p(r) * 2
  const __m512i n = _mm512_cvt_roundps_epi32(
      _mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(n), _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  const __m512i biased = _mm512_add_epi32(n, _mm512_set1_epi32(126));  // 2^(n-1)'s exponent field
  const __m512 scale = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(keep, biased, 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, scale), _mm512_set1_ps(2.f));
#else
  return x.exp_u20();
#endif
}

// o = silu(gate) * up, `inner` values each; up = gate + inner.
template <typename T>
void silu_and_mul_row(const T* gate, T* o, int64_t inner) {
  using L = Lanes<T>;
  const T* up = gate + inner;
  int64_t i = 0;
  for (; i + kVec <= inner; i += kVec) {
    const Vec g = L::load(gate + i);
    L::store(o + i, L::narrow(g / (Vec(1.f) + exp_u20(g.neg())) * L::load(up + i)));
  }
  for (; i < inner; ++i) {
    const float gi = float(gate[i]);
    o[i] = T(gi / (1.f + std::exp(-gi)) * float(up[i]));
  }
}

// out[t] = silu(x[t, :I]) * x[t, I:], x: [T, 2I] contiguous, out: [T, I].
void silu_and_mul(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul: tensors must be contiguous");
  const int64_t rows = x.numel() / x.size(-1), inner = x.size(-1) / 2;
  dispatch<void>(x, "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* xs = x.data_ptr<T>();
    T* os = out.data_ptr<T>();
    parallel_for(0, rows, grain_rows(inner, 8192), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(xs + r * 2 * inner, os + r * inner, inner);
    });
  });
}

// gelu with tanh's approximation (SigLIP's gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x +
// 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same function) in fp32 and rounded once. n values.
template <typename T>
void gelu_tanh_values(const T* x, T* o, int64_t n) {
  using L = Lanes<T>;
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi), and torch's cubic term
  const Vec linear(-2.f * kBeta), cubic(-2.f * kBeta * kKappa);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const Vec v = L::load(x + i);
    const Vec minus_2u = v * at::vec::fmadd(v * v, cubic, linear);
    L::store(o + i, L::narrow(v / (Vec(1.f) + exp_u20(minus_2u))));
  }
  for (; i < n; ++i) {
    const float v = float(x[i]);
    o[i] = T(0.5f * v * (1.f + std::tanh(kBeta * (v + kKappa * v * v * v))));
  }
}

// out = gelu_tanh(x), both contiguous and of one shape.
void gelu_tanh(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes() &&
              out.scalar_type() == x.scalar_type(), "gelu_tanh: out and x must be contiguous, of one shape and dtype");
  constexpr int64_t kChunk = 16384;  // values a thread takes at a time: well past a second thread's ~1 us cost
  const int64_t n = x.numel();
  dispatch<void>(x, "gelu_tanh", [&](auto zero) {
    using T = decltype(zero);
    const T* xs = x.data_ptr<T>();
    T* os = out.data_ptr<T>();
    parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * kChunk, last = std::min(n, end * kChunk);
      gelu_tanh_values(xs + first, os + first, last - first);
    });
  });
}

// key, value: [T, Hkv, D] (rows may be strided views of a fused qkv; D contiguous);
// caches: [num_blocks, block_size, Hkv, D] contiguous; slot_mapping: [T]. Row t goes to its slot.
// key, value: [T, Hkv, D] (rows contiguous); the caches in the rows layout [num_blocks, block_size, Hkv, D],
// or in the pairs layout of paged_attention.cpp: keys [num_blocks, Hkv, D / 2, block_size, 2] (a key's
// pairs (K[2p], K[2p+1]) one 32-bit word each, block_size words apart) and values [num_blocks, Hkv,
// block_size / 2, D, 2] (V[d] at word d of its pair of slots, in the half of its slot's parity).
// An int8 cache row (kv_cache_dtype="int8"): head_dim codes round(x / s), then s = fp16(max|x| / 127) in 2
// bytes; the same arithmetic as kvloom/ops/reference.py quantize_kv_rows (division, round half to even).
template <typename T>
void write_int8_row(const T* x, int64_t dim, int8_t* row) {
  float amax = 0.0f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const c10::Half half_scale(std::min(amax / 127.0f, 65504.0f));
  const float scale = static_cast<float>(half_scale);
  for (int64_t d = 0; d < dim; ++d) {
    const float q = scale > 0.0f ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.0f;
    row[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
  }
  std::memcpy(row + dim, &half_scale.x, sizeof(half_scale.x));
}

void write_int8_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(3) == dim + 2 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() && key.stride(2) == 1 &&
                  value.stride(2) == 1 && value.scalar_type() == key.scalar_type(),
              "write_kv_cache: int8 caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim + 2]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int8_t* kc = key_cache.data_ptr<int8_t>();
  int8_t* vc = value_cache.data_ptr<int8_t>();
  const int64_t row = dim + 2;
  const auto write = [&](auto zero) {
    using T = decltype(zero);
    const T* ks = key.data_ptr<T>();
    const T* vs = value.data_ptr<T>();
    parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at_row = (slots[t] * heads + h) * row;
          write_int8_row(ks + t * key.stride(0) + h * key.stride(1), dim, kc + at_row);
          write_int8_row(vs + t * value.stride(0) + h * value.stride(1), dim, vc + at_row);
        }
    });
  };
  switch (key.scalar_type()) {
    case at::kFloat: write(float()); break;
    case at::kBFloat16: write(c10::BFloat16()); break;
    case at::kHalf: write(c10::Half()); break;
    default: TORCH_CHECK(false, "write_kv_cache: keys and values must be float32, bfloat16 or float16 for an int8 cache");
  }
}

void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping) {
  if (key_cache.scalar_type() == at::kChar) {
    write_int8_kv_cache(key, value, key_cache, value_cache, slot_mapping);
    return;
  }
  const bool paired = key_cache.dim() == 5;
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && value_cache.dim() == key_cache.dim() &&
                  (!paired || (key_cache.size(2) * 2 == key.size(2) && key.element_size() == 2)),
              "write_kv_cache: bad layout");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "write_kv_cache: the new keys and values must have the cache's dtype");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t block_size = paired ? key_cache.size(3) : key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t row_bytes = dim * key.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* ks = static_cast<const char*>(key.data_ptr());
  const char* vs = static_cast<const char*>(value.data_ptr());
  const int64_t es = key.element_size();
  // Tokens spread over the threads. In the pairs layout, tokens of one block share lines but never bytes.
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const char* k = ks + (t * key.stride(0) + h * key.stride(1)) * es;
        const char* v = vs + (t * value.stride(0) + h * value.stride(1)) * es;
        if (!paired) {
          std::memcpy(kc + (slot * heads + h) * row_bytes, k, row_bytes);
          std::memcpy(vc + (slot * heads + h) * row_bytes, v, row_bytes);
          continue;
        }
        const int64_t head_block = block * heads + h;
        auto* key_words = reinterpret_cast<int32_t*>(kc) + head_block * (dim / 2) * block_size + offset;
        for (int64_t p = 0; p < dim / 2; ++p) std::memcpy(key_words + p * block_size, k + 4 * p, 4);
        auto* value_halves = reinterpret_cast<uint16_t*>(vc) + (head_block * (block_size / 2) + offset / 2) * dim * 2 +
                             offset % 2;
        for (int64_t d = 0; d < dim; ++d) std::memcpy(value_halves + 2 * d, v + 2 * d, 2);
      }
    }
  });
}

// The first index of the largest value of row[0, cols), NaN counting as the largest (torch.argmax's
// answer). One pass takes the maximum of each block of kArgmaxBlock values (NaN-propagating); the
// first block whose maximum beats those before it (or holds a NaN) is then searched for it.
template <typename T>
int64_t argmax_row(const T* row, int64_t cols) {
  using L = Lanes<T>;
  constexpr int64_t kArgmaxBlock = 64 * kVec;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t vec_end = cols - cols % kVec;
  float best = -kInf;
  int64_t best_block = -1;
  bool nan = false;
  for (int64_t b = 0; b < vec_end; b += kArgmaxBlock) {
    const int64_t e = std::min(b + kArgmaxBlock, vec_end);
    Vec m0(-kInf), m1(-kInf), m2(-kInf), m3(-kInf);
    int64_t i = b;
    for (; i + 4 * kVec <= e; i += 4 * kVec) {
      m0 = at::vec::maximum(m0, L::load(row + i));
      m1 = at::vec::maximum(m1, L::load(row + i + kVec));
      m2 = at::vec::maximum(m2, L::load(row + i + 2 * kVec));
      m3 = at::vec::maximum(m3, L::load(row + i + 3 * kVec));
    }
    for (; i < e; i += kVec) m0 = at::vec::maximum(m0, L::load(row + i));
    float lanes[kVec];
    at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3)).store(lanes);
    float m = lanes[0];
    for (int64_t k = 1; k < kVec; ++k) m = (std::isnan(m) || m >= lanes[k]) ? m : lanes[k];
    if (std::isnan(m)) {
      best_block = b;
      nan = true;
      break;
    }
    if (m > best) {
      best = m;
      best_block = b;
    }
  }
  if (!nan) {
    // The scalar tail comes after every block: a value there wins only by being larger (or NaN).
    int64_t index = -1;
    for (int64_t i = vec_end; i < cols; ++i) {
      const float v = float(row[i]);
      if (std::isnan(v)) return i;
      if (v > best) {
        best = v;
        index = i;
      }
    }
    if (index >= 0) return index;
    if (best_block < 0) return 0;  // every value is -inf
  }
  const Vec target(best);
  const int64_t e = std::min(best_block + kArgmaxBlock, vec_end);
  for (int64_t i = best_block; i < e; i += kVec) {
    const Vec v = L::load(row + i);
    // zero_mask: a bit for each lane that is 0.0; the compares give all-ones (NaN) lanes where true.
    const int miss = (nan ? v.isnan() : (v == target)).zero_mask();
    const int hit = ~miss & ((1 << kVec) - 1);
    if (hit) return i + __builtin_ctz(hit);
  }
  TORCH_CHECK(false, "argmax_rows: the block's maximum was not found in it");
}

// out[r] = the first index of the largest value of row r of x [N, V] (torch.argmax's answer,
// which takes a NaN for the largest value).
void argmax_rows(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.scalar_type() == at::kLong, "argmax_rows: bad arguments");
  const int64_t rows = x.size(0), cols = x.size(1);
  int64_t* os = out.data_ptr<int64_t>();
  dispatch<void>(x, "argmax_rows", [&](auto zero) {
    using T = decltype(zero);
    const T* xs = x.data_ptr<T>();
    parallel_for(0, rows, grain_rows(cols, 16384), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) os[r] = argmax_row(xs + r * cols, cols);
    });
  });
}

// Structured outputs: logits[rows[r], j] = -inf wherever bit j % 32 of word j / 32 of bitmask[r] is 0 (tokens at
// or past 32 * width are banned too). One 32-bit word at a time: a word of all ones is skipped, a word of
// zeros (most of a grammar's mask) is one run of -inf stores, only mixed words are read bit by bit.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.scalar_type() == at::kInt && rows.dim() == 1 && rows.scalar_type() == at::kLong &&
                  rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: logits [B, V] contiguous, bitmask int32 [R, W] contiguous, rows int64 [R]");
  const int64_t batch = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  const int64_t constrained = rows.size(0);
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < constrained; ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < batch, "apply_token_bitmask: row ", row_ids[r], " outside [0, ",
                batch, ")");
  dispatch<void>(logits, "apply_token_bitmask", [&](auto zero) {
    using T = decltype(zero);
    const T banned = -std::numeric_limits<T>::infinity();
    T* base = logits.data_ptr<T>();
    parallel_for(0, constrained, grain_rows(vocab, 16384), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = base + row_ids[r] * vocab;
        const int32_t* mask = masks + r * words;
        for (int64_t w = 0; w * 32 < vocab; ++w) {
          const int64_t start = w * 32, count = std::min<int64_t>(32, vocab - start);
          const uint32_t word = w < words ? static_cast<uint32_t>(mask[w]) : 0u;
          if (word == 0xFFFFFFFFu) continue;
          if (word == 0) {
            std::fill(row + start, row + start + count, banned);
            continue;
          }
          for (int64_t b = 0; b < count; ++b)
            if (!((word >> b) & 1u)) row[start + b] = banned;
        }
      }
    });
  });
}

}  // namespace

namespace kvloom::kernels {
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) { ::rms_norm(out, x, weight, eps); }
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  ::fused_add_rms_norm(x, residual, weight, eps);
}
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  ::rotary_embedding(x, positions, cos, sin);
}
void silu_and_mul(at::Tensor out, at::Tensor x) { ::silu_and_mul(out, x); }
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping) {
  ::write_kv_cache(key, value, key_cache, value_cache, slot_mapping);
}
}  // namespace kvloom::kernels

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("write_kv_cache", &write_kv_cache);
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("gelu_tanh(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(kvloom, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh);
}
