"""A stand-in child for supervisor tests (not a stand-in for worker/scheduler/gateway): a gRPC server
with grpc.health.v1 whose readiness flips after a delay, or a process that fails on cue.

    python standin_child.py --port P --service S [--ready-after 0.3] [--exit-after 0.3 --exit-code 3]
                            [--exit-when FILE] [--ignore-sigterm] [--say LINE ...]

It prints "started <unix time>" at once and "ready <unix time>" when readiness turns SERVING, so a
test can check that one child started only after another was ready.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float)
    parser.add_argument("--exit-when", help="exit (with --exit-code) once this file exists")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--say", action="append", default=[])
    args = parser.parse_args()

    print(f"started {time.time():.6f}", flush=True)
    for line in args.say:
        print(line, flush=True)
    stopping = threading.Event()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
    else:
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(args.service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()

    started = time.monotonic()
    ready = False
    while not stopping.is_set():
        elapsed = time.monotonic() - started
        if (args.exit_after is not None and elapsed >= args.exit_after) or \
                (args.exit_when is not None and os.path.exists(args.exit_when)):
            print(f"giving up with code {args.exit_code}", file=sys.stderr, flush=True)
            return args.exit_code
        if not ready and elapsed >= args.ready_after:
            servicer.set(args.service, health_pb2.HealthCheckResponse.SERVING)
            print(f"ready {time.time():.6f}", flush=True)
            ready = True
        stopping.wait(0.02)
    print("got SIGTERM, stopping", flush=True)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
