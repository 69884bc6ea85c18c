"""Quantized KV pages (--kv-cache-dtype int8 | fp8_e4m3, worker.model.kv_quant) on the torch reference: the row
quantizer's error bound, attention over quantized pages equal to the float attention over the dequantized
values (decode gathers and a prefill over a cached prefix), the pages' bytes (>= 1.9x the tokens of bfloat16
pages at head_dim 64 and 128), the swap tier moving scales with values, and the flag's round trip and refusal."""
from __future__ import annotations

import argparse

import pytest
import torch

from tests.worker.kv_quant_cases import QUANT_DTYPES, paged_case
from worker.model.attention import build_attention_metadata, paged_attention, write_kv
from worker.model.config import ModelConfig
from worker.model.kv_cache import HostSwapSpace, allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from worker.model.kv_quant import dequantize_rows, kv_cache_dtype, quantize_rows
from worker.options import WorkerOptions
from worker.paths.base import check_kv_cache_dtype, resolve_execution


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_rows_round_trip_within_the_format_error(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]  # rows of very different ranges
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0, no NaN
    values, scales = quantize_rows(x, dtype)
    assert values.dtype == dtype and scales.dtype == torch.float16 and scales.shape == (5, 3)
    back = dequantize_rows(values, scales, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    absmax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of absmax / 127 (plus the float16 scale's rounding); fp8 e4m3: 3 mantissa bits, 1/16 relative
    bound = absmax / 127 * 0.51 if dtype == torch.int8 else x.abs() / 16 + absmax / 448 / 8
    assert ((back - x).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_attention_over_quantized_pages_is_the_float_attention_over_dequantized_values(dtype, model_dtype):
    q, k, v, spans, block_size = paged_case(model_dtype, kv_heads=2, group=3, block_size=4, seed=1)
    num_blocks = 40
    key_cache, value_cache = torch.zeros(2, num_blocks, block_size, 2, 16, dtype=dtype).unbind(0)
    scales = torch.zeros(2, num_blocks, block_size, 2, dtype=torch.float16).unbind(0)
    # the prefix pages already in the cache, as earlier steps wrote them
    prefix = torch.randn(2, num_blocks * block_size, 2, 16).to(model_dtype)
    metadata = build_attention_metadata(spans, block_size)
    all_slots = torch.arange(num_blocks * block_size)
    with torch.inference_mode():
        write_kv(key_cache, value_cache, prefix[0], prefix[1], all_slots, scales)
        write_kv(key_cache, value_cache, k, v, metadata.slot_mapping, scales)
        ours = paged_attention(q, k, v, key_cache, value_cache, metadata, 0.25, None, None, scales)
        # the reference: float pages holding what the quantized ones dequantize to
        float_keys = dequantize_rows(key_cache, scales[0], model_dtype)
        float_values = dequantize_rows(value_cache, scales[1], model_dtype)
        expected = paged_attention(q, k, v, float_keys, float_values, metadata, 0.25)
    assert torch.equal(ours, expected)
    # and the quantized pages are close to what was written (int8: ~0.5%, fp8 e4m3: ~3% relative error)
    written = float_keys.view(-1, 2, 16)[metadata.slot_mapping].float()
    err = ((written - k.float()).norm() / k.float().norm()).item()
    assert err < (0.01 if dtype == torch.int8 else 0.05)


def _config(head_dim: int, num_kv_heads: int = 3) -> ModelConfig:
    return ModelConfig("llama", vocab_size=100, hidden_size=head_dim * 3, intermediate_size=64, num_layers=4,
                       num_heads=6, num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                       max_position_embeddings=256, bos_token_id=None, eos_token_id=None)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_budget_holds_at_least_1_9x_the_pages_of_bfloat16(head_dim, name, capsys):
    config, budget = _config(head_dim), 512 * 2**20
    kv_dtype = kv_cache_dtype(name, torch.bfloat16)
    # one byte a value plus a 2-byte scale per row of head_dim values
    assert bytes_per_block(config, kv_dtype, 16) == 2 * 4 * 16 * 3 * (head_dim + 2)
    ratio = num_blocks_for_budget(config, kv_dtype, 16, budget) / num_blocks_for_budget(config, torch.bfloat16, 16, budget)
    with capsys.disabled():
        print(f"\n--kv-cache-dtype {name}, head_dim {head_dim}: {ratio:.3f}x the tokens of bfloat16 pages per byte")
    assert ratio >= 1.9
    # the allocation is what the sizing counted
    cache = allocate_kv_cache(config, 3, 16, kv_dtype)
    assert cache.storage.nbytes + cache.scales.nbytes == 3 * bytes_per_block(config, kv_dtype, 16)
    assert cache.bytes_per_block == bytes_per_block(config, kv_dtype, 16)


def test_auto_keeps_the_model_dtype_and_no_scales():
    cache = allocate_kv_cache(_config(64), 2, 4, kv_cache_dtype("auto", torch.bfloat16))
    assert cache.storage.dtype == torch.bfloat16 and cache.scales is None
    assert cache.layer_scales() == [None] * 4
    assert cache.bytes_per_block == bytes_per_block(_config(64), torch.bfloat16, 4)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_swap_round_trip_keeps_values_and_scales(name):
    config = _config(16, num_kv_heads=2)
    cache = allocate_kv_cache(config, 6, 4, kv_cache_dtype(name, torch.float32))
    torch.manual_seed(3)
    for layer, (key_scales, value_scales) in enumerate(cache.layer_scales()):
        rows = torch.randn(2, 24, 2, 16) * (layer + 1)
        write_kv(cache.key_caches[layer], cache.value_caches[layer], rows[0], rows[1], torch.arange(24),
                 (key_scales, value_scales))
    before_values, before_scales = cache.storage.clone(), cache.scales.clone()
    swap = HostSwapSpace(cache, num_host_blocks=3)
    swap.copy(swap_out=[(1, 0), (4, 2)], swap_in=[])
    cache.storage.view(torch.uint8).zero_()
    cache.scales.zero_()
    swap.copy(swap_out=[], swap_in=[(5, 0), (0, 2)])  # back into other pages
    for device_block, original in ((5, 1), (0, 4)):
        assert torch.equal(cache.storage[:, :, device_block].view(torch.uint8),
                           before_values[:, :, original].view(torch.uint8))
        assert torch.equal(cache.scales[:, :, device_block], before_scales[:, :, original])
    assert swap.scales.shape == (3, 2, 4, 4, 2)


def test_the_flag_round_trips_and_is_checked():
    parser = argparse.ArgumentParser()
    WorkerOptions.add_arguments(parser)
    options = WorkerOptions.from_args(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    assert options.kv_cache_dtype == "fp8_e4m3" and options.to_argv() == ["--kv-cache-dtype", "fp8_e4m3"]
    assert WorkerOptions.from_args(parser.parse_args(options.to_argv())) == options
    assert WorkerOptions().kv_cache_dtype == "auto" and "--kv-cache-dtype" not in WorkerOptions().to_argv()
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not one of \['auto', 'int8', 'fp8_e4m3'\]"):
        WorkerOptions(kv_cache_dtype="int4")
    cluster = argparse.ArgumentParser()
    WorkerOptions.add_arguments(cluster, cluster=True)  # tokenmill serve offers it under the same name
    assert cluster.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


def test_float8_pages_are_refused_at_start_on_a_gpu_without_float8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e4m3 on --kernel-backend triton needs a GPU of compute "
                                         r"capability 8.9 or newer .* this one is 8.0; use --kv-cache-dtype int8"):
        check_kv_cache_dtype("fp8_e4m3", "triton", "cuda")
    check_kv_cache_dtype("int8", "triton", "cuda")  # int8 converts on every GPU
    check_kv_cache_dtype("fp8_e4m3", "torch", "cuda")  # the torch path converts in torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype("fp8_e4m3", "triton", "cuda")
    assert resolve_execution(WorkerOptions(kv_cache_dtype="int8", kernel_backend="triton"), "cpu").kernel_backend == "triton"
