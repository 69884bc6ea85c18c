"""The cost of a split model on one machine: the same random Llama-shaped model's step times whole (one process)
and split over N gloo ranks (N processes), side by side in one run. A benchmark, not a test.

    python scripts/bench_tensor_parallel.py                     # 1 vs 2 ranks, a 1B-like shape cut to 4 layers
    python scripts/bench_tensor_parallel.py --ranks 1,2,4 --layers 2

Each side: the model built from one seed on every rank (so every rank holds the same weights before it takes
its share), a prefill step of --batch x --prompt-len tokens over the paged cache, then --decode-steps decode
steps of --batch rows; the figure is the median step. Threads: each side gets every core (N ranks: cores / N
each), so on a CPU the split shows its communication and its smaller matmuls, not more compute. A CPU group is
for tests and for models that fit no single machine's memory, not for speed (issue 37).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.model.attention import build_attention_metadata  # noqa: E402
from worker.model.config import ModelConfig  # noqa: E402
from worker.model.kv_cache import allocate_kv_cache  # noqa: E402
from worker.model.llama import LlamaModel  # noqa: E402
from worker.parallel.group import SINGLE_RANK, join_group, leave_group  # noqa: E402
from worker.parallel.shard import RankSplit, shard_model  # noqa: E402
from worker.step_batch import RequestSpan  # noqa: E402

BLOCK_SIZE = 16


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, rope_theta=1e4,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                       max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)


def timed_steps(args: argparse.Namespace, rank: int = 0, world_size: int = 1, init_method: str = "") -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = join_group(rank, world_size, init_method) if world_size > 1 else SINGLE_RANK
    config = model_config(args)
    torch.manual_seed(0)
    model = shard_model(LlamaModel(config).eval(), group)
    kv_config = RankSplit(rank, world_size, config).rank_config() if world_size > 1 else config
    pages = -(-(args.prompt_len + args.decode_steps) // BLOCK_SIZE)
    kv_cache = allocate_kv_cache(kv_config, args.batch * pages, BLOCK_SIZE, torch.float32)
    tables = [list(range(b * pages, (b + 1) * pages)) for b in range(args.batch)]
    lengths = [0] * args.batch
    times = {"prefill": [], "decode": []}
    with torch.inference_mode():
        for step in range(args.decode_steps + 1):
            query = args.prompt_len if step == 0 else 1
            spans, positions = [], []
            for b in range(args.batch):
                spans.append(RequestSpan(b * query, query, lengths[b] + query, tables[b]))
                positions += range(lengths[b], lengths[b] + query)
                lengths[b] += query
            input_ids = torch.randint(0, config.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(step))
            if group.process_group is not None:
                torch.distributed.barrier(group=group.process_group)
            started = time.perf_counter()
            hidden = model(input_ids, torch.tensor(positions), kv_cache, build_attention_metadata(spans, BLOCK_SIZE))
            model.compute_logits(hidden[[s.query_start + s.query_len - 1 for s in spans]])
            times["prefill" if step == 0 else "decode"].append(time.perf_counter() - started)
    leave_group(group)
    return {"prefill_ms": 1e3 * times["prefill"][0], "decode_ms": 1e3 * statistics.median(times["decode"][1:])}


def _rank(args, rank, world_size, init_method, out) -> None:
    figures = timed_steps(args, rank, world_size, init_method)
    if rank == 0:
        torch.save(figures, out)


def split_run(args: argparse.Namespace, world_size: int) -> dict:
    if world_size == 1:
        return timed_steps(args)
    with tempfile.TemporaryDirectory() as folder:
        context = multiprocessing.get_context("spawn")
        out = f"{folder}/figures.pt"
        ranks = [context.Process(target=_rank, args=(args, rank, world_size, f"file://{folder}/store", out))
                 for rank in range(world_size)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(process.exitcode for process in ranks):
            raise SystemExit(f"a rank failed: exit codes {[process.exitcode for process in ranks]}")
        return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2", help="group sizes, one side each (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=20)
    args = parser.parse_args()
    print(f"shape: hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads / {args.kv_heads} KV, "
          f"{args.layers} layers, vocab {args.vocab}, float32; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.decode_steps} decode steps; {os.cpu_count()} cores", flush=True)
    print("| ranks | prefill step (ms) | decode step, median (ms) |\n| ---: | ---: | ---: |")
    for world_size in (int(part) for part in args.ranks.split(",")):
        figures = split_run(args, world_size)
        print(f"| {world_size} | {figures['prefill_ms']:.1f} | {figures['decode_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
