// The block kernels of IQ4_XS, Q2_K and Q3_K (256 values a block), and IQ4_NL's value table. A part of
// ggml_blocks_dot.cpp kept in its own file for size: that file includes it once, inside its anonymous
// namespace, after the helpers used here (hsum_i32, dot32_scaled, join, pair_scales, hsum512); nothing else
// includes it.
//
// Formats (ggml-common.h's block_iq4_xs, block_q2_K, block_q3_K; y = the weight, j the value's group):
//   IQ4_XS [d f16][scales_h u16][scales_l 4 B][128 B nibbles]      y = d*(ls_j - 32)*kv[q], 32 per j
//          ls_j: nibble j of scales_l (low first) | bits 2j, 2j+1 of scales_h << 4; group j's codes are the
//          low nibbles of bytes 16j..16j+15, then their high nibbles; kv: IQ4_NL's 16 signed values
//   Q2_K   [16 B: sc_j | m_j << 4][64 B 2-bit codes][d f16][dmin f16]  y = d*sc_j*q - dmin*m_j, 16 per j
//          element 128h + 32s + l: bits 2s, 2s+1 of code byte 32h + l
//   Q3_K   [32 B hmask][64 B 2-bit codes][12 B: 16 six-bit scales][d f16]  y = d*(sc_j - 32)*(q - 4), 16 per j
//          q's low 2 bits as Q2_K's, its third bit of element 32k + l is bit k of hmask byte l
//
// Products, as for the other types: unsigned codes (Q2_K's 0..3, Q3_K's 0..7, the -4 taken off afterwards
// from x's sums of 16) times x's int8 by maddubs, then the int16 scales by madd / vpdpwssd, exact in int32;
// IQ4_XS's codes are signed table values up to 127, so |w| times x with w's sign, as Q8_0.

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

// The same 8 scales with SIMD, as int16, for the kernels, which decode them every block (iq4xs_scales stays the
// dequantizers' plain reading of the layout)
AVX2_TARGET inline __m128i iq4xs_scales16(const uint8_t* w) {
  uint16_t high;
  uint32_t low4;
  std::memcpy(&high, w + 2, 2);
  std::memcpy(&low4, w + 4, 4);
  const __m128i m4 = _mm_set1_epi8(0x0F), l = _mm_cvtsi32_si128(static_cast<int>(low4));
  const __m128i low = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4)));
  const __m128i h = _mm_set1_epi32(high), three = _mm_set1_epi32(3);
  const __m128i bits = _mm_packus_epi32(_mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), three),
                                        _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(8, 10, 12, 14)), three));
  return _mm_sub_epi16(_mm_or_si128(low, _mm_slli_epi16(bits, 4)), _mm_set1_epi16(32));
}

template <int TB>
AVX2_TARGET void iq4xs_avx2(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 136) {
    const float d = f16(w);
    alignas(16) int16_t ls[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(ls), iq4xs_scales16(w));
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

// Groups 2p and 2p + 1 (32 bytes of nibbles) -> their 64 signed values in one register: each 16 bytes
// copied to two 128-bit lanes, the second of which takes the high nibbles, then one table lookup
AVX512_TARGET inline __m512i iq4xs_pair(const uint8_t* qs) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m512i bytes = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  const __m512i twice = _mm512_shuffle_i64x2(bytes, bytes, _MM_SHUFFLE(1, 1, 0, 0));  // lanes: 0-15, 0-15, 16-31, 16-31
  const __m512i nibbles = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(twice, m4),
                                                  _mm512_and_si512(_mm512_srli_epi16(twice, 4), m4));
  return _mm512_shuffle_epi8(table, nibbles);
}

