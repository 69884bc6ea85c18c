// Q4_K, Q5_K and Q6_K against many rows of x on AVX2 alone (no VNNI, no AMX): a register-blocked GEMM over the
// file's own blocks. Under auto such a CPU's loader repacks the K-quant linears once (ggml_blocks_repack.cpp: the
// same arithmetic, this file's transposes done at load); this one runs the weights left in the file's layout (the
// deterministic mode keeps them, and so do tensor-parallel ranks and --no-cpu-block-repack) and the forced path 4.
// The register tile and its inner loop live in ggml_blocks_avx2_tile.h, shared with the repacked GEMM.
//
// Why it beats the vector kernel (ggml_blocks_dot.cpp) from a few rows: that kernel multiplies each 32 codes'
// int16 products by their scale with one vpmaddwd per register (a weight row's register holds one scale
// group), so every vpmaddubsw is followed by a vpmaddwd: two multiplies per 32 products. Here 8 weight rows
// are transposed so that int32 lane j of a register holds 4 consecutive codes of row j; the 8 (Q4_K) registers
// of a 32-value scale group then share one scale per lane, their vpmaddubsw results add up in int16 (Q4_K: 8 x
// 2 x 15 x 127 = 30480 < 32767; Q5_K 4 at a time, Q6_K 2 at a time) and one vpmaddwd scales the sum: 1.1 to 1.5
// multiplies per 32 products instead of 2. x is broadcast 4 bytes at a time (vpbroadcastd from memory), and a
// register tile of 4 rows of x reuses each loaded weight register 4 times.
//
// The transpose (an 8x8 dword transpose of each 32 bytes of codes, and of the scale bytes) is paid once per
// super-block of 8 weight rows into a small scratch tile, then used by every row of x: at 4 rows it is
// about a third of the work, at 16 and more it vanishes; at one row it was about as long as the arithmetic
// (why the loader repacks).
//
//   scratch tile, one super-block (256 values) of weight rows n..n+7:
//     codes[s]   s = 0..63   lane j = row j's codes for x's values 4s..4s+3 (bytes, unsigned)
//     scales[g]              lane j = row j's scale of group g (int16, twice): Q4_K/Q5_K 8 groups of 32,
//                            Q6_K 16 of 16
//     terms[p]   p = 0..7    lane j = row j's factors of x's 16-value sums 2p and 2p+1 (int16 pair):
//                            Q4_K/Q5_K the minimum m_p twice, Q6_K its scales 2p, 2p+1 (the codes' -32)
//     d, f                   per row: the block scale d, and the terms' factor (dmin; Q6_K: 32 d)
//   row t of x, column n+j:  acc += d * dx * sum_g scale_g * sum(codes * xq)  -  f * dx * sum_p terms_p . sums
//
// Exactness: each block's integer sums are exact in int32 and the same integers the vector kernel sums; only the
// float accumulation differs (one fma per block and row, in block order). A row of x is computed alone
// whatever the tile, so its bits do not depend on the other rows either (the deterministic mode still runs the
// vector kernel, one kernel for every count).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"
#include "ggml_blocks_avx2_tile.h"
#include "simd.h"

using namespace tokenmill::ggml;
using namespace tokenmill::ggml::avx2_tile;

namespace {

AVX2_TARGET inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// r[d] lane j = input r[j]'s dword d
AVX2_TARGET inline void transpose8x8(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);      // rows 2i, 2i+1: dwords 0,1 | 4,5
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);  // dwords 2,3 | 6,7
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);      // dword 0 | 4
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);      // 1 | 5
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // 2 | 6
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // 3 | 7
  }
  for (int d = 0; d < 4; ++d) {
    r[d] = _mm256_permute2x128_si256(u[d], u[4 + d], 0x20);
    r[d + 4] = _mm256_permute2x128_si256(u[d], u[4 + d], 0x31);
  }
}

// 32 bytes at offset off of each row's block, transposed: out[d] lane j = row j's bytes off + 4d .. off + 4d + 3
AVX2_TARGET inline void rows_transposed(const uint8_t* const (&blk)[kRows], int off, __m256i (&out)[8]) {
  for (int j = 0; j < kRows; ++j) out[j] = load256(blk[j] + off);
  transpose8x8(out);
}

