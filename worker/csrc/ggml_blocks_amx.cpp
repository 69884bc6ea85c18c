// The K-quants (Q4_K, Q5_K, Q6_K) against many rows of x on AMX-INT8 tiles, on the file's own blocks.
//
// Why: past a few rows of x the vector kernels (ggml_blocks_dot.cpp) are bound by their arithmetic, one
// maddubs + vpdpwssd pair per 64 weights per row of x, while the weights' bytes are already in cache.
// A TDPBUSD does 16 x 16 x (sub-block) products in one instruction.
//
// The operands, per 16 weight rows, per 256-element super-block, per sub-block (32 values for Q4_K / Q5_K,
// 16 for Q6_K):
//   A: the 16 weight rows' codes of the sub-block as unsigned bytes (0..15, 0..31 or 0..63), unpacked
//      from the block into a 16 x 256 scratch once per super-block and reused for every 16 rows of x;
//   B: x's int8 (q8_K, the same rounding as the vector kernels) for 16 rows of x, laid out once per call
//      in the tiles' 4-bytes-of-K-per-column order (AmxRows);
//   C = A . B: the int32 sums of the sub-block for each (weight row, row of x).
// The sub-blocks carry their own scales, so each sub-block's C goes through memory and is multiplied by
// its integer scale (vpmulld) into one int32 sum per super-block, exactly as the vector kernels' integer
// sum; then the float32 d * dx, minus the minimums' (Q4_K / Q5_K) or the -32 offset's (Q6_K) term from x's
// sums of 16. Only the float accumulation order differs from the vector kernels'.
//
// Q4_K / Q5_K's unpacking keeps the block's byte order: 64 bytes of nibbles give the low nibbles of
// groups 0 and 1 then the high nibbles, which are sub-blocks 0, 2, 1, 3 (kSubOrder); B is addressed at
// the matching sub-block of x, so the codes are never shuffled. Q6_K's come out in order.
//
// Linux hands a process the tile registers' state (8 KiB) only once asked (arch_prctl
// ARCH_REQ_XCOMP_PERM): amx_int8_usable asks, and a CPU or kernel without it keeps the vector kernels.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "ggml_blocks.h"
#include "ggml_blocks_amx.h"

namespace tokenmill::ggml {

namespace {

constexpr int kSubOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // Q4_K / Q5_K: unpacked 32-byte chunk c holds sub-block kSubOrder[c]

// x's per-block numbers for 16 rows of x, as the scaling pass reads them: the block scale, and the sums of
// x's int8 over 32 (Q4_K / Q5_K's minimums) and over 16 (Q6_K's offset), as int16 pairs for vpdpwssd
struct alignas(64) XSums {
  float d[kTile];
  int16_t sum32[4][kTile][2];
  int16_t sum16[8][kTile][2];
};

// tmm0/1: C (int32, 16 weight rows x 16 rows of x); tmm2/3: A (16 weight rows x `sub` code bytes); tmm4/5:
// B (sub / 4 rows of 16 x 4 bytes). Two of each, so that two sub-blocks are in flight.
AMX_TARGET void configure_tiles(int sub) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) c.rows[t] = kTile, c.colsb[t] = 64;
  for (int t = 2; t < 4; ++t) c.rows[t] = kTile, c.colsb[t] = static_cast<uint16_t>(sub);
  for (int t = 4; t < 6; ++t) c.rows[t] = static_cast<uint8_t>(sub / 4), c.colsb[t] = 64;
  load_tile_config(c);
}

AMX_TARGET void release_tiles() { _tile_release(); }

inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// The weight rows' scratch for one super-block: codes, and per row its scales as the scaling pass reads them
struct alignas(64) Unpacked {
  uint8_t codes[kTile][QK];
  int32_t scale[kTile][16];   // per sub-block (8 or 16)
  int32_t pairs[kTile][8];    // Q4_K / Q5_K: the 8 minimums as int16 pairs (4); Q6_K: the 16 scales (8)
  float d[kTile], dmin[kTile];
};

// Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales (bytes 0-7) then 8 minimums (bytes 8-15)
inline __m128i k_scales_packed(const uint8_t* p) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  const uint32_t mins_low = u[1] & 0x3f3f3f3f;
  u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  u[2] = mins_low;
  u[0] &= 0x3f3f3f3f;
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
}

template <bool FIFTH>
AMX_TARGET void unpack_k4(const uint8_t* blk, int r, Unpacked& u) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const uint8_t* qs = blk + (FIFTH ? 48 : 16);
  const __m512i v0 = _mm512_loadu_si512(qs), v1 = _mm512_loadu_si512(qs + 64);
  __m512i c[4] = {_mm512_and_si512(v0, m4), _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4),
                  _mm512_and_si512(v1, m4), _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4)};
  if (FIFTH) {  // element 64i + l's fifth bit: bit 2i of qh[l]; element 64i + 32 + l's: bit 2i + 1
    const __m512i one = _mm512_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i h23 = _mm512_srli_epi16(h01, 4);
    c[0] = _mm512_or_si512(c[0], _mm512_slli_epi16(_mm512_and_si512(h01, one), 4));
    c[1] = _mm512_or_si512(c[1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h01, 1), one), 4));
    c[2] = _mm512_or_si512(c[2], _mm512_slli_epi16(_mm512_and_si512(h23, one), 4));
    c[3] = _mm512_or_si512(c[3], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h23, 1), one), 4));
  }
  for (int i = 0; i < 4; ++i) _mm512_store_si512(u.codes[r] + 64 * i, c[i]);
  const __m128i sm = k_scales_packed(blk + 4);
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.scale[r]), _mm256_cvtepu8_epi32(sm));
  _mm_store_si128(reinterpret_cast<__m128i*>(u.pairs[r]), _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
  u.d[r] = f16(blk);
  u.dmin[r] = f16(blk + 2);
}

// Q6_K: per half of 128, bytes [0,64) of ql's low nibbles with qh's bits 0-1 / 2-3 are elements 0..63,
// its high nibbles with bits 4-5 / 6-7 elements 64..127
AMX_TARGET void unpack_q6k(const uint8_t* blk, int r, Unpacked& u) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(h01, m2), 4));
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h01, 4), m2), 4));
    _mm512_store_si512(u.codes[r] + 128 * h, lo);
    _mm512_store_si512(u.codes[r] + 128 * h + 64, hi);
  }
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  _mm512_store_si512(u.scale[r], _mm512_cvtepi8_epi32(sc));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.pairs[r]), _mm256_cvtepi8_epi16(sc));
  u.d[r] = f16(blk + 208);
  u.dmin[r] = 0.f;
}

}  // namespace

// x's int8 for each 16 rows of x as [K / 4][16 rows][4 bytes] (rows past T are zero), and its XSums per block
struct AmxRows {
  int64_t T = 0, K = 0, nb = 0, tiles = 0;
  LineVector<int8_t> b;
  std::vector<XSums> sums;
  const int8_t* at(int64_t tile, int64_t k) const { return b.data() + (tile * (K / 4) + k / 4) * 64; }
  const XSums& sum(int64_t tile, int64_t block) const { return sums[tile * nb + block]; }
};

