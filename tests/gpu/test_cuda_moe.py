"""A mixture of experts on CUDA (issue 36): `--kernel-backend auto` takes the Triton path for it (routing in torch,
experts through worker.kernels.fused_moe, CUDA graphs on and captured at warm-up), whose tokens equal the float32 CPU
reference's in float32 (logprobs within 1e-3), and which runs it in bfloat16 too (whose tokens may part from
float32's by rounding alone, so only the steps' shape is checked there); the same for gpt-oss's switches (attention
sinks in both attention kernels, its experts' biases and clamped SwiGLU in the fused kernel). Then one
Qwen3-30B-A3B-shaped MoE layer (128 experts, top 8, hidden 2048, expert width 768) in bfloat16 through the fused
kernel against the float32 grouped reference (worker.model.moe.run_experts), from one token to a prefill's 512, and
on int4 experts: the tile sizes and compiled code the tiny shapes of tests/worker/kernels/test_fused_moe.py never
reach.

The CUDA tests are skipped without CUDA; tests/gpu/run.sh runs them on the device machine. On CPU the last test runs
moe_on_device_matches_cpu on the Triton path under the interpreter, so the device function is checked here too."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.model.config import ModelConfig, RopeScaling
from worker.model.moe import route, run_experts
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only; run by tests/gpu/run.sh")
MOE = replace(tiny_config(num_layers=2), architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, qk_norm=True, norm_topk_prob=True)
# gpt-oss's switches (tests/helpers/tiny_models.py's, without transformers, which the device image lacks): sinks,
# sliding / full layers with a window of 8, biases, top-k-first routing, clamped SwiGLU experts, untruncated YaRN
GPT_OSS = replace(tiny_config(num_layers=4), architecture="gpt_oss", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, attention_bias=True, layer_windows=(8, None, 8, None),
                  rope_scaling=RopeScaling("yarn", factor=16.0, original_max_position_embeddings=32, truncate=False),
                  attention_sinks=True, attention_out_bias=True, router_bias=True, router_topk_first=True,
                  expert_bias=True, swiglu_limit=1.5)
# Qwen3-30B-A3B's MoE layer
EXPERTS_30B, TOP_K_30B, HIDDEN_30B, INTER_30B = 128, 8, 2048, 768


def moe_on_device_matches_cpu(device: torch.device | str, options: WorkerOptions = WorkerOptions(),
                              config: ModelConfig = MOE) -> None:
    """options: every execution flag at its default on CUDA; --kernel-backend triton for the CPU's check."""
    device = torch.device(device)
    cpu_model = random_llama(config, torch.float32, "cpu", seed=5, std=0.2)
    reference = run_mixed_steps(ModelRunner(cpu_model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                            dtype=torch.float32,
                                            options=WorkerOptions(packed_linears=False, cpu_fused_ops=False)))
    device_model = copy.deepcopy(cpu_model).to(device)
    runner = ModelRunner(device_model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=options)
    on_cuda = device.type == "cuda"
    assert (runner.execution.kernel_backend, runner.execution.cuda_graphs) == ("triton", on_cuda)
    runner.warm_up()
    if on_cuda:  # the decode steps replay graphs with the MoE layers inside
        assert runner.execution_path.graphs.graphs
    assert_same_steps(reference, run_mixed_steps(runner), logprob_atol=1e-3)
    bf16_model = copy.deepcopy(cpu_model).to(device=device, dtype=torch.bfloat16)
    bf16 = run_mixed_steps(ModelRunner(bf16_model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                       dtype=torch.bfloat16, options=options))
    assert [sorted(step) for step in bf16] == [sorted(step) for step in reference]


@cuda_only
@pytest.mark.parametrize("config", [MOE, GPT_OSS], ids=["qwen3_moe", "gpt_oss"])
def test_moe_on_cuda_runs_on_the_triton_path_as_the_cpu_reference(config):
    moe_on_device_matches_cpu(torch.device("cuda"), config=config)


