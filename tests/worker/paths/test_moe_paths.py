"""Every execution path with a mixture of experts: it runs the model or refuses it at start, naming itself and
the architecture. auto takes the torch backend for a MoE model on CUDA too (logged); --kernel-backend triton, a
hand-built Triton path and --deterministic are refused; the CPU path with its defaults (packed linears, the
compiled decoder ops, int8 / int4 linears) runs it, its experts as the reference runs them."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.linears.group_quant import quantize_linears
from worker.model.moe import SparseMoE
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths.base import resolve_execution

MOE = replace(tiny_config(num_layers=2), architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, qk_norm=True, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_model():
    return random_llama(MOE, torch.float32, "cpu", seed=5, std=0.2)


def _runner(model, **options) -> ModelRunner:
    return ModelRunner(model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                       options=WorkerOptions(**options))


def test_auto_takes_the_torch_backend_for_moe_on_cuda_and_says_why(caplog):
    with caplog.at_level(logging.WARNING):
        cuda = resolve_execution(WorkerOptions(), torch.device("cuda", 0), MOE)  # resolving touches no device
    assert (cuda.kernel_backend, cuda.cuda_graphs) == ("torch", False)
    assert "the Triton path has no mixture-of-experts layers (qwen3_moe)" in caplog.text
    assert resolve_execution(WorkerOptions(), torch.device("cuda", 0), tiny_config()).kernel_backend == "triton"
    assert resolve_execution(WorkerOptions(), "cpu", MOE).kernel_backend == "torch"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_triton_backend_is_refused_by_name(device):
    with pytest.raises(ValueError, match="--kernel-backend triton \\(the Triton path\\) cannot run the "
                                         "mixture-of-experts architecture 'qwen3_moe': it has no expert layers"):
        resolve_execution(WorkerOptions(kernel_backend="triton"), device, MOE)


def test_a_triton_path_built_by_hand_refuses(moe_model):
    from worker.model.kv_cache import allocate_kv_cache
    from worker.paths.triton.path import TritonPath

    execution = resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu")  # no model given: not checked
    cache = allocate_kv_cache(MOE, 4, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="the Triton path cannot run the mixture-of-experts architecture 'qwen3_moe'"):
        TritonPath(moe_model, cache, BLOCK_SIZE, execution, torch.device("cpu"))


def test_deterministic_mode_is_refused_by_name(moe_model):
    with pytest.raises(ValueError, match="--deterministic \\(the batch-invariant kernels\\) cannot run the "
                                         "mixture-of-experts architecture 'qwen3_moe': each expert's matmuls"):
        _runner(moe_model, deterministic=True)


def test_the_cpu_defaults_run_moe_as_the_reference(moe_model):
    """Packed linears + compiled decoder ops (the CPU default) against the plain reference: same tokens,
    logprobs within 1e-4; the experts stay the reference's stacked float parameters."""
    reference = run_mixed_steps(_runner(moe_model, packed_linears=False, cpu_fused_ops=False))
    default = _runner(moe_model)
    assert default.execution.kernel_backend == "torch"
    assert_same_steps(reference, run_mixed_steps(default), logprob_atol=1e-4)
    layer = moe_model.layers[0].mlp
    assert isinstance(layer, SparseMoE) and type(layer.experts.gate_up) is torch.nn.Parameter


def test_int8_linears_leave_the_experts_and_router_in_float(moe_model):
    """--quantization int8 quantizes attention / lm_head linears; experts and router stay float32 and the
    model still runs (its tokens close to the float model's: only the attention linears are rounded)."""
    model = random_llama(MOE, torch.float32, "cpu", seed=5, std=0.2)
    quantize_linears(model, bits=8)
    layer = model.layers[1].mlp
    assert layer.experts.down.dtype == layer.router_weight.dtype == torch.float32
    steps = run_mixed_steps(_runner(model))
    assert [sorted(step) for step in steps][-1] == ["a", "b", "c"]
