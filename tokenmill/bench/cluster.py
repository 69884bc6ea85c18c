"""Cluster benchmark: the engine workload through the gateway over gRPC vs the in-process engine.

Same model, same requests, one run. Starts a real cluster (redis-server, worker, scheduler, gateway
as separate processes) and, in this process, the in-process engine; measures output tokens/s and
time to first token (TTFT) of both, under the full workload (all requests at once) and one request
at a time (sync mode). The full workload runs --rounds times on each path, back to back, the order
reversed every round, each round with its own prompts (the cluster's prefix cache outlives a round);
the ratio reported is the median round's. A command, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import replace

from gateway.text.tokenizer import TextTokenizer, load_tokenizer
from core.sampling import SamplingParams
from scheduler.options import SchedulerOptions
from scheduler.request import Request
from tokenmill.bench.runner import interleaved_order
from tokenmill.bench.workload import (add_json_argument, add_side_by_side_arguments, add_workload_arguments, make_workload, progress_log,
                                      text_prompts)
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_result(output_lens: list[int], elapsed: float, ttfts: list[float], outputs: list[list[int]]) -> dict:
    """One path's full-workload run, in the same shape for both paths."""
    return {"output_tokens_per_s": sum(output_lens) / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": percentile(ttfts, 0.5), "outputs": outputs}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (Linux /proc), and this process's as
    "client": during a cluster round the in-process engine is idle, so its share is the benchmark's
    32 gRPC streams."""
    seconds = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            seconds[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds["client"] = usage.ru_utime + usage.ru_stime
    return seconds


def run_in_process(llm: LLM, prompt_ids: list[list[int]], output_lens: list[int]) -> dict:
    engine = llm.new_engine(llm.config)
    requests = [Request(f"b{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for i, (ids, n) in enumerate(zip(prompt_ids, output_lens))]
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for output in engine.step():
            first_token.setdefault(output.request_id, time.perf_counter() - start)
    return load_result(output_lens, time.perf_counter() - start, list(first_token.values()),
                       [r.output_token_ids for r in requests])


def in_process_ttft(llm: LLM, ids: list[int]) -> float:
    engine = llm.new_engine(llm.config)
    engine.add_request(Request("s", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


async def stream_one(stub, prompt: str, max_tokens: int, start: float) -> tuple[float, list[int], int]:
    from protos.tokenmill.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(prompt=prompt, parameters=generation_pb2.GenerateParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, ids, forward_ns = None, [], 0
    async for message in stub.GenerateStream(request):
        if message.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        ids += message.token_ids
        forward_ns = message.timings.first_token_forward_ns or forward_ns
    return ttft, ids, forward_ns


async def cluster_load(stub, prompts: list[str], output_lens: list[int]) -> dict:
    """The whole workload at once through the gateway."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(stub, p, n, start) for p, n in zip(prompts, output_lens)))
    return load_result(output_lens, time.perf_counter() - start, [r[0] for r in results], [r[1] for r in results])


async def run_cluster(address: str, llm: LLM, workloads: list[list[str]], output_lens: list[int],
                      sync_prompts: list[str], warm_up_prompt: str, tokenizer: TextTokenizer,
                      pids: dict[str, int]) -> dict:
    """workloads: one prompt list per round, each its own texts: the cluster's scheduler keeps its prefix
    cache across rounds (the in-process side starts a new engine each time), so repeated prompts would
    be cache hits on one side only."""
    import grpc

    from protos.tokenmill.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await stream_one(stub, warm_up_prompt, 4, time.perf_counter())
        # Sync mode with short prompts (a short forward pass, so little noise around the overhead),
        # the two paths alternating request by request so drift on this shared machine lands on
        # both: the paired difference is what the gateway and the two gRPC hops add.
        local_ttfts, remote_ttfts, beyond_forward = [], [], []
        for prompt in sync_prompts:
            local_ttfts.append(in_process_ttft(llm, tokenizer.encode(prompt)))
            ttft, _, forward_ns = await stream_one(stub, prompt, 1, time.perf_counter())
            remote_ttfts.append(ttft)
            beyond_forward.append(ttft - forward_ns * 1e-9)  # all that is not the worker's own step
        # The full workload on both paths, back to back, the order alternating every round: this shared
        # machine's speed drifts by tens of percent over minutes (one process's decode step measured
        # 8-12.6 ms within a minute), so one run of each side would compare two moments, not two paths.
        pairs = [{} for _ in workloads]
        for index, side in interleaved_order(["local", "remote"], len(workloads)):
            prompts = workloads[index]
            if side == "local":
                pairs[index][side] = run_in_process(llm, [tokenizer.encode(p) for p in prompts], output_lens)
                continue
            # Where the cluster's CPU time goes: on 2 cores every second the gateway, scheduler, redis
            # and the client spend is a second the worker's two compute threads wait for a core.
            before = cpu_seconds(pids)
            pairs[index][side] = await cluster_load(stub, prompts, output_lens)
            after = cpu_seconds(pids)
            pairs[index][side]["cpu_s"] = {name: after[name] - before[name] for name in after if name in before}
    rounds = len(workloads)
    ratios = [pair["remote"]["output_tokens_per_s"] / pair["local"]["output_tokens_per_s"] for pair in pairs]
    median_pair = pairs[sorted(range(rounds), key=ratios.__getitem__)[rounds // 2]]
    local, remote = median_pair["local"], median_pair["remote"]
    local["sync_ttft_p50_s"] = statistics.median(local_ttfts)
    local["sync_added_ttft_ms"] = [(r - l) * 1e3 for l, r in zip(local_ttfts, remote_ttfts)]
    remote["sync_ttft_p50_s"] = statistics.median(remote_ttfts)
    remote["sync_ttft_beyond_worker_step_p50_ms"] = statistics.median(beyond_forward) * 1e3
    rounds_summary = [{"order": "in-process first" if next(iter(pair)) == "local" else "cluster first",
                       "in_process_tok_s": pair["local"]["output_tokens_per_s"],
                       "cluster_tok_s": pair["remote"]["output_tokens_per_s"], "ratio": ratio,
                       "cluster_elapsed_s": pair["remote"]["elapsed_s"], "cluster_cpu_s": pair["remote"]["cpu_s"]}
                      for index, (pair, ratio) in enumerate(zip(pairs, ratios))]
    return {"local": local, "remote": remote, "rounds": rounds_summary}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenmill bench-cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, num_requests=32, prompt_len=128, min_output=32, max_output=256)
    add_side_by_side_arguments(parser, rounds=3, kv_cache_mb=512)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="both sides plan step N+1 while the worker runs step N (default: the engine's and "
                             "serve's default, on; --no-async-scheduling: the synchronous loop on both sides)")
    parser.add_argument("--no-delta-stream", action="store_true",
                        help="the gateway gets each request's tokens on its own Submit call, not batched per step "
                             "on one StreamDeltas call (serve's --no-delta-stream)")
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.json)

    tokenizer = load_tokenizer(None)
    workloads = [text_prompts(tokenizer, args.num_requests, args.prompt_len, args.seed + 1000 * index)
                 for index in range(args.rounds)]
    output_lens = make_workload(tokenizer.vocab_size, args.num_requests, args.prompt_len, args.min_output,
                                args.max_output, args.seed).output_lens
    config = EngineConfig(worker=replace(ENGINE_WORKER, kv_cache_mb=args.kv_cache_mb),
                          scheduler=SchedulerOptions(max_num_seqs=max(64, args.num_requests), **(
                              {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling})))
    llm = LLM(config, progress=False)
    warm_up_prompt = text_prompts(tokenizer, 1, 16, args.seed + 999)[0]
    llm.generate([tokenizer.encode(warm_up_prompt)], SamplingParams(max_tokens=4, temperature=0.0))

    from tokenmill.cluster.config import LOCAL_GATEWAY, LOCAL_WORKER, ClusterConfig, resolve_ports
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    cluster_config = resolve_ports(ClusterConfig(
        gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        worker=replace(LOCAL_WORKER, kv_cache_mb=args.kv_cache_mb),
        scheduler=config.scheduler,  # the in-process side's, so both sides run the same loop
        gateway=replace(LOCAL_GATEWAY, delta_stream=not args.no_delta_stream)))
    with Supervisor(cluster_specs(cluster_config), echo=False) as supervisor:
        sync_prompts = text_prompts(tokenizer, 32, 8, args.seed + 1)
        pids = {name: pid for name in supervisor.children if (pid := supervisor.pid(name)) is not None}
        runs = asyncio.run(run_cluster(cluster_config.gateway_address, llm, workloads, output_lens, sync_prompts,
                                       warm_up_prompt, tokenizer, pids))
    log_rounds(runs, log)
    result = summarize_runs(args, runs)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, runs)
    return 0


