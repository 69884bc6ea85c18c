// The small ops of a decoder layer, fused for CPU: RMS norm (with the residual add before it), SwiGLU /
// GeGLU, q/k norm + RoPE + the K/V cache write, and decode attention that reads K/V from the paged cache in
// place. In eager torch each of these is 3-40 ATen calls (a decode step of the default model made ~5,000),
// and at a few rows every call costs more than its arithmetic; here each is one call, and attention no
// longer gathers each request's pages into a contiguous copy first.
//
// Same arithmetic as worker/model.py's reference, in the same order (float32 inside; for bfloat16 the
// results are rounded where the reference rounds), so the float32 path stays within float rounding of
// the reference (tests/worker/paths/test_decoder_ops.py). Built with -ffp-contract=off: no FMA contraction
// changes the reference's rounding behind our back, except where a loop says it uses FMA (dot products).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "kv_quant.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using tokenmill::hsum;
using tokenmill::transposed_sums;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline c10::BFloat16 from_float<c10::BFloat16>(float v) { return c10::BFloat16(v); }
// a value as the reference holds it after one op in dtype T (bfloat16 rounds each op's result)
template <typename T> inline float rounded(float v) { return to_float(from_float<T>(v)); }

// 8 values of T at p -> 8 floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

template <typename T> inline __m256 rounded8(__m256 v) { return v; }
template <> inline __m256 rounded8<c10::BFloat16>(__m256 v) { return _mm256_castsi256_ps(tokenmill::bf16_bits(v)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { tokenmill::store_bf16x8(p, v); }

// e^x for 8 lanes (Cephes' polynomial, as the usual avx_mathfun): relative error ~1e-7, e^x = 0 below
// -87.3 (softmax's -inf scores and masked positions come out as exactly 0)
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(below, y);
}

// float32 or bfloat16 only (AT_DISPATCH_FLOATING_TYPES would add double, which nothing here runs in)
template <typename F>
void dispatch(at::ScalarType type, F&& body) {
  if (type == at::kFloat) {
    body(float{});
  } else {
    body(c10::BFloat16{});
  }
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": expected a [rows, features] tensor with unit inner stride, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only, got ", x.scalar_type());
}

// y = w * rms_norm(x) on one row, as worker.model.RMSNorm: normalise in float32, round to T, scale in T
template <typename T>
inline void rms_norm_row(const T* x, const T* w, float eps, int64_t n, T* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) { const float v = to_float(x[i]); sum += v * v; }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(to_float(w[i]) * rounded<T>(to_float(x[i]) * inv));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [", x.size(1), "] of ", x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * x.stride(0), wp, static_cast<float>(eps), n, op + r * n);
    });
  });
  return out;
}

// (h, w * rms_norm(h)) for h = x + delta: the residual join and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x ", x.sizes(), " and delta ", delta.sizes(), " differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [", x.size(1), "] of ", x.scalar_type());
  at::Tensor h = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * x.stride(0);
        const scalar_t* dr = dp + r * delta.stride(0);
        scalar_t* hr = hp + r * n;
        for (int64_t i = 0; i < n; ++i) hr[i] = from_float<scalar_t>(to_float(xr[i]) + to_float(dr[i]));
        rms_norm_row(hr, wp, static_cast<float>(eps), n, op + r * n);
      }
    });
  });
  return {h, out};
}

// [rows, 2I] (gate | up) -> act(gate) * up: SiLU, or GeLU with the tanh approximation (gemma)
at::Tensor act_mul(const at::Tensor& gate_up, bool gelu_tanh) {
  check_rows(gate_up, "act_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "act_mul: odd width ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t chunk = 256;  // elements per task: rows of one decode row split across threads too
    const int64_t per_row = (inter + chunk - 1) / chunk;
    at::parallel_for(0, rows * per_row, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r = t / per_row, i0 = (t % per_row) * chunk, i1 = std::min(inter, i0 + chunk);
        const scalar_t* g = gp + r * gate_up.stride(0);
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        int64_t i = i0;
        for (; i + 8 <= i1; i += 8) {
          const __m256 gv = load8(g + i);
          __m256 a;
          if (gelu_tanh) {  // 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (e^{2y} + 1)
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_add_ps(gv, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
            const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.f), y));
            const __m256 th = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                            _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
            a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), _mm256_add_ps(_mm256_set1_ps(1.f), th));
          } else {  // g / (1 + e^-g)
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            a = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
          }
          // the activation rounded to the dtype, times up, rounded again: the reference's two ops
          store8(o + i, _mm256_mul_ps(rounded8<scalar_t>(a), load8(u + i)));
        }
        for (; i < i1; ++i) {
          const float gv = to_float(g[i]);
          float a;
          if (gelu_tanh) {
            a = 0.5f * gv * (1.f + std::tanh(0.7978845608028654f * (gv + 0.044715f * gv * gv * gv)));
          } else {
            a = gv / (1.f + std::exp(-gv));
          }
          o[i] = from_float<scalar_t>(rounded<scalar_t>(a) * to_float(u[i]));
        }
      }
    });
  });
  return out;
}

