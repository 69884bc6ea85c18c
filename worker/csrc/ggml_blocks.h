// What the GGML block linears' files share: the block types, x rounded to q8_K, a weight part, and the entry
// points of the many-row kernels that ggml_blocks_dot.cpp calls: AMX-INT8 tiles (ggml_blocks_amx.cpp), the
// AVX2 GEMM (ggml_blocks_avx2_gemm.cpp) and the same GEMM on K-quants repacked at load (ggml_blocks_repack.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace tokenmill::ggml {

// body(k) for k in [0, chunks) over the op's threads: each thread starts on its own contiguous share (one stream of
// weight rows a thread, as a static split reads them) and, once done, takes what is left of the others' shares
// from their cursors, so a thread slowed by another process on its core no longer holds the whole call. 2 threads
// on the shared 2-core EPYC, a repacked Q4_K linear, this over the static split, alternated in one process
// (medians of 10 calls, two runs each): one row of x 0.86-1.05x the time, 64 rows 0.90-0.91x, 512 rows 0.88-0.99x.
template <class F>
void shared_chunks(int64_t chunks, F&& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  struct alignas(64) Cursor {  // a cache line each: a thread's claims do not pull in the other's line
    std::atomic<int64_t> next;
  };
  std::unique_ptr<Cursor[]> cursor(new Cursor[threads]);
  for (int64_t t = 0; t < threads; ++t) cursor[t].next.store(chunks * t / threads, std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int64_t v = 0; v < threads; ++v) {
        const int64_t owner = (t + v) % threads, end = chunks * (owner + 1) / threads;
        for (int64_t k; (k = cursor[owner].next.fetch_add(1, std::memory_order_relaxed)) < end;) body(k);
      }
  });
}

constexpr int64_t QK = 256;  // activation block, and the K-quants' super-block

// gguf's GGMLQuantizationType values
enum BlockType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};

// A K-quant type plus this flag: the weight repacked at load into groups of 8 rows (ggml_blocks_repack.cpp),
// which only the AVX2 GEMM path reads (and the dequantizer, row by row)
constexpr int64_t kRepacked = 256;
inline bool is_repacked(int64_t type) { return (type & kRepacked) != 0; }
inline int64_t file_type(int64_t type) { return type & ~kRepacked; }

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

AVX2_TARGET inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// x rounded to q8_K: q [T, nb*256] (a short last block padded with zeros), d [T, nb], bsums [T, nb*16]. A view
// of a Q8Buffer's rows (or of some of them: rows(), a mixture of experts' one expert's rows of a sorted step).
struct Q8Rows {
  int64_t T = 0, K = 0, nb = 0;
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int16_t* bsums = nullptr;
  const int8_t* qs(int64_t t, int64_t b) const { return q + (t * nb + b) * QK; }
  const int16_t* sums(int64_t t, int64_t b) const { return bsums + (t * nb + b) * 16; }
  float scale(int64_t t, int64_t b) const { return d[t * nb + b]; }
  Q8Rows rows(int64_t t0, int64_t count) const {
    Q8Rows view = *this;
    view.T = count;
    view.q += t0 * nb * QK, view.d += t0 * nb, view.bsums += t0 * nb * 16;
    return view;
  }
};

// What a Q8Rows points into
struct Q8Buffer {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
};

// One tensor of a (possibly fused) linear: rows of blocks of one type
struct Part {
  const uint8_t* data;
  int64_t type, rows, row_bytes;
};

