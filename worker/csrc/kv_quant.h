// Quantized KV pages for the compiled CPU ops (--kv-cache-dtype int8 | fp8_e4m3): the format is
// worker/model/kv_quant.py's (one byte a value, a float16 scale per token and KV head, symmetric), and these
// are its arithmetic: decoder_ops.cpp's rope_write_kv writes rows with quantize_kv_row, and its
// paged_decode_attention hands quantized caches to paged_decode_attention_quantized.
#pragma once
#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace tokenmill {

// Whether a cache of this dtype holds quantized rows (int8 or float8_e4m3fn) that need scales.
inline bool is_quantized_kv(at::ScalarType type) { return type == at::kChar || type == at::kFloat8_e4m3fn; }

// The scales beside a quantized cache [blocks, block_size, KVH, D]: float16 [blocks, block_size, KVH], contiguous.
void check_kv_scales(const at::Tensor& cache, const at::Tensor& scales, const char* op, const char* name);

// x (D floats) -> D one-byte values at dst and their scale: absmax / 127 (int8, rounded to nearest even) or
// absmax / 448 (float8 e4m3), the scale rounded to float16 before dividing, as worker.model.kv_quant does.
void quantize_kv_row(const float* x, int64_t D, bool fp8, uint8_t* dst, c10::Half* scale);

// paged_decode_attention's arithmetic over quantized pages (its arguments checked there): each K and V row
// dequantized to float32 as it is read (value * scale), scores and the weighted sum in float32; sinks [H] in q's
// dtype (gpt-oss) join each head's softmax.
void paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                      const at::Tensor& key_scales, const at::Tensor& value_scales,
                                      const at::Tensor& rows, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                                      at::Tensor& out, const c10::optional<at::Tensor>& sinks);

}  // namespace tokenmill
