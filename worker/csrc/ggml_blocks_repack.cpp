// Q4_K, Q5_K and Q6_K repacked once at load for the AVX2 GEMM (ggml_blocks_avx2_gemm.cpp), which otherwise
// transposes every 8 weight rows' blocks into a scratch tile on every call: at one row of x (a decode step) that
// per-call work was about as long as the arithmetic itself. Here the transposes are done at load and the GEMM's
// registers come straight from memory: a load and a mask for most codes (a shift more for a high nibble; Q5_K's
// fifth bit three more), as llama.cpp's repacked block_q4_Kx8 is read. The layout keeps the file's size (Q6_K
// exactly; Q4_K and Q5_K 2-3% more: their 6-bit scales and mins one byte each). Up to one register tile of x (4
// rows), each register is used once and read so; more rows decode each group block once into the GEMM's Tile
// (ggml_blocks_avx2_tile.h) and run its loop, two groups at a time where two remain. Either way the next group's
// block is requested while one is read (without it, 16-64 rows ran 0.93-0.98x the file-layout GEMM). Figures:
// docs/benchmarks.md, "K-quants repacked" and "Two groups a step".
//
//   one group block = the blocks b of 8 weight rows n..n+7 (n a multiple of 8); a repacked weight [N, nb * share]
//   holds group n / 8's nb group blocks one after another (rows n..n+7 of the tensor, share = group bytes / 8).
//   register r = 32 bytes at codes + 32r, int32 lane j = row j's bytes.
//
//   Q4_K (1184 B)  [0]    d: 8 f16, row j's at 2j        [16]  dmin: 8 f16
//                  [32]   scales: byte 8g + j = row j's scale of group g (g = 0..7, 6 bits)
//                  [96]   mins: byte 8g + j = row j's minimum of group g
//                  [160]  nibbles: register 8i + d = row j's bytes 32i + 4d .. 32i + 4d + 3 (i = 0..3): low
//                         nibbles values 64i + 4d.., group 2i; high nibbles values 64i + 32 + 4d.., group 2i + 1
//   Q5_K (1440 B)  as Q4_K, then [160] fifth bits: register d = row j's bytes 4d..4d+3 of qh (bit 2i: the low
//                  nibble of chunk i, bit 2i + 1 its high nibble), and the nibbles at [416]
//   Q6_K (1680 B)  [0]    d: 8 f16                        [16]  scales: byte 8g + j = row j's scale g (int8, 16)
//                  [144]  codes, 3 registers per scale group g (steps 4g..4g+3, 96 B at 144 + 96g): register k
//                         (k = 0..2) byte t of lane j = row j's 6-bit code of value 16g + 4k + t, and in its top
//                         2 bits, bits 2k, 2k + 1 of the code of value 16g + 12 + t: 4 codes in 3 bytes, so a step
//                         costs one mask (the fourth: 3 shifts, 3 masks, 2 ors), where ql / qh's order cost
//                         a step 5 operations on average
//
// Step s of a block (4 values, x's 4s..4s+3) is the scratch tile's codes[s] of ggml_blocks_avx2_gemm.cpp; the
// scales, terms, d and f are its Tile's; the sums run in its order. Exactness: the integer sums are the same
// integers, and the float steps (one fma for the sums, one for the terms, per block and row, in block order)
// are the same operations on the same values: bit for bit today's GEMM, and a row of x alone whatever the others.
// Anything else that reads the weight (the dequantized strips of a long prefill, a dense copy, the embedding a
// tied lm_head shares) gets the file's blocks back, row by row, from unpack_row.
#include <torch/extension.h>
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

// ---- the layout: where each piece of a file block goes in a group block ----

