"""Every execution path with a mixture of experts: it runs the model or refuses it at start, naming itself and
the architecture. auto takes the Triton backend for a MoE model on CUDA (CUDA graphs on) and torch on the CPU;
--kernel-backend triton runs it (routing in torch, experts through worker.kernels.fused_moe) with the torch path's
logits within 1e-4 and its tokens, for each MoE family, and a GGUF file's experts on its blocks behind the
layer's seam; --deterministic is refused, and a Triton path built by hand under it too; the CPU path with its
defaults (packed linears, the compiled decoder ops, int8 / int4 linears) runs it, its experts as the reference runs
them."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from tests.helpers.tiny_models import GPT_OSS, MOE_FLAVOURS, make_tiny_hf_model
from worker.linears.group_quant import quantize_linears
from worker.loader import load_model
from worker.model.moe import SparseMoE
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths.base import resolve_execution
from worker.paths.triton.path import TritonPath

MOE = replace(tiny_config(num_layers=2), architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, qk_norm=True, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_model():
    return random_llama(MOE, torch.float32, "cpu", seed=5, std=0.2)


def _runner(model, config=MOE, **options) -> ModelRunner:
    return ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                       options=WorkerOptions(**options))


def test_auto_takes_the_triton_backend_for_moe_on_cuda_and_torch_on_the_cpu():
    cuda = resolve_execution(WorkerOptions(), torch.device("cuda", 0), MOE)  # resolving touches no device
    assert (cuda.kernel_backend, cuda.cuda_graphs) == ("triton", True)
    assert resolve_execution(WorkerOptions(), "cpu", MOE).kernel_backend == "torch"
    assert resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu", MOE).kernel_backend == "triton"


def _logits_of_each_step(runner: ModelRunner) -> list[torch.Tensor]:
    """Wraps the runner's path's forward: every step's logits [R + Q, vocab] of its sampled rows, in order."""
    path, captured = runner.execution_path, []
    forward = path.forward
    path.forward = lambda batch, inputs: captured.append(forward(batch, inputs)) or captured[-1]
    return captured


def _torch_and_triton(folder):
    """The folder's model on the torch and the Triton path, each through the same steps (run_mixed_steps: the
    same tokens and logprobs on both), counting the Triton path's fused-MoE calls: (model, config, the Triton
    path, its fused calls, each path's logits of each step)."""
    model, config = load_model(folder, progress=False)
    runners = {backend: _runner(model, config, kernel_backend=backend, packed_linears=False, cpu_fused_ops=False)
               for backend in ("torch", "triton")}
    path = runners["triton"].execution_path
    fused_calls, fused_moe = [], path.kernels.fused_moe
    path.kernels = dataclasses.replace(path.kernels, fused_moe=lambda *args, **kwargs: fused_calls.append(1) or
                                       fused_moe(*args, **kwargs))
    logits = {backend: _logits_of_each_step(runner) for backend, runner in runners.items()}
    steps = {backend: run_mixed_steps(runner) for backend, runner in runners.items()}
    assert_same_steps(steps["torch"], steps["triton"], logprob_atol=1e-4)
    return model, config, path, fused_calls, logits


@pytest.mark.parametrize("flavour", MOE_FLAVOURS)
def test_the_triton_backend_runs_moe_as_the_torch_path(tmp_path, flavour):
    """Tiny random qwen3_moe (a dense layer between two sparse ones), mixtral and olmoe (whole-projection q/k norms)
    from Hugging Face folders: chunked prefill, a mixed step and decode steps (the decode kernel) on both paths.
    The torch path equals transformers on these models (tests/worker/model/test_moe_parity.py)."""
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    model, config, path, fused_calls, logits = _torch_and_triton(folder)
    assert type(path) is TritonPath
    num_sparse = sum(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    assert len(fused_calls) == 5 * num_sparse  # every step's every MoE layer through the fused kernel
    assert len(logits["triton"]) == len(logits["torch"]) == 5
    for expected, actual in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_the_triton_backend_runs_gpt_oss_as_the_torch_path(tmp_path):
    """gpt-oss (tests/helpers/tiny_models.py): attention sinks in both attention kernels, past the sliding window of 8
    (a 13-token prompt in two chunks, then decode steps), routing with the router's bias, its experts (biases,
    clamped SwiGLU) through the fused kernel. The torch path equals transformers
    (tests/worker/model/test_gpt_oss_parity.py)."""
    folder, _ = make_tiny_hf_model(tmp_path, GPT_OSS)
    model, config, path, fused_calls, logits = _torch_and_triton(folder)
    assert len(fused_calls) == 5 * config.num_layers  # every step's every layer (all sparse) through the kernel
    for expected, actual in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_experts_on_gguf_blocks_run_behind_the_seam_on_the_triton_path(tmp_path):
    """A GGUF file's Q8_0 experts kept in its blocks (CPU, --cpu-block-kernels all) are not stacked floats: the
    Triton path runs them as the torch path does (their native kernels), the rest of the layer through its kernels."""
    from tests.helpers.tiny_gguf import write_converter_gguf
    from worker.linears.ggml_blocks import block_types
    from worker.linears.ggml_experts import GGMLBlocksExperts
    from worker.native_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the compiled CPU ops are not built")
    _, hf_model = make_tiny_hf_model(tmp_path, "qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "q8.gguf"
    write_converter_gguf(path, hf_model, quantize={f"ffn_{p}_exps.weight": "Q8_0" for p in ("gate", "up", "down")})
    model, config = load_model(path, progress=False, keep_quantized=True, block_types=block_types("all"))
    assert all(isinstance(layer.mlp.experts, GGMLBlocksExperts) for layer in model.layers)
    steps = {backend: run_mixed_steps(_runner(model, config, kernel_backend=backend, packed_linears=False,
                                              cpu_fused_ops=False))
             for backend in ("torch", "triton")}
    assert_same_steps(steps["torch"], steps["triton"], logprob_atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deterministic_mode_with_the_triton_backend_is_refused_by_name(device):
    with pytest.raises(ValueError, match="--deterministic \\(the batch-invariant kernels\\) cannot run the "
                                         "mixture-of-experts architecture 'qwen3_moe': each expert's matmuls"):
        resolve_execution(WorkerOptions(kernel_backend="triton", deterministic=True), device, MOE)


def test_a_deterministic_triton_path_built_by_hand_refuses(moe_model):
    from worker.model.kv_cache import allocate_kv_cache

    # no model given: not checked
    execution = resolve_execution(WorkerOptions(kernel_backend="triton", deterministic=True), "cpu")
    cache = allocate_kv_cache(MOE, 4, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="the Triton path under --deterministic cannot run the mixture-of-experts "
                                         "architecture 'qwen3_moe'"):
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
