"""`tokenmill bench-stack`: the serving stack's own ceiling (issue 33). A command, not a test.

The near-free model (tokenmill.bench.near_free_model: 1 layer, hidden 64, the default tokenizer, made by
this command in a temp folder) runs in-process (tokenmill.llm, no RPC) and through a real local cluster
(redis-server, worker, scheduler, gateway as processes), at each --concurrency level c: c streams at once,
--prompt-len-token text prompts, --output-len tokens each, greedy, EOS ignored, through bench-cluster's
client (one gRPC channel, GenerateStream per request). Per level, the two paths back to back:

    tok/s            output tokens / wall time of the whole level, each path
    ratio            cluster tok/s / in-process tok/s (the same level's two runs)
    worker idle      1 - (worker's step time) / (the cluster run's wall time); the step time is the
                     growth of the worker's tokenmill:worker_step_seconds_sum (every kind) over the run,
                     read from its /metrics before and after
    µs/tok (cores)   per process (gateway, scheduler, worker, redis, and this client): its CPU time
                     (utime + stime in /proc/PID/stat) over the run / output tokens, and in brackets that
                     CPU time / wall time (1.00 = one core busy the whole run)
    Redis RT/step    the growth of the scheduler's Redis round-trip counter (tokenmill:redis_round_trips_total,
                     or any family of its /metrics named *redis*round_trip*) / its steps
                     (tokenmill:scheduler_steps_total, else the worker's step count); n/a where it exports none

The cluster is started once for every level (its prefix cache outlives a level, so every level has its
own prompts). The table is Markdown, to paste into docs/benchmarks.md.

    tokenmill bench-stack                                      c = 64, 256, 1024
    tokenmill bench-stack --concurrency 64,256 --json out.json the table, and the figures in out.json
    tokenmill bench-stack --json                               the figures alone, as JSON on stdout
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from datetime import date
from pathlib import Path

from tokenmill.bench.workload import parse_levels, progress_log, text_prompts

PROCESSES = ("gateway", "scheduler", "worker", "redis", "client")
STEP_SECONDS = "tokenmill:worker_step_seconds"
SCHEDULER_STEPS = "tokenmill:scheduler_steps_total"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenmill bench-stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=parse_levels, default=[64, 256, 1024],
                        help="concurrent streams, one level each (default: 64,256,1024)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="each path's KV cache (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="step budget of both paths (default: 512 or the highest level, whichever is larger, "
                             "so every running stream decodes each step)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="both paths' scheduler plans step N+1 while N runs (default: the scheduler's default)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the cluster's gateway: tokens per message after a stream's first (serve's "
                             "--stream-interval; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="write the figures as JSON to FILE and print the table; bare: JSON on stdout, no table")
    return parser.parse_args(argv)


# -- what each process did during a run --------------------------------------------------------------

def scrape(url: str | None) -> dict[str, float]:
    """Every sample of a Prometheus /metrics page, summed over labels, by sample name ({} when url is None)."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def redis_round_trip_sample(samples: dict[str, float]) -> str | None:
    """The scheduler's Redis round-trip counter, whatever its exact name (None when it exports none)."""
    names = sorted(name for name in samples if "redis" in name and "round_trip" in name
                   and not name.endswith("_created"))
    return next((name for name in names if name.endswith("_total")), names[0] if names else None)


class ClusterProbe:
    """Snapshots of the cluster's processes: CPU seconds and the worker's and scheduler's metrics."""

    def __init__(self, pids: dict[str, int], worker_metrics: str | None, scheduler_metrics: str | None) -> None:
        self.pids, self.worker_metrics, self.scheduler_metrics = pids, worker_metrics, scheduler_metrics

    def snapshot(self) -> dict:
        from tokenmill.bench.cluster import cpu_seconds

        return {"cpu_s": cpu_seconds(self.pids), "worker": scrape(self.worker_metrics),
                "scheduler": scrape(self.scheduler_metrics)}


