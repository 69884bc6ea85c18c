// Linears on llama.cpp's quantized blocks exactly as a GGUF file stores them (no conversion, no copy: the
// weight can be the file's own mapped pages), with integer dot products against 8-bit activations, as
// llama.cpp's CPU backend does (vec_dot_q4_K_q8_K and friends; this is our own code, written from the
// block layouts in ggml-common.h).
//
// Activations: each row of x is rounded once per call to int8 in blocks of 256 (one float scale, absmax /
// 127, and the sums of every 16 rounded values), llama.cpp's q8_K. Every weight type here multiplies
// against that one rounding, so the q/k/v (or gate/up) parts of a fused projection, which a Q4_K_M file
// holds in different types, share it. A row whose length is not a multiple of 256 (only the 32-element
// types allow that) ends in one shorter block.
//
// Products: the weight codes are unsigned bytes and the activations signed, so _mm*_maddubs_epi16 takes
// them as they are (a code of at most 63 times 127, twice, fits int16), then _mm*_madd_epi16 against the
// block's integer scales sums them into int32 exactly; one float multiply per 256 values (per 32 for the
// 32-element types). Q8_0's and the IQ4 types' signed codes go through the sign trick (|w| times x with
// w's sign).
// Formats (y = the weight):
//   Q4_K [d f16][dmin f16][12 B: 8 six-bit scales, 8 mins][128 B nibbles]  y = d*sc_j*q - dmin*m_j (32 per j)
//   Q5_K as Q4_K plus [32 B: the fifth bits] before the nibbles
//   Q6_K [128 B low nibbles][64 B high 2 bits][16 x int8 scales][d f16]      y = d*sc_j*(q - 32) (16 per j)
//   Q8_0 [d f16][32 x int8]                                                  y = d*q
//   Q4_0 [d f16][16 B nibbles]                                               y = d*(q - 8)
//   Q5_0 [d f16][4 B fifth bits][16 B nibbles]                               y = d*(q - 16)
//   Q4_1 [d f16][m f16][16 B nibbles]                                        y = d*q + m
//   Q5_1 [d f16][m f16][4 B fifth bits][16 B nibbles]                        y = d*q + m
//   IQ4_NL [d f16][16 B nibbles]                                             y = d*kv[q] (16 signed values)
//   IQ4_XS, Q2_K, Q3_K: see ggml_blocks_lowbit.h
//
// Two instruction sets (`path`: 0 the best this CPU has, 1 AVX2, 2 AVX-512 BW with VNNI's vpdpwssd), so a
// test can force each; the Python side asks for 0, which this CPU's flags answer once. Path 3 adds AMX-INT8
// tiles for Q4_K / Q5_K / Q6_K (ggml_blocks_amx.cpp), which auto takes from kAmxMinRows rows of x; path 4, auto's
// on a CPU without AVX-512 VNNI, adds the AVX2 GEMM for them (ggml_blocks_avx2_gemm.cpp) from kAvx2GemmMinRows. Work:
// output rows split across threads (at::parallel_for), each weight row decoded once per tile of up to 8
// (AVX-512) or 4 (AVX2) rows of x, the next ~1 KiB of rows prefetched. Also here: exact dequantization, to float32 rows (the
// embedding's lookups, tests) and to bfloat16 strips with SIMD (a prefill's GEMMs).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ggml_blocks.h"
#include "simd.h"

using namespace tokenmill::ggml;

int64_t tokenmill::ggml::block_elems(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == IQ4_NL ? 32 : 256;
}
int64_t tokenmill::ggml::block_bytes(int64_t type) {
  if (is_repacked(type)) return repacked_row_share(type);
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "ggml_blocks: no kernel for GGML type ", type);
}

namespace {

constexpr int64_t kPrefetchBytes = 1024;  // see part_rows

bool cpu_has_avx512_vnni() {
  static const bool yes = tokenmill::cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// 16 values of x as float32 (bfloat16: its bits shifted into a float's high half)
template <typename T>
AVX512_TARGET inline __m512 load16(const T* v) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(v);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One full block of 256 rounded as the scalar loop below rounds it, 16 at a time (a 16-row step's linears
// spent ~5% of their time in the scalar loop): the same absmax / 127, the same 1 / d, the product rounded
// half to even by vcvtps2dq under the default MXCSR, as nearbyint does.
template <typename T>
AVX512_TARGET void quantize_block512(const T* v, int8_t* q, int16_t* sums, float* d_out) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 amax = _mm512_setzero_ps();
  for (int j = 0; j < QK; j += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(v + j)));
  const float d = _mm512_reduce_max_ps(amax) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int j = 0; j < QK; j += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(v + j), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(r));
    sums[j / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(r));
  }
  *d_out = d;
}

// 8 values of x as float32 (bfloat16: its bits shifted into a float's high half)
template <typename T>
AVX2_TARGET inline __m256 load8(const T* v) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(v);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// quantize_block512 on AVX2, 32 values a step. The scalar loop below (one value at a time, its 16-value sums
// added in memory, ~10 cycles a value) took 8% of a 512-token MoE layer, whose 4,096 (token, expert) rows are
// each rounded (perf, docs/benchmarks.md "Rounding x on AVX2"). The same bits: the absmax (vmaxps returns its
// second operand on a NaN, as std::max keeps the running maximum), the same / 127 and 1 / d, the product rounded
// half to even by vcvtps2dq as nearbyint does.
template <typename T>
AVX2_TARGET void quantize_block256(const T* v, int8_t* q, int16_t* sums, float* d_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < QK; j += 8) amax = _mm256_max_ps(_mm256_andnot_ps(sign, load8(v + j)), amax);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lanes back to value order
  for (int j = 0; j < QK; j += 32) {
    __m256i r[4];
    for (int k = 0; k < 4; ++k) r[k] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(v + j + 8 * k), vinv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), _mm256_permutevar8x32_epi32(bytes, order));
    // lanes 0 and 4 of h2: the first 16 values' sum in halves, lanes 1 and 5 the next 16's
    const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    const __m256i h2 = _mm256_hadd_epi32(h, h);
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
    sums[j / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(s));
    sums[j / 16 + 1] = static_cast<int16_t>(_mm_extract_epi32(s, 1));
  }
  *d_out = d;
}

