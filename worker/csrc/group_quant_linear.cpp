// Weight-only group-quantized linear for CPU: y = x @ W^T where W[n, k] = scale[n, g] * code[n, k] + min[n, g]
// for g = k / group_size. Codes are unsigned: 8-bit (one byte each) or 4-bit (a group of 32 packed into 16
// bytes, element j in the low nibble of byte j and element j + 16 in its high nibble: llama.cpp's Q4_0/Q4_1
// layout, so those blocks are copied, not re-packed). Every GGUF format we read maps onto this exactly.
//
// Decode multiplies a few rows by every weight of the model, so the step streams the weights from memory:
// reading 4- or 8-bit codes instead of float32 is the whole point. The min term is folded out of the inner
// loop: sum_k (s*c + m) * x = s * sum_k c*x + m * sum_k x, with sum_k x per group computed once per call.
//
// Built by scripts/build_cpu_ops.py (install time, never at import in a serving process) with -mavx2 -mfma;
// worker/native_ops.py loads it only where the CPU has AVX2 and FMA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <immintrin.h>

#include "simd.h"

#include <vector>

namespace {

constexpr int64_t kTokenBlock = 4;  // rows of x sharing one dequantized weight vector


inline __m256 codes8_to_ps(const uint8_t* p) {  // 8 unsigned bytes -> 8 floats
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

inline __m256 bytes_to_ps(__m128i bytes) {  // the low 8 bytes of a register -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

// One output row n against ROWS rows of x (x row stride ldx). Each row keeps two accumulator chains so
// consecutive FMAs do not wait on each other (one chain is latency-bound at one row).
template <int BITS, int ROWS>
void row_dot(const uint8_t* codes, const float* scales, const float* mins, const float* x, int64_t ldx,
             const float* xsum, int64_t groups, int64_t group_size, float* out, int64_t ldo) {
  __m256 acc0[ROWS], acc1[ROWS];
  float min_acc[ROWS];
  for (int t = 0; t < ROWS; ++t) { acc0[t] = _mm256_setzero_ps(); acc1[t] = _mm256_setzero_ps(); min_acc[t] = 0.f; }
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scales[g]);
    const float m = mins[g];
    for (int t = 0; t < ROWS; ++t) min_acc[t] += m * xsum[t * groups + g];
    const int64_t k0 = g * group_size;
    if (BITS == 8) {
      for (int64_t k = 0; k < group_size; k += 16) {
        const __m256 w0 = _mm256_mul_ps(codes8_to_ps(codes + k0 + k), s);
        const __m256 w1 = _mm256_mul_ps(codes8_to_ps(codes + k0 + k + 8), s);
        for (int t = 0; t < ROWS; ++t) {
          const float* xp = x + t * ldx + k0 + k;
          acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc0[t]);
          acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), acc1[t]);
        }
      }
    } else {  // 4-bit, group_size 32: 16 bytes
      __m128i lo, hi;
      tokenmill::unpack_nibbles(codes + k0 / 2, lo, hi);
      const __m256 w0 = _mm256_mul_ps(bytes_to_ps(lo), s);
      const __m256 w1 = _mm256_mul_ps(bytes_to_ps(_mm_srli_si128(lo, 8)), s);
      const __m256 w2 = _mm256_mul_ps(bytes_to_ps(hi), s);
      const __m256 w3 = _mm256_mul_ps(bytes_to_ps(_mm_srli_si128(hi, 8)), s);
      for (int t = 0; t < ROWS; ++t) {
        const float* xp = x + t * ldx + k0;
        acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc0[t]);
        acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), acc1[t]);
        acc0[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xp + 16), acc0[t]);
        acc1[t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), acc1[t]);
      }
    }
  }
  for (int t = 0; t < ROWS; ++t) out[t * ldo] = tokenmill::hsum(_mm256_add_ps(acc0[t], acc1[t])) + min_acc[t];
}

template <int BITS>
void rows_dot(int64_t rows, const uint8_t* codes, const float* scales, const float* mins, const float* x, int64_t ldx,
              const float* xsum, int64_t groups, int64_t group_size, float* out, int64_t ldo) {
  switch (rows) {
    case 1: row_dot<BITS, 1>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    case 2: row_dot<BITS, 2>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    case 3: row_dot<BITS, 3>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    default: row_dot<BITS, 4>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
  }
}