@cuda_only
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cpu_moe_keeps_the_experts_in_host_memory_and_the_reference_tokens(backend):
    """--cpu-moe (worker.linears.host_experts): the experts wrapped before the move stay on the CPU, everything else
    goes to the GPU, and the steps' tokens are the float32 CPU reference's (graphs off: the layer computes on the host)."""
    from worker.build import keep_experts_on_host

    cpu_model = random_llama(MOE, torch.float32, "cpu", seed=5, std=0.2)
    reference = run_mixed_steps(ModelRunner(cpu_model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                            dtype=torch.float32,
                                            options=WorkerOptions(packed_linears=False, cpu_fused_ops=False)))
    device_model = copy.deepcopy(cpu_model)
    assert keep_experts_on_host(device_model) == MOE.num_layers
    device_model.to("cuda")
    layer = device_model.layers[0].mlp
    assert layer.router_weight.is_cuda and layer.experts.inner.gate_up.device.type == "cpu"
    runner = ModelRunner(device_model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=WorkerOptions(cpu_moe=True, kernel_backend=backend))
    assert not runner.execution.cuda_graphs
    runner.warm_up()
    assert_same_steps(reference, run_mixed_steps(runner), logprob_atol=1e-3)


@pytest.fixture(scope="module")
def experts_30b():
    """(gate_up [E, 2I, H], down [E, H, I]) in bfloat16, outputs of order 1, and the router [E, H] float32."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=generator) * fan_in**-0.5

    return (draw(EXPERTS_30B, 2 * INTER_30B, HIDDEN_30B, fan_in=HIDDEN_30B).bfloat16(),
            draw(EXPERTS_30B, HIDDEN_30B, INTER_30B, fan_in=INTER_30B).bfloat16(),
            draw(EXPERTS_30B, HIDDEN_30B, fan_in=HIDDEN_30B))


@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_a_30b_a3b_shaped_moe_layer_in_bfloat16_matches_the_float32_reference(experts_30b, num_tokens):
    from worker.kernels.fused_moe import fused_moe

    gate_up, down, router = experts_30b
    x = torch.randn(num_tokens, HIDDEN_30B, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    weights, experts = route(x, router, TOP_K_30B, norm_topk_prob=True, weights_float=True)
    x = x.bfloat16()

    out = fused_moe(x, weights, experts, gate_up, down)

    expected = run_experts(x.float(), weights, experts, gate_up.float(), down.float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # three roundings to bfloat16 (gate/up, the activation, down) on the way, each ~0.2% of its value
    relative = ((out.float() - expected).norm() / expected.norm()).item()
    assert relative < 1e-2, relative


@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_a_30b_a3b_shaped_layer_on_int4_experts_matches_the_reference_on_their_dequantized_weights(experts_30b,
                                                                                                  num_tokens):
    """Each expert in 4-bit groups of 32 (worker.linears.group_quant's layout, as group_quant_matmul reads it)."""
    from worker.kernels.fused_moe import GroupQuantExperts, fused_moe
    from worker.linears.group_quant import quantize_weight

    def quantized(weight: torch.Tensor) -> GroupQuantExperts:
        parts = [quantize_weight(expert, 4, 32) for expert in weight]
        return GroupQuantExperts(*(torch.stack([getattr(part, name) for part in parts])
                                   for name in ("codes", "scales", "mins")), 4, 32)

    gate_up, down, router = (quantized(experts_30b[0]), quantized(experts_30b[1]), experts_30b[2])
    x = torch.randn(num_tokens, HIDDEN_30B, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    weights, experts = route(x, router, TOP_K_30B, norm_topk_prob=True, weights_float=True)
    x = x.bfloat16()

    out = fused_moe(x, weights, experts, gate_up, down)

    expected = run_experts(x.float(), weights, experts, gate_up.dequantize(), down.dequantize())
    relative = ((out.float() - expected).norm() / expected.norm()).item()
    assert relative < 1e-2, relative  # the dequantized weights rounded to bfloat16 once more


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test above runs it on the device")
@pytest.mark.parametrize("config", [MOE, GPT_OSS], ids=["qwen3_moe", "gpt_oss"])
def test_the_device_function_on_the_cpu_triton_path(config):
    moe_on_device_matches_cpu("cpu", WorkerOptions(kernel_backend="triton"), config)
