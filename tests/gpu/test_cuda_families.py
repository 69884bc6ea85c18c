"""One model of each attention variant the supported families bring, Triton path (CUDA graphs and the
copy stream on) against the torch path on the GPU: a sliding window on every layer (mistral),
alternating local/global layers with soft-caps, sandwich norms, GeLU-tanh and a query scale (gemma2),
q/k norms with a local rope base and linear scaling (gemma3), q/k norms (qwen3), longrope (phi3) and
llama3 scaling. Built from ModelConfig (the device image has no transformers); the CPU twin with
transformers as the reference is tests/worker/paths/test_triton_families.py. Skipped without CUDA.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.model.config import RopeScaling
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

WINDOW = 7  # run_mixed_steps' contexts reach 16 tokens


def family_configs() -> dict:
    base = tiny_config(num_layers=2)
    gemma = dict(layer_windows=(WINDOW, None), sandwich_norms=True, hidden_act="gelu_tanh", embedding_multiplier=8.0)
    return {
        "mistral_window": replace(base, architecture="mistral", layer_windows=(WINDOW, WINDOW)),
        "gemma2": replace(base, architecture="gemma2", attn_logit_softcap=5.0, final_logit_softcap=3.0,
                          query_scale=24**-0.5, **gemma),
        "gemma3": replace(base, architecture="gemma3", qk_norm=True, local_rope_theta=1000.0,
                          rope_scaling=RopeScaling("linear", factor=8.0), **gemma),
        "qwen3": replace(base, architecture="qwen3", qk_norm=True),
        "phi3": replace(base, architecture="phi3", rope_scaling=RopeScaling(
            "longrope", original_max_position_embeddings=8, attention_factor=1.2,
            short_factor=tuple(1.0 + 0.1 * i for i in range(8)), long_factor=tuple(1.0 + 0.5 * i for i in range(8)))),
        "llama3_rope": replace(base, rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)),
    }


def compare_paths(config, device: torch.device, **triton_options) -> None:
    model = random_llama(config, torch.float32, device, seed=5, std=0.2)
    steps = {}
    for backend, options in (("torch", {}), ("triton", triton_options)):
        runner = ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=WorkerOptions(kernel_backend=backend, **options))
        runner.warm_up()
        steps[backend] = run_mixed_steps(runner)
    assert_same_steps(steps["torch"], steps["triton"], logprob_atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only; run by tests/gpu/run.sh")
@pytest.mark.parametrize("family", list(family_configs()))
def test_family_on_cuda_triton_matches_torch(family):
    compare_paths(family_configs()[family], torch.device("cuda"), cuda_graphs=True, stream_overlap=True,
                  graph_batch_sizes=(1, 2, 4))