template <typename T>
Q8Rows quantize_rows_impl(const T* x, int64_t rows, int64_t K, Q8Buffer& store) {
  Q8Rows r;
  r.T = rows;
  r.K = K;
  r.nb = (K + QK - 1) / QK;
  store.q.assign(rows * r.nb * QK, 0);
  store.d.resize(rows * r.nb);
  store.bsums.assign(rows * r.nb * 16, 0);
  r.q = store.q.data(), r.d = store.d.data(), r.bsums = store.bsums.data();
  const bool wide = cpu_has_avx512_vnni();
  at::parallel_for(0, rows * r.nb, 64, [&](int64_t begin, int64_t end) {
    float buf[QK];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / r.nb, b = i % r.nb, n = std::min(QK, K - b * QK);
      const T* v = x + t * K + b * QK;
      if (n == QK) {  // the scalar loop below for a short last block only
        if (wide)
          quantize_block512(v, store.q.data() + i * QK, store.bsums.data() + i * 16, &store.d[i]);
        else
          quantize_block256(v, store.q.data() + i * QK, store.bsums.data() + i * 16, &store.d[i]);
        continue;
      }
      float amax = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        buf[j] = static_cast<float>(v[j]);
        amax = std::max(amax, std::abs(buf[j]));
      }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = store.q.data() + i * QK;
      int16_t* s = store.bsums.data() + i * 16;
      for (int64_t j = 0; j < n; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(buf[j] * inv));  // half to even, as torch.round
        s[j / 16] += q[j];
      }
      store.d[i] = d;
    }
  });
  return r;
}

// Q4_K / Q5_K's 12 bytes -> scales[0..7], mins[0..7] (six bits each)
inline void k_scales(const uint8_t* p, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 63;
    mn[j] = p[j + 4] & 63;
    sc[j + 4] = (p[j + 8] & 0xF) | ((p[j] >> 6) << 4);
    mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The block kernels, one function per type family and instruction set: TB rows of x (t0..t0+TB) against one
// weight row, the block's codes and scales decoded once for all of them. out[t]: row t's dot product.

AVX2_TARGET inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// sum over 32 elements of (unsigned w) * (signed x) weighted by int16 scale s (one per 32): AVX2
AVX2_TARGET inline __m256i dot32_scaled(__m256i w, __m256i x, __m256i s16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s16);
}

// The minimums' term of Q4_K / Q5_K: sum_j m_j * (bsums[2j] + bsums[2j+1]) as 8 int32, from the mins
// duplicated per 16 values (mins_dup) and x's 16 sums of 16
AVX2_TARGET inline __m256i k4_min_products(__m256i mins_dup, const int16_t* bsums) {
  return _mm256_madd_epi16(mins_dup, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)));
}

// A Q4_K / Q5_K block's scales (sc), and its mins as int16, each twice in a row (mins_dup)
AVX2_TARGET inline __m256i k4_scales(const uint8_t* w, uint8_t (&sc)[8]) {
  uint8_t mn[8];
  k_scales(w + 4, sc, mn);
  uint64_t mn8;
  std::memcpy(&mn8, mn, 8);
  const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn8)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
}

// Q4_K (FIFTH = false) and Q5_K's codes, one 32-element group a register: Q5_K's fifth bit of element
// 64i + l is bit 2i of qh byte l, of element 64i + 32 + l bit 2i + 1
template <bool FIFTH>
AVX2_TARGET inline void k4_groups(const uint8_t* w, __m256i (&lo)[4], __m256i (&hi)[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const uint8_t* qs = w + (FIFTH ? 48 : 16);
  const __m256i qh = FIFTH ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
    lo[i] = _mm256_and_si256(q, m4);
    hi[i] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (FIFTH) {
      lo[i] = _mm256_or_si256(lo[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4));
      hi[i] = _mm256_or_si256(hi[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4));
    }
  }
}

// ---- Q4_K / Q5_K, AVX2 ----
template <bool FIFTH, int TB>
AVX2_TARGET void k4_avx2(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m256 acc[TB], accm[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps(), accm[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += FIFTH ? 176 : 144) {
    const float d = f16(w), dmin = f16(w + 2);
    uint8_t sc[8];
    const __m256i mins_dup = k4_scales(w, sc);
    __m256i lo[4], hi[4];
    k4_groups<FIFTH>(w, lo, hi);
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.qs(t0 + t, b);
      __m256i sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        sum = _mm256_add_epi32(sum, dot32_scaled(lo[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * i)),
                                                 _mm256_set1_epi16(sc[2 * i])));
        sum = _mm256_add_epi32(sum, dot32_scaled(hi[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * i + 32)),
                                                 _mm256_set1_epi16(sc[2 * i + 1])));
      }
      const float dx = x.scale(t0 + t, b);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * dx), acc[t]);
      accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k4_min_products(mins_dup, x.sums(t0 + t, b))),
                                _mm256_set1_ps(dmin * dx), accm[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = tokenmill::hsum(acc[t]) - tokenmill::hsum(accm[t]);
}