// 16 bytes at offset off of each row's block, transposed: out[m] = byte 2m of rows 0..7, then byte 2m + 1
AVX2_TARGET inline void bytes_transposed(const uint8_t* const (&blk)[kRows], int off, __m128i (&out)[8]) {
  __m128i a[8], b[8];
  for (int j = 0; j < kRows; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[j] + off));
  for (int k = 0; k < 4; ++k) {  // 16-bit unit i: rows 2k, 2k+1's byte i
    b[k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
    b[k + 4] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // 32-bit unit i: rows 4h..4h+3's byte i, for bytes 0-3, 4-7, 8-11, 12-15
    a[4 * h + 0] = _mm_unpacklo_epi16(b[0 + 2 * h], b[1 + 2 * h]);  // bytes 0..3
    a[4 * h + 1] = _mm_unpackhi_epi16(b[0 + 2 * h], b[1 + 2 * h]);  // 4..7
    a[4 * h + 2] = _mm_unpacklo_epi16(b[4 + 2 * h], b[5 + 2 * h]);  // 8..11
    a[4 * h + 3] = _mm_unpackhi_epi16(b[4 + 2 * h], b[5 + 2 * h]);  // 12..15
  }
  for (int q = 0; q < 4; ++q) {  // rows 0..3 beside rows 4..7: 64-bit unit = one byte index of all 8 rows
    out[2 * q] = _mm_unpacklo_epi32(a[q], a[4 + q]);
    out[2 * q + 1] = _mm_unpackhi_epi32(a[q], a[4 + q]);
  }
}

// byte k of the 8 rows (from bytes_transposed) as 8 int16
AVX2_TARGET inline __m128i byte_u16(const __m128i (&by)[8], int k) {
  const __m128i v = by[k / 2];
  return _mm_cvtepu8_epi16(k % 2 ? _mm_srli_si128(v, 8) : v);
}
AVX2_TARGET inline __m128i byte_i16(const __m128i (&by)[8], int k) {
  const __m128i v = by[k / 2];
  return _mm_cvtepi8_epi16(k % 2 ? _mm_srli_si128(v, 8) : v);
}

// 8 int16 (one per row) -> lane j holds row j's value twice
AVX2_TARGET inline __m256i twice(__m128i v) { return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)); }

// two bytes k, k + 1 of the 8 rows as 8 f16 -> float
AVX2_TARGET inline __m256 f16_pair(const __m128i (&by)[8], int k) {
  const __m128i v = by[k / 2];
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
}

// Q4_K / Q5_K: [d f16][dmin f16][12 B scales and mins][Q5_K: 32 B fifth bits][128 B nibbles]
template <bool FIFTH>
AVX2_TARGET void decode_k4(const uint8_t* const (&blk)[kRows], Tile& tile) {
  __m128i by[8];
  bytes_transposed(blk, 0, by);
  tile.d = f16_pair(by, 0);
  tile.f = f16_pair(by, 2);
  __m128i p[12];
  for (int k = 0; k < 12; ++k) p[k] = byte_u16(by, 4 + k);
  const __m128i m6 = _mm_set1_epi16(63), m4 = _mm_set1_epi16(15);
  for (int s = 0; s < 4; ++s) {  // llama.cpp's get_scale_min_k4, 8 rows at once
    tile.scales[s] = twice(_mm_and_si128(p[s], m6));
    tile.terms[s] = twice(_mm_and_si128(p[s + 4], m6));
    tile.scales[s + 4] = twice(_mm_or_si128(_mm_and_si128(p[s + 8], m4), _mm_slli_epi16(_mm_srli_epi16(p[s], 6), 4)));
    tile.terms[s + 4] = twice(_mm_or_si128(_mm_srli_epi16(p[s + 8], 4), _mm_slli_epi16(_mm_srli_epi16(p[s + 4], 6), 4)));
  }
  const __m256i m4b = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256i qh[8];
  if (FIFTH) rows_transposed(blk, 16, qh);
  for (int i = 0; i < 4; ++i) {  // bytes 32i..32i+31: low nibbles = values 64i + l, high = 64i + 32 + l
    __m256i q[8];
    rows_transposed(blk, (FIFTH ? 48 : 16) + 32 * i, q);
    for (int d = 0; d < 8; ++d) {
      __m256i lo = _mm256_and_si256(q[d], m4b), hi = _mm256_and_si256(_mm256_srli_epi16(q[d], 4), m4b);
      if (FIFTH) {  // bit 2i of qh byte l: value 64i + l's fifth bit; bit 2i + 1: value 64i + 32 + l's
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh[d], 2 * i), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh[d], 2 * i + 1), one), 4));
      }
      tile.codes[16 * i + d] = lo;
      tile.codes[16 * i + 8 + d] = hi;
    }
  }
}