def log_rounds(runs: dict, log) -> None:
    local, remote = runs["local"], runs["remote"]
    for index, row in enumerate(runs["rounds"]):
        log(f"round {index + 1} ({row['order']}): in-process {row['in_process_tok_s']:.1f} tok/s, "
            f"cluster {row['cluster_tok_s']:.1f} tok/s, ratio {row['ratio']:.3f}")
        cpu = row["cluster_cpu_s"]
        log(f"  cluster round's CPU seconds over {row['cluster_elapsed_s']:.1f} s wall: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])))
    log(f"median round: in-process {local['output_tokens_per_s']:.1f} tok/s, TTFT P50 {local['ttft_p50_s'] * 1e3:.0f} ms; "
        f"cluster {remote['output_tokens_per_s']:.1f} tok/s, TTFT P50 {remote['ttft_p50_s'] * 1e3:.0f} ms")


def summarize_runs(args: argparse.Namespace, runs: dict) -> dict:
    local, remote = runs["local"], runs["remote"]
    return {
        "async_scheduling": args.async_scheduling is not False,
        "delta_stream": not args.no_delta_stream,
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "output_lens": [args.min_output, args.max_output], "seed": args.seed},
        "in_process": {k: v for k, v in local.items() if k not in ("outputs", "sync_added_ttft_ms")},
        "cluster_grpc": {k: v for k, v in remote.items() if k != "outputs"},
        "throughput_ratio": remote["output_tokens_per_s"] / local["output_tokens_per_s"],  # the median round's
        "rounds": runs["rounds"],
        "added_ttft_p50_ms": (remote["ttft_p50_s"] - local["ttft_p50_s"]) * 1e3,
        "added_sync_ttft_p50_ms": (remote["sync_ttft_p50_s"] - local["sync_ttft_p50_s"]) * 1e3,
        "added_sync_ttft_paired_p50_ms": statistics.median(local["sync_added_ttft_ms"]),
        "identical_outputs": sum(a == b for a, b in zip(local["outputs"], remote["outputs"])) / args.num_requests,
    }