// The AVX-512 twin of row_dot, chosen at run time where the CPU has AVX-512 (a 2-core Sapphire Rapids ran
// row_dot compute-bound, at a third of the memory's bandwidth): 16 lanes, the same float32 operations
// (scale * code, then a fused multiply-add with x), so only the order of the sums differs.
TOKENMILL_AVX512 inline __m512 weights16(__m128i codes16, __m512 s) {  // 16 codes -> scale * code
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes16)), s);
}

template <int BITS, int ROWS>
TOKENMILL_AVX512 void row_dot_avx512(const uint8_t* codes, const float* scales, const float* mins, const float* x,
                                     int64_t ldx, const float* xsum, int64_t groups, int64_t group_size, float* out,
                                     int64_t ldo) {
  __m512 acc0[ROWS], acc1[ROWS];
  float min_acc[ROWS];
  for (int t = 0; t < ROWS; ++t) { acc0[t] = _mm512_setzero_ps(); acc1[t] = _mm512_setzero_ps(); min_acc[t] = 0.f; }
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scales[g]);
    const float m = mins[g];
    for (int t = 0; t < ROWS; ++t) min_acc[t] += m * xsum[t * groups + g];
    const int64_t k0 = g * group_size;
    if (BITS == 8) {
      int64_t k = 0;
      for (; k + 32 <= group_size; k += 32) {
        const __m512 w0 = weights16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k0 + k)), s);
        const __m512 w1 = weights16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k0 + k + 16)), s);
        for (int t = 0; t < ROWS; ++t) {
          const float* xp = x + t * ldx + k0 + k;
          acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc0[t]);
          acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc1[t]);
        }
      }
      if (k < group_size) {  // group_size 16 (Q6_K), or 16 past a multiple of 32
        const __m512 w0 = weights16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k0 + k)), s);
        for (int t = 0; t < ROWS; ++t) acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ldx + k0 + k), acc0[t]);
      }
    } else {  // 4-bit, group_size 32: 16 bytes
      __m128i lo, hi;
      tokenmill::unpack_nibbles(codes + k0 / 2, lo, hi);
      const __m512 w0 = weights16(lo, s), w1 = weights16(hi, s);
      for (int t = 0; t < ROWS; ++t) {
        const float* xp = x + t * ldx + k0;
        acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc1[t]);
      }
    }
  }
  for (int t = 0; t < ROWS; ++t) out[t * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) + min_acc[t];
}

template <int BITS>
TOKENMILL_AVX512 void rows_dot_avx512(int64_t rows, const uint8_t* codes, const float* scales, const float* mins,
                                      const float* x, int64_t ldx, const float* xsum, int64_t groups,
                                      int64_t group_size, float* out, int64_t ldo) {
  switch (rows) {
    case 1: row_dot_avx512<BITS, 1>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    case 2: row_dot_avx512<BITS, 2>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    case 3: row_dot_avx512<BITS, 3>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
    default: row_dot_avx512<BITS, 4>(codes, scales, mins, x, ldx, xsum, groups, group_size, out, ldo); break;
  }
}

// The row kernel's AVX-512 path is on where the CPU has it unless turned off (group_quant_rows_avx512), so the
// tests run both paths on one machine
bool avx512_rows_allowed = true;

void check_args(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                int64_t group_size, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_quant: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 8 ? group_size % 16 == 0 : group_size == 32,
              "group_quant: group_size ", group_size, " is not supported for ", bits, "-bit codes");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "group_quant: codes must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(K % group_size == 0, "group_quant: in_features ", K, " is not a multiple of group_size ", group_size);
  const int64_t N = codes.size(0), groups = K / group_size;
  TORCH_CHECK(codes.size(1) == (bits == 8 ? K : K / 2), "group_quant: codes has ", codes.size(1),
              " columns, expected ", (bits == 8 ? K : K / 2), " for in_features ", K);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == groups,
                "group_quant: scales and mins must be contiguous float32 [", N, ", ", groups, "]");
  }
}

}  // namespace

// group_quant_rows_bf16.cpp: the row kernel for bfloat16 x on CPUs with avx512_bf16
void group_quant_linear_bf16_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& mins, int64_t bits, int64_t group_size, at::Tensor& out);