namespace {

// The 16 weight rows' sums for one super-block and 16 rows of x, added into acc [16 weight rows][16 rows of x]
template <int64_t TYPE>
AMX_TARGET void super_block(const Unpacked& u, const AmxRows& x, int64_t tile, int64_t b, float* acc) {
  constexpr int sub = TYPE == Q6_K ? 16 : 32, subs = QK / sub;
  alignas(64) int32_t C[subs][kTile][kTile];
  for (int c = 0; c < subs; c += 2) {
    const int s0 = TYPE == Q6_K ? c : kSubOrder[c], s1 = TYPE == Q6_K ? c + 1 : kSubOrder[c + 1];
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, u.codes[0] + sub * c, QK);
    _tile_loadd(3, u.codes[0] + sub * (c + 1), QK);
    _tile_loadd(4, x.at(tile, b * QK + sub * s0), 64);
    _tile_loadd(5, x.at(tile, b * QK + sub * s1), 64);
    _tile_dpbusd(0, 2, 4);
    _tile_dpbusd(1, 3, 5);
    _tile_stored(0, C[s0], 64);
    _tile_stored(1, C[s1], 64);
  }
  const XSums& xs = x.sum(tile, b);
  const __m512 dx = _mm512_load_ps(xs.d);
  constexpr int npairs = TYPE == Q6_K ? 8 : 4;
  __m512i sums[npairs];
  for (int p = 0; p < npairs; ++p)
    sums[p] = _mm512_load_si512(TYPE == Q6_K ? &xs.sum16[p][0][0] : &xs.sum32[p][0][0]);
  for (int r = 0; r < kTile; ++r) {
    __m512i s = _mm512_mullo_epi32(_mm512_load_si512(C[0][r]), _mm512_set1_epi32(u.scale[r][0]));
    for (int j = 1; j < subs; ++j)
      s = _mm512_add_epi32(s, _mm512_mullo_epi32(_mm512_load_si512(C[j][r]), _mm512_set1_epi32(u.scale[r][j])));
    // Q4_K / Q5_K: sum_j min_j * (x's sum over sub-block j); Q6_K: sum_j scale_j * (x's sum over j), the
    // offset 32 times that
    __m512i t = _mm512_setzero_si512();
    for (int p = 0; p < npairs; ++p) t = _mm512_dpwssd_epi32(t, sums[p], _mm512_set1_epi32(u.pairs[r][p]));
    __m512 a = _mm512_loadu_ps(acc + r * kTile);
    if (TYPE == Q6_K) {
      s = _mm512_sub_epi32(s, _mm512_slli_epi32(t, 5));
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dx, _mm512_set1_ps(u.d[r])), a);
    } else {
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dx, _mm512_set1_ps(u.d[r])), a);
      a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dx, _mm512_set1_ps(u.dmin[r])), a);
    }
    _mm512_storeu_ps(acc + r * kTile, a);
  }
}

template <int64_t TYPE, typename Out>
AMX_TARGET void part_tiles(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, const float* bias, Out* out,
                           int64_t ldo, int64_t col0) {
  // kAhead: 16 rows of x, Qwen2.5-1.5B's layer from memory (bench_ggml_blocks.py --cold 24 --rows 16), GB/s of
  // gate_up / down: none 5.8 / 6.3, 4 blocks 8.3 / 8.6, 8 blocks 7.8 / 7.8, 16 blocks 7.5 / 7.9
  constexpr int64_t kBytes = TYPE == Q6_K ? 210 : TYPE == Q5_K ? 176 : 144, kAhead = 4;
  configure_tiles(TYPE == Q6_K ? 16 : 32);
  Unpacked u;
  std::vector<float> acc(x.tiles * kTile * kTile);
  for (int64_t n = n0; n < n1; n += kTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kTile, n1 - n));
    if (rows < kTile) std::memset(&u, 0, sizeof u);  // the tile's missing rows: zero codes and scales
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < x.nb; ++b) {
      for (int r = 0; r < rows; ++r) {
        const uint8_t* blk = p.data + (n + r) * p.row_bytes + b * kBytes;
        // 16 rows read side by side are 16 strided streams, more than the hardware prefetcher follows: each
        // row's block kAhead blocks on is requested by hand, past the row's end the next tile's same row
        const int64_t ahead = b + kAhead < x.nb ? (n + r) * p.row_bytes + (b + kAhead) * kBytes
                                                : (n + kTile + r) * p.row_bytes + (b + kAhead - x.nb) * kBytes;
        if (n + kTile + r < n1 || b + kAhead < x.nb) prefetch_block(p.data + ahead, kBytes);
        if (TYPE == Q6_K)
          unpack_q6k(blk, r, u);
        else
          unpack_k4<TYPE == Q5_K>(blk, r, u);
      }
      for (int64_t tile = 0; tile < x.tiles; ++tile) super_block<TYPE>(u, x, tile, b, acc.data() + tile * kTile * kTile);
    }
    store_tile(acc.data(), rows, x.T, bias ? bias + col0 + n : nullptr, out + col0 + n, ldo);
  }
  release_tiles();
}