AVX512_TARGET inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// two 256-bit halves -> one 512-bit register
AVX512_TARGET inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// per-32 int16 scales for a pair (lanes 0-7: a, 8-15: b), from 8 scales as int16 in s16
AVX512_TARGET inline __m512i pair_scales(__m512i s16, int pair) {
  const __m512i idx = _mm512_set_epi16(2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1,
                                       2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1,
                                       2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair, 2 * pair, 2 * pair,
                                       2 * pair, 2 * pair, 2 * pair, 2 * pair, 2 * pair, 2 * pair, 2 * pair, 2 * pair,
                                       2 * pair, 2 * pair, 2 * pair, 2 * pair, 2 * pair);
  return _mm512_permutexvar_epi16(idx, s16);
}

// Q4_K / Q5_K's codes as 4 registers, each a pair of 32-element groups (2i, 2i + 1)
template <bool FIFTH>
AVX512_TARGET inline void k4_codes(const uint8_t* w, __m512i (&qv)[4]) {
  __m256i lo[4], hi[4];
  k4_groups<FIFTH>(w, lo, hi);
  for (int i = 0; i < 4; ++i) qv[i] = join(lo[i], hi[i]);
}

// 256 codes (bytes, 4 x 64) times one row's 256 q8 values, each 64's int16 products weighted by its scales:
// 16 int32 partial sums (the AVX-512 kernels' inner product)
AVX512_TARGET inline __m512i dot256(const __m512i (&codes)[4], const __m512i (&scales)[4], const int8_t* xq) {
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i)
    sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(codes[i], _mm512_loadu_si512(xq + 64 * i)), scales[i]);
  return sum;
}

template <bool FIFTH, int TB>
AVX512_TARGET void k4_avx512(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m512 acc[TB];
  __m256 accm[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps(), accm[t] = _mm256_setzero_ps();
  const int64_t stride = FIFTH ? 176 : 144;
  for (int64_t b = 0; b < nb; ++b, w += stride) {
    const float d = f16(w), dmin = f16(w + 2);
    uint8_t sc[8];
    const __m256i mins_dup = k4_scales(w, sc);
    uint64_t sc8;
    std::memcpy(&sc8, sc, 8);
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
    __m512i qv[4], sv[4];
    k4_codes<FIFTH>(w, qv);
    for (int i = 0; i < 4; ++i) sv[i] = pair_scales(s16, i);
    for (int t = 0; t < TB; ++t) {
      const __m512i sum = dot256(qv, sv, x.qs(t0 + t, b));
      const float dx = x.scale(t0 + t, b);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[t]);
      accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k4_min_products(mins_dup, x.sums(t0 + t, b))),
                                _mm256_set1_ps(dmin * dx), accm[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = hsum512(acc[t]) - hsum512(_mm512_zextps256_ps512(accm[t]));
}

// ---- Q6_K: per half of 128, elements [0,32) from ql[0..32) low nibbles + qh bits 0-1, [32,64) ql[32..64)
// low + bits 2-3, [64,96) ql[0..32) high + bits 4-5, [96,128) ql[32..64) high + bits 6-7; one int8 scale per
// 16 elements, in order. The -32 is taken off once per block from the 16-element sums of x. ----
AVX2_TARGET inline void q6k_codes(const uint8_t* ql, const uint8_t* qh, __m256i (&e)[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  e[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
  e[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
  e[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
  e[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
}

// sum_j sc[j] * bsums[j] over a block's 16 scales
AVX2_TARGET inline int32_t q6k_offset_sum(const int8_t* sc, const int16_t* bs) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  return hsum_i32(_mm256_madd_epi16(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs))));
}

template <int TB>
AVX2_TARGET void q6k_avx2(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  float acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = 0.f;
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = f16(w + 208);
    __m256i e[8];
    __m256i s16[8];  // each 32 elements: lanes 0-3 (elements 0-15) scale 2j, lanes 4-7 scale 2j+1 after madd
    for (int h = 0; h < 2; ++h) {
      __m256i part[4];
      q6k_codes(w + 64 * h, w + 128 + 32 * h, part);
      for (int j = 0; j < 4; ++j) {
        e[4 * h + j] = part[j];
        const int k = 8 * h + 2 * j;
        s16[4 * h + j] = _mm256_set_m128i(_mm_set1_epi16(sc[k + 1]), _mm_set1_epi16(sc[k]));
      }
    }
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.qs(t0 + t, b);
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sum = _mm256_add_epi32(sum, dot32_scaled(e[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j)), s16[j]));
      const int32_t total = hsum_i32(sum) - 32 * q6k_offset_sum(sc, x.sums(t0 + t, b));
      acc[t] += d * x.scale(t0 + t, b) * static_cast<float>(total);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = acc[t];
}

// The per-16 scales (16 int16 in sc512) for pair p of 64 codes: 128-bit lane L takes scale 4p + L in every int16
AVX512_TARGET inline __m512i lane_scales(__m512i sc512, int p) {
  const short s = static_cast<short>(4 * p);
  return _mm512_permutexvar_epi16(
      _mm512_set_epi16(s + 3, s + 3, s + 3, s + 3, s + 3, s + 3, s + 3, s + 3, s + 2, s + 2, s + 2, s + 2, s + 2, s + 2,
                       s + 2, s + 2, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s, s, s, s, s, s, s, s),
      sc512);
}

// One block of 256 codes e (bytes, 4 x 64) with 16 int16 scales against rows t0.. of x: acc[t] += d * dx *
// sum(code * scale * xq), and corr[t] += f * dx * (term . the row's 16 sums); the caller's result is
// acc - corr. Q6_K (term = its scales, f = 32 d: the codes' -32) and Q2_K / Q3_K (their min or -4 terms).
template <int TB>
AVX512_TARGET inline void block256_avx512(const __m512i (&e)[4], __m256i scale16, __m256i term16, float d, float f,
                                          const Q8Rows& x, int64_t t0, int64_t b, __m512* acc, __m256* corr) {
  const __m512i sc512 = _mm512_castsi256_si512(scale16);
  __m512i sv[4];
  for (int p = 0; p < 4; ++p) sv[p] = lane_scales(sc512, p);
  for (int t = 0; t < TB; ++t) {
    const __m512i sum = dot256(e, sv, x.qs(t0 + t, b));
    const __m256i terms = _mm256_madd_epi16(term16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums(t0 + t, b))));
    const float dx = x.scale(t0 + t, b);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[t]);
    corr[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(terms), _mm256_set1_ps(f * dx), corr[t]);
  }
}

