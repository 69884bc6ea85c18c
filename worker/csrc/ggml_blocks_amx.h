// What the two AMX kernels of the GGML block linears share: the CPUID and tile-state request, the cache-line
// buffers their tiles load from, the tile configuration block, and the store of a [16 weight rows][16 rows of x]
// float32 accumulator into the output's rows. ggml_blocks_amx.cpp runs the K-quants on AMX-INT8 tiles against x
// rounded to q8_K; ggml_blocks_amx_bf16.cpp runs every block type, dequantized to bfloat16 32 weight rows at a
// time, on AMX-BF16 tiles against x in bfloat16.
#pragma once
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>
#include <type_traits>

#include <c10/util/BFloat16.h>

namespace tokenmill::ggml {

#define AMX_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")))

constexpr int kTile = 16;  // weight rows per weight tile, rows of x per x tile

// Whether CPUID leaf 7 sets every bit of `edx_bits` (AMX-TILE 24, AMX-INT8 25, AMX-BF16 22) and Linux hands this
// process the tile registers' state (8 KiB), which it does only once asked (arch_prctl ARCH_REQ_XCOMP_PERM)
inline bool amx_tiles_granted(unsigned edx_bits) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & edx_bits) != edx_bits) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// A vector on 64-byte boundaries, for every buffer a tile is loaded from or stored to. A tile's row that straddles
// two cache lines (std::vector's 16-byte alignment) made TDPs wait on their loads: on the Xeon with AMX, 16
// rows of 64 bytes from a buffer 16 bytes off a line ran the 2x2 TDPBSSD loop at 16.5-18.3 ns a TDP against 6.6-7.1
// ns on lines (a probe of the AMX kernels' loop, weights in L1 and x from L2).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept { return true; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

// The same alignment for a buffer every value of which the caller writes (no zero fill first)
struct LineFree {
  void operator()(void* p) const noexcept { ::operator delete(p, std::align_val_t{64}); }
};
template <typename T>
std::unique_ptr<T[], LineFree> line_buffer(size_t n) {
  return std::unique_ptr<T[], LineFree>(static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})));
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads c; GCC 12 does not see _tile_loadconfig read its operand and drops the stores that filled it without
// the barrier
AMX_TARGET inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// acc [tiles of x][16 weight rows][16 rows of x] -> out[t * ldo + r] for r < rows, plus bias, in out's dtype:
// one gather per row of x makes its 16 outputs one store (a scalar loop converting each was a third of a
// 16-row tile's time at K = 1536). bfloat16 by vcvtneps2bf16: nearest even, as torch rounds.
template <typename Out>
AMX_TARGET inline void store_tile(const float* acc, int rows, int64_t T, const float* bias, Out* out, int64_t ldo) {
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTile));
  for (int64_t t = 0; t < T; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, acc + (t / kTile) * kTile * kTile + t % kTile, 4), bv);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out + t * ldo, mask, v);
    } else {
      _mm256_mask_storeu_epi16(out + t * ldo, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

}  // namespace tokenmill::ggml