template <typename Out>
void part_rows_any(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, const float* bias, Out* out, int64_t ldo,
                   int64_t col0) {
  switch (p.type) {
    case Q4_K: part_tiles<Q4_K>(p, n0, n1, x, bias, out, ldo, col0); break;
    case Q5_K: part_tiles<Q5_K>(p, n0, n1, x, bias, out, ldo, col0); break;
    case Q6_K: part_tiles<Q6_K>(p, n0, n1, x, bias, out, ldo, col0); break;
    default: TORCH_CHECK(false, "ggml_blocks: no AMX kernel for GGML type ", p.type);
  }
}

}  // namespace

bool amx_int8_usable() {
  static const bool yes = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq") ||
        !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bf16"))
      return false;
    return amx_tiles_granted((1u << 24) | (1u << 25));  // AMX-TILE, AMX-INT8
  }();
  return yes;
}

bool amx_has_kernel(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

std::shared_ptr<const AmxRows> amx_rows_of(const Q8Rows& q) {
  auto x = std::make_shared<AmxRows>();
  x->T = q.T, x->K = q.nb * QK, x->nb = q.nb, x->tiles = (q.T + kTile - 1) / kTile;
  x->b.assign(x->tiles * x->K * kTile, 0);
  x->sums.assign(x->tiles * x->nb, XSums{});
  at::parallel_for(0, x->tiles * x->nb, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i / x->nb, b = i % x->nb;
      XSums& s = x->sums[i];
      for (int64_t m = 0; m < kTile && tile * kTile + m < q.T; ++m) {
        const int64_t t = tile * kTile + m;
        int8_t* dst = x->b.data() + (tile * (x->K / 4) + b * QK / 4) * 64 + m * 4;
        const int8_t* src = q.qs(t, b);
        for (int64_t k = 0; k < QK; k += 4) std::memcpy(dst + k * 16, src + k, 4);
        const int16_t* bs = q.sums(t, b);
        s.d[m] = q.scale(t, b);
        for (int j = 0; j < 8; ++j) s.sum32[j / 2][m][j % 2] = static_cast<int16_t>(bs[2 * j] + bs[2 * j + 1]);
        for (int j = 0; j < 16; ++j) s.sum16[j / 2][m][j % 2] = bs[j];
      }
    }
  });
  return x;
}

namespace {

// Threads take chunks of up to kChunkRows rows of the K-quant parts from a shared counter, not a fixed half
// each: the parts differ in cost per row (a fused q/k/v's Q6_K v against its Q4_K q), and with a static split
// one thread waited on the other for ~15% of a 16-row decode step. Within a chunk the next tile's rows are
// prefetched (part_tiles).
constexpr int64_t kChunkRows = 4 * kTile;

template <typename Out>
void linear_tiles(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, const AmxRows& x,
                  const float* bias, Out* out) {
  struct Chunk {
    size_t part;
    int64_t n0, n1;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < ps.size(); ++i)
    if (amx_has_kernel(ps[i].type))
      for (int64_t n = 0; n < ps[i].rows; n += kChunkRows) chunks.push_back({i, n, std::min(ps[i].rows, n + kChunkRows)});
  std::atomic<size_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(chunks.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
      const Chunk& c = chunks[k];
      part_rows_any(ps[c.part], c.n0, c.n1, x, bias, out, ldo, first_col[c.part]);
    }
  });
}

}  // namespace

void amx_linear(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, const AmxRows& x,
                const float* bias, float* out) {
  linear_tiles(ps, first_col, ldo, x, bias, out);
}

void amx_linear(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, const AmxRows& x,
                const float* bias, at::BFloat16* out) {
  linear_tiles(ps, first_col, ldo, x, bias, out);
}

void amx_rows(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, float* out, int64_t ldo, int64_t col0) {
  part_rows_any(p, n0, n1, x, nullptr, out, ldo, col0);
}

void amx_rows(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, at::BFloat16* out, int64_t ldo, int64_t col0) {
  part_rows_any(p, n0, n1, x, nullptr, out, ldo, col0);
}

}  // namespace tokenmill::ggml
