// The AVX2 GEMM's register tile and inner loop (ggml_blocks_avx2_gemm.cpp explains the arithmetic): a decoded
// Tile of 8 weight rows' super-block against rows of x, 4 at a time, or two tiles against 3 at a time. Shared by the
// GEMM on the file's blocks and the one on blocks repacked at load (ggml_blocks_repack.cpp, which takes the
// tiles in pairs), so that both sum in one order: the same bits.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"

namespace tokenmill::ggml::avx2_tile {

constexpr int kRows = 8;  // weight rows a tile transposes: one int32 lane each
constexpr int kTileX = 4;  // rows of x a register tile holds (16 ymm registers: 4 int16 + 4 int32 sums + operands)
constexpr int kPairX = 3;  // rows of x against two tiles at once (tile_pair_rows: 6 int16 + 6 int32 sums)

//   codes[s]  s = 0..63  lane j = row j's codes for x's values 4s..4s+3 (bytes, unsigned)
//   scales[g]            lane j = row j's scale of group g (int16, twice): Q4_K/Q5_K 8 groups of 32, Q6_K 16 of 16
//   terms[p]  p = 0..7   lane j = row j's factors of x's 16-value sums 2p and 2p+1 (int16 pair)
//   d, f                 per row: the block scale d, and the terms' factor
struct Tile {
  __m256i codes[64];
  __m256i scales[16];
  __m256i terms[8];
  __m256 d, f;
};

// The calling thread's accumulator of at least n floats (contents left over): kept between calls, since a MoE
// step calls a GEMM once per (expert, part, 64 weight rows), and with glibc's thread cache off, as the worker runs,
// a malloc and free each time took ~3% of a 16-token layer
inline float* thread_acc(size_t n) {
  thread_local std::vector<float> store;
  if (store.size() < n) store.resize(n);
  return store.data();
}

// Keeps v in a register here: without it GCC turns the chain of int16 adds into a tree over all the group's
// products at once, which needs more than 16 registers and spills half of them to the stack
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

AVX2_TARGET inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The end of a block for R rows of x: the terms (minimums, Q6_K's -32) against x's 16-value sums, then acc gains
// d * dx * isum - f * dx * iterm, per row of x and weight row, in that order.
template <int R>
AVX2_TARGET inline void finish_rows(const Tile& tile, const Q8Rows& x, int64_t t0, int64_t b, const __m256i (&isum)[R],
                                    float* acc) {
  __m256i iterm[R];
  for (int r = 0; r < R; ++r) iterm[r] = _mm256_setzero_si256();
  for (int p = 0; p < 8; ++p)
    for (int r = 0; r < R; ++r)
      iterm[r] = _mm256_add_epi32(iterm[r], _mm256_madd_epi16(tile.terms[p], broadcast4(x.sums(t0 + r, b) + 2 * p)));
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_set1_ps(x.scale(t0 + r, b));
    __m256 a = _mm256_loadu_ps(acc + 8 * r);
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(tile.d, dx), a);
    a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(iterm[r]), _mm256_mul_ps(tile.f, dx), a);
    _mm256_storeu_ps(acc + 8 * r, a);
  }
}

// R rows of x (t0..) against a decoded tile, block b: acc[r * 8 + j] (row t0 + r, weight row j) gains the block.
// GROUP: steps (4 values each) per scale group; SUM: steps whose int16 products add up before vpmaddwd.
template <int GROUP, int SUM, int R>
AVX2_TARGET inline void tile_rows(const Tile& tile, const Q8Rows& x, int64_t t0, int64_t b, float* acc) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.qs(t0 + r, b);
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int g = 0; g < 64 / GROUP; ++g) {
    for (int s0 = 0; s0 < GROUP; s0 += SUM) {
      __m256i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
      for (int k = 0; k < SUM; ++k) {
        const int step = g * GROUP + s0 + k;
        const __m256i codes = tile.codes[step];
        for (int r = 0; r < R; ++r) {
          part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(codes, broadcast4(xq[r] + 4 * step)));
          in_register(part[r]);
        }
      }
      for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], tile.scales[g]));
    }
  }
  finish_rows<R>(tile, x, t0, b, isum, acc);
}

