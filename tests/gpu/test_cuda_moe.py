"""A mixture of experts on CUDA (issue 36): `--kernel-backend auto` takes the torch backend for it (the Triton path
has no expert layers; CUDA graphs off with it), which runs the same tokens as the float32 CPU reference, in float32
(logprobs within 1e-3), and runs it in bfloat16 too (whose tokens may part from float32's by rounding alone, so only
the steps' shape is checked there). Skipped without CUDA; tests/gpu/run.sh runs it on the device machine (checked on
CPU by calling moe_on_device_matches_cpu("cpu"))."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only; run by tests/gpu/run.sh")
MOE = replace(tiny_config(num_layers=2), architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, qk_norm=True, norm_topk_prob=True)


def moe_on_device_matches_cpu(device: torch.device | str) -> None:
    cpu_model = random_llama(MOE, torch.float32, "cpu", seed=5, std=0.2)
    reference = run_mixed_steps(ModelRunner(cpu_model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                            dtype=torch.float32,
                                            options=WorkerOptions(packed_linears=False, cpu_fused_ops=False)))
    device_model = copy.deepcopy(cpu_model).to(device)
    runner = ModelRunner(device_model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=WorkerOptions())  # every execution flag at its default
    assert (runner.execution.kernel_backend, runner.execution.cuda_graphs) == ("torch", False)
    runner.warm_up()
    assert_same_steps(reference, run_mixed_steps(runner), logprob_atol=1e-3)
    bf16_model = copy.deepcopy(cpu_model).to(device=device, dtype=torch.bfloat16)
    bf16 = run_mixed_steps(ModelRunner(bf16_model, MOE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                       dtype=torch.bfloat16, options=WorkerOptions()))
    assert [sorted(step) for step in bf16] == [sorted(step) for step in reference]


def test_moe_on_cuda_runs_on_the_torch_backend_as_the_cpu_reference():
    moe_on_device_matches_cpu(torch.device("cuda"))