// k and v rows (D values of T) quantized into row slot_head (slot * KVH + head) of int8 / float8 caches and their scales
template <typename T>
void write_quantized_rows(const T* k, const T* v, int64_t D, int64_t slot_head, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& key_scales, const at::Tensor& value_scales,
                          std::vector<float>& row) {
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  for (int64_t i = 0; i < D; ++i) row[i] = to_float(k[i]);
  tokenmill::quantize_kv_row(row.data(), D, fp8, static_cast<uint8_t*>(key_cache.data_ptr()) + slot_head * D,
                             key_scales.data_ptr<c10::Half>() + slot_head);
  for (int64_t i = 0; i < D; ++i) row[i] = to_float(v[i]);
  tokenmill::quantize_kv_row(row.data(), D, fp8, static_cast<uint8_t*>(value_cache.data_ptr()) + slot_head * D,
                             value_scales.data_ptr<c10::Half>() + slot_head);
}

// q/k norm (optional) and RoPE on the q and k parts of a fused qkv projection, then k and v written to
// their cache slots. Returns (q [T, H, D], k [T, KVH, D]) rotated; the prefill path reads k from here.
// cos / signed_sin: [T, 1, D] (worker.model.rope_cos_sin's convention: x * cos + rotate_half(x) * sin).
// With key_scales / value_scales the caches are int8 or float8 pages (kv_quant.h): each row is quantized.
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                 const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                                                 const c10::optional<at::Tensor>& q_norm,
                                                 const c10::optional<at::Tensor>& k_norm, double eps,
                                                 const c10::optional<at::Tensor>& key_scales,
                                                 const c10::optional<at::Tensor>& value_scales) {
  check_rows(qkv, "rope_write_kv");
  const int64_t T = qkv.size(0), D = key_cache.size(3), H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "rope_write_kv: qkv width ", qkv.size(1), " is not (", H, " + 2 * ",
              KVH, ") * ", D);
  const bool quantized = key_scales.has_value();
  TORCH_CHECK(key_scales.has_value() == value_scales.has_value(), "rope_write_kv: key_scales and value_scales come together");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.size(2) == KVH &&
              (quantized || key_cache.scalar_type() == qkv.scalar_type()) && value_cache.sizes() == key_cache.sizes() &&
              value_cache.scalar_type() == key_cache.scalar_type(),
              "rope_write_kv: caches must be contiguous [blocks, block_size, ", KVH, ", ", D, "] of ", qkv.scalar_type(),
              " (or int8 / float8_e4m3fn with scales)");
  if (quantized) {
    tokenmill::check_kv_scales(key_cache, *key_scales, "rope_write_kv", "key_scales");
    tokenmill::check_kv_scales(value_cache, *value_scales, "rope_write_kv", "value_scales");
  }
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == T && cos.size(2) == D && cos.stride(2) == 1 && sin.sizes() == cos.sizes() &&
              sin.stride(2) == 1 && cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_write_kv: cos/sin must be [", T, ", 1, ", D, "] of ", qkv.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "rope_write_kv: slot_mapping must be [", T, "] int64");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_write_kv: q_norm and k_norm come together");
  if (q_norm) {
    TORCH_CHECK(q_norm->is_contiguous() && q_norm->numel() == D && k_norm->is_contiguous() && k_norm->numel() == D &&
                q_norm->scalar_type() == qkv.scalar_type() && k_norm->scalar_type() == qkv.scalar_type(),
                "rope_write_kv: q/k norm weights must be [", D, "] of ", qkv.scalar_type());
  }
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "rope_write_kv: slot ", slot[t], " of row ", t, " outside the cache (",
                slots, " slots)");
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options()), k = at::empty({T, KVH, D}, qkv.options());
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const scalar_t* qn = q_norm ? q_norm->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kn = k_norm ? k_norm->data_ptr<scalar_t>() : nullptr;
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* kc = quantized ? nullptr : key_cache.data_ptr<scalar_t>();
    scalar_t* vc = quantized ? nullptr : value_cache.data_ptr<scalar_t>();
    const int64_t half = D / 2;
    at::parallel_for(0, T * (H + KVH), 8, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> normed(D);
      std::vector<float> row(D);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / (H + KVH), head = job % (H + KVH);
        const scalar_t* x = src + t * qkv.stride(0) + head * D;
        const bool is_q = head < H;
        if (qn != nullptr) {
          rms_norm_row(x, is_q ? qn : kn, static_cast<float>(eps), D, normed.data());
          x = normed.data();
        }
        const scalar_t* c = cp + t * cos.stride(0);
        const scalar_t* s = sp + t * sin.stride(0);
        scalar_t* dst = is_q ? qp + (t * H + head) * D : kp + (t * KVH + head - H) * D;
        for (int64_t i = 0; i < D; ++i) {
          const float swapped = to_float(x[i < half ? i + half : i - half]);
          dst[i] = from_float<scalar_t>(rounded<scalar_t>(to_float(x[i]) * to_float(c[i])) +
                                        rounded<scalar_t>(swapped * to_float(s[i])));
        }
        if (!is_q) {
          const int64_t kvh = head - H;
          const scalar_t* v = src + t * qkv.stride(0) + (H + KVH + kvh) * D;
          if (quantized) {
            write_quantized_rows(dst, v, D, slot[t] * KVH + kvh, key_cache, value_cache, *key_scales, *value_scales, row);
          } else {
            std::copy(dst, dst + D, kc + (slot[t] * KVH + kvh) * D);
            std::copy(v, v + D, vc + (slot[t] * KVH + kvh) * D);
          }
        }
      }
    });
  });
  return {q, k};
}

