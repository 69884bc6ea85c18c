// Every GGML block type against many rows of x on AMX-BF16 tiles: the dequantized strips of a long step
// (GGMLBlocksLinear.forward_strips) without the strips. Per 32 weight rows and 256 values of K the blocks are
// dequantized to bfloat16 into a scratch that stays in L1 (the same values as the strips: scale * code + min in float32,
// rounded to nearest even), and one TDPBF16PS a step of 32 values multiplies 16 of those rows by 16 rows of x
// in bfloat16, summing in float32 inside the tile over the whole row: no per-sub-block scaling pass, which is
// what the AMX-INT8 kernel (ggml_blocks_amx.cpp) spends most of a tile's time on, and no oneDNN call that packs
// a 4 MB strip for each GEMM.
//
// The operands, per 32 weight rows (two A tiles of 16) and two tiles of 16 rows of x (two B tiles), per 32
// values of K: A = scratch rows [16][32] bfloat16 (row stride K); B = x's [16 pairs of K][16 rows][2] (the
// tiles' pairs-of-K order, laid out once per call); C = 4 float32 tiles [16 weight rows][16 rows of x], stored
// once per row of K and written to the output by store_tile, as the INT8 kernel's.
//
// Accuracy: x rounded to bfloat16 as torch rounds it (strips: x.to(bfloat16)), the weights as the strips
// dequantize them; the float32 sums' order is the tiles' (oneDNN's differs: not bit for bit the strips).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "ggml_blocks.h"
#include "ggml_blocks_amx.h"
#include "simd.h"

using namespace tokenmill::ggml;

namespace {

constexpr int kStep = 32;            // values of K a TDPBF16PS takes (64 bytes of bfloat16 a tile row)
constexpr int64_t kChunk = 2 * kTile;  // weight rows dequantized at a time: the two A tiles
// Values of K dequantized at a time (a whole number of every type's blocks): the chunk's slice (16 KB) stays in L1
// and x's slice (T x 512 bytes) in L2 while every tile of x passes. Over the whole K at once, x's 512 rows of
// Qwen2.5-1.5B's down (9 MB) came from memory again for every 32 weight rows: its layer at 512 rows took
// 47.5 ms against 43.1 for the strips through oneDNN.
constexpr int64_t kSlice = 256;

// tmm0..3: C (C[a][b]: weight tile a, x tile b); tmm4/5: A; tmm6/7: B. Every tile 16 rows of 64 bytes.
AMX_TARGET void configure_bf16_tiles() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = kTile, c.colsb[t] = 64;
  load_tile_config(c);
}

AMX_TARGET void release_bf16_tiles() { _tile_release(); }