template <int TB>
AVX512_TARGET void q6k_avx512(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m512 acc[TB];
  __m256 acco[TB];  // the -32's term, 8 partial sums
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps(), acco[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = f16(w + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    __m512i e[4];
    for (int h = 0; h < 2; ++h) {
      __m256i part[4];
      q6k_codes(w + 64 * h, w + 128 + 32 * h, part);
      e[2 * h] = join(part[0], part[1]);
      e[2 * h + 1] = join(part[2], part[3]);
    }
    block256_avx512<TB>(e, sc16, sc16, d, 32.f * d, x, t0, b, acc, acco);
  }
  for (int t = 0; t < TB; ++t) out[t] = hsum512(acc[t]) - hsum512(_mm512_zextps256_ps512(acco[t]));
}

#include "ggml_blocks_lowbit.h"

// ---- the 32-element types: a float scale per block, so a float multiply per 32 ----
// Q4_1 / Q5_1's f16 minimum m follows d; their fifth bits and nibbles follow it
inline bool has_min(int64_t type) { return type == Q4_1 || type == Q5_1; }
inline int small_offset(int64_t type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }
// codes that are signed bytes: Q8_0's, and the IQ4 types' table values
inline bool signed_codes(int64_t type) { return type == Q8_0 || type == IQ4_NL || type == IQ4_XS; }

// codes of block b (32 of them, unsigned but Q8_0's and IQ4_NL's) and its offset: w = d*(q - offset), or
// d*q + m
AVX2_TARGET inline __m256i small_codes(int64_t type, const uint8_t* blk) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  if (type == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const uint8_t* qh_at = blk + (has_min(type) ? 4 : 2);
  const bool fifth = type == Q5_0 || type == Q5_1;
  const uint8_t* qs = qh_at + (fifth ? 4 : 0);
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m4), _mm_and_si128(p, m4));
  if (fifth) {  // bit j of the 32-bit qh is element j's fifth bit
    uint32_t qh;
    std::memcpy(&qh, qh_at, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
  return type == IQ4_NL ? iq4_values(q) : q;
}

template <int TB>
AVX2_TARGET void small_avx2(int64_t type, const uint8_t* w, int64_t K, const Q8Rows& x, int64_t t0, float* out) {
  const int64_t bytes = block_bytes(type), blocks = K / 32;
  const int offset = small_offset(type);
  const bool minimum = has_min(type);
  __m256 acc[TB];
  float acco[TB];  // the offset's term, less the minimum's: the block's codes alone are in acc
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps(), acco[t] = 0.f;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b, w += bytes) {
    const float d = f16(w), m = minimum ? f16(w + 2) : 0.f;
    const __m256i q = small_codes(type, w);
    const bool sign = signed_codes(type);
    const __m256i qa = sign ? _mm256_sign_epi8(q, q) : q;
    for (int t = 0; t < TB; ++t) {
      const int64_t xb = b / 8, xo = (b % 8) * 32;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs(t0 + t, xb) + xo));
      const __m256i p = sign ? _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xv, q)) : _mm256_maddubs_epi16(qa, xv);
      const float dx = x.scale(t0 + t, xb);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(d * dx), acc[t]);
      if (offset) {
        const int16_t* bs = x.sums(t0 + t, xb) + (b % 8) * 2;
        acco[t] += d * dx * static_cast<float>(offset * (bs[0] + bs[1]));
      }
      if (minimum) {  // m times x's sum over the 32, as Q4_K's minimums
        const int16_t* bs = x.sums(t0 + t, xb) + (b % 8) * 2;
        acco[t] -= m * dx * static_cast<float>(bs[0] + bs[1]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = tokenmill::hsum(acc[t]) - acco[t];
}

// ---------------------------------------------------------------------------------------------------------
template <int TB>
AVX2_TARGET void row_avx2(const Part& p, const uint8_t* w, int64_t K, const Q8Rows& x, int64_t t0, float* r) {
  const int64_t nb = K / QK;
  switch (p.type) {
    case Q4_K: k4_avx2<false, TB>(w, nb, x, t0, r); break;
    case Q5_K: k4_avx2<true, TB>(w, nb, x, t0, r); break;
    case Q6_K: q6k_avx2<TB>(w, nb, x, t0, r); break;
    case IQ4_XS: iq4xs_avx2<TB>(w, nb, x, t0, r); break;
    case Q2_K: sub16_avx2<Q2_K, TB>(w, nb, x, t0, r); break;
    case Q3_K: sub16_avx2<Q3_K, TB>(w, nb, x, t0, r); break;
    default: small_avx2<TB>(p.type, w, K, x, t0, r); break;
  }
}

template <int TB>
AVX512_TARGET void row_avx512(const Part& p, const uint8_t* w, int64_t K, const Q8Rows& x, int64_t t0, float* r) {
  const int64_t nb = K / QK;
  switch (p.type) {
    case Q4_K: k4_avx512<false, TB>(w, nb, x, t0, r); break;
    case Q5_K: k4_avx512<true, TB>(w, nb, x, t0, r); break;
    case Q6_K: q6k_avx512<TB>(w, nb, x, t0, r); break;
    case IQ4_XS: iq4xs_avx512<TB>(w, nb, x, t0, r); break;
    case Q2_K: sub16_avx512<Q2_K, TB>(w, nb, x, t0, r); break;
    case Q3_K: sub16_avx512<Q3_K, TB>(w, nb, x, t0, r); break;
    default: small_avx2<TB>(p.type, w, K, x, t0, r); break;
  }
}

// rows [n0, n1) of part p (output columns col0 + n) against every row of x
template <bool WIDE, typename Out>
void part_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, const float* bias, Out* out,
               int64_t ldo, int64_t col0) {
  // rows of x per pass over a weight row: its decoded codes and scales stay in registers across them (AVX-512
  // has 32 vector registers, AVX2 16)
  constexpr int64_t tile = WIDE ? 8 : 4;
  float r[8];
  // The next ~1 KiB of rows is requested by hand: the hardware prefetcher alone keeps the integer kernel
  // waiting. One row of x, 2 threads, Sapphire Rapids, weights not in cache (24-28 of them), GB/s without ->
  // with: Q4_K rows of 864 bytes 5.5-9.2 -> 15-19, of 2304 bytes 10.3-10.6 -> 15.6-17.4, of 8064 bytes
  // 9.9-10.1 -> 12.5-13.1; Q6_K rows of 1260 bytes 16.5 -> 22.0, of 7350 bytes 12.9-16.2 -> 14.4-15.3; the
  // one loss, Q6_K rows of 3360 bytes, 19.7-22.5 -> 13.4-13.7 (scripts/bench_ggml_blocks.py --cold).
  const int64_t ahead = (kPrefetchBytes + p.row_bytes - 1) / p.row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.data + n * p.row_bytes;
    if (n + ahead < n1) tokenmill::prefetch_lines(p.data + (n + ahead) * p.row_bytes, p.row_bytes);
    for (int64_t t0 = 0; t0 < x.T; t0 += tile) {
      const int64_t tb = std::min<int64_t>(tile, x.T - t0);
      if (WIDE) {
        switch (tb) {
          case 1: row_avx512<1>(p, w, K, x, t0, r); break;
          case 2: row_avx512<2>(p, w, K, x, t0, r); break;
          case 3: row_avx512<3>(p, w, K, x, t0, r); break;
          case 4: row_avx512<4>(p, w, K, x, t0, r); break;
          case 5: row_avx512<5>(p, w, K, x, t0, r); break;
          case 6: row_avx512<6>(p, w, K, x, t0, r); break;
          case 7: row_avx512<7>(p, w, K, x, t0, r); break;
          default: row_avx512<8>(p, w, K, x, t0, r); break;
        }
      } else {
        switch (tb) {
          case 1: row_avx2<1>(p, w, K, x, t0, r); break;
          case 2: row_avx2<2>(p, w, K, x, t0, r); break;
          case 3: row_avx2<3>(p, w, K, x, t0, r); break;
          default: row_avx2<4>(p, w, K, x, t0, r); break;
        }
      }
      // the bias added in float32, then one rounding to the output's dtype (torch's: nearest even)
      const float b = bias ? bias[col0 + n] : 0.f;
      for (int64_t t = 0; t < tb; ++t) out[(t0 + t) * ldo + col0 + n] = static_cast<Out>(r[t] + b);
    }
  }
}