// The 8 dot products of q (D floats) with rows k[0..7] (D values of T each), lane j holding row j's: eight
// independent FMA chains, then one transposing reduction, where a dot and its horizontal sum at a time
// waited on each FMA's latency (32 rows of the default model: 1.23 ms a layer before).
template <typename T>
inline __m256 dot8(const float* q, const T* const* k, int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(k[j] + i), a[j]);
  }
  return transposed_sums(a);
}

// In a step the pages come from memory, not cache (the other layers' pages and the weights passed through
// since), and each position's row is a short read at its own address: 32 rows at context 160, two
// threads, Sapphire Rapids, bfloat16, ran at 380-433 us a call from memory against ~175 with the pages in
// cache (scripts/bench_decode_attention.py --from-memory). So the q.k and p.V loops ask for the rows
// kPrefetchAhead positions on while they work on these: 209-224 us from memory (16 ahead: ~15% slower).
constexpr int64_t kPrefetchAhead = 32;

template <typename T>
inline void prefetch_row(const T* row, int64_t count) {  // count values of a K or V row, a cache line at a time
  for (int64_t i = 0; i < count; i += 64 / static_cast<int64_t>(sizeof(T)))
    _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// out[0 : 8 NC] = sum_j w[j] * v_j[d0 : d0 + 8 NC], v_j at vc + offsets[j]: NC accumulators in registers
// over every position, in position order (the same sums, in the same order, as one position at a time)
template <int NC, typename T>
inline void weighted_rows(const float* w, int64_t n, const T* vc, const int64_t* offsets, int64_t d0, float* out) {
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < std::min(n, kPrefetchAhead); ++j) prefetch_row(vc + offsets[j] + d0, 8 * NC);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) prefetch_row(vc + offsets[j + kPrefetchAhead] + d0, 8 * NC);
    const __m256 wv = _mm256_set1_ps(w[j]);
    const T* v = vc + offsets[j] + d0;
    for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(wv, load8(v + 8 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, a[c]);
}