// kHalf: 2 bytes, row j's at dst + 2j. kBytes: byte i of row j at dst + 8i + j. kDwords: byte 32c + 4d + t of
// row j at dst + 256c + 32d + 4j + t. kScalesK4: Q4_K / Q5_K's 12 bytes of 6-bit scales and mins, scale g of row
// j at dst + 8g + j, min g at dst + 64 + 8g + j.
enum Piece { kHalf, kBytes, kDwords, kScalesK4 };
struct Segment {
  Piece piece;
  int src, len, dst;
};
constexpr Segment kQ4K[] = {{kHalf, 0, 2, 0}, {kHalf, 2, 2, 16}, {kScalesK4, 4, 12, 32}, {kDwords, 16, 128, 160}};
constexpr Segment kQ5K[] = {{kHalf, 0, 2, 0}, {kHalf, 2, 2, 16}, {kScalesK4, 4, 12, 32}, {kDwords, 16, 32, 160},
                            {kDwords, 48, 128, 416}};
constexpr Segment kQ6K[] = {{kHalf, 208, 2, 0}, {kBytes, 192, 16, 16}};  // and the codes: q6k_pack

struct Layout {
  const Segment* segments;
  int count, group_bytes;
  bool codes6;  // Q6_K: the codes go by q6k_pack / q6k_unpack, not by segments
};

Layout layout_of(int64_t type) {
  switch (file_type(type)) {
    case Q4_K: return {kQ4K, 4, 1184, false};
    case Q5_K: return {kQ5K, 5, 1440, false};
    case Q6_K: return {kQ6K, 2, 1680, true};
  }
  TORCH_CHECK(false, "ggml_blocks: GGML type ", file_type(type), " has no repacked layout (Q4_K, Q5_K, Q6_K have)");
}

int byte_at(const Segment& s, int j, int i) {
  switch (s.piece) {
    case kHalf: return s.dst + 2 * j + i;
    case kBytes: return s.dst + 8 * i + j;
    default: return s.dst + 256 * (i / 32) + 32 * (i % 32 / 4) + 4 * j + i % 4;
  }
}

// llama.cpp's get_scale_min_k4 for all 8 groups, and its inverse (all 96 bits are used: the round trip is exact)
void k4_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int g = 0; g < 4; ++g) {
    sc[g] = q[g] & 63, mn[g] = q[g + 4] & 63;
    sc[g + 4] = (q[g + 8] & 0xF) | ((q[g] >> 6) << 4);
    mn[g + 4] = (q[g + 8] >> 4) | ((q[g + 4] >> 6) << 4);
  }
}
void k4_scales_packed(const uint8_t* sc, const uint8_t* mn, uint8_t* q) {
  for (int g = 0; g < 4; ++g) {
    q[g] = (sc[g] & 63) | ((sc[g + 4] >> 4) << 6);
    q[g + 4] = (mn[g] & 63) | ((mn[g + 4] >> 4) << 6);
    q[g + 8] = (sc[g + 4] & 0xF) | ((mn[g + 4] & 0xF) << 4);
  }
}

// Q6_K's 256 codes (0..63) of a block from its ql / qh (value 128h + 32q + l: ql[64h + 32(q % 2) + l]'s low
// nibble for q < 2, else its high one, and qh[32h + l]'s bits 2q, 2q + 1), and back
void q6k_codes(const uint8_t* block, uint8_t* code) {
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 4; ++q)
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = block[64 * h + 32 * (q % 2) + l], high = block[128 + 32 * h + l];
        code[128 * h + 32 * q + l] = ((q < 2 ? low : low >> 4) & 0xF) | (((high >> (2 * q)) & 3) << 4);
      }
}
void q6k_block(const uint8_t* code, uint8_t* block) {
  std::memset(block, 0, 192);
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 4; ++q)
      for (int l = 0; l < 32; ++l) {
        const uint8_t c = code[128 * h + 32 * q + l];
        block[64 * h + 32 * (q % 2) + l] |= (c & 0xF) << (q < 2 ? 0 : 4);
        block[128 + 32 * h + l] |= (c >> 4) << (2 * q);
      }
}
// where value v's code goes in a Q6_K group block for row j: 4 codes of a scale group in 3 bytes
void q6k_pack(const uint8_t* block, int j, uint8_t* group) {
  uint8_t code[256];
  q6k_codes(block, code);
  for (int g = 0; g < 16; ++g)
    for (int k = 0; k < 3; ++k)
      for (int t = 0; t < 4; ++t) {
        const uint8_t fourth = code[16 * g + 12 + t];
        group[144 + 96 * g + 32 * k + 4 * j + t] = code[16 * g + 4 * k + t] | (((fourth >> (2 * k)) & 3) << 6);
      }
}
void q6k_unpack(const uint8_t* group, int j, uint8_t* block) {
  uint8_t code[256];
  for (int g = 0; g < 16; ++g)
    for (int t = 0; t < 4; ++t) {
      uint8_t fourth = 0;
      for (int k = 0; k < 3; ++k) {
        const uint8_t byte = group[144 + 96 * g + 32 * k + 4 * j + t];
        code[16 * g + 4 * k + t] = byte & 63;
        fourth |= (byte >> 6) << (2 * k);
      }
      code[16 * g + 12 + t] = fourth;
    }
  q6k_block(code, block);
}

