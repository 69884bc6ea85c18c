// Quantized KV pages on CPU (kv_quant.h): the row quantizer rope_write_kv writes with, and decode attention
// that dequantizes each K and V row as it reads it. Built with the other ops (-ffp-contract=off; the dot
// products and the weighted sum use FMA on purpose, as decoder_ops.cpp's do).
#include "kv_quant.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace tokenmill {

namespace {

constexpr float kInt8Max = 127.f, kFp8Max = 448.f;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// every float8 e4m3fn byte as a float: a table lookup instead of c10's bit manipulation per value
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits) values[bits] = static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table;
}

// D one-byte values * scale -> D floats
void dequantize_row(const uint8_t* src, bool fp8, float scale, int64_t D, float* dst) {
  if (fp8) {
    const std::array<float, 256>& values = fp8_values();
    for (int64_t i = 0; i < D; ++i) dst[i] = values[src[i]] * scale;
    return;
  }
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s));
  }
  for (; i < D; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(src[i])) * scale;
}

float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum(acc);
  for (; i < D; ++i) total += a[i] * b[i];
  return total;
}

void add_scaled(float weight, const float* row, int64_t D, float* acc) {  // acc += weight * row
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(row + i), _mm256_loadu_ps(acc + i)));
  for (; i < D; ++i) acc[i] += weight * row[i];
}

void softmax(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) { scores[j] = std::exp(scores[j] - top); total += scores[j]; }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) scores[j] *= inv;
}

// One (request, KV head) job: its G query heads against the n positions from `start` of its context.
template <typename S>
void attend_job(const S* q, const uint8_t* kc, const uint8_t* vc, const c10::Half* ks, const c10::Half* vs, bool fp8,
                const int64_t* pages, int64_t BS, int64_t KVH, int64_t kvh, int64_t start, int64_t L, int64_t G,
                int64_t D, float scale, float cap, S* out, std::vector<float>& scratch) {
  const int64_t n = L - start;
  scratch.resize(G * D * 2 + D + G * n);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* row = acc + G * D;
  float* scores = row + D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(q[i]);
  for (int64_t p = start; p < L; ++p) {  // scores[g, p] = q_g . k_p * scale
    const int64_t slot_head = (pages[p / BS] * BS + p % BS) * KVH + kvh;
    dequantize_row(kc + slot_head * D, fp8, static_cast<float>(ks[slot_head]), D, row);
    for (int64_t g = 0; g < G; ++g) {
      const float s = dot(qf + g * D, row, D) * scale;
      scores[g * n + p - start] = cap > 0.f ? std::tanh(s / cap) * cap : s;
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax(scores + g * n, n);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t p = start; p < L; ++p) {  // acc_g = sum_p w[g, p] v_p
    const int64_t slot_head = (pages[p / BS] * BS + p % BS) * KVH + kvh;
    dequantize_row(vc + slot_head * D, fp8, static_cast<float>(vs[slot_head]), D, row);
    for (int64_t g = 0; g < G; ++g) add_scaled(scores[g * n + p - start], row, D, acc + g * D);
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<S>(acc[i]);
}

}  // namespace

void check_kv_scales(const at::Tensor& cache, const at::Tensor& scales, const char* op, const char* name) {
  TORCH_CHECK(is_quantized_kv(cache.scalar_type()), op, ": ", name, " are given, so its cache must be int8 or "
              "float8_e4m3fn, got ", cache.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == cache.size(0) && scales.size(1) == cache.size(1) && scales.size(2) == cache.size(2),
              op, ": ", name, " must be contiguous float16 [", cache.size(0), ", ", cache.size(1), ", ", cache.size(2),
              "], got ", scales.scalar_type(), " ", scales.sizes());
}

void quantize_kv_row(const float* x, int64_t D, bool fp8, uint8_t* dst, c10::Half* scale) {
  const float qmax = fp8 ? kFp8Max : kInt8Max;
  float absmax = 0.f;
  for (int64_t i = 0; i < D; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const c10::Half stored(absmax / qmax);
  *scale = stored;
  const float s = static_cast<float>(stored), inv = s > 0.f ? 1.f / s : 0.f;  // an all-zero row stays 0
  for (int64_t i = 0; i < D; ++i) {
    const float v = std::min(std::max(x[i] * inv, -qmax), qmax);
    if (fp8) {
      dst[i] = c10::Float8_e4m3fn(v).x;
    } else {
      dst[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)));  // nearest even, as torch.round
    }
  }
}

void paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                      const at::Tensor& key_scales, const at::Tensor& value_scales,
                                      const at::Tensor& rows, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                                      at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), BS = key_cache.size(1), KVH = key_cache.size(2);
  const int64_t B = rows.numel(), G = H / KVH, max_blocks = block_tables.size(1);
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const uint8_t* kc = static_cast<const uint8_t*>(key_cache.data_ptr());
  const uint8_t* vc = static_cast<const uint8_t*>(value_cache.data_ptr());
  const c10::Half* ks = key_scales.data_ptr<c10::Half>();
  const c10::Half* vs = value_scales.data_ptr<c10::Half>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  auto run = [&](auto tag) {
    using S = decltype(tag);
    const S* qp = q.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t b = job / KVH, kvh = job % KVH, L = ctx[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t first = (row[b] * H + kvh * G) * D;  // the job's G query heads, contiguous
        attend_job(qp + first, kc, vc, ks, vs, fp8, table + b * max_blocks, BS, KVH, kvh, start, L, G, D, fscale, cap,
                   op + first, scratch);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
}

}  // namespace tokenmill
