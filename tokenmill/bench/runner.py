"""Runs a workload against a target: sync mode and the async concurrency sweep.

At each concurrency level, `concurrency` clients each send their next request as soon as their last
one finished (closed loop) until the level's requests are done; concurrency 1 is sync mode. Warm-up
requests go first, outside the timed window, and are reported on their own.
"""
from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from tokenmill.bench.report import summarize
from tokenmill.bench.targets import LoadPoller, RequestRecord, TransformersTarget
from tokenmill.bench.workload import BenchWorkload


async def run_level(target, workload: BenchWorkload, concurrency: int, poller: LoadPoller | None = None,
                    label: str = "") -> dict:
    """Sends every request of workload with at most `concurrency` in flight; returns summarize()'s dict."""
    queue = list(zip(workload.prompts, workload.output_lens))
    records: list[RequestRecord] = []
    bar = tqdm(total=len(queue), desc=f"{label} c={concurrency}", unit="req", leave=False)

    async def client() -> None:
        while queue:
            prompt, max_tokens = queue.pop(0)
            records.append(await target.send(prompt, max_tokens))
            bar.update(1)

    if poller is not None:
        poller.start()
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    bar.close()
    load = await poller.stop() if poller is not None else {}
    return {"concurrency": concurrency, **summarize(records, elapsed), **load}


async def warm_up(target, workload: BenchWorkload, count: int) -> dict:
    """count requests one at a time before anything is timed (first-call costs: graphs, allocations)."""
    start = time.perf_counter()
    records = [await target.send(p, n) for p, n in zip(workload.prompts[:count], workload.output_lens[:count])]
    return summarize(records, time.perf_counter() - start)


async def sweep(target, workload: BenchWorkload, levels: list[int], requests_per_level: int,
                warmup: int, poller: LoadPoller | None = None, label: str = "") -> dict:
    result = {"target": target.name, "warmup": await warm_up(target, workload, warmup), "levels": []}
    for concurrency in levels:
        count = max(requests_per_level, concurrency)  # every client gets at least one request
        result["levels"].append(await run_level(target, workload.head(count), concurrency, poller, label))
    return result


def sweep_transformers(target: TransformersTarget, workload: BenchWorkload, levels: list[int],
                       requests_per_level: int, warmup: int) -> dict:
    """The baseline has no server: at concurrency c it runs static batches of c requests back to back."""
    start = time.perf_counter()
    records = target.run_batch(workload.prompt_ids[:warmup], workload.output_lens[:warmup]) if warmup else []
    result = {"target": target.name, "warmup": summarize(records, time.perf_counter() - start), "levels": []}
    for concurrency in levels:
        level = workload.head(max(requests_per_level, concurrency))
        records = []
        start = time.perf_counter()
        for first in tqdm(range(0, len(level.prompts), concurrency), desc=f"transformers c={concurrency}",
                          unit="batch", leave=False):
            batch = slice(first, first + concurrency)
            records += target.run_batch(level.prompt_ids[batch], level.output_lens[batch])
        result["levels"].append({"concurrency": concurrency,
                                 **summarize(records, time.perf_counter() - start)})
    return result
