// A mixture of experts' projection on the GGUF file's own stacked expert blocks (ffn_{gate,up,down}_exps): every
// expert that has rows in the step, in one call and one parallel region, on the dense block linears' kernels
// (ggml_blocks_dot.cpp's vector rows, ggml_blocks_amx.cpp's tiles, ggml_blocks_avx2_gemm.cpp's GEMM), which this
// file only schedules.
//
// The step's token-expert pairs come sorted by expert (worker.model.moe draws the layout), x holding each pair's
// row, so expert e's rows are one slice:
//
//   x       [R, K]   | e0 e0 e0 | e2 | e3 e3 e3 e3 e3 e3 |      offsets = [0, 3, 3, 4, 10]  (e1: no rows)
//   part i  [E, N_i, row bytes]: expert e's N_i weight rows (gate and up are two parts: one call runs both)
//   out     [R, sum N_i]: the parts' outputs side by side, each pair's row where its x row was
//
// x is rounded to q8_K once for all rows; an expert's rows are a view of it. Work items are (expert, part,
// up to kChunkRows weight rows), expert-major so that threads walk the weights in file order, shared by the threads
// (shared_chunks): a step's experts differ in rows (1 to hundreds), a static split would leave threads waiting.
// An expert with kAmxMinRows or more rows runs its K-quant parts on the AMX tiles where auto has them (its x
// laid out for the tiles once, experts in parallel), or on an AVX2-only CPU from kAvx2GemmMinRows on the AVX2
// GEMM; one with fewer on the vector kernels, each exactly as a dense block linear of that many rows would: a
// row's output does not depend on the other experts. Parts repacked at load (an AVX2-only CPU,
// worker.linears.ggml_repack) run the GEMM on their layout at every row count, as a repacked dense linear does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "ggml_blocks.h"

using namespace tokenmill::ggml;

namespace {

constexpr int64_t kChunkRows = 64;  // weight rows a work item: 4 AMX tiles, ~72 KiB of a Q4_K row of 2048

struct Item {
  int64_t expert, part, n0, n1;
};

struct Experts {
  std::vector<Part> parts;  // part i of expert 0; expert e's rows start e * rows * row_bytes on
  std::vector<int64_t> first_col;
  int64_t num_experts = 0, N = 0, K = 0;
};

// x's rows of each expert, (where the tiles run them) their tile layout, and whether the AVX2 GEMM runs them
struct ExpertRows {
  std::vector<Q8Rows> rows;
  std::vector<std::shared_ptr<const AmxRows>> tiles;
  std::vector<char> gemm;
};

ExpertRows expert_rows(const Q8Rows& q, const int64_t* offsets, const Experts& w, int64_t runs, int64_t path) {
  ExpertRows r;
  r.tiles.resize(w.num_experts);
  for (int64_t e = 0; e < w.num_experts; ++e) r.rows.push_back(q.rows(offsets[e], offsets[e + 1] - offsets[e]));
  for (int64_t e = 0; e < w.num_experts; ++e)
    r.gemm.push_back(runs == 4 && r.rows[e].T > 0 && (path == 4 || r.rows[e].T >= kAvx2GemmMinRows));
  const bool any_tiled = std::any_of(w.parts.begin(), w.parts.end(), [](const Part& p) { return amx_has_kernel(p.type); });
  if (runs != 3 || !any_tiled) return r;
  at::parallel_for(0, w.num_experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e)
      if (r.rows[e].T > 0 && (path == 3 || r.rows[e].T >= kAmxMinRows)) r.tiles[e] = amx_rows_of(r.rows[e]);
  });
  return r;
}

template <typename Out>
void run_items(const Experts& w, const ExpertRows& x, const int64_t* offsets, bool wide, Out* out) {
  std::vector<Item> items;
  for (int64_t e = 0; e < w.num_experts; ++e) {
    if (x.rows[e].T == 0) continue;
    for (size_t i = 0; i < w.parts.size(); ++i)
      for (int64_t n = 0; n < w.parts[i].rows; n += kChunkRows)
        items.push_back({e, static_cast<int64_t>(i), n, std::min(w.parts[i].rows, n + kChunkRows)});
  }
  shared_chunks(static_cast<int64_t>(items.size()), [&](int64_t k) {
    const Item& it = items[k];
    Part p = w.parts[it.part];
    p.data += it.expert * p.rows * p.row_bytes;
    Out* rows_out = out + offsets[it.expert] * w.N;
    const AmxRows* tiles = x.tiles[it.expert].get();
    if (is_repacked(p.type))  // repacked at load (worker.linears.ggml_repack): the GEMM at any row count
      repacked_gemm_rows(p, it.n0, it.n1, x.rows[it.expert], nullptr, rows_out, w.N, w.first_col[it.part]);
    else if (tiles && amx_has_kernel(p.type))
      amx_rows(p, it.n0, it.n1, *tiles, rows_out, w.N, w.first_col[it.part]);
    else if (x.gemm[it.expert] && avx2_gemm_has_kernel(p.type))
      avx2_gemm_rows(p, it.n0, it.n1, x.rows[it.expert], nullptr, rows_out, w.N, w.first_col[it.part]);
    else
      vector_rows(p, it.n0, it.n1, w.K, x.rows[it.expert], rows_out, w.N, w.first_col[it.part], wide);
  });
}

