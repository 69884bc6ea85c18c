// The group-quantized row kernel for bfloat16 activations on CPUs with avx512_bf16 (the decode step of a
// bfloat16 model at 1-3 rows, and up to GEMM_ROWS where there are no dense copies).
//
// The float32 row kernel turns each code into scale * code in float32 before its multiply-add: per 32
// weights an unpack, two widenings, two conversions, two multiplies and two FMAs, which kept it compute-bound
// at a third of the memory's bandwidth on a 2-core Sapphire Rapids. Here the codes become bfloat16 values
// (exact: every integer up to 256 is a bfloat16) and one vdpbf16ps multiplies 32 of them with 32 activations,
// summing pairs into 16 float32 lanes; the group's scale multiplies that partial sum once:
//   y = sum_g scale_g * sum_{k in g} code_k * x_k + sum_g min_g * sum_{k in g} x_k.
// Each product code * x is exact in float32 (8 significant bits times 8), so only the order of the float32
// sums and where the scale enters differ from the float32 kernel on the same bfloat16 x. vdpbf16ps flushes
// subnormal inputs to zero (activations below 1e-38).
//
// 4-bit codes (group 32, Q4 layout: element j in the low nibble of byte j, j + 16 in its high nibble): the 16
// bytes widen to 16 words, the high nibbles are the words shifted right by 4, and one vpermw maps the 32
// words (index: their low five bits) through a table of bfloat16(i & 15). 8-bit codes (groups of any multiple
// of 16) widen to float32 and pack to bfloat16 in pairs of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTokenBlock = 4;  // rows of x sharing one converted weight vector

// bfloat16(i & 15) for i in 0..31: vpermw reads an index's low five bits, so a byte's high nibble in bit 4
// of a word needs no mask
TOKENMILL_AVX512_BF16 inline __m512i nibble_table() {
  alignas(64) uint16_t values[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    values[i] = static_cast<uint16_t>(bits >> 16);  // exact: the low 16 bits are zero
  }
  return _mm512_load_si512(values);
}

// A group of 32 4-bit codes (16 packed bytes) -> 32 bfloat16 values in element order
TOKENMILL_AVX512_BF16 inline __m512bh codes4(const uint8_t* packed, __m512i table) {
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(words), _mm256_srli_epi16(words, 4), 1);
  return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(both, table));
}

// 16 8-bit codes -> 16 float32 values
TOKENMILL_AVX512_BF16 inline __m512 codes8_ps(const uint8_t* c) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}

// 32 8-bit codes -> 32 bfloat16 values (exact: integers up to 256)
TOKENMILL_AVX512_BF16 inline __m512bh codes8(const uint8_t* c) {
  return _mm512_cvtne2ps_pbh(codes8_ps(c + 16), codes8_ps(c));
}

