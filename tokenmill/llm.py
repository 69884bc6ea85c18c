"""The engine in one process: scheduler + worker, no gRPC. Used by tests, benchmarks and `generate`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from core.outputs import RequestOutput
from core.sampling import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from worker.options import WorkerOptions
from worker.build import build_runner
from worker.model_runner import ModelRunner


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default GGUF model
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20  # memory budget for the KV cache
    num_blocks: int | None = None  # overrides kv_cache_bytes
    target_itl_ms: float | None = None  # latency targets (scheduler.step_time); None: the fixed budgets
    target_ttft_ms: float | None = None
    swap_space_bytes: int = 0  # host pages for preemption by swap (worker.model.llama.kv_cache.HostSwapSpace); 0: recompute only
    kv_policy: str = "paged"
    queue_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    async_scheduling: bool = False  # plan step N+1 before step N's tokens are applied (scheduler.step_pipeline)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own limit
    device: str = "cpu"  # cpu, cuda or auto (worker.build.resolve_device)
    kernel_backend: str = "auto"  # auto: triton on CUDA, torch on CPU (worker.paths.base)
    quantization: str = "auto"  # worker.paths.base.QUANTIZATIONS: auto runs a GGUF file's weights as stored
    cuda_graphs: bool = True  # CUDA + triton only
    stream_overlap: bool = True  # CUDA only
    packed_linears: bool = True  # CPU float32: weights reordered once for oneDNN (worker.linears.packed)
    cpu_int8_activations: bool = False  # worker.paths.base.ExecutionOptions
    cpu_fused_ops: bool = True  # worker.paths.base.ExecutionOptions; False: the plain-torch reference
    cpu_dense_weights: str = "auto"  # worker.paths.base.ExecutionOptions (worker.linears.dense_weights)
    deterministic: bool = False  # worker.paths.base.ExecutionOptions: batch-invariant kernels (worker.paths.batch_invariant)
    # a model whose every layer slides: give back each request's pages before its window (scheduler.pages.kv_manager)
    free_window_pages: bool = True

    def execution_options(self) -> WorkerOptions:
        return WorkerOptions(model=self.model, dtype=self.dtype, block_size=self.block_size, num_blocks=self.num_blocks,
                             swap_space_gb=self.swap_space_bytes / 2**30, device=self.device,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             kernel_backend=self.kernel_backend, quantization=self.quantization,
                             cuda_graphs=self.cuda_graphs, stream_overlap=self.stream_overlap,
                             packed_linears=self.packed_linears, cpu_int8_activations=self.cpu_int8_activations,
                             cpu_fused_ops=self.cpu_fused_ops, cpu_dense_weights=self.cpu_dense_weights,
                             deterministic=self.deterministic)


def scheduler_config_for(config: EngineConfig, num_blocks: int, model_max_len: int, num_host_blocks: int = 0,
                         bytes_per_block: int = 0, sliding_window: int | None = None) -> SchedulerConfig:
    """sliding_window: the model's every-layer window (worker ModelConfig.every_layer_window), None if none."""
    return SchedulerConfig(num_host_blocks=num_host_blocks, bytes_per_block=bytes_per_block,
        sliding_window=sliding_window if config.free_window_pages else None,
        target_itl_ms=config.target_itl_ms, target_ttft_ms=config.target_ttft_ms,
        num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=min(config.max_model_len or model_max_len, model_max_len),
        kv_policy=config.kv_policy, queue_policy=config.queue_policy,
        enable_prefix_caching=config.enable_prefix_caching)


class LLM:
    def __init__(self, config: EngineConfig = EngineConfig(), runner: ModelRunner | None = None,
                 progress: bool = True) -> None:
        self.config = config
        self.runner = runner or build_runner(config.execution_options(), progress=progress,
                                             kv_cache_bytes=config.kv_cache_bytes)
        self.model_config = self.runner.model_config
        self.engine = self.new_engine(config)
        self._ids = itertools.count()

    def new_engine(self, config: EngineConfig) -> EngineCore:
        """A fresh scheduler over the same worker (e.g. the other KV policy on the same weights)."""
        sched_config = scheduler_config_for(config, self.runner.num_blocks,
                                            self.model_config.max_position_embeddings,
                                            self.runner.swap_space.num_host_blocks,
                                            self.runner.kv_cache.storage[:, :, 0].nbytes,
                                            self.model_config.every_layer_window)
        return EngineCore(Scheduler(sched_config), self.runner, async_scheduling=config.async_scheduling)

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
