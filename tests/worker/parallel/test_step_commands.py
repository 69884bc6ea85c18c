"""Rank 0's commands to its group (worker.parallel.commands, worker.parallel.step_mirror.StepChannel): every field of
a step survives the int64 encoding, and over a real gloo group a command longer than the channel's message
arrives whole, then both sides grow the message alike (the commands after it still arrive)."""
from __future__ import annotations

import multiprocessing

import torch

from worker.parallel.commands import decode, encode
from worker.step_batch import RequestSpan, StepBatch


def a_step(rows: int = 3, pages: int = 4) -> StepBatch:
    return StepBatch(
        step_id=7, input_ids=[5, -1, 9] * (rows // 3) + [4] * (rows % 3), positions=list(range(rows)),
        spans=[RequestSpan(row, 1, 40 + row, list(range(row * pages, (row + 1) * pages))) for row in range(rows)],
        sample_rows=list(range(rows)), prompt_logprob_rows=[0], verify_rows=[1, 2][: min(2, rows)],
        placeholder_rows=[1], placeholder_sources=[(6, 0)])


def test_every_command_survives_the_encoding():
    commands = [("runner", 128, 16), ("swap", [(1, 2), (3, 4)], []), ("swap", [], [(5, 0)]), ("forward", a_step()),
                ("forward", StepBatch(3)), ("forward", StepBatch(3 << 33, placeholder_sources=[((3 << 33) - 1, 4), (-1, -1)])),
        ("stop",)]
    for command in commands:
        assert decode(encode(command)) == command
    assert encode(("forward", a_step())).dtype == torch.int32


def _rank(rank: int, init: str, commands: list, out) -> None:
    from worker.parallel.group import join_group, leave_group
    from worker.parallel.step_mirror import StepChannel

    group = join_group(rank, 2, init, timeout_s=60)
    channel = StepChannel(group)
    received = []
    for command in commands:
        if rank == 0:
            channel.send(*command)
        else:
            received.append(channel.receive())
    if rank == 1:
        out.put(received)
    leave_group(group)


def test_a_long_command_arrives_whole_and_the_channel_keeps_working(tmp_path):
    long_step = a_step(rows=300, pages=32)  # ~11k words: past the 8,192-word message
    commands = [("runner", 8, 0), ("forward", long_step), ("forward", a_step()), ("forward", long_step), ("stop",)]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, f"file://{tmp_path}/store", commands, queue)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    received = queue.get(timeout=120)
    for process in ranks:
        process.join(60)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert received == commands