// Dequantization to bfloat16 for a many-row step's strips (AVX-512 BF16 CPUs): a block's codes are laid
// out as bytes with SIMD (the same unpacking the dot kernels use), then each group of 16 becomes
// scale * code + min in float32, rounded to bfloat16 by vcvtneps2bf16 (nearest even, as torch rounds).
#define AVX512BF16_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")))

// codes [256 or 32] as bytes (signed_codes: as int8) and scale / min per 16 elements
AVX512BF16_TARGET inline int block_groups(int64_t type, const uint8_t* w, uint8_t* codes, float* scale, float* minv) {
  switch (type) {
    case Q4_K: case Q5_K: {
      const float d = f16(w), dmin = f16(w + 2);
      uint8_t sc[8], mn[8];
      k_scales(w + 4, sc, mn);
      __m512i qv[4];
      if (type == Q4_K) k4_codes<false>(w, qv); else k4_codes<true>(w, qv);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(codes + 64 * i, qv[i]);
      for (int j = 0; j < 16; ++j) scale[j] = d * sc[j / 2], minv[j] = -dmin * mn[j / 2];
      return 16;
    }
    case Q6_K: {
      const float d = f16(w + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      for (int h = 0; h < 2; ++h) {
        __m256i part[4];
        q6k_codes(w + 64 * h, w + 128 + 32 * h, part);
        for (int k = 0; k < 4; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 128 * h + 32 * k), part[k]);
      }
      for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(sc[j]), minv[j] = -32.f * scale[j];
      return 16;
    }
    case IQ4_XS: case Q2_K: case Q3_K:
      lowbit_groups(type, w, codes, scale, minv);
      return 16;
    default: {
      const float d = f16(w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), small_codes(type, w));
      const int offset = small_offset(type);
      const float m = has_min(type) ? f16(w + 2) : offset ? -static_cast<float>(offset) * d : 0.f;
      scale[0] = scale[1] = d, minv[0] = minv[1] = m;
      return 2;
    }
  }
}

