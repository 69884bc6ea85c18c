"""The in-process engine with async scheduling gives the synchronous engine's greedy tokens."""
from __future__ import annotations

from dataclasses import replace

from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig


def test_async_scheduling_greedy_tokens_equal_sync(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "qwen2")
    prompts = [[(5 * i + 3 * j) % 100 + 3 for j in range(n)] for i, n in enumerate([4, 37, 12, 26])]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 5, 14, 1)]
    config = EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), num_blocks=64),
                          scheduler=SchedulerOptions(max_num_batched_tokens=20))
    sync = LLM(config, progress=False)
    expected = sync.generate_token_ids(prompts, params)
    asynchronous = LLM(replace(config, scheduler=replace(config.scheduler, async_scheduling=True)), runner=sync.runner,
                       progress=False)
    assert asynchronous.engine.async_scheduling
    assert asynchronous.generate_token_ids(prompts, params) == expected
    assert [len(t) for t in expected] == [9, 5, 14, 1]