template <int TB>
AVX512_TARGET void iq4xs_avx512(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b, w += 136) {
    const float d = f16(w);
    const __m512i s16 = _mm512_castsi128_si512(iq4xs_scales16(w));
    __m512i q[4], qa[4], sv[4];  // pairs of groups (2p, 2p + 1), their |w|, their scales
    for (int p = 0; p < 4; ++p) {
      q[p] = iq4xs_pair(w + 8 + 32 * p);
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

// ---- Q2_K and Q3_K: a scale per 16 values and a term on x's sums of 16 (Q2_K's minimums, Q3_K's -4) ----
// A block decoded: the 256 codes (unsigned, 32 a register, in element order), the 16 scales, and the block's
// value = d * sum_j scale_j * (codes . x)_j - f * sum_j term_j * (x's sum over j)
struct Sub16Block {
  __m256i codes[8];
  __m256i scale, term;  // 16 int16 each, in element order
  float d, f;
};

// 64 bytes of 2-bit codes -> 8 registers of 32 (element 128h + 32s + l: bits 2s of byte 32h + l)
AVX2_TARGET inline void two_bit_codes(const uint8_t* qs, __m256i (&e)[8]) {
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h));
    for (int s = 0; s < 4; ++s) e[4 * h + s] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m3);
  }
}

// Q3_K's 12 bytes -> 16 scales, sc_j - 32: the low 4 bits from byte j (j < 8) or byte j - 8's high nibble,
// the high 2 from bits 2(j / 4) of byte 8 + j % 4
inline void q3k_scales(const uint8_t* s, int16_t* sc) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    sc[j] = static_cast<int16_t>((low | (high << 4)) - 32);
  }
}

// The same 16 scales with SIMD, for the kernels. Their decode runs every block of a one-row step: with the scales
// and terms written by scalar loops and read back as vectors, Q2_K / Q3_K took 2.6x Q4_K's time (1536 x 8960,
// one thread, AVX-512: Q2_K 1.66 -> 0.44 ms, Q3_K 1.71 -> 0.66, Q4_K 0.64)
AVX2_TARGET inline __m256i q3k_scales16(const uint8_t* s) {
  uint64_t low8;
  uint32_t high4;
  std::memcpy(&low8, s, 8);
  std::memcpy(&high4, s + 8, 4);
  const __m128i m4 = _mm_set1_epi8(0x0F), l = _mm_cvtsi64_si128(static_cast<long long>(low8));
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4));
  // 32-bit lane i: bits 2i, 2i + 1 of bytes 8-11, i.e. scales 4i..4i+3
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(high4)), _mm_set_epi32(6, 4, 2, 0)),
                                     _mm_set1_epi8(3));
  return _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32)));
}

template <int64_t TYPE>
AVX2_TARGET inline void sub16_block(const uint8_t* w, Sub16Block& k) {
  if (TYPE == Q2_K) {
    two_bit_codes(w + 16, k.codes);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), m4 = _mm_set1_epi8(0x0F);
    k.scale = _mm256_cvtepu8_epi16(_mm_and_si128(s, m4));
    k.term = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), m4));
    k.d = f16(w + 80), k.f = f16(w + 82);
  } else {  // Q3_K
    two_bit_codes(w + 32, k.codes);
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), one = _mm256_set1_epi8(1);
    for (int i = 0; i < 8; ++i)
      k.codes[i] = _mm256_or_si256(k.codes[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, i), one), 2));
    k.scale = q3k_scales16(w + 96);
    k.term = _mm256_slli_epi16(k.scale, 2);
    k.d = k.f = f16(w + 108);
  }
}

