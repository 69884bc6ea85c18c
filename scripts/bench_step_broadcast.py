"""What a tensor-parallel group pays to give every rank the step, the two ways issue 37 names (docs/benchmarks.md).

    rank 0 broadcasts (built: worker.parallel.step_mirror): the scheduler sends the plan to rank 0 only; rank 0
        sends the packed StepBatch to the other ranks over the gloo command group, on its critical path,
        before its own forward
    every rank receives (not built): the scheduler sends the plan to every rank, each a gRPC call; each rank
        then does the plan-to-batch bookkeeping itself (rank 0 does it today), in parallel

Measured here, per step, at decode batches of 1 to 1,024 rows (each request 512 tokens of context in 16-token
pages), medians over many sends:

- broadcast: rank 0's `StepChannel.send("forward", batch)` (one gloo broadcast of int64 words,
  worker.parallel.commands) to 1 and 3 followers (2 and 4 ranks, spawned processes on this machine), beside
  broadcast_object_list of the same command (what the channel did before: a size, then a pickle), and the sizes;
- fan-out: a unary gRPC call carrying the same bytes to 1, 2 and 4 local servers at once (the transport the
  scheduler would add per extra rank; a real plan proto is smaller than the pickle, so this is an upper bound).

    .venv/bin/python scripts/bench_step_broadcast.py [--rows 1,64,256,1024] [--sends 200]
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from worker.parallel.commands import encode  # noqa: E402
from worker.step_batch import RequestSpan, StepBatch  # noqa: E402

CONTEXT, PAGE = 512, 16
METHOD = "/bench.Step/Run"


def decode_batch(rows: int, step_id: int = 1) -> StepBatch:
    pages = CONTEXT // PAGE
    batch = StepBatch(step_id)
    for row in range(rows):
        batch.input_ids.append(1000 + row)
        batch.positions.append(CONTEXT - 1)
        batch.spans.append(RequestSpan(row, 1, CONTEXT, list(range(row * pages, (row + 1) * pages))))
        batch.sample_rows.append(row)
    return batch


def _rank(rank: int, world: int, init: str, rows_list: list[int], sends: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    from worker.parallel.group import join_group, leave_group
    from worker.parallel.step_mirror import StepChannel

    import torch.distributed as dist

    group = join_group(rank, world, init, timeout_s=60)
    channel = StepChannel(group)
    objects = dist.new_group(backend="gloo")
    results = {}
    for rows in rows_list:
        batch = decode_batch(rows)
        for way in ("channel", "object list"):  # alternated per row count: load drift hits both alike
            times = []
            for _ in range(sends):
                start = time.perf_counter()
                if way == "channel":
                    channel.send("forward", batch) if rank == 0 else channel.receive()
                else:  # what StepChannel did before: broadcast_object_list (a size, then a pickle)
                    dist.broadcast_object_list([("forward", batch) if rank == 0 else None], src=0, group=objects)
                times.append(time.perf_counter() - start)
            results[way, rows] = statistics.median(times)
    if rank == 0:
        out.put(results)
    leave_group(group)


def broadcast_us(world: int, rows_list: list[int], sends: int) -> dict[int, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{folder}/store"
        ranks = [context.Process(target=_rank, args=(r, world, init, rows_list, sends, queue)) for r in range(world)]
        for process in ranks:
            process.start()
        results = queue.get(timeout=600)
        for process in ranks:
            process.join(60)
    return {key: seconds * 1e6 for key, seconds in results.items()}


def _serve(port_queue) -> None:
    handler = grpc.method_handlers_generic_handler("bench.Step", {
        "Run": grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")})
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 1 << 30)])
    server.add_generic_rpc_handlers((handler,))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def fan_out_us(servers: int, payloads: dict[int, bytes], sends: int) -> dict[int, float]:
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    processes = [context.Process(target=_serve, args=(ports,), daemon=True) for _ in range(servers)]
    for process in processes:
        process.start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}",
                                      options=[("grpc.max_send_message_length", 1 << 30)]) for _ in range(servers)]
    calls = [channel.unary_unary(METHOD) for channel in channels]
    results = {}
    try:
        for rows, payload in payloads.items():
            times = []
            for _ in range(sends):
                start = time.perf_counter()
                pending = [call.future(payload) for call in calls]  # at once, as the scheduler would
                for future in pending:
                    future.result()
                times.append(time.perf_counter() - start)
            results[rows] = statistics.median(times) * 1e6
    finally:
        for channel in channels:
            channel.close()
        for process in processes:
            process.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,64,256,1024", help="decode rows a step (comma-separated)")
    parser.add_argument("--sends", type=int, default=200, help="sends per figure (the median is printed)")
    args = parser.parse_args()
    rows_list = [int(value) for value in args.rows.split(",")]
    payloads = {rows: pickle.dumps(("forward", decode_batch(rows))) for rows in rows_list}
    table = {"pickled batch (KiB)": {rows: len(payload) / 1024 for rows, payload in payloads.items()}}
    table["StepChannel words (KiB)"] = {rows: encode(("forward", decode_batch(rows))).nbytes / 1024 for rows in rows_list}
    for world in (2, 4):
        figures = broadcast_us(world, rows_list, args.sends)
        for way in ("channel", "object list"):
            name = "StepChannel.send" if way == "channel" else "broadcast_object_list (before)"
            table[f"{name} to {world - 1} follower(s) (us)"] = {rows: figures[way, rows] for rows in rows_list}
    for servers in (1, 2, 4):
        table[f"gRPC fan-out to {servers} rank(s) (us)"] = fan_out_us(servers, payloads, args.sends)
    print("| per step | " + " | ".join(f"{rows} rows" for rows in rows_list) + " |")
    print("| --- |" + " --- |" * len(rows_list))
    for name, values in table.items():
        print(f"| {name} | " + " | ".join(f"{values[rows]:,.1f}" for rows in rows_list) + " |")


if __name__ == "__main__":
    main()
