"""Rank 0 drives the other ranks of its group: what changes their KV pages, sent before rank 0 does it.

The scheduler talks to rank 0 only (one logical worker, its page accounting unchanged). Rank 0's runner
keeps every request's state and samples; the other ranks only hold their share of the weights and of each
KV page, so they need three things, each a command rank 0 broadcasts right before it acts on it:

    ("runner", num_blocks, num_host_blocks)   a runner over that many pages (rank 0 sized them; its
                                              activation probe's throw-away runner is mirrored too)
    ("swap", swap_out, swap_in)                a step's page copies to and from the host tier
    ("forward", batch)                         a step's packed batch (placeholder rows already filled): every
                                              rank runs the same forward, whose all-reduces and logits
                                              all-gather meet rank 0's; the followers drop the logits
    ("stop",)                                  rank 0 is shutting down

Commands travel on a group of their own (gloo, CPU objects even beside NCCL), whose wait has no practical
limit: an idle server sends nothing. A dead rank is seen by the processes around it, not by this channel:
rank 0 watches the ranks it started (worker.parallel.ranks), a follower watches its parent, and a
multi-node group is recreated whole by its LeaderWorkerSet.

Why this and not every rank receiving the plan from the scheduler: it needs no change to the scheduler or to
its gRPC link, and a follower does no request bookkeeping or sampling. The cost is one broadcast of the
batch per step (worker.parallel.commands: int32 words, 39 KiB at 256 rows of 512 tokens' context) on the
leader's critical path: one gloo broadcast of a fixed message, two for a longer command (docs/benchmarks.md:
scripts/bench_step_broadcast.py).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from worker.parallel.commands import decode, encode
from worker.parallel.group import TensorParallelGroup
from worker.step_batch import StepBatch

log = logging.getLogger(__name__)
COMMAND_WAIT = timedelta(days=365)
MESSAGE_WORDS = 8192  # a step of ~220 decode rows at 512 tokens of context in 16-token pages
GROUP_LOST_EXIT = 70  # EX_SOFTWARE: rank 0 ended itself because its group broke  # a follower waits for the next step as long as the server idles


class StepChannel:
    """Commands from rank 0 to the others of a group of two or more ranks. Every rank must create it, in the same
    order as other groups."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.rank = group.rank
        self._group = dist.new_group(backend="gloo", timeout=COMMAND_WAIT)
        # one broadcast a command where broadcast_object_list makes two (its size, then its pickle): a message of
        # this many int32 words holds the length and the command (worker.parallel.commands); a longer command sends
        # its rest in a second one, and both sides then grow the message to hold the next like it
        self._message = torch.zeros(MESSAGE_WORDS, dtype=torch.int32)

    def send(self, *command) -> None:
        words = encode(command)
        message, first = self._message, min(words.numel(), self._message.numel() - 1)
        message[0] = words.numel()
        message[1 : 1 + first] = words[:first]
        dist.broadcast(message, src=0, group=self._group)
        if first < words.numel():
            dist.broadcast(words[first:].contiguous(), src=0, group=self._group)
            self._grow(words.numel())

    def receive(self) -> tuple:
        message = self._message
        dist.broadcast(message, src=0, group=self._group)
        length = int(message[0])
        words = message[1 : 1 + length]
        if words.numel() < length:
            rest = torch.empty(length - words.numel(), dtype=torch.int32)
            dist.broadcast(rest, src=0, group=self._group)
            words = torch.cat((words, rest))
            self._grow(length)
        return decode(words)

    def _grow(self, length: int) -> None:
        self._message = torch.zeros(1 << length.bit_length(), dtype=torch.int32)

    def agree(self, settings: dict[str, object]) -> None:
        """Raises ValueError on every rank when a rank's settings (model, dtype, ...) differ from rank 0's: ranks
        started with other flags would split or page the model differently and compute garbage together."""
        everyone: list[dict | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(everyone, settings, group=self._group)
        for rank, theirs in enumerate(everyone[1:], start=1):
            for name, value in everyone[0].items():
                if theirs.get(name) != value:
                    raise ValueError(f"tensor parallel: rank {rank} was started with {name}={theirs.get(name)!r}, "
                                     f"rank 0 with {name}={value!r}; every rank needs the same flags but its rank")



class LeaderPath:
    """Rank 0's ExecutionPath: each forward first sends its batch to the other ranks."""

    def __init__(self, inner, channel: StepChannel) -> None:
        self.inner = inner
        self.channel = channel

    def __getattr__(self, name: str):  # everything else is the wrapped path's (model, kv_cache, ...)
        return getattr(self.inner, name)

    def prepare(self, batch: StepBatch):
        return self.inner.prepare(batch)

    def forward(self, batch: StepBatch, inputs) -> torch.Tensor:
        try:
            self.channel.send("forward", batch)
            return self.inner.forward(batch, inputs)
        except Exception as error:  # noqa: BLE001 - see leave_broken_group
            leave_broken_group(error)

    def sample(self, batch, logits, rows, token_bitmask=None):
        return self.inner.sample(batch, logits, rows, token_bitmask)

    def warm_up(self) -> None:
        self.inner.warm_up()


class LeaderSwapSpace:
    """Rank 0's host tier: each step's page copies go to the other ranks first."""

    def __init__(self, inner, channel: StepChannel) -> None:
        self.inner = inner
        self.channel = channel

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def copy(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        if swap_out or swap_in:
            try:
                self.channel.send("swap", list(swap_out), list(swap_in))
            except Exception as error:  # noqa: BLE001 - see leave_broken_group
                leave_broken_group(error)
        self.inner.copy(swap_out, swap_in)


def leave_broken_group(error: Exception) -> None:
    """A step that failed on rank 0 leaves the group unusable: another rank may still sit in a collective this
    one will never join, or be gone (gloo: "Connection closed by peer"). Answering the scheduler with a failed
    step would only fail the next one too; ending rank 0 is a worker loss instead, which the scheduler
    recovers from (its running requests re-admitted, nothing lost) once the supervisor has restarted the
    whole group."""
    log.critical("tensor parallel: a step failed on rank 0 (%r); ending rank 0 so the group restarts as a unit",
                 error)
    logging.shutdown()
    os._exit(GROUP_LOST_EXIT)


def follow(channel: StepChannel, build_runner: Callable[[int, int], object]) -> None:
    """A follower's life: build the runners rank 0 builds, run the forwards it runs, until it stops."""
    runner = None
    while True:
        command = channel.receive()
        kind = command[0]
        if kind == "runner":
            runner = None  # the probe's pages go before the real cache is allocated
            runner = build_runner(command[1], command[2])
        elif kind == "swap":
            runner.swap_space.copy(command[1], command[2])
        elif kind == "forward":
            batch = command[1]
            with torch.inference_mode():
                runner.execution_path.forward(batch, runner.execution_path.prepare(batch))
        elif kind == "stop":
            log.info("rank %d: rank 0 stopped the group", channel.rank)
            return
        else:
            raise ValueError(f"rank {channel.rank}: unknown command {kind!r} from rank 0")
