"""A mixture of experts' weights as the worker reports and sizes them: every expert of every MoE layer counts
(all stay resident, whichever few a token reads), the KV cache is sized from what is left after them and a
profile pass through the experts, and the model's `quantization` says what the experts run in."""
from __future__ import annotations

import logging

import torch

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import GPT_OSS, NUM_EXPERTS, make_tiny_hf_model
from worker.build import build_sized_runner, weight_bytes
from worker.linears.group_quant import weight_formats
from worker.loader import load_model
from worker.model.kv_cache import bytes_per_block
from worker.options import WorkerOptions


def test_every_expert_is_counted_and_the_cache_sized_after_them(tmp_path, caplog):
    folder, hf_model = make_tiny_hf_model(tmp_path, "qwen3_moe")  # layers 0 and 2 MoE, layer 1 dense
    options = WorkerOptions(model=str(folder), dtype="float32", device="cpu", kv_cache_memory_fraction=0.5,
                            max_num_batched_tokens=64)
    with caplog.at_level(logging.INFO, logger="worker.build"):
        runner, sizing = build_sized_runner(options, progress=False, free_bytes=2**30)
    total, experts = weight_bytes(runner.model)
    hidden, expert_inter = 64, 32
    per_layer = NUM_EXPERTS * (2 * expert_inter * hidden + hidden * expert_inter) + NUM_EXPERTS * hidden  # + router
    assert experts == 2 * per_layer * 4
    assert total == sum(p.numel() * p.element_size() for p in hf_model.parameters())  # transformers' own count
    assert f"are the {NUM_EXPERTS} experts (and router) of each of 2 MoE layers, all resident (2 read per token)" in caplog.text
    # the cache takes its share of what is left after the weights and the profile pass (run through the experts)
    per_block = bytes_per_block(runner.model_config, torch.float32, options.block_size)
    assert 0 < sizing.num_blocks <= 2**29 // per_block and "after the weights" in sizing.reason


def test_gpt_oss_experts_count_with_their_biases_and_router_bias(tmp_path):
    folder, hf_model = make_tiny_hf_model(tmp_path, GPT_OSS)  # 4 MoE layers of 4 experts, width 32
    model, _ = load_model(folder, progress=False)
    total, experts = weight_bytes(model)
    hidden, expert_inter, num_experts = 64, 32, 4
    per_layer = (num_experts * (3 * expert_inter * hidden + 2 * expert_inter + hidden)  # weights and biases
                 + num_experts * (hidden + 1))  # the router and its bias
    assert experts == 4 * per_layer * 4
    assert total == sum(p.numel() * p.element_size() for p in hf_model.parameters())  # transformers' own count


def test_quantization_names_what_the_experts_run_in(tmp_path):
    _, hf_model = make_tiny_hf_model(tmp_path, "mixtral")
    path = tmp_path / "q8.gguf"
    write_converter_gguf(path, hf_model, quantize={"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0",
                                                   "attn_v.weight": "Q8_0", "attn_output.weight": "Q8_0"})
    model, _ = load_model(path, progress=False, keep_quantized=True)
    assert weight_formats(model) == "Q8_0; experts float32"
    dense, _ = load_model(path, progress=False)
    assert weight_formats(dense) == ""  # all floats, as for a dense model