// row j's file block <-> its place in a group block
void pack_block(const Layout& l, const uint8_t* block, int j, uint8_t* group) {
  if (l.codes6) q6k_pack(block, j, group);
  for (int k = 0; k < l.count; ++k) {
    const Segment& s = l.segments[k];
    if (s.piece == kScalesK4) {
      uint8_t sc[8], mn[8];
      k4_scales(block + s.src, sc, mn);
      for (int g = 0; g < 8; ++g) group[s.dst + 8 * g + j] = sc[g], group[s.dst + 64 + 8 * g + j] = mn[g];
      continue;
    }
    if (s.piece == kDwords) {  // 4 bytes at a time: the bulk of a block, and of the load's repacking time
      for (int i = 0; i < s.len; i += 4) std::memcpy(group + byte_at(s, j, i), block + s.src + i, 4);
      continue;
    }
    for (int i = 0; i < s.len; ++i) group[byte_at(s, j, i)] = block[s.src + i];
  }
}
void unpack_block(const Layout& l, const uint8_t* group, int j, uint8_t* block) {
  if (l.codes6) q6k_unpack(group, j, block);
  for (int k = 0; k < l.count; ++k) {
    const Segment& s = l.segments[k];
    if (s.piece == kScalesK4) {
      uint8_t sc[8], mn[8];
      for (int g = 0; g < 8; ++g) sc[g] = group[s.dst + 8 * g + j], mn[g] = group[s.dst + 64 + 8 * g + j];
      k4_scales_packed(sc, mn, block + s.src);
      continue;
    }
    for (int i = 0; i < s.len; ++i) block[s.src + i] = group[byte_at(s, j, i)];
  }
}

// ---- the GEMM on group blocks: each type's registers, then ggml_blocks_avx2_gemm.cpp's tile loop ----

AVX2_TARGET inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
AVX2_TARGET inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
AVX2_TARGET inline __m128i load64(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
// 8 int16 (one per row) -> lane j holds row j's value twice
AVX2_TARGET inline __m256i twice(__m128i v) { return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)); }

// Q4_K / Q5_K: 8 steps a scale group; Q4_K's 8 steps' int16 products add up before vpmaddwd, Q5_K's 4
template <bool FIFTH>
struct K4Layout {
  static constexpr int kGroup = 8, kSum = FIFTH ? 4 : 8, kNibbles = FIFTH ? 416 : 160;
  AVX2_TARGET static __m256 d(const uint8_t* g) { return _mm256_cvtph_ps(load128(g)); }
  AVX2_TARGET static __m256 f(const uint8_t* g) { return _mm256_cvtph_ps(load128(g + 16)); }
  AVX2_TARGET static __m256i scale(const uint8_t* g, int group) { return twice(_mm_cvtepu8_epi16(load64(g + 32 + 8 * group))); }
  AVX2_TARGET static __m256i term(const uint8_t* g, int p) { return twice(_mm_cvtepu8_epi16(load64(g + 96 + 8 * p))); }
  AVX2_TARGET static __m256i codes(const uint8_t* g, int step) {
    const int i = step / 16, high = step % 16 / 8, d = step % 8;  // chunk i, its high nibbles or its low
    const __m256i q = load256(g + kNibbles + 32 * (8 * i + d));
    __m256i c = _mm256_and_si256(high ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    if (FIFTH) {
      const __m256i qh = load256(g + 160 + 32 * d);
      c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + high), _mm256_set1_epi8(1)), 4));
    }
    return c;
  }
};