AVX512BF16_TARGET void dequantize_rows_bf16(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t K,
                                            int64_t rows, at::BFloat16* out) {
  const int64_t per = block_elems(type), bytes = block_bytes(type);
  alignas(64) uint8_t codes[256];
  float scale[16], minv[16];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < K / per; ++b) {
      const int groups = block_groups(type, w + r * row_bytes + b * bytes, codes, scale, minv);
      at::BFloat16* y = out + r * K + b * per;
      for (int g = 0; g < groups; ++g) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * g));
        const __m512i wide = signed_codes(type) ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c);
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale[g]), _mm512_set1_ps(minv[g]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16 * g), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
}

bool cpu_has_avx512_bf16_vnni() {
  static const bool yes = tokenmill::cpu_has_avx512_bf16() && cpu_has_avx512_vnni();
  return yes;
}

// ---------------------------------------------------------------------------------------------------------
// Dequantization, one block at a time (the embedding's lookups, the strips of a many-row step, tests):
// values exactly as gguf-py's dequantize gives them (float32 products of f16 scales and small integers).
void dequantize_block(int64_t type, const uint8_t* w, float* y) {
  switch (type) {
    case IQ4_NL: {
      const float d = f16(w);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(kIQ4Values[w[2 + j] & 0xF]);
        y[j + 16] = d * static_cast<float>(kIQ4Values[w[2 + j] >> 4]);
      }
      return;
    }
    case IQ4_XS: case Q2_K: case Q3_K:
      dequantize_lowbit(type, w, y);
      return;
    case Q4_0: case Q5_0: case Q8_0: case Q4_1: case Q5_1: {
      const float d = f16(w);
      if (type == Q8_0) {
        for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(w[2 + j]));
        return;
      }
      const bool fifth = type == Q5_0 || type == Q5_1, minimum = has_min(type);
      const uint8_t* qh_at = w + (minimum ? 4 : 2);
      uint32_t qh = 0;
      if (fifth) std::memcpy(&qh, qh_at, 4);
      const uint8_t* qs = qh_at + (fifth ? 4 : 0);
      const int offset = small_offset(type);
      const float m = minimum ? f16(w + 2) : 0.f;
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0xF) | (fifth ? ((qh >> j) & 1) << 4 : 0);
        const int hi = (qs[j] >> 4) | (fifth ? ((qh >> (j + 16)) & 1) << 4 : 0);
        if (minimum) {  // gguf-py's (d * q) + m: the product is exact, the sum rounds once
          y[j] = d * static_cast<float>(lo) + m;
          y[j + 16] = d * static_cast<float>(hi) + m;
        } else {
          y[j] = d * static_cast<float>(lo - offset);
          y[j + 16] = d * static_cast<float>(hi - offset);
        }
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = f16(w), dmin = f16(w + 2);
      uint8_t sc[8], mn[8];
      k_scales(w + 4, sc, mn);
      const uint8_t* qh = w + 16;
      const uint8_t* qs = w + (type == Q5_K ? 48 : 16);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * i + l] & 0xF, hi = qs[32 * i + l] >> 4;
          if (type == Q5_K) lo |= ((qh[l] >> (2 * i)) & 1) << 4, hi |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
          y[64 * i + l] = d * sc[2 * i] * lo - dmin * mn[2 * i];
          y[64 * i + 32 + l] = d * sc[2 * i + 1] * hi - dmin * mn[2 * i + 1];
        }
      return;
    }
    case Q6_K: {
      const float d = f16(w + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = w + 64 * h;
        const uint8_t* qh = w + 128 + 32 * h;
        float* out = y + 128 * h;
        for (int l = 0; l < 32; ++l) {
          const int q[4] = {(ql[l] & 0xF) | ((qh[l] & 3) << 4), (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                            (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
          for (int k = 0; k < 4; ++k) {
            const int e = 32 * k + l;
            out[e] = d * static_cast<float>(sc[8 * h + e / 16]) * static_cast<float>(q[k] - 32);
          }
        }
      }
      return;
    }
  }
  TORCH_CHECK(false, "ggml_blocks: no kernel for GGML type ", type);
}

}  // namespace

void tokenmill::ggml::dequantize_bf16_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t rows,
                                           at::BFloat16* out) {
  dequantize_rows_bf16(type, w, row_bytes, K, rows, out);
}

Q8Rows tokenmill::ggml::quantize_rows(const float* x, int64_t rows, int64_t K, Q8Buffer& buf) {
  return quantize_rows_impl(x, rows, K, buf);
}
Q8Rows tokenmill::ggml::quantize_rows(const at::BFloat16* x, int64_t rows, int64_t K, Q8Buffer& buf) {
  return quantize_rows_impl(x, rows, K, buf);
}

template <typename Out>
static void vector_rows_any(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, Out* out, int64_t ldo,
                            int64_t col0, bool wide) {
  if (wide)
    part_rows<true>(p, n0, n1, K, x, nullptr, out, ldo, col0);
  else
    part_rows<false>(p, n0, n1, K, x, nullptr, out, ldo, col0);
}
void tokenmill::ggml::vector_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, float* out,
                                  int64_t ldo, int64_t col0, bool wide) {
  vector_rows_any(p, n0, n1, K, x, out, ldo, col0, wide);
}
void tokenmill::ggml::vector_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, at::BFloat16* out,
                                  int64_t ldo, int64_t col0, bool wide) {
  vector_rows_any(p, n0, n1, K, x, out, ldo, col0, wide);
}

