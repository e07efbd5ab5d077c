// AVX2 helpers the int8 and 4-bit GEMMs (gemm_int8.cpp, gemm_q4.cpp) share: 8 output columns as one vector.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvloom::avx2 {

// One 4-byte group of int8 codes in every 32-bit lane.
inline __m256i broadcast_word(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_set1_epi32(word);
}

// Columns [0, count) of a panel's scales or bias (zeros past them: nothing is read past N).
inline __m256 load_columns(const float* p, int64_t count) {
  if (count == 8) return _mm256_loadu_ps(p);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, mask);
}

// Columns [0, count) of an 8-column vector of results into y, rounded once to T.
template <typename T>
inline void store_columns(T* y, __m256 v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == 8) {
      _mm256_storeu_ps(y, v);
      return;
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, v);
  for (int64_t c = 0; c < count; ++c) y[c] = static_cast<T>(out[c]);
}

}  // namespace kvloom::avx2
#endif
