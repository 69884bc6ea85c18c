// The AVX2 GEMM's register tile and inner loop (ggml_blocks_avx2_gemm.cpp explains the arithmetic): a decoded
// Tile of 8 weight rows' super-block against rows of x, 4 at a time. Shared by the GEMM on the file's blocks and
// the one on blocks repacked at load (ggml_blocks_repack.cpp), so that both sum in one order: the same bits.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"

namespace tokenmill::ggml::avx2_tile {

constexpr int kRows = 8;  // weight rows a tile transposes: one int32 lane each
constexpr int kTileX = 4;  // rows of x a register tile holds (16 ymm registers: 4 int16 + 4 int32 sums + operands)

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

// Keeps v in a register here: without it GCC turns the chain of int16 adds into a tree over all the group's
// products at once, which needs more than 16 registers and spills half of them to the stack
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

AVX2_TARGET inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
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

}  // namespace tokenmill::ggml::avx2_tile