// Q6_K: 4 steps a scale group (16 values), 2 at a time in int16; the terms carry the codes' -32
struct Q6KLayout {
  static constexpr int kGroup = 4, kSum = 2;
  AVX2_TARGET static __m256 d(const uint8_t* g) { return _mm256_cvtph_ps(load128(g)); }
  AVX2_TARGET static __m256 f(const uint8_t* g) { return _mm256_mul_ps(d(g), _mm256_set1_ps(32.f)); }
  AVX2_TARGET static __m256i scale(const uint8_t* g, int group) { return twice(_mm_cvtepi8_epi16(load64(g + 16 + 8 * group))); }
  AVX2_TARGET static __m256i term(const uint8_t* g, int p) {  // lane j: row j's scales 2p, 2p + 1
    const __m128i a = _mm_cvtepi8_epi16(load64(g + 16 + 16 * p)), b = _mm_cvtepi8_epi16(load64(g + 24 + 16 * p));
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
  }
  AVX2_TARGET static __m256i codes(const uint8_t* g, int step) {
    const uint8_t* regs = g + 144 + 96 * (step / 4);
    const int k = step % 4;
    if (k < 3) return _mm256_and_si256(load256(regs + 32 * k), _mm256_set1_epi8(63));
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0xC0));  // the fourth code's 2 bits in each
    return _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(load256(regs), top), 6),
                           _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(load256(regs + 32), top), 4),
                                           _mm256_srli_epi16(_mm256_and_si256(load256(regs + 64), top), 2)));
  }
};

// A group block's registers read (and unpacked) from memory at each use: for one tile of x or fewer, where each
// is used once. More rows of x decode it once into the GEMM's Tile instead (decode, then avx2_tile::all_rows, or
// two groups' Tiles and all_rows_pair).
template <class L>
struct Direct {
  const uint8_t* g;
  AVX2_TARGET __m256i codes(int step) const { return L::codes(g, step); }
  AVX2_TARGET __m256i scale(int group) const { return L::scale(g, group); }
  AVX2_TARGET __m256i term(int p) const { return L::term(g, p); }
  AVX2_TARGET __m256 d() const { return L::d(g); }
  AVX2_TARGET __m256 f() const { return L::f(g); }
};

// The GEMM's Tile filled without transposes
template <class L>
AVX2_TARGET void decode(const uint8_t* g, Tile& tile) {
#pragma GCC unroll 64
  for (int step = 0; step < 64; ++step) tile.codes[step] = L::codes(g, step);
#pragma GCC unroll 16
  for (int group = 0; group < 64 / L::kGroup; ++group) tile.scales[group] = L::scale(g, group);
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) tile.terms[p] = L::term(g, p);
  tile.d = L::d(g), tile.f = L::f(g);
}

// R rows of x (t0..) against one group block, block b of x: acc[r * 8 + j] (row t0 + r, weight row j) gains
// it; avx2_tile::tile_rows step for step. The loops unroll fully, so each step's register
// offsets and shifts are constants.
template <class L, int R, class Src>
AVX2_TARGET void group_rows(const Src& w, const Q8Rows& x, int64_t t0, int64_t b, float* acc) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.qs(t0 + r, b);
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int grp = 0; grp < 64 / L::kGroup; ++grp) {
#pragma GCC unroll 8
    for (int s0 = 0; s0 < L::kGroup; s0 += L::kSum) {
      __m256i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int k = 0; k < L::kSum; ++k) {
        const int step = grp * L::kGroup + s0 + k;
        const __m256i codes = w.codes(step);
        for (int r = 0; r < R; ++r) {
          part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(codes, broadcast4(xq[r] + 4 * step)));
          in_register(part[r]);
        }
      }
      const __m256i scale = w.scale(grp);
      for (int r = 0; r < R; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], scale));
        in_register(isum[r]);  // unrolled, GCC would keep every group's product apart and spill them
      }
    }
  }
  __m256i iterm[R];
  for (int r = 0; r < R; ++r) iterm[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    const __m256i term = w.term(p);
    for (int r = 0; r < R; ++r)
      iterm[r] = _mm256_add_epi32(iterm[r], _mm256_madd_epi16(term, broadcast4(x.sums(t0 + r, b) + 2 * p)));
  }
  const __m256 d = w.d(), f = w.f();
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_set1_ps(x.scale(t0 + r, b));
    __m256 a = _mm256_loadu_ps(acc + 8 * r);
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), a);
    a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(iterm[r]), _mm256_mul_ps(f, dx), a);
    _mm256_storeu_ps(acc + 8 * r, a);
  }
}