// Q6_K: [128 B low nibbles][64 B high 2 bits][16 x int8 scales][d f16]; per half h of 128 values, value
// 128h + 32q + l takes ql[64h + 32(q % 2) + l]'s low (q < 2) or high nibble and qh[32h + l]'s bits 2q, 2q+1
AVX2_TARGET void decode_q6k(const uint8_t* const (&blk)[kRows], Tile& tile) {
  __m128i by[8];
  bytes_transposed(blk, 192, by);
  for (int g = 0; g < 16; ++g) tile.scales[g] = twice(byte_i16(by, g));
  for (int p = 0; p < 8; ++p) {
    const __m128i a = byte_i16(by, 2 * p), b = byte_i16(by, 2 * p + 1);
    tile.terms[p] = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
  }
  alignas(16) uint16_t d16[kRows];
  for (int j = 0; j < kRows; ++j) std::memcpy(&d16[j], blk[j] + 208, 2);
  tile.d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d16)));
  tile.f = _mm256_mul_ps(tile.d, _mm256_set1_ps(32.f));
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    __m256i l0[8], l1[8], hb[8];
    rows_transposed(blk, 64 * h, l0);
    rows_transposed(blk, 64 * h + 32, l1);
    rows_transposed(blk, 128 + 32 * h, hb);
    for (int d = 0; d < 8; ++d) {
      const __m256i hi = hb[d];
      __m256i* c = tile.codes + 32 * h + d;
      c[0] = _mm256_or_si256(_mm256_and_si256(l0[d], m4), _mm256_slli_epi16(_mm256_and_si256(hi, m2), 4));
      c[8] = _mm256_or_si256(_mm256_and_si256(l1[d], m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2), m2), 4));
      c[16] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0[d], 4), m4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m2), 4));
      c[24] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1[d], 4), m4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 6), m2), 4));
    }
  }
}

template <typename Out>
void gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, Out* out, int64_t ldo,
               int64_t col0) {
  const int64_t bytes = block_bytes(p.type);
  float* const acc = thread_acc(x.T * kRows);
  Tile tile;
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n1 - n);
    const uint8_t* blk[kRows];  // a short last group repeats its first row; those outputs are not written
    for (int j = 0; j < kRows; ++j) blk[j] = p.data + (n + (j < rows ? j : 0)) * p.row_bytes;
    std::fill(acc, acc + x.T * kRows, 0.f);
    for (int64_t b = 0; b < x.nb; ++b) {
      // The next group's rows (contiguous), a block's share at a time: without it the 8 rows' streams kept the
      // GEMM waiting at few rows of x. Qwen2.5-1.5B's layer, 1 thread, CPU time, vs the vector kernel: 4 rows
      // 1.13-1.28x without, 1.70x with; 1 row 0.88-1.03x without, 1.25x with.
      if (n + kRows < n1)
        tokenmill::prefetch_lines(p.data + (n + kRows) * p.row_bytes + b * kRows * bytes, kRows * bytes);
      switch (p.type) {
        case Q4_K: decode_k4<false>(blk, tile); all_rows<8, 8>(tile, x, b, acc); break;
        case Q5_K: decode_k4<true>(blk, tile); all_rows<8, 4>(tile, x, b, acc); break;
        default: decode_q6k(blk, tile); all_rows<4, 2>(tile, x, b, acc); break;
      }
      for (int j = 0; j < kRows; ++j) blk[j] += bytes;
    }
    for (int64_t t = 0; t < x.T; ++t)
      for (int64_t j = 0; j < rows; ++j) {
        const float add = bias ? bias[col0 + n + j] : 0.f;  // in float32, then one rounding to Out
        out[t * ldo + col0 + n + j] = static_cast<Out>(acc[t * kRows + j] + add);
      }
  }
}

}  // namespace

bool tokenmill::ggml::avx2_gemm_has_kernel(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

void tokenmill::ggml::avx2_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias,
                                     float* out, int64_t ldo, int64_t col0) {
  gemm_rows(p, n0, n1, x, bias, out, ldo, col0);
}
void tokenmill::ggml::avx2_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias,
                                     at::BFloat16* out, int64_t ldo, int64_t col0) {
  gemm_rows(p, n0, n1, x, bias, out, ldo, col0);
}
