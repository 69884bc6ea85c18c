"""Runs a workload against a target: sync mode, the closed-loop concurrency sweep, open-loop rates.

Closed loop: at each concurrency level, `concurrency` clients each send their next request as soon as
their last one finished until the level's requests are done; concurrency 1 is sync mode. Open loop: at
each request rate, requests are sent at Poisson arrival times (exponential gaps, seeded) whether or not
earlier ones have finished, as vLLM's benchmark_serving does, so a server slower than the rate builds
a queue instead of slowing the clients down. Warm-up requests go first, outside the timed window, and
are reported on their own.
"""
from __future__ import annotations

import asyncio
import random
import time

from tqdm import tqdm

from tokenmill.bench.report import summarize
from tokenmill.bench.targets import LoadPoller, RequestRecord, TransformersTarget
from tokenmill.bench.workload import BenchWorkload, Levels


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


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start of a level: cumulative exponential gaps of mean 1 / rate
    (a Poisson process at `rate` requests/s), the same times for the same seed."""
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"request rate {rate}: must be a finite number > 0 (requests/s)")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


async def run_open_level(target, workload: BenchWorkload, rate: float, seed: int,
                         poller: LoadPoller | None = None, label: str = "") -> dict:
    """Sends workload's requests at poisson_arrivals(rate, seed), never waiting for a response first."""
    arrivals = poisson_arrivals(len(workload.prompts), rate, seed)
    bar = tqdm(total=len(arrivals), desc=f"{label} {rate:g} req/s", unit="req", leave=False)
    in_flight = peak_in_flight = 0

    async def one(prompt: str, max_tokens: int) -> RequestRecord:
        nonlocal in_flight, peak_in_flight
        in_flight += 1
        peak_in_flight = max(peak_in_flight, in_flight)
        try:
            return await target.send(prompt, max_tokens)
        finally:
            in_flight -= 1
            bar.update(1)

    if poller is not None:
        poller.start()
    start = time.perf_counter()
    tasks, last_sent = [], 0.0
    for at, prompt, max_tokens in zip(arrivals, workload.prompts, workload.output_lens):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        last_sent = time.perf_counter() - start
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    records = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bar.close()
    load = await poller.stop() if poller is not None else {}
    # the rate the arrivals achieved (n arrivals over the time to the last one), beside the one asked for
    achieved = len(arrivals) / last_sent if last_sent > 0 else None
    return {"request_rate": rate, "seed": seed, "achieved_rate": achieved, "peak_in_flight": peak_in_flight,
            **summarize(records, elapsed), **load}


async def warm_up(target, workload: BenchWorkload, count: int) -> dict:
    """count requests one at a time before anything is timed (first-call costs: graphs, allocations)."""
    start = time.perf_counter()
    records = [await target.send(p, n) for p, n in zip(workload.prompts[:count], workload.output_lens[:count])]
    return summarize(records, time.perf_counter() - start)


async def sweep(target, workload: BenchWorkload, levels: list[int], requests_per_level: int,
                warmup: int, poller: LoadPoller | None = None, label: str = "",
                rates: list[float] = (), seed: int = 0) -> dict:
    """The closed-loop levels (concurrency), then the open-loop ones (request rates)."""
    result = {"target": target.name, "warmup": await warm_up(target, workload, warmup), "levels": []}
    fresh = Levels(warmup)  # each level its own prompts, after the warm-up's
    for concurrency in levels:
        count = max(requests_per_level, concurrency)  # every client gets at least one request
        result["levels"].append(await run_level(target, fresh.take(workload, count), concurrency, poller, label))
    for rate in rates:
        result["levels"].append(await run_open_level(target, fresh.take(workload, requests_per_level), rate, seed,
                                                     poller, label))
    return result


def interleaved_order(names: list[str], steps: int) -> list[tuple[int, str]]:
    """(step, run name) in the order an interleaved sweep runs them: every run's step i back to back, each
    step's order rotated ceil(runs / steps) places from the one before, so that the machine drifting
    faster or slower over a long run falls on every configuration alike rather than on whichever ran
    last. (Forward / reverse instead put the same run last at steps 0, 2, 4: issue 19's latency-target
    cluster, added last, ran last at c=1 and c=32 of its three levels, after the longest idle gap, and
    was the slowest there twice.) Two runs, two steps: a b, then b a."""
    shift = -(-len(names) // max(steps, 1))
    return [(step, names[(step * shift + index) % len(names)]) for step in range(steps) for index in range(len(names))]


async def interleaved_sweeps(targets: dict[str, tuple], workload: BenchWorkload, levels: list[int],
                             requests_per_level: int, warmup: int, rates: list[float] = (),
                             seed: int = 0, repeats: int = 1) -> dict[str, dict]:
    """sweep() for several targets (run name -> (target, poller or None)) at once, a level at a time in
    interleaved_order; returns run name -> what sweep() returns for that target.
    repeats: each level this many times in a row (each time on every target, the order rotating on), its
    levels then listed once per repeat with "repeat": 0, 1, ... (itl_verdict takes medians over them)."""
    results, fresh = {}, {}
    for name, (target, _) in targets.items():
        results[name] = {"target": target.name, "warmup": await warm_up(target, workload, warmup), "levels": []}
        fresh[name] = Levels(warmup)  # each target its own count: the same prompts at the same step
    steps = [(kind, value, repeat) for kind, values in (("closed", levels), ("open", rates))
             for value in values for repeat in range(repeats)]
    for step, name in interleaved_order(list(targets), len(steps)):
        target, poller = targets[name]
        kind, value, repeat = steps[step]
        if kind == "closed":
            count = max(requests_per_level, value)  # every client gets at least one request
            level = await run_level(target, fresh[name].take(workload, count), value, poller, name)
        else:
            level = await run_open_level(target, fresh[name].take(workload, requests_per_level), value, seed,
                                         poller, name)
        if repeats > 1:
            level["repeat"] = repeat
        results[name]["levels"].append(level)
    return results


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