def usage(before: dict, after: dict, elapsed_s: float, output_tokens: int) -> dict:
    """What the processes did between two snapshots, per output token and as a share of wall time."""
    cpu = {name: after["cpu_s"][name] - before["cpu_s"][name] for name in after["cpu_s"] if name in before["cpu_s"]}
    worker = {name: after["worker"].get(name, 0.0) - value for name, value in before["worker"].items()}
    busy_s, steps = worker.get(f"{STEP_SECONDS}_sum", 0.0), worker.get(f"{STEP_SECONDS}_count", 0.0)
    round_trips = redis_round_trip_sample(after["scheduler"])
    result = {
        "cpu_us_per_token": {name: seconds * 1e6 / output_tokens for name, seconds in cpu.items()},
        "cores": {name: seconds / elapsed_s for name, seconds in cpu.items()},
        "worker_busy_s": busy_s, "worker_steps": int(steps),
        "worker_idle_share": max(0.0, 1.0 - busy_s / elapsed_s) if steps else None,
        "redis_round_trips_per_step": None, "redis_round_trip_metric": round_trips,
    }
    # per scheduler step where it counts them (its steps are the worker's, one plan each), else per worker step
    scheduler_steps = (after["scheduler"].get(SCHEDULER_STEPS, 0.0) - before["scheduler"].get(SCHEDULER_STEPS, 0.0)
                       if SCHEDULER_STEPS in after["scheduler"] else steps)
    if round_trips is not None and scheduler_steps:
        trips = after["scheduler"][round_trips] - before["scheduler"].get(round_trips, 0.0)
        result["redis_round_trips_per_step"] = trips / scheduler_steps
    return result


# -- one level, both paths ----------------------------------------------------------------------------

async def cluster_level(address: str, prompts: list[str], output_lens: list[int], warm_up: str,
                        probe: ClusterProbe) -> dict:
    import grpc

    from protos.tokenmill.v1 import generation_pb2_grpc
    from tokenmill.bench.cluster import cluster_load, stream_one

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await stream_one(stub, warm_up, 4, time.perf_counter())  # the channel connected before the clock starts
        before = probe.snapshot()
        run = await cluster_load(stub, prompts, output_lens)
        after = probe.snapshot()
    return {**run, **usage(before, after, run["elapsed_s"], sum(output_lens))}


def run_level(llm, tokenizer, address: str, probe: ClusterProbe, concurrency: int, args: argparse.Namespace,
              log) -> dict:
    from tokenmill.bench.cluster import run_in_process

    # its own prompts per level: the cluster's prefix cache outlives a level, a new in-process engine does not
    prompts = text_prompts(tokenizer, concurrency, args.prompt_len, args.seed + 1000 * concurrency)
    output_lens = [args.output_len] * concurrency
    warm_up = text_prompts(tokenizer, 1, 8, args.seed + 999)[0]
    local = run_in_process(llm, [tokenizer.encode(p) for p in prompts], output_lens)
    log(f"c={concurrency}: in-process {local['output_tokens_per_s']:.0f} tok/s")
    remote = asyncio.run(cluster_level(address, prompts, output_lens, warm_up, probe))
    log(f"c={concurrency}: cluster {remote['output_tokens_per_s']:.0f} tok/s")
    identical = sum(a == b for a, b in zip(local.pop("outputs"), remote.pop("outputs"))) / concurrency
    return {"concurrency": concurrency, "output_tokens": sum(output_lens),
            "in_process_tok_s": local["output_tokens_per_s"], "cluster_tok_s": remote["output_tokens_per_s"],
            "ratio": remote["output_tokens_per_s"] / local["output_tokens_per_s"],
            "in_process": local, "cluster": remote, "identical_greedy_outputs": identical}


def run_levels(args: argparse.Namespace, model_dir: Path, log) -> list[dict]:
    from gateway.text.tokenizer import load_tokenizer
    from scheduler.options import SchedulerOptions
    from tokenmill.cluster.config import LOCAL_GATEWAY, LOCAL_WORKER, ClusterConfig, resolve_ports
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor
    from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

    budget = args.max_num_batched_tokens or max(512, *args.concurrency)
    scheduler = SchedulerOptions(max_num_seqs=max(args.concurrency), max_num_batched_tokens=budget)
    if args.async_scheduling is not None:
        scheduler = replace(scheduler, async_scheduling=args.async_scheduling)
    tokenizer = load_tokenizer(model_dir)
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(model_dir), kv_cache_mb=args.kv_cache_mb),
                           scheduler=scheduler), progress=False)
    cluster = resolve_ports(ClusterConfig(
        model=str(model_dir), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        max_num_batched_tokens=budget, worker=replace(LOCAL_WORKER, kv_cache_mb=args.kv_cache_mb),
        scheduler=scheduler, gateway=replace(LOCAL_GATEWAY, stream_interval=args.stream_interval),
        worker_metrics_port=0, scheduler_metrics_port=0, gateway_metrics_port=0))
    with Supervisor(cluster_specs(cluster), echo=False) as supervisor:
        pids = {name: pid for name in supervisor.children if (pid := supervisor.pid(name)) is not None}
        probe = ClusterProbe(pids, f"http://{cluster.host}:{cluster.worker_metrics_port}/metrics",
                             f"http://{cluster.host}:{cluster.scheduler_metrics_port}/metrics")
        return [run_level(llm, tokenizer, cluster.gateway_address, probe, concurrency, args, log)
                for concurrency in args.concurrency]


