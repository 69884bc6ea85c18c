// What the GGML block linears' two files share: the block types, x rounded to q8_K, a weight part, and the
// AMX-INT8 tile kernels' entry points (ggml_blocks_amx.cpp), which ggml_blocks_dot.cpp calls for many rows.
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace tokenmill::ggml {

constexpr int64_t QK = 256;  // activation block, and the K-quants' super-block

// gguf's GGMLQuantizationType values
enum BlockType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

AVX2_TARGET inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// x rounded to q8_K: q [T, nb*256] (a short last block padded with zeros), d [T, nb], bsums [T, nb*16]
struct Q8Rows {
  int64_t T = 0, K = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  const int8_t* qs(int64_t t, int64_t b) const { return q.data() + t * nb * QK + b * QK; }
  const int16_t* sums(int64_t t, int64_t b) const { return bsums.data() + (t * nb + b) * 16; }
  float scale(int64_t t, int64_t b) const { return d[t * nb + b]; }
};

// One tensor of a (possibly fused) linear: rows of blocks of one type
struct Part {
  const uint8_t* data;
  int64_t type, rows, row_bytes;
};

// ---- ggml_blocks_amx.cpp ----
// Whether this CPU has AMX-INT8 (and AVX-512 VNNI) and Linux lets this process use the tile registers,
// asked once.
bool amx_int8_usable();
// The types the tile kernels run: the K-quants (Q4_K, Q5_K, Q6_K)
bool amx_has_kernel(int64_t type);
// x's q8_K rounding laid out as the tiles' B operand, with its per-block sums; built once per call
struct AmxRows;
std::shared_ptr<const AmxRows> amx_rows_of(const Q8Rows& x);
// Every K-quant part of a linear (output columns first_col[i] + n of out [T, ldo]) against every row of x, plus
// bias, in one parallel region; the other parts are left to the caller
void amx_linear(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, const AmxRows& x,
                const float* bias, float* out);
void amx_linear(const std::vector<Part>& ps, const std::vector<int64_t>& first_col, int64_t ldo, const AmxRows& x,
                const float* bias, at::BFloat16* out);

}  // namespace tokenmill::ggml
