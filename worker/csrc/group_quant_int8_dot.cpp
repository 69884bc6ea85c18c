// Decode rows against 4-bit group-quantized weights with integer dot products, as llama.cpp does: each
// group of 32 activations is rounded to int8 under its own scale (absmax / 127), and the 32 products of a
// group are summed exactly in int32 (_mm256_maddubs_epi16 on the unsigned 4-bit codes times the signed
// int8 activations: at most 15 * 127 * 2 per int16 lane, no saturation). Per group and row that is one
// load, one maddubs, one madd and one FMA where the float kernel spends four FMAs plus eight
// conversions, at the cost of rounding the activations (measured by tokenmill accuracy).
// y[t, n] = sum_g scale[n, g] * xscale[t, g] * dot_g + min[n, g] * xscale[t, g] * sum_g(xq)
// Opt-in (--cpu-int8-activations); worker/group_quant.py calls it for 4-bit weights and few rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <vector>

namespace {


template <int ROWS>
void row_dot_q8(const uint8_t* codes, const float* scales, const float* mins, const int8_t* xq, const float* xscale,
                const float* xsum, int64_t groups, float* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  float min_acc[ROWS];
  for (int t = 0; t < ROWS; ++t) { acc[t] = _mm256_setzero_ps(); min_acc[t] = 0.f; }
  for (int64_t g = 0; g < groups; ++g) {
    __m128i lo, hi;
    tokenmill::unpack_nibbles(codes + g * 16, lo, hi);
    const __m256i w = _mm256_set_m128i(hi, lo);  // elements 0..31 of the group, one byte each
    const float s = scales[g], m = mins[g];
    for (int t = 0; t < ROWS; ++t) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (t * groups + g) * 32));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // 8 x int32
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xscale[t * groups + g]), acc[t]);
      min_acc[t] += m * xsum[t * groups + g];
    }
  }
  for (int t = 0; t < ROWS; ++t) out[t * ldo] = tokenmill::hsum(acc[t]) + min_acc[t];
}

}  // namespace

// x: [T, K] float32, codes: 4-bit packed [N, K / 2] (group 32) -> [T, N] float32
at::Tensor group_quant_linear_int8_dot(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& mins) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "group_quant_linear_int8_dot: x must be 2-D float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), groups = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) == K / 2,
              "group_quant_linear_int8_dot: codes must be 4-bit packed [N, K / 2] uint8 for in_features ", K);
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous() && scales.size(0) == N && scales.size(1) == groups &&
                  mins.size(0) == N && mins.size(1) == groups && scales.scalar_type() == at::kFloat &&
                  mins.scalar_type() == at::kFloat,
              "group_quant_linear_int8_dot: scales and mins must be contiguous float32 [", N, ", ", groups, "]");
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> xq(T * K);
  std::vector<float> xscale(T * groups), xsum(T * groups);
  for (int64_t i = 0; i < T * groups; ++i) {
    const float* v = xp + i * 32;
    float amax = 0.f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t qsum = 0;
    for (int k = 0; k < 32; ++k) {
      xq[i * 32 + k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
      qsum += xq[i * 32 + k];
    }
    xscale[i] = d;
    // the min term on the same rounded activations as the codes' term: W x~ exactly, x~ the rounded x
    // (the float sum instead leaves the two large terms' rounding errors uncancelled)
    xsum[i] = d * static_cast<float>(qsum);
  }
  at::Tensor out = at::empty({T, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
      const int64_t rows = std::min<int64_t>(4, T - t0);
      const int8_t* xr = xq.data() + t0 * K;
      const float *xs = xscale.data() + t0 * groups, *xm = xsum.data() + t0 * groups;
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* c = cp + n * (K / 2);
        const float *s = sp + n * groups, *m = mp + n * groups;
        float* o = op + t0 * N + n;
        switch (rows) {
          case 1: row_dot_q8<1>(c, s, m, xr, xs, xm, groups, o, N); break;
          case 2: row_dot_q8<2>(c, s, m, xr, xs, xm, groups, o, N); break;
          case 3: row_dot_q8<3>(c, s, m, xr, xs, xm, groups, o, N); break;
          default: row_dot_q8<4>(c, s, m, xr, xs, xm, groups, o, N); break;
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("group_quant_linear_int8_dot(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("group_quant_linear_int8_dot", &group_quant_linear_int8_dot);
}
