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

// lane j = the sum of a[j]'s eight lanes. hadd pairs within each 128-bit half: t0 = [a0..a3 low halves,
// a0..a3 high halves], t1 the same for a4..a7; then the halves added
inline __m256 transposed_sums(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// A group of 32 4-bit codes in llama.cpp's Q4_0 / Q4_1 layout (16 bytes: element j in the low nibble of
// byte j, element j + 16 in its high nibble) -> elements 0..15 in lo and 16..31 in hi, one byte each.
inline void unpack_nibbles(const uint8_t* packed_codes, __m128i& lo, __m128i& hi) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed_codes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(packed, mask);
  hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
}

// Floats rounded to bfloat16 as c10::BFloat16 rounds them (nearest even; NaN -> 0x7FC0), as float bits
// (the low 16 bits zero), 8 at a time
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// 8 floats stored as 8 bfloat16 values (the 16-bit patterns at p), rounded as bf16_bits
inline void store_bf16x8(void* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(bf16_bits(v), 16);
  _mm_storeu_si128(static_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}

// The AVX-512 float32 paths (the group-quantized row kernel): functions with this target, called only where
// cpu_has_avx512() (the rest of the build stays AVX2)
#define TOKENMILL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// Whether this CPU has avx512f/bw/vl/dq, asked once (see cpu_has_avx512_bf16 for cpu_init)
inline bool cpu_has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

// The AVX-512 bfloat16 paths: functions with this target, called only where cpu_has_avx512_bf16() (the
// rest of the build stays AVX2)
#define TOKENMILL_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

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

// Every cache line of [p, p + bytes), requested into L1
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t line = first; line <= last; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

// How many output rows ahead the bfloat16 row kernel requests a row's codes, scales and minimums: ~1.7 KiB
// of them. At one row of x that kernel waits on memory, not arithmetic: the default model's 121 linears of a
// decode step from memory, 2 threads, AMD EPYC: 5.2-5.5 ms without, 4.5 with 4 rows (432 bytes each)
// ahead; 2, 8 and 16 rows ahead were slower. The float32 row kernel, still bound by its arithmetic there,
// gained nothing from it (5.9-6.2 ms either way).
inline int64_t prefetch_rows_ahead(int64_t code_bytes, int64_t groups) {
  constexpr int64_t kPrefetchBytes = 1728;
  const int64_t row_bytes = code_bytes + 2 * groups * static_cast<int64_t>(sizeof(float));
  return (kPrefetchBytes + row_bytes - 1) / row_bytes;
}

// Row n + ahead's codes, scales and minimums, where there is one before end
inline void prefetch_weight_row(const uint8_t* codes, const float* scales, const float* mins, int64_t code_bytes,
                                int64_t groups, int64_t n, int64_t end) {
  if (n >= end) return;
  prefetch_lines(codes + n * code_bytes, code_bytes);
  prefetch_lines(scales + n * groups, groups * static_cast<int64_t>(sizeof(float)));
  prefetch_lines(mins + n * groups, groups * static_cast<int64_t>(sizeof(float)));
}

}  // namespace tokenmill
