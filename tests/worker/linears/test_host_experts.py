"""--cpu-moe (worker.linears.host_experts): a MoE layer's experts stay in host memory when the model moves (here to
the meta device, the one move a CPU-only machine can show; tests/gpu/test_cuda_moe.py moves to a GPU) and give the
layer the same output; a GGUF file's experts stay in its blocks while its other weights are converted."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.build import keep_experts_on_host
from worker.linears.ggml_blocks import GGMLBlocksLinear, block_types
from worker.linears.ggml_experts import GGMLBlocksExperts
from worker.linears.group_quant import GroupQuantLinear
from worker.linears.host_experts import HostExperts
from worker.loader import load_model
from worker.native_ops import cpu_ops_available
from worker.paths.base import resolve_execution
from worker.options import WorkerOptions


def test_experts_stay_in_host_memory_when_the_model_moves_and_compute_the_same(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "qwen3_moe")
    model, _ = load_model(folder, progress=False)
    layer = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(7, model.config.hidden_size)
    with torch.no_grad():
        expected = layer(x)
        assert keep_experts_on_host(model) == sum(hasattr(layer.mlp, "experts") for layer in model.layers) > 0
        assert isinstance(layer.experts, HostExperts)
        assert torch.equal(layer(x), expected)
    model.to("meta")
    assert layer.router_weight.is_meta and model.layers[0].attn.wqkv.weight.is_meta
    assert layer.experts.inner.gate_up.device.type == "cpu"  # never copied where the model went


def test_cpu_moe_turns_cuda_graphs_off():
    assert not resolve_execution(WorkerOptions(cpu_moe=True, kernel_backend="triton"), "cuda").cuda_graphs
    assert resolve_execution(WorkerOptions(kernel_backend="triton"), "cuda").cuda_graphs


@pytest.mark.skipif(not cpu_ops_available(), reason="GGUF blocks run on the compiled CPU ops (not built)")
def test_a_gguf_files_experts_stay_on_its_blocks_while_its_other_weights_are_converted(tmp_path):
    """What --cpu-moe loads on a GPU: no block types for the device's weights, the CPU's for the experts."""
    _, hf_model = make_tiny_hf_model(tmp_path, "qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "q8.gguf"
    write_converter_gguf(path, hf_model, quantize={name: "Q8_0" for name in (
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "attn_q.weight", "attn_k.weight",
        "attn_v.weight", "attn_output.weight")})
    model, _ = load_model(path, progress=False, keep_quantized=True, block_types=(),
                          expert_block_types=block_types("all"))
    assert all(isinstance(layer.mlp.experts, GGMLBlocksExperts) for layer in model.layers)
    assert isinstance(model.layers[0].attn.wqkv, GroupQuantLinear)
    assert not any(isinstance(module, GGMLBlocksLinear) for module in model.modules())
