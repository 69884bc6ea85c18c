// Rows of x against group-quantized weights with integer dot products, as llama.cpp does: each block of 32
// activations is rounded to int8 under its own scale (absmax / 127, half to even), and the 32 products of a
// block are summed exactly in int32 (_mm256_maddubs_epi16 + _mm256_madd_epi16). Per block and row pair that
// is one maddubs, one madd, one conversion and one FMA, where the float kernel spends four FMAs plus eight
// conversions: about twice the weights per cycle at one row, and at 9-64 rows it beats a float32 GEMM on
// dequantized strips because the codes never expand to float. The cost is the activations' rounding
// (measured by `tokenmill accuracy`).
//
// Weights: 4-bit codes (group 32, packed as Q4_0/Q4_1) are unsigned < 16, so maddubs takes them as they are
// (15 * 127 * 2 per int16 lane: no saturation). 8-bit codes (group 32, or 16 as Q6_K's) are taken as
// signed c - 128 (one xor), multiplied as |w| * (x with w's sign) (128 * 127 * 2 < 32768), the 128 going
// into the minimum: s * c + m = s * (c - 128) + (m + 128 s).
// y[t, n] = sum_b xscale[t, b] * sum_{groups g in b} (scale[n, g] * dot_g + min'[n, g] * sum_g(xq))
// Opt-in (--cpu-int8-activations); worker/group_quant.py decides which linears and how many rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <vector>

namespace {

constexpr int64_t kBlock = 32;       // activations per int8 scale
constexpr int64_t kRowsPerTile = 4;  // rows of x sharing one unpacked weight block
constexpr int64_t kCodeRows = 32;    // weight rows whose codes stay in L1 while every row of x passes

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// x rounded to int8 per block of 32, and the per-weight-group sums of the rounded values times the block's
// scale (the minimum's term on the same rounded x as the codes' term: the float sum instead would leave
// the two large terms' rounding errors uncancelled).
struct Int8Rows {
  std::vector<int8_t> q;        // [T, K]
  std::vector<float> scale;     // [T, K / 32]
  std::vector<float> group_sum; // [T, K / group_size]
};

void quantize_rows(const float* x, int64_t T, int64_t K, int64_t group_size, Int8Rows& r) {
  const int64_t blocks = K / kBlock, groups = K / group_size;
  r.q.resize(T * K);
  r.scale.resize(T * blocks);
  r.group_sum.resize(T * groups);
  at::parallel_for(0, T * blocks, 256, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * kBlock;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      const float d = hmax(a) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      const __m256 m = _mm256_set1_ps(inv);
      // cvtps rounds half to even under the default MXCSR mode, as std::nearbyint and torch.round do
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, m)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, m)),
                    i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, m)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, m));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + i * kBlock),
                          _mm256_permutevar8x32_epi32(packed, order));
      r.scale[i] = d;
      const int32_t low = hsum_epi32(_mm256_add_epi32(i0, i1)), high = hsum_epi32(_mm256_add_epi32(i2, i3));
      if (group_size == 16) {
        r.group_sum[2 * i] = d * static_cast<float>(low);
        r.group_sum[2 * i + 1] = d * static_cast<float>(high);
      } else {
        r.group_sum[i] = d * static_cast<float>(low + high);
      }
    }
  });
}

// NB weight rows against TB rows of x, every block of K: acc[n][t] holds 8 partial sums.
template <int BITS, int GS, int NB, int TB>
inline void tile_dot(const uint8_t* codes, int64_t code_stride, const float* scales, int64_t groups,
                     const int8_t* xq, int64_t K, const float* xscale, int64_t blocks, __m256 (&acc)[NB][TB]) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int n = 0; n < NB; ++n)
    for (int t = 0; t < TB; ++t) acc[n][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i w[NB], w_abs[NB];
    __m256 ws[NB];
    for (int n = 0; n < NB; ++n) {
      const uint8_t* c = codes + n * code_stride;
      if (BITS == 4) {
        __m128i lo, hi;
        tokenmill::unpack_nibbles(c + b * 16, lo, hi);
        w[n] = _mm256_set_m128i(hi, lo);  // elements 0..31 of the block, one byte each
      } else {
        w[n] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * 32)), flip);
        w_abs[n] = _mm256_abs_epi8(w[n]);  // -128 -> 128 read unsigned by maddubs
      }
      const float* s = scales + n * groups;
      // after madd, int32 lanes 0-3 hold elements 0-15 and lanes 4-7 elements 16-31
      ws[n] = GS == 32 ? _mm256_set1_ps(s[b]) : _mm256_set_m128(_mm_set1_ps(s[2 * b + 1]), _mm_set1_ps(s[2 * b]));
    }
    for (int t = 0; t < TB; ++t) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * 32));
      const __m256 xs = _mm256_set1_ps(xscale[t * blocks + b]);
      for (int n = 0; n < NB; ++n) {
        const __m256i products = BITS == 4 ? _mm256_maddubs_epi16(w[n], xv)
                                           : _mm256_maddubs_epi16(w_abs[n], _mm256_sign_epi8(xv, w[n]));
        const __m256i dot = _mm256_madd_epi16(products, ones);
        acc[n][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[n], xs), acc[n][t]);
      }
    }
  }
}