// dword lanes 0-7 of a dot over 32 elements sum elements 0-15, lanes 8-15 elements 16-31
TOKENMILL_AVX512_BF16 inline __m512 half_scales(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

TOKENMILL_AVX512_BF16 inline __m512bh load_bf16(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Output row n against ROWS rows of x (row stride ldx, bfloat16), into out[t] as float32
template <int BITS, int ROWS>
TOKENMILL_AVX512_BF16 void row_dot(const uint8_t* codes, const float* scales, const float* mins,
                                   const at::BFloat16* x, int64_t ldx, const float* xsum, int64_t K, int64_t groups,
                                   int64_t group_size, __m512i table, float* out) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc0[ROWS], acc1[ROWS];
  for (int t = 0; t < ROWS; ++t) acc0[t] = acc1[t] = zero;
  if (BITS == 4) {  // group_size 32: two groups a step, into two accumulators
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      const __m512bh w0 = codes4(codes + g * 16, table), w1 = codes4(codes + g * 16 + 16, table);
      const __m512 s0 = _mm512_set1_ps(scales[g]), s1 = _mm512_set1_ps(scales[g + 1]);
      for (int t = 0; t < ROWS; ++t) {
        const at::BFloat16* xp = x + t * ldx + g * 32;
        acc0[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w0, load_bf16(xp)), s0, acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w1, load_bf16(xp + 32)), s1, acc1[t]);
      }
    }
    if (g < groups) {
      const __m512bh w0 = codes4(codes + g * 16, table);
      const __m512 s0 = _mm512_set1_ps(scales[g]);
      for (int t = 0; t < ROWS; ++t)
        acc0[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w0, load_bf16(x + t * ldx + g * 32)), s0, acc0[t]);
    }
  } else {  // 32 codes a step; each half of 16 lies in one group (group_size is a multiple of 16)
    // the halves' groups are counted, not divided for: two 64-bit divisions a step cost more than the
    // step's arithmetic (measured: the lm_head at one row ran 2.5x slower than the float32 kernel)
    int64_t g = 0, left = group_size;  // the group of the next half, and its codes not yet reached
    const auto next_half_scale = [&]() {
      const float scale = scales[g];
      if ((left -= 16) == 0) {
        ++g;
        left = group_size;
      }
      return scale;
    };
    // (a lambda is compiled without AVX-512, so only floats leave it)
    int64_t k = 0;
    // two steps of 32 an iteration, one per accumulator: a runtime choice between them would keep them in
    // memory rather than registers
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = codes8(codes + k), w1 = codes8(codes + k + 32);
      const float s00 = next_half_scale(), s01 = next_half_scale(), s10 = next_half_scale(),
                  s11 = next_half_scale();
      const __m512 s0 = half_scales(s00, s01), s1 = half_scales(s10, s11);
      for (int t = 0; t < ROWS; ++t) {
        const at::BFloat16* xp = x + t * ldx + k;
        acc0[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w0, load_bf16(xp)), s0, acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w1, load_bf16(xp + 32)), s1, acc1[t]);
      }
    }
    if (k + 32 <= K) {
      const __m512bh w = codes8(codes + k);
      const float s_lo = next_half_scale(), s_hi = next_half_scale();
      const __m512 s = half_scales(s_lo, s_hi);
      for (int t = 0; t < ROWS; ++t)
        acc0[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w, load_bf16(x + t * ldx + k)), s, acc0[t]);
      k += 32;
    }
    if (k < K) {  // 16 left: the upper half's codes and activations are zero
      const __m512bh w = _mm512_cvtne2ps_pbh(zero, codes8_ps(codes + k));
      const __m512 s = _mm512_set1_ps(scales[g]);  // the last half's group
      for (int t = 0; t < ROWS; ++t) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(0xFFFF, x + t * ldx + k));
        acc0[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w, xv), s, acc0[t]);
      }
    }
  }
  // the minimums' term, 16 groups a step
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 mask = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
    const __m512 m = _mm512_maskz_loadu_ps(mask, mins + g);
    for (int t = 0; t < ROWS; ++t)
      acc1[t] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, xsum + t * groups + g), acc1[t]);
  }
  for (int t = 0; t < ROWS; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

template <int BITS>
TOKENMILL_AVX512_BF16 void rows_dot(int64_t rows, const uint8_t* codes, const float* scales, const float* mins,
                                    const at::BFloat16* x, int64_t ldx, const float* xsum, int64_t K, int64_t groups,
                                    int64_t group_size, __m512i table, float* out) {
  switch (rows) {
    case 1: row_dot<BITS, 1>(codes, scales, mins, x, ldx, xsum, K, groups, group_size, table, out); break;
    case 2: row_dot<BITS, 2>(codes, scales, mins, x, ldx, xsum, K, groups, group_size, table, out); break;
    case 3: row_dot<BITS, 3>(codes, scales, mins, x, ldx, xsum, K, groups, group_size, table, out); break;
    default: row_dot<BITS, 4>(codes, scales, mins, x, ldx, xsum, K, groups, group_size, table, out); break;
  }
}

// Output rows begin..end for every row of x, rounded to bfloat16 once at the end. Called from the parallel
// loop's lambda, which is compiled without AVX-512: only pointers and integers cross into it (a vector
// passed by value there would not be in the register this side reads it from).
TOKENMILL_AVX512_BF16 void output_rows(int64_t begin, int64_t end, const at::BFloat16* xp, int64_t T, int64_t K,
                                       const uint8_t* cp, int64_t code_stride, const float* sp, const float* mp,
                                       int64_t N, int64_t bits, int64_t group_size, const float* xs,
                                       at::BFloat16* op) {
  const int64_t groups = K / group_size;
  const __m512i table = nibble_table();
  float block[kTokenBlock];
  const int64_t ahead = tokenmill::prefetch_rows_ahead(code_stride, groups);
  for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
    const int64_t rows = std::min(kTokenBlock, T - t0);
    for (int64_t n = begin; n < end; ++n) {
      tokenmill::prefetch_weight_row(cp, sp, mp, code_stride, groups, n + ahead, end);
      const uint8_t* c = cp + n * code_stride;
      if (bits == 4)
        rows_dot<4>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, K, groups,
                    group_size, table, block);
      else
        rows_dot<8>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, K, groups,
                    group_size, table, block);
      for (int64_t t = 0; t < rows; ++t) op[(t0 + t) * N + n] = at::BFloat16(block[t]);
    }
  }
}

}  // namespace

// y = x @ W^T for bfloat16 x [T, K] (contiguous) into out [T, N] (bfloat16): called by group_quant_linear,
// which checked the layout, where the CPU has avx512_bf16
void group_quant_linear_bf16_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& mins, int64_t bits, int64_t group_size, at::Tensor& out) {
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), groups = K / group_size;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  // each group's sum of x in float32, once per call (the minimums' term)
  std::vector<float> xsum(T * groups);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t k = 0; k < group_size; ++k) total += static_cast<float>(xp[t * K + g * group_size + k]);
      xsum[t * groups + g] = total;
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>(), *xs = xsum.data();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t code_stride = codes.size(1);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    output_rows(begin, end, xp, T, K, cp, code_stride, sp, mp, N, bits, group_size, xs, op);
  });
}
