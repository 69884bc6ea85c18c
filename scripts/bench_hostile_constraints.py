"""Fairness under hostile constraints (issue 31, item 2): does one client's heavy grammar slow anybody else?

    .venv/bin/python scripts/bench_hostile_constraints.py [--heavy 10] [--tokens 96] [--repeats 2]

Starts the default cluster (SmolLM2-135M), then, alternating, `--repeats` times each:
- unloaded: one normal greedy stream of --tokens tokens over gRPC GenerateStream;
- loaded: the same stream while --heavy distinct heavy constraints are in flight: GBNF grammars of
  ~100 kB (1,500 chained rules, the pure-Python converter's slow case) and 1,998-rule Lark grammars
  that crash the compiler (under the rule limit), each one new, sent over the OpenAI HTTP API as fast
  as they are answered;
and throughout both, a Tokenize call every 50 ms (the heavy clients run in a process of their own at nice
19, standing in for clients on other machines, so their Python work does not delay the probe). Prints the stream's tok/s and largest inter-token gap,
the Tokenize latencies (P50 / P99 / max) and the loaded/unloaded tok/s ratio. Targets: ratio >= 0.8,
no gap over 0.5 s, Tokenize under 50 ms. A benchmark, not a test: the figures go in docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import grpc

from core.percentile import percentile
from protos.tokenmill.v1 import generation_pb2 as g
from protos.tokenmill.v1 import generation_pb2_grpc
from tokenmill.cluster.config import LOCAL_WORKER, ClusterConfig, resolve_ports
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor


def heavy_grammar(index: int, nonce: int) -> str:
    """A grammar no earlier request sent (the nonce), so no cached verdict helps: every one compiles."""
    if index % 2 == 0:  # GBNF, ~100 kB: seconds of pure-Python conversion
        rules = "".join(f'g{nonce}r{i} ::= "x{i}" g{nonce}r{i + 1} | "y"\n' for i in range(1500))
        return f"root ::= g{nonce}r0\n{rules}g{nonce}r1500 ::= \"end{index}\"\n"
    # under the rule limit but deep enough to crash the compiler: each one costs a helper its life
    rules = "".join(f'r{i}: ("x{nonce}_{i}" ((r{i + 1})))\n' for i in range(1998))
    return f"start: r0\n{rules}r1998: \"end\"\n"


def stream_once(stub, num_tokens: int) -> tuple[float, float]:
    """(tok/s, largest gap in s) of one greedy stream, timed from its first token."""
    request = g.GenerateRequest(prompt="Write a long story about a lighthouse keeper.",
                                parameters=g.GenerateParameters(max_tokens=num_tokens, temperature=0.0,
                                                                ignore_eos=True))
    stamps = []
    for message in stub.GenerateStream(request, timeout=600):
        now = time.monotonic()
        stamps.extend([now] * len(message.token_ids))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), max(gaps)


def hammer(http_address: str, num_heavy: int, stop: threading.Event, answers: list) -> None:
    """num_heavy clients, each sending a new heavy constraint as soon as the last was answered, until stop."""
    def send(index: int) -> None:
        nonce = (os.getpid() * 100 + index) * 1_000_000  # new grammars in every run: no cached verdict helps
        while not stop.is_set():
            nonce += 1
            body = json.dumps({"prompt": "hi", "max_tokens": 4, "guided_grammar": heavy_grammar(index, nonce)}).encode()
            request = urllib.request.Request(f"http://{http_address}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    answers.append(response.status)
            except urllib.error.HTTPError as error:
                answers.append(error.code)
    threads = [threading.Thread(target=send, args=(index,), daemon=True) for index in range(num_heavy)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def hammer_process(http_address: str, num_heavy: int) -> subprocess.Popen:
    """The heavy clients in a process of their own: their grammar building and JSON encoding would
    otherwise hold this process's GIL and show up as the probe's Tokenize latency. It runs until its
    stdin closes, then prints its answers' status counts as one JSON line."""
    return subprocess.Popen([sys.executable, __file__, "--hammer", http_address, "--heavy", str(num_heavy)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run_hammer(http_address: str, num_heavy: int) -> None:
    # hostile clients sit on other machines: here their own CPU (building 100 kB grammars in a loop) runs
    # at the lowest priority, so what the probe sees is the cluster's doing, not the load generator's
    os.nice(19)
    stop, answers = threading.Event(), []
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    hammer(http_address, num_heavy, stop, answers)
    print(json.dumps({code: answers.count(code) for code in sorted(set(answers))}), flush=True)


def tokenize_probe(stub, stop: threading.Event, latencies: list) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            start = time.monotonic()
            stub.Tokenize(g.TokenizeRequest(text="How long does this take?"), timeout=60)
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure(config: ClusterConfig, stub, num_heavy: int, num_tokens: int) -> dict:
    stop, latencies = threading.Event(), []
    probe = tokenize_probe(stub, stop, latencies)
    heavy = hammer_process(config.http_address, num_heavy) if num_heavy else None
    time.sleep(2.0 if num_heavy else 0.0)  # the heavy requests in flight first
    tok_s, gap = stream_once(stub, num_tokens)
    stop.set()
    probe.join()
    answers = json.loads(heavy.communicate("", timeout=300)[0]) if heavy else {}
    return {"tok_s": tok_s, "max_gap_s": gap, "tokenize_p50_ms": 1000 * percentile(latencies, 50),
            "tokenize_p99_ms": 1000 * percentile(latencies, 99), "tokenize_max_ms": 1000 * max(latencies),
            "heavy_answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hammer", metavar="HTTP_ADDRESS", help=argparse.SUPPRESS)  # the heavy clients' process
    args = parser.parse_args()
    if args.hammer:
        return run_hammer(args.hammer, args.heavy)
    config = resolve_ports(ClusterConfig(gateway_port=0, http_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, worker=replace(LOCAL_WORKER, kv_cache_mb=64)))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300) as supervisor:
        gateway_pid = supervisor.children["gateway"].pid
        with grpc.insecure_channel(config.gateway_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stream_once(stub, 8)  # warm-up
            runs = {"unloaded": [], "loaded": []}
            for _ in range(args.repeats):
                runs["unloaded"].append(measure(config, stub, 0, args.tokens))
                runs["loaded"].append(measure(config, stub, args.heavy, args.tokens))
        for name, results in runs.items():
            for result in results:
                print(f"{name:9s} {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()})}")
        ratio = statistics.median(r["tok_s"] for r in runs["loaded"]) / statistics.median(
            r["tok_s"] for r in runs["unloaded"])
        print(f"loaded / unloaded tok/s (medians): {ratio:.2f}; largest loaded gap "
              f"{max(r['max_gap_s'] for r in runs['loaded']):.3f} s; Tokenize max "
              f"{max(r['tokenize_max_ms'] for r in runs['loaded']):.1f} ms; gateway pid unchanged: "
              f"{supervisor.children['gateway'].pid == gateway_pid}")


if __name__ == "__main__":
    main()
