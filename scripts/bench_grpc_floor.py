"""What one streamed gRPC message costs grpcio's asyncio server by itself: the floor under the gateway's CPU per
output token (issue 33), which sends one GenerateStream message per token a stream gets in a step.

A bare grpc.aio server under uvloop (as the gateway runs) streams --messages small messages (40 bytes, a
token's GenerateStreamResponse is about that) on each of --concurrency server-streaming calls, all streams
writing once per --step-ms tick as the gateway does after each scheduler step, with nothing else in the
process: no protobuf, no detokenizing, no metrics. The client runs in this process, the server in a child;
the server's CPU time (utime + stime from /proc) over the run / messages is the figure.

    python scripts/bench_grpc_floor.py                       # 256 streams, 150 messages each
    python scripts/bench_grpc_floor.py --concurrency 64 --messages 300

Compare it with `tokenmill bench-stack`'s gateway µs/tok on the same machine: the difference is the gateway's
own work; this part only fewer messages (--stream-interval) or a cheaper transport can cut.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

SERVER = r"""
import asyncio, sys, grpc, uvloop
MESSAGES, STEP_S = int(sys.argv[1]), float(sys.argv[2])
MESSAGE = b"x" * 40


class Tick:  # every stream wakes on the same tick, as the gateway's do on one scheduler step
    def __init__(self):
        self.future = None

    def next(self):
        if self.future is None or self.future.done():
            self.future = asyncio.get_running_loop().create_future()
        return self.future


async def main():
    tick = Tick()

    async def stream(request, context):
        for _ in range(MESSAGES):
            await tick.next()
            await context.write(MESSAGE)

    async def ticker():
        while True:
            await asyncio.sleep(STEP_S)
            future, tick.future = tick.future, None
            if future is not None and not future.done():
                future.set_result(None)

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    task = asyncio.create_task(ticker())
    await server.wait_for_termination()
    task.cancel()

uvloop.run(main())
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def read_all(port: int, concurrency: int) -> int:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_stream("/floor.Floor/Stream")

        async def one() -> int:
            return sum([1 async for _ in method(b"")])

        return sum(await asyncio.gather(*(one() for _ in range(concurrency))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256, help="server-streaming calls at once")
    parser.add_argument("--messages", type=int, default=150, help="messages per call")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the tick every stream writes on")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(args.messages), str(args.step_ms / 1e3)],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        before, started = cpu_seconds(server.pid), time.perf_counter()
        received = asyncio.run(read_all(port, args.concurrency))
        cpu, wall = cpu_seconds(server.pid) - before, time.perf_counter() - started
    finally:
        server.kill()
        server.wait()
    print(f"{args.concurrency} streams x {args.messages} messages, a write per stream every {args.step_ms:g} ms: "
          f"{received} received in {wall:.1f} s; server CPU {cpu:.2f} s = {cpu / received * 1e6:.1f} µs per message "
          f"({cpu / wall:.2f} cores)")


if __name__ == "__main__":
    main()
