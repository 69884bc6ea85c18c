// Quantized KV pages on CPU (kv_quant.h): the row quantizer rope_write_kv writes with, and decode attention
// over the stored bytes: key rows widened to floats eight at a time, each key's scale applied to its dot products
// and each value's folded into its softmax weight (the same products as dequantize-then-attend, in float32). Built with the other ops (-ffp-contract=off; the dot
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
#include <type_traits>
#include <vector>

namespace tokenmill {

namespace {

constexpr float kInt8Max = 127.f, kFp8Max = 448.f;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// every float8 e4m3fn byte as a float (the scalar tails; the vector loads use load8_values' bit moves)
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits) {
      values[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    }
    return values;
  }();
  return table;
}

// one stored value as a float, not yet scaled
template <bool FP8>
inline float value_at(const uint8_t* p) {
  return FP8 ? fp8_values()[*p] : static_cast<float>(static_cast<int8_t>(*p));
}

// 8 stored values at p as floats, not yet scaled. int8: sign-extended. float8 e4m3fn: its exponent and mantissa
// moved into a float32's (bits << 20), times 2^120 (the bias difference, 127 - 7), which also makes its subnormals
// float32 subnormals of the right value (were denormals flushed, which torch does not do by default, they would
// read as 0: under 1/64 of a step); the sign moved to bit 31. Checked against torch for all 256 codes but NaN,
// which the writer never stores (it clamps to +-448).
template <bool FP8>
inline __m256 load8_values(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (!FP8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256i wide = _mm256_cvtepu8_epi32(bytes);
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(wide, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(wide, _mm256_set1_epi32(0x80)), 24);
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// In a step the pages come from memory at addresses the hardware prefetcher cannot guess (each position's row
// sits in its own page slot): both loops ask for the rows kPrefetchAhead positions on, as decoder_ops.cpp's
// float loops do (measured there: 209-224 us a call against 380-433 without, from memory).
constexpr int64_t kPrefetchAhead = 32;

inline void prefetch_row(const uint8_t* row) { _mm_prefetch(reinterpret_cast<const char*>(row), _MM_HINT_T0); }

// sink: an attention sink's logit (gpt-oss), in the max and the denominator but given no weight; -inf: none
void softmax(float* scores, int64_t n, float sink) {
  const float top = std::max(sink, *std::max_element(scores, scores + n));
  float total = std::exp(sink - top);
  for (int64_t j = 0; j < n; ++j) { scores[j] = std::exp(scores[j] - top); total += scores[j]; }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) scores[j] *= inv;
}

// The positions of one (request, KV head) job: where each one's row of values and its scale sit.
struct JobRows {
  const uint8_t* keys;  // key_cache's bytes; row p at keys + slot_heads[p] * D
  const uint8_t* values;
  const c10::Half* key_scales;  // scale of row p at key_scales[slot_heads[p]]
  const c10::Half* value_scales;
  const int64_t* slot_heads;  // [n]: slot * KVH + kv_head of each position
  int64_t n, D;
};

// scores[g * n + j] = scale * q_g . k_j, k_j = key row j dequantized. Head dims that are a multiple of 8: eight
// rows at a time widened to floats once (into rows, 8 x D), then each query head's eight dot products in
// independent FMA chains and one transposing sum, the scales applied to the sums; else one value at a time.
template <bool FP8>
void key_scores(const float* qf, int64_t G, const JobRows& job, float scale, float* rows, float* scores) {
  const int64_t n = job.n, D = job.D;
  if (D % 8 != 0) {
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* k = job.keys + job.slot_heads[j] * D;
      const float k_scale = static_cast<float>(job.key_scales[job.slot_heads[j]]) * scale;
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t i = 0; i < D; ++i) dot += qf[g * D + i] * value_at<FP8>(k + i);
        scores[g * n + j] = dot * k_scale;
      }
    }
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int64_t j = j0 + kPrefetchAhead; j < std::min(n, j0 + kPrefetchAhead + 8); ++j) {
      for (int64_t i = 0; i < D; i += 64) prefetch_row(job.keys + job.slot_heads[j] * D + i);  // a line at a time
    }
    float k_scales[8];
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t slot_head = job.slot_heads[j0 + std::min(j, count - 1)];
      const uint8_t* k = job.keys + slot_head * D;
      for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(rows + j * D + i, load8_values<FP8>(k + i));
      k_scales[j] = static_cast<float>(job.key_scales[slot_head]) * scale;
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qf + g * D + i);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + j * D + i), a[j]);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, _mm256_mul_ps(transposed_sums(a), _mm256_loadu_ps(k_scales)));
      for (int64_t j = 0; j < count; ++j) scores[g * n + j0 + j] = lanes[j];
    }
  }
}