// out[t] += round(pair output * its weight) over token t's pairs in sorted order: (expert_out * weights).to(x.dtype)
// then index_add_, as worker.model.moe.run_grouped computes it (one rounding for the product, one for each sum)
template <typename T>
void scatter_pairs(const at::Tensor& expert_out, const float* weights, const std::vector<int64_t>& position,
                   int64_t K, at::Tensor& out) {
  const int64_t tokens = out.size(0), H = out.size(1);
  const T* src = expert_out.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> pairs(K);  // (sorted position, pair) of one token's K pairs
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < K; ++j) pairs[j] = {position[t * K + j], t * K + j};
      std::sort(pairs.begin(), pairs.end());
      T* row = dst + t * H;
      for (const auto& [i, p] : pairs) {
        const T* from = src + i * H;
        const float weight = weights[p];
        for (int64_t h = 0; h < H; ++h)
          row[h] = static_cast<T>(static_cast<float>(row[h]) + static_cast<float>(static_cast<T>(static_cast<float>(from[h]) * weight)));
      }
    }
  });
}

Experts check_experts(at::TensorList parts, at::IntArrayRef types, int64_t K) {
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "ggml_blocks_experts: ", parts.size(), " parts but ",
              types.size(), " types");
  Experts w;
  w.K = K;
  w.num_experts = parts[0].dim() == 3 ? parts[0].size(0) : 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& blocks = parts[i];
    const int64_t type = types[i], per = block_elems(type), bytes = block_bytes(type);
    TORCH_CHECK(K % per == 0, "ggml_blocks_experts: in_features ", K, " is not a multiple of ", per, " (GGML type ",
                type, ")");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous() &&
                    blocks.size(0) == w.num_experts && blocks.size(2) == K / per * bytes,
                "ggml_blocks_experts: part ", i, " must be contiguous uint8 [", w.num_experts, " experts, rows, ",
                K / per * bytes, "], got ", blocks.sizes());
    TORCH_CHECK(!is_repacked(type) || (repack_has_layout(file_type(type)) && blocks.size(1) % 8 == 0),
                "ggml_blocks_experts: repacked part ", i, " (GGML type ", file_type(type), ") must be Q4_K, Q5_K or "
                "Q6_K in groups of 8 rows, got ", blocks.size(1), " rows an expert");
    w.parts.push_back({blocks.data_ptr<uint8_t>(), type, blocks.size(1), blocks.size(2)});
    w.first_col.push_back(w.N);
    w.N += blocks.size(1);
  }
  return w;
}

}  // namespace

// x: [R, K] float32 or bfloat16, the pairs' rows sorted by expert; offsets: int64 [E + 1], expert e's rows
// offsets[e]..offsets[e + 1]; parts: uint8 [E, N_i, K / block_elems * block_bytes] in types[i] -> [R, sum N_i]
// in x's dtype. path: as ggml_blocks_linear's (0 auto).
at::Tensor ggml_blocks_experts(const at::Tensor& x_in, const at::Tensor& offsets_in, at::TensorList parts,
                               at::IntArrayRef types, int64_t path) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "ggml_blocks_experts: x must be 2-D float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  const Experts w = check_experts(parts, types, K);
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == w.num_experts + 1, "ggml_blocks_experts: offsets must have ",
              w.num_experts + 1, " values (experts + 1), got ", offsets.sizes());
  const int64_t* op = offsets.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[w.num_experts] == R, "ggml_blocks_experts: offsets must run from 0 to ", R,
              " (x's rows), got ", op[0], "..", op[w.num_experts]);
  for (int64_t e = 0; e < w.num_experts; ++e)
    TORCH_CHECK(op[e] <= op[e + 1], "ggml_blocks_experts: offsets decrease at expert ", e);
  at::Tensor out = at::empty({R, w.N}, x.options());
  if (R == 0) return out;
  const int64_t runs = ggml_blocks_path(path);
  const bool repacked = std::any_of(w.parts.begin(), w.parts.end(), [](const Part& p) { return is_repacked(p.type); });
  TORCH_CHECK(runs == 4 || !repacked,
              "ggml_blocks_experts: repacked parts run on the AVX2 GEMM only (path 4, or auto on a CPU without "
              "AVX-512 VNNI), got path ", path);
  Q8Buffer buf;
  const Q8Rows q = x.scalar_type() == at::kFloat ? quantize_rows(x.data_ptr<float>(), R, K, buf)
                                                 : quantize_rows(x.data_ptr<at::BFloat16>(), R, K, buf);
  const ExpertRows rows = expert_rows(q, op, w, runs, path);
  AT_DISPATCH_SWITCH(out.scalar_type(), "ggml_blocks_experts",
    AT_DISPATCH_CASE(at::kFloat, [&] { run_items(w, rows, op, wide_path(runs), out.data_ptr<float>()); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run_items(w, rows, op, wide_path(runs), out.data_ptr<at::BFloat16>()); }));
  return out;
}