// Up to one tile of x (x.T <= kTileX)
template <class L>
AVX2_TARGET void few_rows(const Direct<L>& w, const Q8Rows& x, int64_t b, float* acc) {
  switch (x.T) {
    case 1: group_rows<L, 1>(w, x, 0, b, acc); break;
    case 2: group_rows<L, 2>(w, x, 0, b, acc); break;
    case 3: group_rows<L, 3>(w, x, 0, b, acc); break;
    case 4: group_rows<L, 4>(w, x, 0, b, acc); break;
  }
}

template <class L, typename Out>
void gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, Out* out, int64_t ldo,
               int64_t col0) {
  TORCH_CHECK(n0 % kRows == 0 && (n1 % kRows == 0 || n1 == p.rows), "ggml_blocks: repacked rows [", n0, ", ", n1,
              ") do not start and end on groups of 8");
  const int64_t group_bytes = kRows * block_bytes(p.type);
  const int64_t group_stride = x.nb * group_bytes;  // from a group's block b to the next group's
  float* const acc = thread_acc(2 * x.T * kRows);  // [T, 8] a group: two while a pair of groups runs
  float* const acc_b = acc + x.T * kRows;
  Tile tile, tile_b;
  for (int64_t n = n0; n < n1;) {
    // more than one tile of x: two groups at a time where two remain (avx2_tile::tile_pair_rows says why)
    const bool pair = x.T > kTileX && n + 2 * kRows <= n1;
    const int64_t width = pair ? 2 * kRows : kRows, next = n + width;
    const uint8_t* g = p.data + n * p.row_bytes;  // group n / 8's blocks, one after another
    std::fill(acc, acc + x.T * width, 0.f);
    for (int64_t b = 0; b < x.nb; ++b, g += group_bytes) {
      for (int64_t ahead = 0; ahead < width && next + ahead < n1; ahead += kRows)  // the next groups' block b
        tokenmill::prefetch_lines(g + (width + ahead) / kRows * group_stride, group_bytes);
      if (x.T <= kTileX) {
        few_rows<L>(Direct<L>{g}, x, b, acc);
      } else if (pair) {
        decode<L>(g, tile);
        decode<L>(g + group_stride, tile_b);
        all_rows_pair<L::kGroup, L::kSum>(tile, tile_b, x, b, acc, acc_b);
      } else {
        decode<L>(g, tile);
        all_rows<L::kGroup, L::kSum>(tile, x, b, acc);
      }
    }
    for (int64_t t = 0; t < x.T; ++t)
      for (int64_t j = 0; j < width; ++j) {
        const float add = bias ? bias[col0 + n + j] : 0.f;  // in float32, then one rounding to Out
        const float sum = j < kRows ? acc[t * kRows + j] : acc_b[t * kRows + j - kRows];
        out[t * ldo + col0 + n + j] = static_cast<Out>(sum + add);
      }
    n = next;
  }
}

template <typename Out>
void repacked_rows_any(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, Out* out,
                       int64_t ldo, int64_t col0) {
  switch (file_type(p.type)) {
    case Q4_K: gemm_rows<K4Layout<false>>(p, n0, n1, x, bias, out, ldo, col0); return;
    case Q5_K: gemm_rows<K4Layout<true>>(p, n0, n1, x, bias, out, ldo, col0); return;
    case Q6_K: gemm_rows<Q6KLayout>(p, n0, n1, x, bias, out, ldo, col0); return;
  }
  TORCH_CHECK(false, "ggml_blocks: GGML type ", file_type(p.type), " has no repacked GEMM");
}

}  // namespace