def print_table(result: dict, runs: dict) -> None:
    local, remote = runs["local"], runs["remote"]
    print(f"\n{'path':<26}{'output tok/s':>14}{'TTFT P50 (load)':>17}{'TTFT P50 (sync, 8 tok)':>24}")
    for name, row, sync in (("in-process engine", result["in_process"], local["sync_ttft_p50_s"]),
                            ("gateway -> scheduler -> worker", result["cluster_grpc"], remote["sync_ttft_p50_s"])):
        print(f"{name:<26}{row['output_tokens_per_s']:>14.1f}{row['ttft_p50_s'] * 1e3:>14.0f} ms"
              f"{sync * 1e3:>21.1f} ms")
    ratios = ", ".join(f"{row['ratio']:.3f}" for row in result["rounds"])
    print(f"\nthroughput cluster / in-process: {result['throughput_ratio']:.3f} (median of {ratios}); added TTFT P50: "
          f"{result['added_ttft_p50_ms']:.1f} ms under load, {result['added_sync_ttft_paired_p50_ms']:.1f} ms sync "
          f"(8-token prompts, median of 32 paired differences); client TTFT minus the worker's own "
          f"step time: {remote['sync_ttft_beyond_worker_step_p50_ms']:.1f} ms (P50); "
          f"identical greedy outputs: {result['identical_outputs']:.0%}")


if __name__ == "__main__":
    sys.exit(main())
