// AVX2 helpers shared by the compiled CPU ops.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

inline float hsum(__m256 v) {  // the sum of the eight lanes
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// A group of 32 4-bit codes in llama.cpp's Q4_0 / Q4_1 layout (16 bytes: element j in the low nibble of
// byte j, element j + 16 in its high nibble) -> elements 0..15 in lo and 16..31 in hi, one byte each.
inline void unpack_nibbles(const uint8_t* packed_codes, __m128i& lo, __m128i& hi) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed_codes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(packed, mask);
  hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
}

// Whether this CPU runs the AVX-512 bfloat16 paths (avx512f/bw/vl/dq + avx512_bf16), asked once; the
// explicit cpu_init makes the answer right even when first asked from a static initializer.
inline bool cpu_has_avx512_bf16() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
}

}  // namespace tokenmill
