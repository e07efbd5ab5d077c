// In-register transposes of 32-bit words, for kernels that lay keys along the vectors (paged_attention.cpp,
// dense_attention.cpp).
#pragma once

#include "cpu_capability.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvloom {

#if defined(CPU_CAPABILITY_AVX512)
// r[i] = row i of a 16 x 16 block of 32-bit words in, column i out.
inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  KVLOOM_UNROLL
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit lane: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  KVLOOM_UNROLL
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);          // lane L: column 4L of rows i..i+3
    r[i + 1] = hi(t[i], t[i + 2]);      // column 4L + 1
    r[i + 2] = lo(t[i + 1], t[i + 3]);  // column 4L + 2
    r[i + 3] = hi(t[i + 1], t[i + 3]);  // column 4L + 3
  }
  KVLOOM_UNROLL
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);  // lanes 0, 2 of each
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);  // lanes 1, 3
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  KVLOOM_UNROLL
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// r[i] = row i of an 8 x 8 block of floats in, column i out.
inline void transpose_8x8(__m256 r[8]) {
  __m256 t[8];
  KVLOOM_UNROLL
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit lane: a0 b0 a1 b1
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  __m256 u[8];
  KVLOOM_UNROLL
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);          // a0 b0 c0 d0 (per lane)
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);      // a1 b1 c1 d1
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);  // a2 b2 c2 d2
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);  // a3 b3 c3 d3
  }
  KVLOOM_UNROLL
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);      // columns 0..3: low lanes
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);  // columns 4..7: high lanes
  }
}
#endif

}  // namespace kvloom