# -- the report -------------------------------------------------------------------------------------

def machine_facts() -> dict:
    """The date, the commit and the CPU (lscpu's model, cores and SIMD flags), for the doc's note."""
    from tokenmill.bench.peers import cpu_summary

    def output(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"date": date.today().isoformat(), "commit": output("git", "rev-parse", "--short", "HEAD") or "unknown",
            "cpu": cpu_summary(output("lscpu")), "cpus": os.cpu_count(), "in_process_heap": in_process_heap()}


def in_process_heap() -> str:
    """The in-process engine runs in this process, whose glibc thread cache was set at its start: the worker's
    is off (worker.host_heap), and with it on, steps that free several large tensors (c=1,024 here: 192 MiB of
    logits) take fresh pages again (docs/benchmarks.md: 2,790 vs 4,605 tok/s in-process)."""
    from worker.host_heap import THREAD_CACHE_OFF, thread_cache_off

    if thread_cache_off():
        return "as the worker's (glibc thread cache off)"
    return f"glibc thread cache on, unlike the worker's: for the same heap start with GLIBC_TUNABLES={THREAD_CACHE_OFF}"


def _cell(row: dict, name: str) -> str:
    cluster = row["cluster"]
    if name not in cluster["cpu_us_per_token"]:
        return "-"
    return f"{cluster['cpu_us_per_token'][name]:.0f} ({cluster['cores'][name]:.2f})"


def table(rows: list[dict]) -> list[str]:
    header = ["c", "in-process tok/s", "cluster tok/s", "cluster / in-process", "worker idle",
              *(f"{name} µs/tok (cores)" for name in PROCESSES), "Redis RT/step"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---:" for _ in header) + " |"]
    for row in rows:
        cluster = row["cluster"]
        idle, trips = cluster["worker_idle_share"], cluster["redis_round_trips_per_step"]
        cells = [str(row["concurrency"]), f"{row['in_process_tok_s']:.0f}", f"{row['cluster_tok_s']:.0f}",
                 f"{row['ratio']:.2f}", "n/a" if idle is None else f"{idle:.0%}",
                 *(_cell(row, name) for name in PROCESSES), "n/a" if trips is None else f"{trips:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(result: dict) -> str:
    facts, rows = result["machine"], result["levels"]
    steps = ", ".join(f"c={row['concurrency']}: {row['cluster']['worker_steps']} steps, "
                      f"{row['cluster']['worker_busy_s'] / max(1, row['cluster']['worker_steps']) * 1e3:.1f} ms each"
                      for row in rows)
    return "\n".join([
        f"`{result['command']}` on {facts['date']}, commit {facts['commit']}, {facts['cpus']} CPUs: {facts['cpu']}",
        f"workload: c streams at once, {result['workload']['prompt_len']}-token prompts, "
        f"{result['workload']['output_len']} output tokens, greedy, EOS ignored; step budget "
        f"{result['workload']['max_num_batched_tokens']} tokens; worker steps in the cluster runs: {steps}",
        f"in-process engine's heap: {facts.get('in_process_heap', 'not recorded')}",
        "", *table(rows)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    to_stdout = args.json == "-"
    log = progress_log(to_stdout)
    facts = machine_facts()  # before the runs: the commit measured, should another land meanwhile
    with tempfile.TemporaryDirectory(prefix="tokenmill-near-free-") as folder:
        from tokenmill.bench.near_free_model import write_near_free_model

        rows = run_levels(args, write_near_free_model(Path(folder) / "model", args.seed), log)
    result = {"command": "tokenmill bench-stack" + "".join(f" {arg}" for arg in argv),
              "machine": facts, "levels": rows,
              "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                           "max_num_batched_tokens": args.max_num_batched_tokens or max(512, *args.concurrency)}}
    if to_stdout:
        print(json.dumps(result))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("\n" + report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
