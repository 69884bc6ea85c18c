"""Both execution paths apply a constrained row's token bitmask through the ExecutionPath protocol (the
Triton path under the interpreter on CPU): on the device path (sampling kernel) and on its hand-over to
worker.sampling.sampler (a row with logprobs), masked tokens never come out, and greedy rows agree with torch."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from tests.worker.sampling.test_constrained_sampling import pack
from worker.model.kv_cache import allocate_kv_cache
from worker.options import WorkerOptions
from worker.paths import build_execution_path
from worker.paths.base import resolve_execution
from worker.sampling.sampler import SamplingRow
from worker.sampling.structured_output import TokenBitmask
from worker.step_batch import StepBatch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def paths():
    config = tiny_config(num_layers=1)
    model = random_llama(config, torch.float32, CPU, seed=1)
    return {backend: build_execution_path(model, allocate_kv_cache(config, 4, 4, torch.float32), 4,
                                          resolve_execution(WorkerOptions(kernel_backend=backend), CPU), CPU)
            for backend in ("torch", "triton")}


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_both_paths_keep_constrained_rows_to_their_tokens(paths, with_logprobs):
    vocab_size = 70
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(3)) * 3
    allowed = [{1, 2}, {60}, {10, 11, 12}]  # rows 0, 2, 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.0, seed=2, top_k=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=2 if with_logprobs else None), SamplingParams(temperature=0.5)]
    rows = [SamplingRow(p, [0], 1) for p in params]
    bitmask = TokenBitmask([0, 2, 4], pack(allowed, vocab_size))
    results = {backend: path.sample(StepBatch(1), logits, rows, bitmask)[0] for backend, path in paths.items()}
    for tokens in results.values():
        assert tokens[0] in allowed[0] and tokens[2] in allowed[1] and tokens[4] in allowed[2]
    assert [results["triton"][i] for i in (0, 3, 4)] == [results["torch"][i] for i in (0, 3, 4)]  # greedy rows
