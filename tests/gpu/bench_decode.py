"""Decode-step benchmark on a Llama-3-8B-shaped random-weight model: `python -m tests.gpu.bench_decode`.

Drives the real ModelRunner with StepPlans, so a step costs what it costs in the worker: packing,
metadata, staging, the forward (graph replay or eager kernels), sampling and the token readback.
Requests start with their context already "computed" (the pages hold random K/V): only decode steps
are measured. Per batch size and per (CUDA graphs, stream overlap) setting it prints the step time,
output tokens/s and the achieved memory bandwidth, bytes read per step (every weight once, plus each
request's K and V over all layers) / step time, next to a device-to-device copy bandwidth measured
here first. With CUDA graphs and stream overlap on, it also measures async scheduling: each step is
prepared on this thread while the previous one runs on a compute thread, as worker.service does when
the scheduler sends step N+1 before step N's tokens are back (with stream overlap, that prepare also
starts step N+1's H2D copy, and step N+1's decode ids are written from step N's sampled ids on the
device), against the same steps run in turn. --dry-run runs the same code on a tiny
model on the CPU (what the CPU test does).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.gpu.random_model import llama3_8b_config, random_llama, tiny_config
from worker.linears.group_quant import quantize_linears
from worker.model.config import ModelConfig
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
SETTINGS = (  # (cuda_graphs, stream_overlap)
    (True, True), (False, True), (True, False), (False, False))


@dataclass(slots=True)
class Row:
    batch_size: int
    cuda_graphs: bool
    stream_overlap: bool
    kernel_backend: str
    step_ms: float
    tokens_per_s: float
    bytes_per_step: int
    bandwidth_gb_s: float
    fraction_of_copy: float
    async_scheduling: bool = False  # step N+1 prepared while step N runs


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Device-to-device copy, counting bytes read plus bytes written (what a kernel streaming weights does twice over)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - started) / 1e9


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from weights: every parameter/buffer once, except the embedding table (B rows)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    embedding = model.embed_tokens.weight
    return total - embedding.numel() * embedding.element_size()


def kv_bytes(config: ModelConfig, dtype: torch.dtype, context_lens: list[int]) -> int:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_token * sum(context_lens)


class DecodeDriver:
    """Feeds one batch of requests to a runner, one decode step per call, with pages allocated up front."""

    def __init__(self, runner: ModelRunner, context_lens: list[int], max_steps: int, tag: str) -> None:
        self.runner, self.step_id = runner, 0
        block_size = runner.block_size
        next_block, new_requests = 1, []  # block 0 is the warm-up's scratch page
        self.num_computed: dict[str, int] = {}
        for index, context_len in enumerate(context_lens):
            request_id = f"{tag}-{index}"
            num_blocks = -(-(context_len + max_steps) // block_size)
            blocks = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            prompt = [random.randrange(runner.model_config.vocab_size) for _ in range(context_len)]
            # the prefix is declared computed: its pages hold whatever K/V they hold; one decode step follows
            new_requests.append(NewRequestData(request_id, prompt, context_len, GREEDY, blocks, context_len - 1))
            self.num_computed[request_id] = context_len - 1
        if next_block > runner.num_blocks:
            raise ValueError(f"the batch needs {next_block} KV blocks, the runner has {runner.num_blocks}")
        self.pending_new = new_requests

    def next_plan(self) -> StepPlan:
        self.step_id += 1
        plan = StepPlan(self.step_id, num_scheduled_tokens={rid: 1 for rid in self.num_computed})
        if self.pending_new:
            plan.new_requests, self.pending_new = self.pending_new, []
        else:
            plan.cached_requests = [CachedRequestData(rid, [], n) for rid, n in self.num_computed.items()]
        for rid in self.num_computed:
            self.num_computed[rid] += 1
        return plan

    def step(self) -> None:
        result = self.runner.execute(self.next_plan())
        assert len(result.sampled_token_ids) == len(self.num_computed)

    def steps_ahead(self, num_steps: int, compute: ThreadPoolExecutor) -> None:
        """num_steps steps, each prepared here while the one before runs on `compute` (as the worker
        does under async scheduling)."""
        running = None
        for _ in range(num_steps):
            prepared = self.runner.prepare(self.next_plan())
            if running is not None:
                assert len(running.result().sampled_token_ids) == len(self.num_computed)
            running = compute.submit(self.runner.run, prepared)
        assert len(running.result().sampled_token_ids) == len(self.num_computed)

    def finish(self) -> None:
        self.step_id += 1
        self.runner.execute(StepPlan(self.step_id, finished_request_ids=list(self.num_computed)))


def measure(runner: ModelRunner, config: ModelConfig, dtype: torch.dtype, batch_size: int, context_range: tuple[int, int],
            warmup_steps: int, timed_steps: int, copy_gb_s: float, tag: str,
            compute: ThreadPoolExecutor | None = None) -> Row:
    """compute: run each step there while the next is prepared here (async scheduling); None: in turn."""
    context_lens = [random.randint(*context_range) for _ in range(batch_size)]
    driver = DecodeDriver(runner, context_lens, warmup_steps + timed_steps + 1, tag)
    for _ in range(warmup_steps + 1):
        driver.step()
    synchronize(runner.device)
    started = time.perf_counter()
    if compute is not None:
        driver.steps_ahead(timed_steps, compute)
    else:
        for _ in range(timed_steps):
            driver.step()
    synchronize(runner.device)
    step_s = (time.perf_counter() - started) / timed_steps
    driver.finish()
    mean_context = [c + warmup_steps + 1 + timed_steps // 2 for c in context_lens]
    num_bytes = weight_bytes(runner.model) + kv_bytes(config, dtype, mean_context)
    bandwidth = num_bytes / step_s / 1e9
    execution = runner.execution
    return Row(batch_size, execution.cuda_graphs, execution.stream_overlap, execution.kernel_backend,
               step_s * 1e3, batch_size / step_s, num_bytes, bandwidth, bandwidth / copy_gb_s, compute is not None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.bench_decode", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, a few steps: checks the script runs")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--min-context", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=1536)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--settings", default="all", choices=("all", "default"),
                        help="all: CUDA graphs on/off x stream overlap on/off; default: both on")
    parser.add_argument("--quantization", default="none", choices=("none", "int4", "int8"),
                        help="group-quantize every linear (groups of 32), as --quantization does at load")
    parser.add_argument("--gemv-config", help="BLOCK_N,BLOCK_GROUPS,num_warps for the group-quantized GEMV kernel "
                        "(default: its GEMV_CONFIG; tests/gpu/run.sh passes bench_group_quant's best)")
    parser.add_argument("--many-rows-kernel", choices=("tiled", "dequant"),
                        help="the group-quantized kernel above GEMV_MAX_ROWS rows (default: its MANY_ROWS_KERNEL)")
    parser.add_argument("--output", help="write the rows as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def bench_setup(args: argparse.Namespace):
    """The device, dtype, model config, batch sizes, context range, step counts and copy bandwidth of a run
    (--dry-run: a tiny float32 model on CPU, to check the script without a GPU)."""
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.dry_run:
        device, dtype, config = torch.device("cpu"), torch.float32, tiny_config(num_layers=1)
        batch_sizes = [min(b, 3) for b in batch_sizes[:2]]
        context_range, warmup, timed = (5, 20), 1, 2
        copy_gb_s = copy_bandwidth_gb_s(device, 1 << 20, 2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_decode needs CUDA (or --dry-run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = llama3_8b_config(max_position_embeddings=args.max_context + 64)
        context_range, warmup, timed = (args.min_context, args.max_context), args.warmup_steps, args.timed_steps
        copy_gb_s = copy_bandwidth_gb_s(device, 1 << 30, 20)
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}", flush=True)
    return device, dtype, config, batch_sizes, context_range, warmup, timed, copy_gb_s


def build_model(args: argparse.Namespace, config, dtype: torch.dtype, device: torch.device):
    """The random-weight model in the weights --quantization names, with the kernel settings asked for."""
    started = time.perf_counter()
    model = random_llama(config, dtype, device, seed=args.seed)
    from worker.kernels import group_quant_matmul

    if args.gemv_config:
        group_quant_matmul.GEMV_CONFIG = tuple(int(value) for value in args.gemv_config.split(","))
    if args.many_rows_kernel:
        group_quant_matmul.MANY_ROWS_KERNEL = args.many_rows_kernel
    if args.quantization != "none":
        quantize_linears(model, bits=int(args.quantization[3:]), group_size=32)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float weights the codes replaced
    print(f"model: {args.quantization} weights, {config.num_layers} layers, hidden {config.hidden_size}, {weight_bytes(model) / 1e9:.2f} GB of weights "
          f"read per step; built in {time.perf_counter() - started:.1f} s", flush=True)
    return model


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    random.seed(args.seed)
    device, dtype, config, batch_sizes, context_range, warmup, timed, copy_gb_s = bench_setup(args)
    print(f"device-to-device copy: {copy_gb_s:.1f} GB/s (read + write)", flush=True)
    model = build_model(args, config, dtype, device)
    max_steps = warmup + timed + 2
    blocks_per_request = -(-(context_range[1] + max_steps) // args.block_size)
    num_blocks = 1 + max(batch_sizes) * blocks_per_request
    rows: list[Row] = []
    settings = SETTINGS if args.settings == "all" else SETTINGS[:1]
    header = (f"{'batch':>5} {'graphs':>6} {'overlap':>7} {'async':>5} {'backend':>7} {'step ms':>9} {'tok/s':>10} "
              f"{'GB/step':>8} {'GB/s':>8} {'of copy':>7}")
    print(header, flush=True)
    for cuda_graphs, stream_overlap in settings:
        options = WorkerOptions(kernel_backend=args.kernel_backend, cuda_graphs=cuda_graphs, stream_overlap=stream_overlap,
                                   graph_batch_sizes=tuple(sorted(set(batch_sizes))))
        started = time.perf_counter()
        runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=args.block_size, dtype=dtype, options=options)
        runner.warm_up()  # captures the graphs when they are on
        print(f"# runner graphs={runner.execution.cuda_graphs} overlap={runner.execution.stream_overlap}: "
              f"warm-up {time.perf_counter() - started:.1f} s", flush=True)
        # async scheduling on vs off, measured with the default (graphs and overlap on) setting only
        modes = (False, True) if (cuda_graphs, stream_overlap) == SETTINGS[0] else (False,)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute") as compute:
            for async_scheduling in modes:
                for batch_size in batch_sizes:
                    row = measure(runner, config, dtype, batch_size, context_range, warmup, timed, copy_gb_s,
                                  tag=f"g{int(cuda_graphs)}o{int(stream_overlap)}a{int(async_scheduling)}b{batch_size}",
                                  compute=compute if async_scheduling else None)
                    rows.append(row)
                    print(f"{row.batch_size:>5} {str(row.cuda_graphs):>6} {str(row.stream_overlap):>7} "
                          f"{str(row.async_scheduling):>5} {row.kernel_backend:>7} {row.step_ms:>9.2f} "
                          f"{row.tokens_per_s:>10.0f} {row.bytes_per_step / 1e9:>8.2f} "
                          f"{row.bandwidth_gb_s:>8.0f} {row.fraction_of_copy:>7.0%}", flush=True)
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"copy_gb_s": copy_gb_s, "quantization": args.quantization, "gemv_config": args.gemv_config,
                       "many_rows_kernel": args.many_rows_kernel, "rows": [asdict(row) for row in rows]}, handle, indent=2)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