// sum_g min'[n, g] * group_sum[t, g], min' = min + 128 * scale for 8-bit codes (see the file's header)
template <int BITS>
inline float min_term(const float* scales, const float* mins, const float* group_sum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256 m = _mm256_loadu_ps(mins + g);
    if (BITS == 8) m = _mm256_fmadd_ps(_mm256_set1_ps(128.f), _mm256_loadu_ps(scales + g), m);
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(group_sum + g), acc);
  }
  float total = tokenmill::hsum(acc);
  for (; g < groups; ++g) total += (BITS == 8 ? mins[g] + 128.f * scales[g] : mins[g]) * group_sum[g];
  return total;
}

template <int BITS, int GS, int NB, int TB>
inline void tile(const uint8_t* codes, int64_t code_stride, const float* scales, const float* mins, int64_t groups,
                 const Int8Rows& x, int64_t t0, int64_t K, float* out, int64_t ldo) {
  const int64_t blocks = K / kBlock;
  __m256 acc[NB][TB];
  tile_dot<BITS, GS, NB, TB>(codes, code_stride, scales, groups, x.q.data() + t0 * K, K,
                             x.scale.data() + t0 * blocks, blocks, acc);
  for (int n = 0; n < NB; ++n)
    for (int t = 0; t < TB; ++t)
      out[t * ldo + n] = tokenmill::hsum(acc[n][t]) +
                         min_term<BITS>(scales + n * groups, mins + n * groups,
                                        x.group_sum.data() + (t0 + t) * groups, groups);
}

template <int BITS, int GS, int NB>
void tile_rows(int64_t rows, const uint8_t* codes, int64_t code_stride, const float* scales, const float* mins,
               int64_t groups, const Int8Rows& x, int64_t t0, int64_t K, float* out, int64_t ldo) {
  switch (rows) {
    case 1: tile<BITS, GS, NB, 1>(codes, code_stride, scales, mins, groups, x, t0, K, out, ldo); break;
    case 2: tile<BITS, GS, NB, 2>(codes, code_stride, scales, mins, groups, x, t0, K, out, ldo); break;
    case 3: tile<BITS, GS, NB, 3>(codes, code_stride, scales, mins, groups, x, t0, K, out, ldo); break;
    default: tile<BITS, GS, NB, 4>(codes, code_stride, scales, mins, groups, x, t0, K, out, ldo); break;
  }
}

template <int BITS, int GS>
void linear_rows(const Int8Rows& x, int64_t T, int64_t K, const uint8_t* codes, const float* scales,
                 const float* mins, int64_t N, float* out) {
  const int64_t code_stride = BITS == 4 ? K / 2 : K, groups = K / GS;
  // weight rows in chunks whose codes stay in L1 while every row of x passes over them, so at 32 rows the
  // weight is read from memory once, not once per tile of x
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kCodeRows) {
      const int64_t n1 = std::min(end, n0 + kCodeRows);
      for (int64_t t0 = 0; t0 < T; t0 += kRowsPerTile) {
        const int64_t rows = std::min(kRowsPerTile, T - t0);
        int64_t n = n0;
        for (; n + 2 <= n1; n += 2)
          tile_rows<BITS, GS, 2>(rows, codes + n * code_stride, code_stride, scales + n * groups, mins + n * groups,
                                 groups, x, t0, K, out + t0 * N + n, N);
        if (n < n1)
          tile_rows<BITS, GS, 1>(rows, codes + n * code_stride, code_stride, scales + n * groups, mins + n * groups,
                                 groups, x, t0, K, out + t0 * N + n, N);
      }
    }
  });
}

}  // namespace

// x: [T, K] float32; codes: 4-bit packed [N, K / 2] (group 32) or 8-bit [N, K] (group 32 or 16) -> [T, N]
at::Tensor group_quant_linear_int8_dot(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& mins, int64_t bits, int64_t group_size) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "group_quant_linear_int8_dot: x must be 2-D float32");
  TORCH_CHECK((bits == 4 && group_size == 32) || (bits == 8 && (group_size == 32 || group_size == 16)),
              "group_quant_linear_int8_dot: ", bits, "-bit codes in groups of ", group_size,
              " are not supported (4-bit group 32, 8-bit group 32 or 16)");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), groups = K / group_size;
  TORCH_CHECK(K % kBlock == 0, "group_quant_linear_int8_dot: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == (bits == 4 ? K / 2 : K),
              "group_quant_linear_int8_dot: codes must be contiguous uint8 [N, ", (bits == 4 ? K / 2 : K),
              "] for ", bits, "-bit codes and in_features ", K);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == groups,
                "group_quant_linear_int8_dot: scales and mins must be contiguous float32 [", N, ", ", groups, "]");
  }
  Int8Rows rows;
  quantize_rows(x.data_ptr<float>(), T, K, group_size, rows);
  at::Tensor out = at::empty({T, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (bits == 4)
    linear_rows<4, 32>(rows, T, K, cp, sp, mp, N, op);
  else if (group_size == 32)
    linear_rows<8, 32>(rows, T, K, cp, sp, mp, N, op);
  else
    linear_rows<8, 16>(rows, T, K, cp, sp, mp, N, op);
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("group_quant_linear_int8_dot(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int group_size) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("group_quant_linear_int8_dot", &group_quant_linear_int8_dot);
}