bool tokenmill::ggml::repack_has_layout(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

int64_t tokenmill::ggml::repacked_row_share(int64_t type) { return layout_of(type).group_bytes / kRows; }

void tokenmill::ggml::unpack_row(const uint8_t* data, int64_t type, int64_t K, int64_t row, uint8_t* out) {
  const Layout l = layout_of(type);
  const int64_t nb = K / QK, file_bytes = block_bytes(file_type(type));
  const uint8_t* group = data + (row / kRows) * kRows * nb * (l.group_bytes / kRows);
  for (int64_t b = 0; b < nb; ++b) unpack_block(l, group + b * l.group_bytes, static_cast<int>(row % kRows), out + b * file_bytes);
}

void tokenmill::ggml::repacked_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias,
                                         float* out, int64_t ldo, int64_t col0) {
  repacked_rows_any(p, n0, n1, x, bias, out, ldo, col0);
}
void tokenmill::ggml::repacked_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias,
                                         at::BFloat16* out, int64_t ldo, int64_t col0) {
  repacked_rows_any(p, n0, n1, x, bias, out, ldo, col0);
}

// blocks: uint8 [N, K / 256 * block bytes] in a K-quant type, N a multiple of 8 -> the repacked weight, uint8
// [N, K / 256 * share]: a copy (the caller lets go of the file's pages)
at::Tensor ggml_blocks_repack(const at::Tensor& blocks, int64_t type, int64_t K) {
  TORCH_CHECK(repack_has_layout(type), "ggml_blocks_repack: GGML type ", type, " has no repacked layout (Q4_K 12, "
              "Q5_K 13, Q6_K 14 have)");
  const int64_t nb = K / QK, file_bytes = block_bytes(type);
  TORCH_CHECK(K % QK == 0 && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == nb * file_bytes && blocks.size(0) % kRows == 0,
              "ggml_blocks_repack: blocks must be contiguous uint8 [N, ", nb * file_bytes, "] for K ", K,
              " with N a multiple of 8, got ", blocks.sizes());
  const Layout l = layout_of(type);
  const int64_t groups = blocks.size(0) / kRows;
  at::Tensor packed = at::empty({blocks.size(0), nb * (l.group_bytes / kRows)}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < kRows; ++j)
          pack_block(l, src + (u * kRows + j) * nb * file_bytes + b * file_bytes, j, dst + (u * nb + b) * l.group_bytes);
  });
  return packed;
}

// the inverse, for tests: a repacked weight -> the file's blocks [N, K / 256 * block bytes]
at::Tensor ggml_blocks_unpack(const at::Tensor& packed, int64_t type, int64_t K) {
  const Layout l = layout_of(type);
  const int64_t nb = K / QK, file_bytes = block_bytes(file_type(type));
  TORCH_CHECK(K % QK == 0 && packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == nb * (l.group_bytes / kRows) && packed.size(0) % kRows == 0,
              "ggml_blocks_unpack: a repacked weight must be contiguous uint8 [N, ", nb * (l.group_bytes / kRows),
              "] for K ", K, " with N a multiple of 8, got ", packed.sizes());
  at::Tensor blocks = at::empty({packed.size(0), nb * file_bytes}, packed.options());
  at::parallel_for(0, packed.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      unpack_row(packed.data_ptr<uint8_t>(), type, K, row, blocks.data_ptr<uint8_t>() + row * nb * file_bytes);
  });
  return blocks;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("ggml_blocks_repack(Tensor blocks, int type, int K) -> Tensor");
  m.def("ggml_blocks_unpack(Tensor packed, int type, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("ggml_blocks_repack", &ggml_blocks_repack);
  m.impl("ggml_blocks_unpack", &ggml_blocks_unpack);
}