// x: [T, K] float32 -> [T, N] float32; bfloat16 x -> bfloat16, through the bfloat16 kernel where the CPU
// has avx512_bf16, else as float32 (the same values) with the result rounded once
at::Tensor group_quant_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, int64_t bits, int64_t group_size) {
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) && x_in.dim() == 2,
              "group_quant_linear: x must be 2-D float32 or bfloat16, got ", x_in.scalar_type(), " with ",
              x_in.dim(), " dimensions");
  if (x_in.scalar_type() == at::kBFloat16) {
    if (avx512_rows_allowed && tokenmill::cpu_has_avx512_bf16()) {
      check_args(codes, scales, mins, bits, group_size, x_in.size(1));
      const at::Tensor x = x_in.contiguous();
      at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options());
      group_quant_linear_bf16_rows(x, codes, scales, mins, bits, group_size, out);
      return out;
    }
    return group_quant_linear(x_in.to(at::kFloat), codes, scales, mins, bits, group_size).to(at::kBFloat16);
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), groups = K / group_size;
  check_args(codes, scales, mins, bits, group_size, K);
  at::Tensor out = at::empty({T, N}, x.options());
  // sum of x over each group, once per call (an aten::sum here cost ~30 us a call: dispatch, not work)
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(T * groups);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xp + t * K + g * group_size;
      __m256 acc = _mm256_loadu_ps(v);
      for (int64_t k = 8; k < group_size; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(v + k));
      xsum[t * groups + g] = tokenmill::hsum(acc);
    }
  const float* xs = xsum.data();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t code_stride = codes.size(1);
  const bool avx512 = avx512_rows_allowed && tokenmill::cpu_has_avx512();
  // grain: enough rows per task that the fork/join cost stays small next to streaming their codes
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
      const int64_t rows = std::min(kTokenBlock, T - t0);
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* c = cp + n * code_stride;
        if (avx512 && bits == 8)
          rows_dot_avx512<8>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, groups,
                             group_size, op + t0 * N + n, N);
        else if (avx512)
          rows_dot_avx512<4>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, groups,
                             group_size, op + t0 * N + n, N);
        else if (bits == 8)
          rows_dot<8>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, groups, group_size,
                      op + t0 * N + n, N);
        else
          rows_dot<4>(rows, c, sp + n * groups, mp + n * groups, xp + t0 * K, K, xs + t0 * groups, groups, group_size,
                      op + t0 * N + n, N);
      }
    }
  });
  return out;
}

namespace {

// Row n of W as float32 into o[0:K]: scale * code, then + min, rounded twice as torch does it, so the
// reference (GroupQuantWeight.dequantize) and this agree bit for bit.
void dequantize_row(const uint8_t* c, const float* scales, const float* mins, int64_t groups, int64_t group_size,
                    int64_t bits, float* o) {
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scales[g]), m = _mm256_set1_ps(mins[g]);
    const int64_t k0 = g * group_size;
    if (bits == 8) {
      for (int64_t k = 0; k < group_size; k += 8)
        _mm256_storeu_ps(o + k0 + k, _mm256_add_ps(_mm256_mul_ps(codes8_to_ps(c + k0 + k), s), m));
    } else {
      __m128i lo, hi;
      tokenmill::unpack_nibbles(c + k0 / 2, lo, hi);
      _mm256_storeu_ps(o + k0, _mm256_add_ps(_mm256_mul_ps(bytes_to_ps(lo), s), m));
      _mm256_storeu_ps(o + k0 + 8, _mm256_add_ps(_mm256_mul_ps(bytes_to_ps(_mm_srli_si128(lo, 8)), s), m));
      _mm256_storeu_ps(o + k0 + 16, _mm256_add_ps(_mm256_mul_ps(bytes_to_ps(hi), s), m));
      _mm256_storeu_ps(o + k0 + 24, _mm256_add_ps(_mm256_mul_ps(bytes_to_ps(_mm_srli_si128(hi, 8)), s), m));
    }
  }
}

// Float32 -> bfloat16, rounded as torch rounds (simd.h), 8 at a time
inline void store_bf16(const float* v, int64_t n, at::BFloat16* o) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) tokenmill::store_bf16x8(o + k, _mm256_loadu_ps(v + k));
  for (; k < n; ++k) o[k] = at::BFloat16(v[k]);
}

// Row n of W as bfloat16 with AVX-512 (the CPUs whose bfloat16 GEMM runs natively: there the AVX2 path's
// dequantization cost as much as the GEMM at 32 rows): the same float32 values as dequantize_row (scale *
// code, then + min), rounded to nearest even by the conversion instruction, 16 weights at a time.
TOKENMILL_AVX512_BF16 inline void store16(__m128i codes16, __m512 s, __m512 m, at::BFloat16* o) {
  const __m512 w = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes16)), s), m);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
}