// acc[a] [16 weight rows][16 rows of x] per x tile (+)= the chunk's A tiles (TWO_A: both) times x tiles b, b + 1
// (TWO_B) over one slice of K: a = the slice's scratch [32 rows][kc], xb0 = x tile 0's values at the slice's start.
// The first slice starts the sums at zero, the others add to what acc holds. The tile numbers are immediates,
// hence the template.
template <bool TWO_A, bool TWO_B>
AMX_TARGET void tile_block(const at::BFloat16* a, int64_t kc, const at::BFloat16* xb0, int64_t K, int64_t b,
                           bool first, float* acc0, float* acc1) {
  constexpr int kTileFloats = kTile * kTile;
  const int64_t a_stride = kc * 2, xb_tile = K * kTile;  // bytes between scratch rows; values between x tiles
  const at::BFloat16* x0 = xb0 + b * xb_tile;
  const at::BFloat16* x1 = x0 + xb_tile;
  float* c0 = acc0 + b * kTileFloats;
  float* c2 = acc1 + b * kTileFloats;
  if (first) {
    _tile_zero(0);
    if (TWO_B) _tile_zero(1);
    if (TWO_A) _tile_zero(2);
    if (TWO_A && TWO_B) _tile_zero(3);
  } else {
    _tile_loadd(0, c0, 64);
    if (TWO_B) _tile_loadd(1, c0 + kTileFloats, 64);
    if (TWO_A) _tile_loadd(2, c2, 64);
    if (TWO_A && TWO_B) _tile_loadd(3, c2 + kTileFloats, 64);
  }
  for (int64_t k = 0; k < kc; k += kStep) {
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(6, x0 + k * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_B) {
      _tile_loadd(7, x1 + k * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TWO_A) {
      _tile_loadd(5, a + kTile * kc + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (TWO_B) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c0, 64);
  if (TWO_B) _tile_stored(1, c0 + kTileFloats, 64);
  if (TWO_A) _tile_stored(2, c2, 64);
  if (TWO_A && TWO_B) _tile_stored(3, c2 + kTileFloats, 64);
}

// x bfloat16 [T, K] -> xb [tiles][K / 2][16 rows][2]: for each tile and pair of K, the 16 rows' pairs (a gather
// each); rows past T are zero. One tile here (a lambda does not take its caller's target).
AMX_TARGET void lay_out_tile(const at::BFloat16* x, int64_t T, int64_t K, int64_t tile, at::BFloat16* xb) {
  const int64_t rows = std::min<int64_t>(kTile, T - tile * kTile), pairs = K / 2;
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(pairs)));
  const int32_t* src = reinterpret_cast<const int32_t*>(x + tile * kTile * K);
  int32_t* dst = reinterpret_cast<int32_t*>(xb + tile * kTile * K);
  for (int64_t p = 0; p < pairs; ++p)
    _mm512_storeu_si512(dst + p * kTile, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row, src + p, 4));
}

void lay_out_x(const at::BFloat16* x, int64_t T, int64_t K, at::BFloat16* xb) {
  at::parallel_for(0, (T + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) lay_out_tile(x, T, K, tile, xb);
  });
}

struct Chunk {
  size_t part;
  int64_t n0, n1;
};

// Every part against every row of x (xb: lay_out_x's), plus bias, into out [T, ldo] at the parts' columns
template <typename Out>
void linear_bf16_tiles(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, int64_t K,
                       int64_t T, const at::BFloat16* xb, const float* bias, Out* out) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < ps.size(); ++i)
    for (int64_t n = 0; n < ps[i].rows; n += kChunk) chunks.push_back({i, n, std::min(ps[i].rows, n + kChunk)});
  const int64_t tiles = (T + kTile - 1) / kTile;
  shared_chunks(static_cast<int64_t>(chunks.size()), [&](int64_t k) {
    // per thread: one slice of the chunk's rows dequantized (16 KB: stays in L1 while every tile of x passes) and
    // the chunk's sums [2][tiles][16][16]
    thread_local LineVector<at::BFloat16> scratch;
    thread_local LineVector<float> acc;
    if (scratch.size() < static_cast<size_t>(kChunk * kSlice)) scratch.resize(kChunk * kSlice);
    if (acc.size() < static_cast<size_t>(2 * tiles * kTile * kTile)) acc.resize(2 * tiles * kTile * kTile);
    const Chunk& c = chunks[k];
    const Part& p = ps[c.part];
    const int64_t rows = c.n1 - c.n0, per = block_elems(p.type), bytes = block_bytes(p.type);
    float* acc0 = acc.data();
    float* acc1 = acc0 + tiles * kTile * kTile;
    const bool two_a = rows > kTile;
    // a short chunk's missing rows keep what the scratch held: their sums are never stored (store_tile's rows)
    configure_bf16_tiles();  // the dequantizing between slices is AVX-512 only: the tiles keep their state
    for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
      const int64_t kc = std::min(kSlice, K - k0);
      dequantize_bf16_rows(p.type, p.data + c.n0 * p.row_bytes + k0 / per * bytes, p.row_bytes, kc, rows,
                           scratch.data());
      const at::BFloat16* xb0 = xb + k0 * kTile;
      for (int64_t b = 0; b < tiles; b += 2) {
        const bool two_b = b + 1 < tiles, first = k0 == 0;
        if (two_a && two_b) tile_block<true, true>(scratch.data(), kc, xb0, K, b, first, acc0, acc1);
        else if (two_a) tile_block<true, false>(scratch.data(), kc, xb0, K, b, first, acc0, acc1);
        else if (two_b) tile_block<false, true>(scratch.data(), kc, xb0, K, b, first, acc0, acc1);
        else tile_block<false, false>(scratch.data(), kc, xb0, K, b, first, acc0, acc1);
      }
    }
    release_bf16_tiles();
    const int64_t col = first_col[c.part] + c.n0;
    store_tile(acc0, static_cast<int>(std::min<int64_t>(kTile, rows)), T, bias ? bias + col : nullptr, out + col, ldo);
    if (two_a)
      store_tile(acc1, static_cast<int>(rows - kTile), T, bias ? bias + col + kTile : nullptr, out + col + kTile, ldo);
  });
}