template <typename T>
void weighted_sum(const float* w, int64_t n, const T* vc, const int64_t* offsets, int64_t D, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 64 values (8 registers) at a time
    switch (std::min<int64_t>(8, (D - d0) / 8)) {
      case 1: weighted_rows<1>(w, n, vc, offsets, d0, out + d0); break;
      case 2: weighted_rows<2>(w, n, vc, offsets, d0, out + d0); break;
      case 3: weighted_rows<3>(w, n, vc, offsets, d0, out + d0); break;
      case 4: weighted_rows<4>(w, n, vc, offsets, d0, out + d0); break;
      case 5: weighted_rows<5>(w, n, vc, offsets, d0, out + d0); break;
      case 6: weighted_rows<6>(w, n, vc, offsets, d0, out + d0); break;
      case 7: weighted_rows<7>(w, n, vc, offsets, d0, out + d0); break;
      default: weighted_rows<8>(w, n, vc, offsets, d0, out + d0); break;
    }
  }
}

// bfloat16 decode attention with AVX-512 where the CPU has avx512_bf16 (chosen at run time; the build
// stays AVX2): q.k by vdpbf16ps (bfloat16 pairs multiplied exactly, summed in float32: no conversion of
// either side), p.V in 16 float32 lanes with every query head of a KV head sharing each V row's
// conversion. Head dims that are multiples of 64. Same p.V sums, in the same order, as the AVX2 path.


TOKENMILL_AVX512_BF16
void scores_bf16_avx512(const c10::BFloat16* q, const c10::BFloat16* kc, const int64_t* offsets, int64_t n,
                        int64_t G, int64_t D, float scale, float* scores) {
  for (int64_t j = 0; j < std::min(n, kPrefetchAhead); ++j) prefetch_row(kc + offsets[j], D);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int64_t j = j0 + kPrefetchAhead; j < std::min(n, j0 + kPrefetchAhead + 8); ++j) prefetch_row(kc + offsets[j], D);
    const c10::BFloat16* keys[8];
    for (int64_t j = 0; j < 8; ++j) keys[j] = kc + offsets[j0 + std::min(j, count - 1)];
    for (int64_t g = 0; g < G; ++g) {
      __m512 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < D; i += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * D + i);
        for (int j = 0; j < 8; ++j) a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(keys[j] + i));
      }
      __m256 halves[8];
      for (int j = 0; j < 8; ++j) halves[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
      float lanes[8];
      _mm256_storeu_ps(lanes, _mm256_mul_ps(transposed_sums(halves), _mm256_set1_ps(scale)));
      for (int64_t j = 0; j < count; ++j) scores[g * n + j0 + j] = lanes[j];
    }
  }
}