TOKENMILL_AVX512_BF16
void dequantize_row_bf16_avx512(const uint8_t* c, const float* scales, const float* mins, int64_t groups,
                                int64_t group_size, int64_t bits, at::BFloat16* o) {
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scales[g]), m = _mm512_set1_ps(mins[g]);
    const int64_t k0 = g * group_size;
    if (bits == 8) {
      for (int64_t k = 0; k < group_size; k += 16)
        store16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k0 + k)), s, m, o + k0 + k);
    } else {
      __m128i lo, hi;
      tokenmill::unpack_nibbles(c + k0 / 2, lo, hi);
      store16(lo, s, m, o + k0);
      store16(hi, s, m, o + k0 + 16);
    }
  }
}

}  // namespace

// The float32 weight [N, K] (the reference's twin, and what tests compare the codes with).
at::Tensor group_quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                  int64_t bits, int64_t group_size) {
  const int64_t N = codes.size(0), K = bits == 8 ? codes.size(1) : codes.size(1) * 2, groups = K / group_size;
  check_args(codes, scales, mins, bits, group_size, K);
  at::Tensor out = at::empty({N, K}, scales.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t code_stride = codes.size(1);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      dequantize_row(cp + n * code_stride, sp + n * groups, mp + n * groups, groups, group_size, bits, op + n * K);
  });
  return out;
}

// Many rows of x (prefill, large decode batches): arithmetic-bound, so a GEMM does the work, on strips of W
// dequantized into a buffer that stays in cache, never the whole weight (the 49152-row lm_head would be
// 113 MB of float32 written and read back per step). Each task owns its strip and its slice of the
// output; the GEMM inside runs on that task's thread (nested parallel regions run inline). x in bfloat16
// gets bfloat16 strips (each weight rounded once from its float32 value) and a bfloat16 GEMM, which
// oneDNN runs natively where the CPU has avx512_bf16 / AMX: 2.3-3.3x float32's rate at 8-128 rows there.
at::Tensor group_quant_linear_strips(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& mins, int64_t bits, int64_t group_size, int64_t strip_rows) {
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) && x_in.dim() == 2,
              "group_quant_linear_strips: x must be 2-D float32 or bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(strip_rows > 0, "group_quant_linear_strips: strip_rows must be positive");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16, avx512 = bf16 && tokenmill::cpu_has_avx512_bf16();
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), groups = K / group_size;
  check_args(codes, scales, mins, bits, group_size, K);
  at::Tensor out = at::empty({T, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const int64_t code_stride = codes.size(1), strips = (N + strip_rows - 1) / strip_rows;
  // the GEMM below dispatches through ATen on worker threads: they need the caller's thread-local state
  // (inference mode, grad mode), which OpenMP threads do not inherit
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor strip = at::empty({strip_rows, K}, x.options());
    std::vector<float> row(bf16 && !avx512 ? K : 0);  // a float32 row before its rounding to bfloat16
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * strip_rows, rows = std::min(strip_rows, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        if (avx512) {
          dequantize_row_bf16_avx512(cp + n * code_stride, sp + n * groups, mp + n * groups, groups, group_size,
                                     bits, strip.data_ptr<at::BFloat16>() + r * K);
        } else if (bf16) {
          dequantize_row(cp + n * code_stride, sp + n * groups, mp + n * groups, groups, group_size, bits, row.data());
          store_bf16(row.data(), K, strip.data_ptr<at::BFloat16>() + r * K);
        } else {
          dequantize_row(cp + n * code_stride, sp + n * groups, mp + n * groups, groups, group_size, bits,
                         strip.data_ptr<float>() + r * K);
        }
      }
      at::Tensor slice = out.narrow(1, n0, rows);
      at::mm_out(slice, x, strip.narrow(0, 0, rows).t());
    }
  });
  return out;
}

// Turns the row kernel's AVX-512 path off or back on (for tests: both paths on one machine); returns whether
// it runs now, which needs a CPU with AVX-512 besides
bool group_quant_rows_avx512(bool allowed) {
  avx512_rows_allowed = allowed;
  return allowed && tokenmill::cpu_has_avx512();
}

TORCH_LIBRARY(tokenmill, m) {
  m.def("group_quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int group_size) -> Tensor");
  m.def("group_quant_rows_avx512(bool allowed) -> bool", &group_quant_rows_avx512);
  m.def("group_quant_dequantize(Tensor codes, Tensor scales, Tensor mins, int bits, int group_size) -> Tensor");
  m.def("group_quant_linear_strips(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int group_size, "
        "int strip_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("group_quant_linear", &group_quant_linear);
  m.impl("group_quant_dequantize", &group_quant_dequantize);
  m.impl("group_quant_linear_strips", &group_quant_linear_strips);
}