// A whole MoE layer after its routing, in one call: what worker.model.moe.run_grouped does around the experts
// (group the (token, expert) pairs by expert, gather their rows, scatter each pair's output times its routing
// weight back onto its token), with ggml_blocks_experts for gate/up and down and torch's own activation between.
// A decode step of a 48-layer model made ~15 small torch calls a layer around the two native ones; from Python
// each cost more than the experts of one token take to multiply. The numbers are run_grouped's, bit for bit: the
// pairs in the same order (stable by expert), each pair's output times its weight rounded to x's dtype, then
// added onto its token in that order, as index_add_ adds.
//
// x: [T, H] float32 or bfloat16; top_weights: [T, K] (float32 or x's dtype); top_experts: [T, K] integer ids;
// gate_up / down: as ggml_blocks_experts' parts -> [T, H] in x's dtype.
at::Tensor ggml_blocks_moe(const at::Tensor& x_in, const at::Tensor& top_weights, const at::Tensor& top_experts,
                           at::TensorList gate_up, at::IntArrayRef gate_up_types, at::TensorList down,
                           at::IntArrayRef down_types, bool gelu_tanh, int64_t path) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "ggml_blocks_moe: x must be 2-D float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(top_experts.dim() == 2 && top_experts.size(0) == T && top_weights.sizes() == top_experts.sizes(),
              "ggml_blocks_moe: top_weights ", top_weights.sizes(), " and top_experts ", top_experts.sizes(),
              " must both be [", T, " tokens, k]");
  TORCH_CHECK(!gate_up.empty() && gate_up[0].dim() == 3, "ggml_blocks_moe: gate/up parts must be [experts, rows, bytes]");
  at::Tensor out = at::zeros_like(x);
  if (T == 0) return out;
  const int64_t K = top_experts.size(1), P = T * K, E = gate_up[0].size(0);
  const at::Tensor ids = top_experts.to(at::kLong).contiguous();
  const at::Tensor weights = top_weights.to(at::kFloat).contiguous();  // exact from bfloat16
  const int64_t* id = ids.data_ptr<int64_t>();
  // pairs sorted by expert, stable (argsort(stable=True)): order[i] is the pair at sorted position i
  at::Tensor offsets = at::zeros({E + 1}, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "ggml_blocks_moe: token ", p / K, " routed to expert ", id[p], " of ", E);
    ++off[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> order(P), position(P), cursor(off, off + E);
  for (int64_t p = 0; p < P; ++p) position[p] = cursor[id[p]]++;
  for (int64_t p = 0; p < P; ++p) order[position[p]] = p;
  at::Tensor rows = at::empty({P, H}, x.options());
  const int64_t row_bytes = H * x.element_size();
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* rs = static_cast<char*>(rows.data_ptr());
  for (int64_t i = 0; i < P; ++i) std::memcpy(rs + i * row_bytes, xs + order[i] / K * row_bytes, row_bytes);
  const std::vector<at::Tensor> halves = ggml_blocks_experts(rows, offsets, gate_up, gate_up_types, path).chunk(2, -1);
  const at::Tensor hidden = (gelu_tanh ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1];
  const at::Tensor expert_out = ggml_blocks_experts(hidden, offsets, down, down_types, path);  // [P, H]
  const float* w = weights.data_ptr<float>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "ggml_blocks_moe",
    AT_DISPATCH_CASE(at::kFloat, [&] { scatter_pairs<float>(expert_out, w, position, K, out); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { scatter_pairs<at::BFloat16>(expert_out, w, position, K, out); }));
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("ggml_blocks_experts(Tensor x, Tensor offsets, Tensor[] parts, int[] types, int path) -> Tensor");
  m.def("ggml_blocks_moe(Tensor x, Tensor top_weights, Tensor top_experts, Tensor[] gate_up, int[] gate_up_types, "
        "Tensor[] down, int[] down_types, bool gelu_tanh, int path) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("ggml_blocks_experts", &ggml_blocks_experts);
  m.impl("ggml_blocks_moe", &ggml_blocks_moe);
}