// blocks: uint8 [N, K / block_elems * block_bytes]; rows: int64 indices into N -> float32 [len(rows), K]
at::Tensor ggml_blocks_dequantize(const at::Tensor& blocks, int64_t type, int64_t K, const at::Tensor& rows_in) {
  const int64_t per = block_elems(type), bytes = block_bytes(type);
  TORCH_CHECK(K % per == 0 && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == K / per * bytes,
              "ggml_blocks_dequantize: blocks must be contiguous uint8 [N, ", K / per * bytes, "] for K ", K, ", got ",
              blocks.sizes());
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const int64_t R = rows.numel(), N = blocks.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "ggml_blocks_dequantize: row ", rp[i], " is outside [0, ", N, ")");
  at::Tensor out = at::empty({R, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (is_repacked(type)) {  // each row back in the file's blocks first (ggml_blocks_repack.cpp)
    TORCH_CHECK(N % 8 == 0, "ggml_blocks_dequantize: a repacked weight has rows in groups of 8, got ", N);
    const int64_t plain = file_type(type), plain_bytes = block_bytes(plain);
    at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> row(K / per * plain_bytes);
      for (int64_t i = begin; i < end; ++i) {
        unpack_row(wp, type, K, rp[i], row.data());
        for (int64_t b = 0; b < K / per; ++b) dequantize_block(plain, row.data() + b * plain_bytes, op + i * K + b * per);
      }
    });
    return out;
  }
  at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b = 0; b < K / per; ++b) dequantize_block(type, wp + rp[i] * blocks.size(1) + b * bytes, op + i * K + b * per);
  });
  return out;
}

// rows [row0, row1) of blocks -> bfloat16 [row1 - row0, K]: a strip for a many-row step's GEMM. AVX-512 BF16
// CPUs dequantize with SIMD; others through the float32 dequantizer, then torch's rounding (the same values).
at::Tensor ggml_blocks_dequantize_bf16(const at::Tensor& blocks, int64_t type, int64_t K, int64_t row0, int64_t row1) {
  const int64_t per = block_elems(type), bytes = block_bytes(type);
  TORCH_CHECK(K % per == 0 && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == K / per * bytes && 0 <= row0 && row0 <= row1 && row1 <= blocks.size(0),
              "ggml_blocks_dequantize_bf16: blocks must be contiguous uint8 [N, ", K / per * bytes, "] and rows [", row0,
              ", ", row1, ") inside N, got ", blocks.sizes());
  if (!cpu_has_avx512_bf16_vnni() || is_repacked(type))
    return ggml_blocks_dequantize(blocks, type, K, at::arange(row0, row1, blocks.options().dtype(at::kLong))).to(at::kBFloat16);
  at::Tensor out = at::empty({row1 - row0, K}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* wp = blocks.data_ptr<uint8_t>() + row0 * blocks.size(1);
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, row1 - row0, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows_bf16(type, wp + begin * blocks.size(1), blocks.size(1), K, end - begin, op + begin * K);
  });
  return out;
}

// 0: the best this CPU has; 1: AVX2; 2: AVX-512 (BW + VNNI); 3: AMX-INT8 tiles for the K-quants (the rest on
// AVX-512 VNNI); 4: AVX2 with its GEMM for the K-quants (ggml_blocks_avx2_gemm.cpp; the rest on AVX2). Returns
// the path a call with `path` runs.
int64_t tokenmill::ggml::ggml_blocks_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path <= 4, "ggml_blocks: path ", path,
              " is not 0 (auto), 1 (avx2), 2 (avx512_vnni), 3 (amx_int8) or 4 (avx2_gemm)");
  if (path == 0) return amx_int8_usable() ? 3 : cpu_has_avx512_vnni() ? 2 : 4;
  TORCH_CHECK(path != 2 || cpu_has_avx512_vnni(), "ggml_blocks: this CPU lacks avx512f/bw/vl/dq + avx512_vnni");
  TORCH_CHECK(path != 3 || amx_int8_usable(),
              "ggml_blocks: this CPU lacks amx_tile + amx_int8 (with avx512_vnni), or Linux refused the tile state");
  return path;
}

// Under auto, the tiles take the K-quants from this many rows of x; below it the vector kernel is faster (a
// tile computes 16 rows of x whatever the count, with a scaling pass per sub-block). Forced path 3 uses them
// at any count. Qwen2.5-1.5B's layer, 2 threads, Sapphire Rapids, ms, vector / tiles (scripts/
// bench_ggml_blocks.py): 1 row 1.45 / 2.56, 2 rows 1.74 / 2.59, 4 rows 2.34 / 2.66, 8 rows 3.93 / 2.84,
// 16 rows 8.11 / 3.28 (a bfloat16 copy: 3.40), 32 rows 17.4 / 5.8, 64 rows 37.0 / 11.3. (kAmxMinRows = 6, in
// ggml_blocks.h: the experts' op takes the tiles from the same count.)

// one parallel region over every part's rows: a fused projection keeps both threads busy to its end. amx: x
// as tiles where the K-quant parts run on AMX (their own region, ggml_blocks_amx.cpp), else null; gemm: the
// K-quant parts run the AVX2 GEMM. The threads share chunks of 64 columns (shared_chunks); repacked parts (always
// on the GEMM) are read in groups of 8 rows, which a chunk never splits (each part starts on one: ggml_blocks_linear
// checks).
template <typename Out>
void linear_parts(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t N, int64_t K,
                  const Q8Rows& q, const AmxRows* amx, bool gemm, const float* bias, Out* out, bool wide) {
  if (amx) amx_linear(ps, first_col, N, *amx, bias, out);
  const auto vector_part = [&](const Part& p) { return !amx || !amx_has_kernel(p.type); };
  if (std::none_of(ps.begin(), ps.end(), vector_part)) return;
  const int64_t unit = 64;  // weight rows a chunk: whole groups of 8 where repacked
  shared_chunks((N + unit - 1) / unit, [&](int64_t k) {
    const int64_t begin = k * unit, end = std::min(N, (k + 1) * unit);
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t lo = std::max(begin, first_col[i]), hi = std::min(end, first_col[i] + ps[i].rows);
      if (lo >= hi || !vector_part(ps[i])) continue;
      if (is_repacked(ps[i].type))
        repacked_gemm_rows(ps[i], lo - first_col[i], hi - first_col[i], q, bias, out, N, first_col[i]);
      else if (gemm && avx2_gemm_has_kernel(ps[i].type))
        avx2_gemm_rows(ps[i], lo - first_col[i], hi - first_col[i], q, bias, out, N, first_col[i]);
      else if (wide)
        part_rows<true>(ps[i], lo - first_col[i], hi - first_col[i], K, q, bias, out, N, first_col[i]);
      else
        part_rows<false>(ps[i], lo - first_col[i], hi - first_col[i], K, q, bias, out, N, first_col[i]);
    }
  });
}