// x: [T, K] float32 or bfloat16; parts: uint8 [N_i, K / block_elems * block_bytes] in the file's types[i] (not
// repacked); bias: [sum N_i] or none -> [T, sum N_i] in x's dtype
at::Tensor ggml_blocks_linear_bf16_tiles(const at::Tensor& x_in, at::TensorList parts, at::IntArrayRef types,
                                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_bf16_usable(), "ggml_blocks_linear_bf16_tiles: this CPU lacks amx_tile + amx_bf16 (with "
              "avx512_bf16), or Linux refused the tile state");
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "ggml_blocks_linear_bf16_tiles: x must be 2-D float32 or bfloat16, got ", x_in.sizes(), " ",
              x_in.scalar_type());
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "ggml_blocks_linear_bf16_tiles: ", parts.size(),
              " parts but ", types.size(), " types");
  const int64_t T = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K % kStep == 0, "ggml_blocks_linear_bf16_tiles: in_features ", K, " is not a multiple of ", kStep);
  const LinearParts lp = linear_parts_of("ggml_blocks_linear_bf16_tiles", parts, types, K, false);
  const int64_t N = lp.N;
  at::Tensor b;
  const float* bp = bias_of("ggml_blocks_linear_bf16_tiles", bias, N, b);
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();  // torch's rounding, as the strips'
  const int64_t tiles = (T + kTile - 1) / kTile;
  // every value written by lay_out_x (rows past T as zeros): no zero fill first
  const auto xb = line_buffer<at::BFloat16>(tiles * kTile * K);
  lay_out_x(x.data_ptr<at::BFloat16>(), T, K, xb.get());
  at::Tensor out = at::empty({T, N}, x_in.options());
  AT_DISPATCH_SWITCH(out.scalar_type(), "ggml_blocks_linear_bf16_tiles",
    AT_DISPATCH_CASE(at::kFloat, [&] { linear_bf16_tiles(lp.ps, lp.first_col, N, K, T, xb.get(), bp, out.data_ptr<float>()); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      linear_bf16_tiles(lp.ps, lp.first_col, N, K, T, xb.get(), bp, out.data_ptr<at::BFloat16>()); }));
  return out;
}

bool amx_bf16_op() { return amx_bf16_usable(); }

}  // namespace

bool tokenmill::ggml::amx_bf16_usable() {
  static const bool yes = [] {
    if (!tokenmill::cpu_has_avx512_bf16()) return false;
    return amx_tiles_granted((1u << 22) | (1u << 24));  // AMX-BF16, AMX-TILE
  }();
  return yes;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("ggml_blocks_linear_bf16_tiles(Tensor x, Tensor[] parts, int[] types, Tensor? bias=None) -> Tensor");
  m.def("ggml_blocks_amx_bf16() -> bool");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("ggml_blocks_linear_bf16_tiles", &ggml_blocks_linear_bf16_tiles); }

TORCH_LIBRARY_IMPL(tokenmill, CompositeExplicitAutograd, m) {
  m.impl("ggml_blocks_amx_bf16", &amx_bf16_op);
}
