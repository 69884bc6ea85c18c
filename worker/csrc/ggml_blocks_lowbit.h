// The block kernels of IQ4_XS (256 values a block), and IQ4_NL's value table. A part of
// ggml_blocks_dot.cpp kept in its own file for size: that file includes it once, inside its anonymous
// namespace, after the helpers used here (hsum_i32, dot32_scaled, join, pair_scales, hsum512); nothing else
// includes it.
//
// Format (ggml-common.h's block_iq4_xs; y = the weight, j the value's group):
//   IQ4_XS [d f16][scales_h u16][scales_l 4 B][128 B nibbles]      y = d*(ls_j - 32)*kv[q], 32 per j
//          ls_j: nibble j of scales_l (low first) | bits 2j, 2j+1 of scales_h << 4; group j's codes are the
//          low nibbles of bytes 16j..16j+15, then their high nibbles; kv: IQ4_NL's 16 signed values
//
// Products: IQ4_XS's codes are signed table values up to 127, so |w| times x with w's sign (as Q8_0) by
// maddubs, then the int16 scales by madd / vpdpwssd, exact in int32.

// IQ4_NL's (and IQ4_XS's) 16 values: kvalues_iq4nl in ggml-common.h
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 32 nibbles (one a byte) -> their signed IQ4 values; pshufb looks up within each 128-bit lane, so the
// table sits in both
AVX2_TARGET inline __m256i iq4_values(__m256i nibbles) {
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles);
}

// 16 bytes of nibbles -> 32 codes: the low nibbles (elements 0-15), then the high (16-31)
AVX2_TARGET inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m4), _mm_and_si128(p, m4));
}

// ---- IQ4_XS ----
// the 8 scales, ls_j - 32 (-32..31)
inline void iq4xs_scales(const uint8_t* w, int16_t (&ls)[8]) {
  uint16_t high;
  std::memcpy(&high, w + 2, 2);
  for (int j = 0; j < 8; ++j)
    ls[j] = static_cast<int16_t>((((w[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)) - 32);
}

template <int TB>
AVX2_TARGET void iq4xs_avx2(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 136) {
    const float d = f16(w);
    int16_t ls[8];
    iq4xs_scales(w, ls);
    __m256i q[8];
    for (int j = 0; j < 8; ++j) q[j] = iq4_values(nibbles32(w + 8 + 16 * j));
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.qs(t0 + t, b);
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
        sum = _mm256_add_epi32(sum, dot32_scaled(_mm256_sign_epi8(q[j], q[j]), _mm256_sign_epi8(xv, q[j]),
                                                 _mm256_set1_epi16(ls[j])));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x.scale(t0 + t, b)), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = tokenmill::hsum(acc[t]);
}

template <int TB>
AVX512_TARGET void iq4xs_avx512(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b, w += 136) {
    const float d = f16(w);
    alignas(16) int16_t ls[8];
    iq4xs_scales(w, ls);
    const __m512i s16 = _mm512_castsi128_si512(_mm_load_si128(reinterpret_cast<const __m128i*>(ls)));
    __m512i q[4], qa[4], sv[4];  // pairs of groups (2p, 2p + 1), their |w|, their scales
    for (int p = 0; p < 4; ++p) {
      q[p] = join(iq4_values(nibbles32(w + 8 + 32 * p)), iq4_values(nibbles32(w + 8 + 32 * p + 16)));
      qa[p] = _mm512_abs_epi8(q[p]);
      sv[p] = pair_scales(s16, p);
    }
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.qs(t0 + t, b);
      __m512i sum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i xv = _mm512_loadu_si512(xq + 64 * p);  // x with w's sign (x is never -128)
        const __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(q[p]), zero, xv);
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(qa[p], xs), sv[p]);
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * x.scale(t0 + t, b)), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = hsum512(acc[t]);
}

// ---- dequantization ----
// A block's codes as bytes (IQ4_XS's signed) and each 16's scale and min, for the bfloat16 strips:
// y = scale * code + min, one rounding of an exact value as gguf-py's (see dequantize_lowbit)
AVX2_TARGET inline void lowbit_groups(int64_t type, const uint8_t* w, uint8_t* codes, float* scale, float* minv) {
  const float d = f16(w);
  int16_t ls[8];
  iq4xs_scales(w, ls);
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * j), iq4_values(nibbles32(w + 8 + 16 * j)));
    scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(ls[j]);
    minv[2 * j] = minv[2 * j + 1] = 0.f;
  }
}

// float32, gguf-py's arithmetic: its products of f16 scales and small integers are exact, so the values are
// the same bits
inline void dequantize_lowbit(int64_t type, const uint8_t* w, float* y) {
  const float d = f16(w);
  int16_t ls[8];
  iq4xs_scales(w, ls);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>(ls[j]);
    const uint8_t* qs = w + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      y[32 * j + l] = dl * static_cast<float>(kIQ4Values[qs[l] & 0xF]);
      y[32 * j + 16 + l] = dl * static_cast<float>(kIQ4Values[qs[l] >> 4]);
    }
  }
}