tokenmill::ggml::LinearParts tokenmill::ggml::linear_parts_of(const char* op, at::TensorList parts, at::IntArrayRef types,
                                                              int64_t K, bool repacked_ok) {
  LinearParts lp;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& w = parts[i];
    const int64_t type = types[i];
    TORCH_CHECK(repacked_ok || !is_repacked(type), op, ": part ", i, " is repacked (GGML type ", file_type(type),
                "); the tiles read the file's own blocks");
    const int64_t per = block_elems(type), bytes = block_bytes(type);
    TORCH_CHECK(K % per == 0, op, ": in_features ", K, " is not a multiple of ", per, " (GGML type ", type, ")");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == K / per * bytes,
                op, ": part ", i, " must be contiguous uint8 [N, ", K / per * bytes, "], got ", w.sizes());
    TORCH_CHECK(!is_repacked(type) || (repack_has_layout(file_type(type)) && w.size(0) % 8 == 0 && lp.N % 8 == 0),
                op, ": repacked part ", i, " (GGML type ", file_type(type), ") must be Q4_K, Q5_K or Q6_K "
                "with rows a multiple of 8 starting on a multiple of 8, got ", w.size(0), " rows from column ", lp.N);
    lp.ps.push_back({w.data_ptr<uint8_t>(), type, w.size(0), w.size(1)});
    lp.first_col.push_back(lp.N);
    lp.N += w.size(0);
  }
  return lp;
}

const float* tokenmill::ggml::bias_of(const char* op, const std::optional<at::Tensor>& bias, int64_t N,
                                      at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.dim() == 1 && keep.size(0) == N, op, ": bias must have ", N, " values, got ", keep.sizes());
  return keep.data_ptr<float>();
}

// x: [T, K] float32 or bfloat16; parts: uint8 [N_i, K / block_elems * block_bytes] in types[i]; bias: [sum N_i]
// or none -> [T, sum N_i] in x's dtype, the parts' outputs side by side.
at::Tensor ggml_blocks_linear(const at::Tensor& x_in, at::TensorList parts, at::IntArrayRef types, int64_t path,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "ggml_blocks_linear: x must be 2-D float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "ggml_blocks_linear: ", parts.size(), " parts but ",
              types.size(), " types");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1);
  const LinearParts lp = linear_parts_of("ggml_blocks_linear", parts, types, K, true);
  const std::vector<Part>& ps = lp.ps;
  const std::vector<int64_t>& first_col = lp.first_col;
  const int64_t N = lp.N;
  const int64_t runs = ggml_blocks_path(path);
  const bool wide = wide_path(runs);
  TORCH_CHECK(runs == 4 || std::none_of(ps.begin(), ps.end(), [](const Part& p) { return is_repacked(p.type); }),
              "ggml_blocks_linear: repacked parts run on the AVX2 GEMM only (path 4, or auto on a CPU without "
              "AVX-512 VNNI), not on path ", runs);
  Q8Buffer buf;
  const Q8Rows q = x.scalar_type() == at::kFloat ? quantize_rows(x.data_ptr<float>(), T, K, buf)
                                                 : quantize_rows(x.data_ptr<at::BFloat16>(), T, K, buf);
  std::shared_ptr<const AmxRows> amx;
  const bool tiles = runs == 3 && (path == 3 || T >= kAmxMinRows) &&
                     std::any_of(ps.begin(), ps.end(), [](const Part& p) { return amx_has_kernel(p.type); });
  if (tiles) amx = amx_rows_of(q);
  const bool gemm = runs == 4 && (path == 4 || T >= kAvx2GemmMinRows);
  at::Tensor b;
  const float* bp = bias_of("ggml_blocks_linear", bias, N, b);
  // the output in x's dtype, written once: no float32 result to convert and add the bias to afterwards
  at::Tensor out = at::empty({T, N}, x.options());
  AT_DISPATCH_SWITCH(out.scalar_type(), "ggml_blocks_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] { linear_parts(ps, first_col, N, K, q, amx.get(), gemm, bp, out.data_ptr<float>(), wide); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { linear_parts(ps, first_col, N, K, q, amx.get(), gemm, bp, out.data_ptr<at::BFloat16>(), wide); }));
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("ggml_blocks_linear(Tensor x, Tensor[] parts, int[] types, int path, Tensor? bias=None) -> Tensor");
  m.def("ggml_blocks_path(int path) -> int");
  m.def("ggml_blocks_dequantize(Tensor blocks, int type, int K, Tensor rows) -> Tensor");
  m.def("ggml_blocks_dequantize_bf16(Tensor blocks, int type, int K, int row0, int row1) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("ggml_blocks_linear", &ggml_blocks_linear);
  m.impl("ggml_blocks_dequantize", &ggml_blocks_dequantize);
  m.impl("ggml_blocks_dequantize_bf16", &ggml_blocks_dequantize_bf16);
}

TORCH_LIBRARY_IMPL(tokenmill, CompositeExplicitAutograd, m) {
  m.impl("ggml_blocks_path", &ggml_blocks_path);
}