// out[g][d0 : d0 + 16] = sum_j w[g][j] * v_j[d0 : d0 + 16] for GB query heads (w's rows n apart, out's D), w
// already times v_j's scale: each 16 values of a V row widened once for all GB heads, 2 GB accumulators in registers
template <int GB, bool FP8>
inline void weighted_rows(const float* w, const JobRows& job, int64_t d0, float* out) {
  const int64_t n = job.n, D = job.D;
  __m256 a[GB][2];
  for (int g = 0; g < GB; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) prefetch_row(job.values + job.slot_heads[j + kPrefetchAhead] * D + d0);
    const uint8_t* v = job.values + job.slot_heads[j] * D + d0;
    const __m256 low = load8_values<FP8>(v), high = load8_values<FP8>(v + 8);
    for (int g = 0; g < GB; ++g) {
      const __m256 wv = _mm256_set1_ps(w[g * n + j]);
      a[g][0] = _mm256_fmadd_ps(wv, low, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(wv, high, a[g][1]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    _mm256_storeu_ps(out + g * D + d0, a[g][0]);
    _mm256_storeu_ps(out + g * D + d0 + 8, a[g][1]);
  }
}

// out[g] = sum_j w[g][j] * v_j for the G query heads (w: G rows of n weights already times v_j's scale; out: G x D)
template <bool FP8>
void weighted_sums(const float* w, int64_t G, const JobRows& job, float* out) {
  const int64_t n = job.n, D = job.D;
  if (D % 16 != 0) {
    std::fill(out, out + G * D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* v = job.values + job.slot_heads[j] * D;
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < D; ++i) out[g * D + i] += w[g * n + j] * value_at<FP8>(v + i);
      }
    }
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    for (int64_t g0 = 0; g0 < G; g0 += 6) {  // 6 heads x 2 registers of accumulators, 2 of V, 1 weight
      const float* wg = w + g0 * n;
      float* og = out + g0 * D;
      switch (std::min<int64_t>(6, G - g0)) {
        case 1: weighted_rows<1, FP8>(wg, job, d0, og); break;
        case 2: weighted_rows<2, FP8>(wg, job, d0, og); break;
        case 3: weighted_rows<3, FP8>(wg, job, d0, og); break;
        case 4: weighted_rows<4, FP8>(wg, job, d0, og); break;
        case 5: weighted_rows<5, FP8>(wg, job, d0, og); break;
        default: weighted_rows<6, FP8>(wg, job, d0, og); break;
      }
    }
  }
}

// One (request, KV head) job: its G query heads (q, out: G x D) against the n positions of job. The value
// scales are folded into the softmax weights, so no row is ever dequantized on its own.
template <typename S, bool FP8>
void attend_job(const S* q, const JobRows& job, int64_t G, float scale, float cap, const S* sinks, S* out,
                std::vector<float>& scratch) {
  const int64_t n = job.n, D = job.D;
  scratch.resize(G * D * 2 + 8 * D + G * n);  // q, the output, 8 widened key rows, the scores
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* rows = acc + G * D;
  float* scores = rows + 8 * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(q[i]);
  key_scores<FP8>(qf, G, job, scale, rows, scores);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    if (cap > 0.f) {
      for (int64_t j = 0; j < n; ++j) sg[j] = std::tanh(sg[j] / cap) * cap;
    }
    softmax(sg, n, sinks ? static_cast<float>(sinks[g]) : -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; ++j) sg[j] *= static_cast<float>(job.value_scales[job.slot_heads[j]]);
  }
  weighted_sums<FP8>(scores, G, job, acc);
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
                                      at::Tensor& out, const c10::optional<at::Tensor>& sinks) {
  const int64_t H = q.size(1), D = q.size(2), BS = key_cache.size(1), KVH = key_cache.size(2);
  const int64_t B = rows.numel(), G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const uint8_t* kc = static_cast<const uint8_t*>(key_cache.data_ptr());
  const uint8_t* vc = static_cast<const uint8_t*>(value_cache.data_ptr());
  const c10::Half* ks = key_scales.data_ptr<c10::Half>();
  const c10::Half* vs = value_scales.data_ptr<c10::Half>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  auto run = [&](auto tag, auto fp8_tag) {
    using S = decltype(tag);
    constexpr bool FP8 = decltype(fp8_tag)::value;
    const S* qp = q.data_ptr<S>();
    S* op = out.data_ptr<S>();
    const S* sp = sinks.has_value() ? sinks->data_ptr<S>() : nullptr;
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      std::vector<int64_t> slot_heads;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t b = job / KVH, kvh = job % KVH, L = ctx[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t* pages = table + b * max_blocks;
        slot_heads.resize(L - start);
        for (int64_t p = start; p < L; ++p) slot_heads[p - start] = (pages[p / BS] * BS + p % BS) * KVH + kvh;
        const JobRows rows_of_job{kc, vc, ks, vs, slot_heads.data(), L - start, D};
        const int64_t first = (row[b] * H + kvh * G) * D;  // the job's G query heads, contiguous
        attend_job<S, FP8>(qp + first, rows_of_job, G, fscale, cap, sp ? sp + kvh * G : nullptr, op + first,
                           scratch);
      }
    });
  };
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (q.scalar_type() == at::kFloat) {
    fp8 ? run(float{}, std::true_type{}) : run(float{}, std::false_type{});
  } else {
    fp8 ? run(c10::BFloat16{}, std::true_type{}) : run(c10::BFloat16{}, std::false_type{});
  }
}

}  // namespace tokenmill