// out[g][d0 : d0 + 64] = sum_j w[g][j] v_j[d0 : d0 + 64] for GB query heads (rows n apart in w, D in out)
template <int GB>
TOKENMILL_AVX512_BF16 inline void weighted_rows_avx512(const float* w, int64_t n, const c10::BFloat16* vc,
                                                       const int64_t* offsets, int64_t d0, float* out, int64_t D) {
  __m512 a[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < std::min(n, kPrefetchAhead); ++j) prefetch_row(vc + offsets[j] + d0, 64);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) prefetch_row(vc + offsets[j + kPrefetchAhead] + d0, 64);
    const c10::BFloat16* v = vc + offsets[j] + d0;
    __m512 rows[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c));
      rows[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    for (int g = 0; g < GB; ++g) {
      const __m512 wv = _mm512_set1_ps(w[g * n + j]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(wv, rows[c], a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * D + d0 + 16 * c, a[g][c]);
}

TOKENMILL_AVX512_BF16
void weighted_sum_bf16_avx512(const float* scores, int64_t n, int64_t G, const c10::BFloat16* vc,
                              const int64_t* offsets, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    for (int64_t g0 = 0; g0 < G; g0 += 6) {  // 6 heads x 4 registers of accumulators, 4 of V, 1 weight
      const float* w = scores + g0 * n;
      float* out = acc + g0 * D;
      switch (std::min<int64_t>(6, G - g0)) {
        case 1: weighted_rows_avx512<1>(w, n, vc, offsets, d0, out, D); break;
        case 2: weighted_rows_avx512<2>(w, n, vc, offsets, d0, out, D); break;
        case 3: weighted_rows_avx512<3>(w, n, vc, offsets, d0, out, D); break;
        case 4: weighted_rows_avx512<4>(w, n, vc, offsets, d0, out, D); break;
        case 5: weighted_rows_avx512<5>(w, n, vc, offsets, d0, out, D); break;
        default: weighted_rows_avx512<6>(w, n, vc, offsets, d0, out, D); break;
      }
    }
  }
}

// Decode attention over the paged cache, in place: rows[b] of q (one query token of request b, context
// context_lens[b] ending at that token) attends to the keys its block table names, read straight from
// the cache pages; the query heads sharing a KV head (GQA) go together so each key is read once for all
// of them. Writes out[rows[b]]. window > 0: only the last `window` positions; softcap > 0: gemma2's
// tanh cap on the scores. Scores and the weighted sum are float32, as SDPA's CPU kernel keeps them.
// With key_scales / value_scales the caches are int8 or float8 pages (kv_quant.h), dequantized as read.
// sinks [H] (gpt-oss): each query head's learned logit joins its softmax's max and denominator, carrying no value.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t window, double softcap, at::Tensor& out,
                            const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
                            const c10::optional<at::Tensor>& sinks) {
  const bool quantized = key_scales.has_value();
  TORCH_CHECK(key_scales.has_value() == value_scales.has_value(),
              "paged_decode_attention: key_scales and value_scales come together");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged_decode_attention: float32 or "
              "bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.sizes() == q.sizes() && out.is_contiguous() &&
              out.scalar_type() == q.scalar_type(), "paged_decode_attention: q and out must be contiguous [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              value_cache.sizes() == key_cache.sizes() && (quantized || key_cache.scalar_type() == q.scalar_type()) &&
              value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_decode_attention: caches must be contiguous [blocks, block_size, KVH, D] of ", q.scalar_type(),
              " (or int8 / float8_e4m3fn with scales)");
  if (quantized) {
    tokenmill::check_kv_scales(key_cache, *key_scales, "paged_decode_attention", "key_scales");
    tokenmill::check_kv_scales(value_cache, *value_scales, "paged_decode_attention", "value_scales");
  }
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), BS = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % KVH == 0, "paged_decode_attention: ", H, " query heads over ", KVH,
              " KV heads of dim ", key_cache.size(3), " (q's is ", D, ")");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->numel() == H && sinks->is_contiguous() &&
                                     sinks->scalar_type() == q.scalar_type()),
              "paged_decode_attention: sinks must be contiguous [", H, "] of ", q.scalar_type());
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong && rows.is_contiguous() && context_lens.is_contiguous() &&
              block_tables.dim() == 2 && block_tables.is_contiguous() && rows.numel() == block_tables.size(0) &&
              context_lens.numel() == rows.numel(),
              "paged_decode_attention: rows [B], block_tables [B, max_blocks], context_lens [B], all int64");
  const int64_t B = rows.numel(), G = H / KVH, max_blocks = block_tables.size(1), num_blocks = key_cache.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(row[b] >= 0 && row[b] < T, "paged_decode_attention: row ", row[b], " outside the batch of ", T);
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= max_blocks * BS, "paged_decode_attention: context ", ctx[b], " of row ", row[b],
                " does not fit its ", max_blocks, " pages of ", BS);
    for (int64_t i = 0; i < (ctx[b] + BS - 1) / BS; ++i) {
      TORCH_CHECK(table[b * max_blocks + i] >= 0 && table[b * max_blocks + i] < num_blocks, "paged_decode_attention: page ",
                  table[b * max_blocks + i], " outside the cache of ", num_blocks);
    }
  }
  if (quantized) {
    tokenmill::paged_decode_attention_quantized(q, key_cache, value_cache, *key_scales, *value_scales, rows,
                                                block_tables, context_lens, scale, window, softcap, out, sinks);
    return;
  }
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* sp = sinks.has_value() ? sinks->data_ptr<scalar_t>() : nullptr;
    const bool vector_dim = D % 8 == 0;
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf(G * D), acc(G * D);
      std::vector<int64_t> offsets;  // each position's K/V row in the caches (the same in both)
      for (int64_t job = begin; job < end; ++job) {
        const int64_t b = job / KVH, kvh = job % KVH, L = ctx[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - start;
        const int64_t* pages = table + b * max_blocks;
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qp[(row[b] * H + kvh * G + g) * D + i]);
        }
        offsets.resize(n);
        for (int64_t p = start; p < L; ++p) offsets[p - start] = ((pages[p / BS] * BS + p % BS) * KVH + kvh) * D;
        scores.resize(G * n);
        bool avx512 = false;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) avx512 = tokenmill::cpu_has_avx512_bf16() && D % 64 == 0;
        if (avx512) {
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            scores_bf16_avx512(qp + (row[b] * H + kvh * G) * D, kc, offsets.data(), n, G, D, fscale, scores.data());
          }
          if (cap > 0.f) {
            for (float& score : scores) score = std::tanh(score / cap) * cap;
          }
        } else if (vector_dim) {  // scores[g, p] = q_g . k_p * scale, eight positions at a time
          for (int64_t j = 0; j < std::min(n, kPrefetchAhead); ++j) prefetch_row(kc + offsets[j], D);
          for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t count = std::min<int64_t>(8, n - j0);
            for (int64_t j = j0 + kPrefetchAhead; j < std::min(n, j0 + kPrefetchAhead + 8); ++j) {
              prefetch_row(kc + offsets[j], D);
            }
            const scalar_t* keys[8];
            for (int64_t j = 0; j < 8; ++j) keys[j] = kc + offsets[j0 + std::min(j, count - 1)];
            for (int64_t g = 0; g < G; ++g) {
              float lanes[8];
              _mm256_storeu_ps(lanes, _mm256_mul_ps(dot8(qf.data() + g * D, keys, D), _mm256_set1_ps(fscale)));
              for (int64_t j = 0; j < count; ++j) {
                scores[g * n + j0 + j] = cap > 0.f ? std::tanh(lanes[j] / cap) * cap : lanes[j];
              }
            }
          }
        } else {
          for (int64_t p = 0; p < n; ++p) {
            const scalar_t* kp = kc + offsets[p];
            for (int64_t g = 0; g < G; ++g) {
              const float* qg = qf.data() + g * D;
              float dot = 0.f;
              for (int64_t i = 0; i < D; ++i) dot += qg[i] * to_float(kp[i]);
              float score = dot * fscale;
              if (cap > 0.f) score = std::tanh(score / cap) * cap;
              scores[g * n + p] = score;
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {  // softmax in place, the sink (if any) in its max and denominator
          float* sg = scores.data() + g * n;
          const float sink = sp ? to_float(sp[kvh * G + g]) : -std::numeric_limits<float>::infinity();
          float top = sink;
          for (int64_t j = 0; j < n; ++j) top = std::max(top, sg[j]);
          float total = sp ? std::exp(sink - top) : 0.f;
          int64_t j = 0;
          for (; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sg + j, e);
            total += hsum(e);
          }
          for (; j < n; ++j) { sg[j] = std::exp(sg[j] - top); total += sg[j]; }
          const float inv = 1.f / total;
          for (j = 0; j < n; ++j) sg[j] *= inv;
        }
        if (avx512) {  // acc_g = sum_p p_g * v_p
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            weighted_sum_bf16_avx512(scores.data(), n, G, vc, offsets.data(), D, acc.data());
          }
        } else {
          for (int64_t g = 0; g < G; ++g) {
            float* ag = acc.data() + g * D;
            if (vector_dim) {
              weighted_sum(scores.data() + g * n, n, vc, offsets.data(), D, ag);
            } else {
              std::fill(ag, ag + D, 0.f);
              for (int64_t p = 0; p < n; ++p) {
                const scalar_t* vp = vc + offsets[p];
                for (int64_t i = 0; i < D; ++i) ag[i] += scores[g * n + p] * to_float(vp[i]);
              }
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          scalar_t* dst = op + (row[b] * H + kvh * G + g) * D;
          for (int64_t i = 0; i < D; ++i) dst[i] = from_float<scalar_t>(acc[g * D + i]);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("act_mul(Tensor gate_up, bool gelu_tanh) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor(c!)? key_scales=None, Tensor(d!)? value_scales=None) -> (Tensor, Tensor)");
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor rows, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, float softcap, Tensor(a!) out, Tensor? key_scales=None, "
        "Tensor? value_scales=None, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("act_mul", &act_mul);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
