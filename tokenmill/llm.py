"""The engine in one process: scheduler + worker, no gRPC. Used by tests, benchmarks and `generate`.

    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, num_blocks=64),
                           scheduler=SchedulerOptions(max_num_batched_tokens=48)))
    llm.generate_token_ids([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

from core.outputs import RequestOutput
from core.sampling import SamplingParams
from scheduler.engine import EngineCore
from scheduler.options import SchedulerOptions
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculation import check_draft_model
from worker.build import build_runner
from worker.host_heap import give_back_freed_memory, keep_freed_memory
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

# The engine's worker unless told otherwise: float32 on the CPU (the same numbers on every machine, what
# tests compare against) with a 512 MiB KV cache (a process sizes its cache from free memory instead).
ENGINE_WORKER = WorkerOptions(dtype="float32", device="cpu", kv_cache_mb=512)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """A worker's and a scheduler's options, as their processes take them. The step budget both take is
    the scheduler's (the worker's profile pass runs one that size); the page size is the worker's. The
    scheduler's free_window_pages says whether a model whose every layer slides gives back each request's
    pages before its window (the process always does)."""

    worker: WorkerOptions = ENGINE_WORKER
    scheduler: SchedulerOptions = SchedulerOptions()


class LLM:
    """The engine over one model. Built with its own runner, it tells the host process's C heap what a worker
    process's is told (worker.host_heap: freed blocks kept for the next step, one glibc arena);
    WorkerOptions(keep_freed_memory=False) leaves the heap as it is."""

    def __init__(self, config: EngineConfig = EngineConfig(), runner: ModelRunner | None = None,
                 progress: bool = True) -> None:
        self.config = config
        check_draft_model(config.scheduler.speculative, config.worker.draft_model)
        worker = replace(config.worker, max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
        sets_heap = worker.keep_freed_memory and runner is None
        if sets_heap:
            keep_freed_memory()  # the steps run on this thread: the same heap settings as a worker process
        self.runner = runner or build_runner(worker, progress=progress)
        if sets_heap:
            give_back_freed_memory()  # what loading freed
        self.model_config = self.runner.model_config
        self.engine = self.new_engine(config)
        self._ids = itertools.count()

    def new_engine(self, config: EngineConfig) -> EngineCore:
        """A fresh scheduler over the same worker (e.g. the other KV policy on the same weights)."""
        sched_config = config.scheduler.scheduler_config(
            num_blocks=self.runner.num_blocks, block_size=config.worker.block_size,
            model_max_len=self.model_config.max_position_embeddings,
            num_host_blocks=self.runner.swap_space.num_host_blocks,
            bytes_per_block=self.runner.kv_cache.bytes_per_block + (
                self.runner.drafter.kv_cache.bytes_per_block if self.runner.drafter else 0),
            sliding_window=self.model_config.every_layer_window)
        return EngineCore(Scheduler(sched_config), self.runner, async_scheduling=config.scheduler.async_scheduling)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[RequestOutput]]:
        """Runs the prompts (token ids) concurrently to completion; the outputs of each, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        requests = [Request(f"llm-{next(self._ids)}", list(p), sp, eos_token_id=self.model_config.eos_token_id)
                    for p, sp in zip(prompts, params)]
        results = self.engine.run_to_completion(requests)
        return [results[r.request_id] for r in requests]

    def generate_token_ids(self, prompts: Sequence[Sequence[int]],
                           params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        return [[t for out in outputs for t in out.new_token_ids] for outputs in self.generate(prompts, params)]
