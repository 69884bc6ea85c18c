"""The Triton path (interpreted on CPU) against the torch path on each attention variant the families
bring: a sliding window on every layer (mistral), alternating local/global layers with attention and
final soft-caps and sandwich norms (gemma2), q/k norms with per-layer rope bases (gemma3), q/k norms
alone (qwen3), longrope with fused checkpoints (phi3) and llama3 rope scaling. The torch path equals
transformers on these models (test_model_parity.py), so equal tokens and logprobs here carry that over.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.options import WorkerOptions
from worker.loader import load_model
from worker.model_runner import ModelRunner


@pytest.mark.parametrize("flavour", ["mistral_window", "gemma2", "gemma3", "qwen3", "phi3", "llama3_rope"])
def test_triton_path_matches_torch_path(tmp_path, flavour):
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    model, config = load_model(folder, progress=False)
    steps = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=WorkerOptions(kernel_backend=backend))
        steps[backend] = run_mixed_steps(runner)
    assert_same_steps(steps["torch"], steps["triton"], logprob_atol=1e-4)