// ---- ggml_blocks_dot.cpp ----
// A (possibly fused) linear's parts checked against x's K, every error naming `op`: K a whole number of each
// type's blocks, each part contiguous uint8 [N_i, K / block_elems * block_bytes]; repacked parts only where
// repacked_ok (then in whole groups of 8 rows), else refused as the tiles' ops refuse them
struct LinearParts {
  std::vector<Part> ps;
  std::vector<int64_t> first_col;  // each part's first output column
  int64_t N = 0;                   // the output columns
};
LinearParts linear_parts_of(const char* op, at::TensorList parts, at::IntArrayRef types, int64_t K, bool repacked_ok);
// bias [N] in float32 (held by keep), or nullptr without one
const float* bias_of(const char* op, const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep);
int64_t block_elems(int64_t type);
// a block's bytes; a repacked type's: one row's share of a group block (8 rows' blocks of 256 values)
int64_t block_bytes(int64_t type);
// 0: the best this CPU has, 1 AVX2, 2 AVX-512 VNNI, 3 AMX-INT8 tiles, 4 AVX2 with its GEMM for the K-quants:
// the path a call with `path` runs
int64_t ggml_blocks_path(int64_t path);
// Whether a path's vector kernels are the AVX-512 VNNI ones (the AMX path runs them beside its tiles)
inline bool wide_path(int64_t runs) { return runs == 2 || runs == 3; }
// Under auto, the tiles take the K-quants from this many rows of x (see ggml_blocks_dot.cpp)
constexpr int64_t kAmxMinRows = 6;
// x [rows, K] rounded to q8_K into buf, in parallel
Q8Rows quantize_rows(const float* x, int64_t rows, int64_t K, Q8Buffer& buf);
Q8Rows quantize_rows(const at::BFloat16* x, int64_t rows, int64_t K, Q8Buffer& buf);
// rows [0, rows) of a weight (a row every row_bytes from w, K values each) in the file's own blocks of `type` ->
// out [rows, K] bfloat16, scale * code + min in float32 rounded to nearest even; CPUs with AVX-512 BF16 only
void dequantize_bf16_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t rows, at::BFloat16* out);
// Rows [n0, n1) of p against every row of x on the vector kernels (wide: AVX-512 VNNI, else AVX2), written to
// out[t * ldo + col0 + n] without a bias; serial (the caller runs it inside its own parallel region)
void vector_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, float* out, int64_t ldo,
                 int64_t col0, bool wide);
void vector_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, const Q8Rows& x, at::BFloat16* out, int64_t ldo,
                 int64_t col0, bool wide);

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
// Rows [n0, n1) of a K-quant part against every row of x on the tiles, as vector_rows (serial, no bias)
void amx_rows(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, float* out, int64_t ldo, int64_t col0);
void amx_rows(const Part& p, int64_t n0, int64_t n1, const AmxRows& x, at::BFloat16* out, int64_t ldo, int64_t col0);

// ---- ggml_blocks_amx_bf16.cpp ----
// Whether this CPU has AMX-BF16 (with AVX-512 BF16) and Linux lets this process use the tile registers, asked once
bool amx_bf16_usable();

// ---- ggml_blocks_avx2_gemm.cpp ----
// Under auto on a CPU without AVX-512 VNNI, the K-quants run the AVX2 GEMM from this many rows of x: from one,
// since it reads the weight faster than the vector kernel there too (one sequence's decode, in-process on the
// 1.5B Q4_K_M shape: 60 vs 69 ms a token on the 2-core EPYC); ggml_blocks_dot.cpp's figures
constexpr int64_t kAvx2GemmMinRows = 1;
// The types the GEMM runs: Q4_K, Q5_K, Q6_K
bool avx2_gemm_has_kernel(int64_t type);
// Rows [n0, n1) of a K-quant part against every row of x, plus bias[col0 + n] where bias is given, written to
// out[t * ldo + col0 + n] (serial: the caller runs it inside its own parallel region)
void avx2_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, float* out,
                    int64_t ldo, int64_t col0);
void avx2_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, at::BFloat16* out,
                    int64_t ldo, int64_t col0);

// ---- ggml_blocks_repack.cpp ----
// The types repack() takes: Q4_K, Q5_K, Q6_K
bool repack_has_layout(int64_t type);
// One row's share of a repacked group block (148, 180, 210 bytes: a group block is 8 of them)
int64_t repacked_row_share(int64_t type);
// Row `row` of a repacked weight (data, K values a row) back in the file's blocks: out gets K / 256 blocks
void unpack_row(const uint8_t* data, int64_t type, int64_t K, int64_t row, uint8_t* out);
// Rows [n0, n1) (multiples of 8, or n1 the part's end) of a repacked part against every row of x, as
// avx2_gemm_rows: the same integer sums and float steps, so the same bits
void repacked_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, float* out,
                        int64_t ldo, int64_t col0);
void repacked_gemm_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, const float* bias, at::BFloat16* out,
                        int64_t ldo, int64_t col0);

}  // namespace tokenmill::ggml