template <int64_t TYPE, int TB>
AVX2_TARGET void sub16_avx2(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  constexpr int64_t bytes = TYPE == Q2_K ? 84 : 110;
  __m256 acc[TB], acct[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps(), acct[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    Sub16Block k;
    sub16_block<TYPE>(w, k);
    alignas(32) int16_t sc[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc), k.scale);
    __m256i s16[8];  // 32 elements each: lanes 0-3 (elements 0-15) scale 2j, lanes 4-7 scale 2j+1 after madd
    for (int j = 0; j < 8; ++j) s16[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    const __m256i term = k.term;
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.qs(t0 + t, b);
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sum = _mm256_add_epi32(sum, dot32_scaled(k.codes[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j)), s16[j]));
      const __m256i terms = _mm256_madd_epi16(term, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums(t0 + t, b))));
      const float dx = x.scale(t0 + t, b);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(k.d * dx), acc[t]);
      acct[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(terms), _mm256_set1_ps(k.f * dx), acct[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = tokenmill::hsum(acc[t]) - tokenmill::hsum(acct[t]);
}

template <int64_t TYPE, int TB>
AVX512_TARGET void sub16_avx512(const uint8_t* w, int64_t nb, const Q8Rows& x, int64_t t0, float* out) {
  constexpr int64_t bytes = TYPE == Q2_K ? 84 : 110;
  __m512 acc[TB];
  __m256 acct[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps(), acct[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    Sub16Block k;
    sub16_block<TYPE>(w, k);
    __m512i e[4];
    for (int p = 0; p < 4; ++p) e[p] = join(k.codes[2 * p], k.codes[2 * p + 1]);
    block256_avx512<TB>(e, k.scale, k.term, k.d, k.f, x, t0, b, acc, acct);
  }
  for (int t = 0; t < TB; ++t) out[t] = hsum512(acc[t]) - hsum512(_mm512_zextps256_ps512(acct[t]));
}

// ---- dequantization ----
// A block's codes as bytes (IQ4_XS's signed) and each 16's scale and min, for the bfloat16 strips:
// y = scale * code + min, one rounding of an exact value as gguf-py's (see dequantize_lowbit)
AVX2_TARGET inline void lowbit_groups(int64_t type, const uint8_t* w, uint8_t* codes, float* scale, float* minv) {
  if (type == IQ4_XS) {
    const float d = f16(w);
    int16_t ls[8];
    iq4xs_scales(w, ls);
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * j), iq4_values(nibbles32(w + 8 + 16 * j)));
      scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(ls[j]);
      minv[2 * j] = minv[2 * j + 1] = 0.f;
    }
    return;
  }
  Sub16Block k;
  if (type == Q2_K) sub16_block<Q2_K>(w, k); else sub16_block<Q3_K>(w, k);
  for (int i = 0; i < 8; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * i), k.codes[i]);
  alignas(32) int16_t sc[16], term[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc), k.scale);
  _mm256_store_si256(reinterpret_cast<__m256i*>(term), k.term);
  for (int j = 0; j < 16; ++j) {
    scale[j] = k.d * static_cast<float>(sc[j]);
    // Q2_K: -(dmin * m_j); Q3_K: -4 * scale (the code's -4, exact)
    minv[j] = type == Q2_K ? -(k.f * static_cast<float>(term[j])) : -4.f * scale[j];
  }
}

// float32, gguf-py's arithmetic: its products of f16 scales and small integers are exact, so the values are
// the same bits (Q2_K's dl * q - ml rounds once, as it does there)
inline void dequantize_lowbit(int64_t type, const uint8_t* w, float* y) {
  if (type == IQ4_XS) {
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
    return;
  }
  const bool q2 = type == Q2_K;
  const uint8_t* qs = w + (q2 ? 16 : 32);
  int16_t sc[16];
  if (!q2) q3k_scales(w + 96, sc);
  const float d = f16(w + (q2 ? 80 : 108)), dmin = q2 ? f16(w + 82) : 0.f;
  for (int e = 0; e < 256; ++e) {
    const int j = e / 16, l = e % 32, low = (qs[32 * (e / 128) + l] >> (2 * ((e % 128) / 32))) & 3;
    if (q2) {
      const float dl = d * static_cast<float>(w[j] & 0xF), ml = dmin * static_cast<float>(w[j] >> 4);
      y[e] = dl * static_cast<float>(low) - ml;
    } else {
      const int q = low | (((w[l] >> (e / 32)) & 1) << 2);
      y[e] = d * static_cast<float>(sc[j]) * static_cast<float>(q - 4);
    }
  }
}