// Two decoded tiles (weight rows n..n+15) against R rows of x: each broadcast of x feeds both tiles' vpmaddubsw.
// On Zen 3 the broadcasts (vpbroadcastd from memory) take the vector pipes the multiplies need: tile_rows' step (4
// broadcasts, 4 vpmaddubsw, 4 adds) ran in ~3.7 cycles where the same multiplies on x held in registers ran in
// ~2.2 (a /tmp microbenchmark, fifteenth session, AMD EPYC, 2.45 GHz). Two tiles x 3 rows have half the broadcasts
// per product. Each output's integer sums and float steps are tile_rows', so are its bits.
template <int GROUP, int SUM, int R>
AVX2_TARGET inline void tile_pair_rows(const Tile& ta, const Tile& tb, const Q8Rows& x, int64_t t0, int64_t b,
                                       float* acc_a, float* acc_b) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.qs(t0 + r, b);
  __m256i isum_a[R], isum_b[R];
  for (int r = 0; r < R; ++r) isum_a[r] = isum_b[r] = _mm256_setzero_si256();
  for (int g = 0; g < 64 / GROUP; ++g) {
    for (int s0 = 0; s0 < GROUP; s0 += SUM) {
      __m256i part_a[R], part_b[R];
      for (int r = 0; r < R; ++r) part_a[r] = part_b[r] = _mm256_setzero_si256();
      for (int k = 0; k < SUM; ++k) {
        const int step = g * GROUP + s0 + k;
        const __m256i codes_a = ta.codes[step], codes_b = tb.codes[step];
        for (int r = 0; r < R; ++r) {
          const __m256i xr = broadcast4(xq[r] + 4 * step);
          part_a[r] = _mm256_add_epi16(part_a[r], _mm256_maddubs_epi16(codes_a, xr));
          part_b[r] = _mm256_add_epi16(part_b[r], _mm256_maddubs_epi16(codes_b, xr));
          in_register(part_a[r]);
          in_register(part_b[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        isum_a[r] = _mm256_add_epi32(isum_a[r], _mm256_madd_epi16(part_a[r], ta.scales[g]));
        isum_b[r] = _mm256_add_epi32(isum_b[r], _mm256_madd_epi16(part_b[r], tb.scales[g]));
      }
    }
  }
  finish_rows<R>(ta, x, t0, b, isum_a, acc_a);
  finish_rows<R>(tb, x, t0, b, isum_b, acc_b);
}

template <int GROUP, int SUM>
AVX2_TARGET inline void all_rows(const Tile& tile, const Q8Rows& x, int64_t b, float* acc) {
  int64_t t0 = 0;
  for (; t0 + kTileX <= x.T; t0 += kTileX) tile_rows<GROUP, SUM, kTileX>(tile, x, t0, b, acc + 8 * t0);
  switch (x.T - t0) {
    case 1: tile_rows<GROUP, SUM, 1>(tile, x, t0, b, acc + 8 * t0); break;
    case 2: tile_rows<GROUP, SUM, 2>(tile, x, t0, b, acc + 8 * t0); break;
    case 3: tile_rows<GROUP, SUM, 3>(tile, x, t0, b, acc + 8 * t0); break;
  }
}

// Every row of x against two tiles: acc_a[t * 8 + j] (weight row j of the first) and acc_b (of the second)
template <int GROUP, int SUM>
AVX2_TARGET inline void all_rows_pair(const Tile& ta, const Tile& tb, const Q8Rows& x, int64_t b, float* acc_a,
                                      float* acc_b) {
  int64_t t0 = 0;
  for (; t0 + kPairX <= x.T; t0 += kPairX)
    tile_pair_rows<GROUP, SUM, kPairX>(ta, tb, x, t0, b, acc_a + 8 * t0, acc_b + 8 * t0);
  switch (x.T - t0) {
    case 1: tile_pair_rows<GROUP, SUM, 1>(ta, tb, x, t0, b, acc_a + 8 * t0, acc_b + 8 * t0); break;
    case 2: tile_pair_rows<GROUP, SUM, 2>(ta, tb, x, t0, b, acc_a + 8 * t0, acc_b + 8 * t0); break;
  }
}

}  // namespace tokenmill::ggml::avx2_tile
