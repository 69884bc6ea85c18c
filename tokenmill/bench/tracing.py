"""Tracing overhead: the same workload through two clusters, tracing off and tracing every request.

One run starts two real clusters on the same model: one with nothing configured (tracing off), one
with OTEL_TRACES_SAMPLER=always_on exporting OTLP/gRPC to a sink in this process (every request and
every step traced and exported). It then alternates the workload between them, round after round
(which goes first alternates too), so the drift of a shared machine lands on both, and reports the
median output tokens/s of each and their ratio, and the CPU seconds each process spent per run.
With --concurrent each round runs both at the same moment instead, so both see the same machine.
A command, not a test.

    tokenmill bench-tracing [--rounds 5] [--num-requests 16] [--prompt-len 64] [--output-len 64] [--concurrent]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from concurrent import futures
from dataclasses import replace

import grpc

from gateway.text.tokenizer import load_tokenizer
from tokenmill.bench.cluster import stream_one
from tokenmill.bench.workload import add_json_argument, add_side_by_side_arguments, progress_log, text_prompts


PROCESSES = ("gateway", "scheduler", "worker")


class SpanSink:
    """An OTLP/gRPC trace endpoint that counts what it is sent (and drops it)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self
        self.num_spans = 0
        self._lock = threading.Lock()

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                count = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
                with sink._lock:
                    sink.num_spans += count
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self._server)
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc), all its threads."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_workload(address: str, prompts: list[str], output_len: int) -> float:
    """All requests at once; output tokens/s."""
    from protos.tokenmill.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(stub, prompt, output_len, start) for prompt in prompts))
        elapsed = time.perf_counter() - start
    assert all(len(ids) == output_len for _, ids, _ in results), "a request came back short"
    return len(prompts) * output_len / elapsed


async def run_together(addresses: dict[str, str], prompts: list[str], output_len: int) -> dict[str, float]:
    """The workload against each address at the same time; output tokens/s of each."""
    speeds = await asyncio.gather(*(run_workload(address, prompts, output_len) for address in addresses.values()))
    return dict(zip(addresses, speeds))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenmill bench-tracing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    add_side_by_side_arguments(parser, rounds=5, kv_cache_mb=256)
    parser.add_argument("--concurrent", action="store_true",
                        help="each round runs both clusters' workloads at the same time (same machine "
                             "conditions for both; each gets about half the CPU) instead of one after the other")
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.json)

    from scheduler.options import SchedulerOptions
    from tokenmill.cluster.config import LOCAL_WORKER, ClusterConfig, resolve_ports

    tokenizer = load_tokenizer(args.model)
    prompts = text_prompts(tokenizer, args.num_requests, args.prompt_len, args.seed)
    sink = SpanSink()
    traced_env = (("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint), ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
                  ("OTEL_TRACES_SAMPLER", "always_on"))

    def cluster(env) -> ClusterConfig:
        return resolve_ports(ClusterConfig(model=args.model, gateway_port=0, scheduler_port=0, worker_port=0,
                                           redis_port=0, worker=replace(LOCAL_WORKER, kv_cache_mb=args.kv_cache_mb),
                                           scheduler=SchedulerOptions(max_num_seqs=max(64, args.num_requests)),
                                           child_env=env))

    configs = {"off": cluster(()), "on": cluster(traced_env)}
    try:
        results, cpu = run_rounds(args, configs, prompts, log)
    finally:
        sink.stop()
    result = summarize(args, results, cpu, sink.num_spans)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result, args.rounds)
    return 0


def run_rounds(args: argparse.Namespace, configs: dict, prompts: list[str], log):
    """Output tokens/s of each cluster per round, and the CPU seconds of each of its processes per run."""
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    results: dict[str, list[float]] = {"off": [], "on": []}
    # CPU seconds per process per run: on a machine shared with others, the CPU a run costs is a
    # steadier measure of overhead than its wall time
    cpu: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PROCESSES} for name in configs}
    with Supervisor(cluster_specs(configs["off"]), echo=False) as off, \
            Supervisor(cluster_specs(configs["on"]), echo=False) as on:
        supervisors = {"off": off, "on": on}
        for name, config in configs.items():  # warm-up, not timed
            asyncio.run(run_workload(config.gateway_address, prompts[:2], 4))
        for round_index in range(args.rounds):
            order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
            for group in [order] if args.concurrent else [(name,) for name in order]:
                pids = {(name, p): supervisors[name].pid(p) for name in group for p in PROCESSES}
                cpu_before = {key: cpu_seconds(pid) for key, pid in pids.items()}
                speeds = asyncio.run(run_together({name: configs[name].gateway_address for name in group},
                                                  prompts, args.output_len))
                time.sleep(0.5)  # let the run's last span exports and state writes finish
                for (name, p), pid in pids.items():
                    cpu[name][p].append(cpu_seconds(pid) - cpu_before[name, p])
                for name, tokens_per_s in speeds.items():
                    results[name].append(tokens_per_s)
                    log(f"round {round_index + 1}: tracing {name:<3} {tokens_per_s:7.1f} output tok/s, CPU s "
                        + " ".join(f"{p} {cpu[name][p][-1]:.2f}" for p in PROCESSES))
        time.sleep(1.0)  # the last batch of spans reaches the sink
    return results, cpu


def summarize(args: argparse.Namespace, results: dict[str, list[float]], cpu: dict[str, dict[str, list[float]]],
              num_spans: int) -> dict:
    cpu_medians = {name: {p: statistics.median(values) for p, values in per.items()} for name, per in cpu.items()}
    cpu_total = {name: sum(per.values()) for name, per in cpu_medians.items()}
    median_off, median_on = statistics.median(results["off"]), statistics.median(results["on"])
    paired = [on / off for off, on in zip(results["off"], results["on"])]
    return {
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "rounds": args.rounds, "model": args.model or "default",
                     "concurrent": args.concurrent},
        "tokens_per_s_off": results["off"], "tokens_per_s_on": results["on"],
        "median_off": median_off, "median_on": median_on,
        "throughput_ratio_on_over_off": median_on / median_off,
        "paired_ratio_median": statistics.median(paired),
        "spans_exported": num_spans,
        "cpu_s_median_per_run": cpu_medians,
        "cpu_ratio_on_over_off": cpu_total["on"] / cpu_total["off"],
    }


def print_report(result: dict, rounds: int) -> None:
    cpu_medians = result["cpu_s_median_per_run"]
    print(f"\ntracing off: {result['median_off']:.1f} output tok/s (median of {rounds})")
    print(f"tracing on (always_on, OTLP export): {result['median_on']:.1f} output tok/s (median of {rounds}); "
          f"{result['spans_exported']} spans exported")
    print(f"throughput on / off: {result['throughput_ratio_on_over_off']:.3f} (medians), "
          f"{result['paired_ratio_median']:.3f} (median of the {rounds} paired rounds)")
    for name in ("off", "on"):
        print(f"CPU seconds per run, tracing {name:<3}: " + ", ".join(
            f"{p} {cpu_medians[name][p]:.2f}" for p in PROCESSES) + f"; total {sum(cpu_medians[name].values()):.2f}")
    print(f"CPU on / off: {result['cpu_ratio_on_over_off']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
