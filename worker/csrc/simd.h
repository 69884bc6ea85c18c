// AVX2 helpers shared by the compiled CPU ops.
#pragma once
#include <immintrin.h>

namespace tokenmill {

inline float hsum(__m256 v) {  // the sum of the eight lanes
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

}  // namespace tokenmill
