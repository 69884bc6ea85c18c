"""The processes of one tensor-parallel group: joining it, rank 0 starting the others on one machine, and
tearing the group down as a unit when any rank dies.

One machine (`tokenmill serve --tensor-parallel-size N`): rank 0 is the worker process the cluster starts; it
picks a free local port for the rendezvous and starts ranks 1..N-1 as its own children, with its flags. If a
child dies, rank 0 exits at once (its supervisor restarts the worker, which starts a whole new group, and the
scheduler re-admits the running requests as after any worker loss); if rank 0 dies, Linux kills its children
(PR_SET_PDEATHSIG). Several machines: each rank is started by the deployment with --rank and
--rendezvous, and the LeaderWorkerSet recreates the whole group when one pod fails (deploy/).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from plumbing.ports import free_port
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.options import WorkerOptions
from worker.parallel.group import TensorParallelGroup, join_group
from worker.parallel.pipeline import PipelineStage, stage_layers
from worker.parallel.shard import HfShare, RankSplit, check_split, shard_model, wrap_share
from worker.parallel.step_mirror import GROUP_LOST_EXIT, StepChannel

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.5
PR_SET_PDEATHSIG = 1


class Parallel:
    """This process's place in a worker group: its share of the model and of each KV page, and (rank 0) the channel
    it drives the others by. Split by heads (tensor parallel, worker.parallel.shard) or by layers (pipeline)."""

    def __init__(self, group: TensorParallelGroup, channel: StepChannel, pipeline: bool = False) -> None:
        self.group = group
        self.channel = channel
        self.pipeline = pipeline

    @property
    def leads(self) -> bool:
        return self.group.rank == 0

    def split(self, model: LlamaModel) -> nn.Module:
        """This rank's share of the whole model, loaded alike on every rank."""
        return PipelineStage(model, self.group) if self.pipeline else shard_model(model, self.group)

    def share_of(self, path: Path) -> Callable[[ModelConfig], HfShare] | None:
        """What load_model reads of `path` for this rank (a Hugging Face folder split by heads: only its rows and
        columns, never the whole model); None: the whole model, split after loading (split())."""
        if self.pipeline or not path.is_dir():
            return None

        def share(config: ModelConfig) -> HfShare:
            check_split(config, self.group.world_size)
            return HfShare(RankSplit(self.group.rank, self.group.world_size, config))
        return share

    def wrap(self, share: LlamaModel, config: ModelConfig) -> nn.Module:
        """The collectives around a share load_model read with share_of()."""
        return wrap_share(share, config, self.group)

    def kv_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's KV pages: its KV heads of every layer, or every KV head of its layers."""
        if self.pipeline:
            return replace(config, num_layers=len(stage_layers(self.group.rank, self.group.world_size,
                                                               config.num_layers)), layer_windows=())
        return RankSplit(self.group.rank, self.group.world_size, config).rank_config()


def join_parallel(options: WorkerOptions, device: torch.device | str) -> Parallel | None:
    """This process's place in its group (None: one rank); blocks until every rank has joined."""
    if options.group_size == 1:
        return None
    group = join_group(options.rank, options.group_size, options.rendezvous,
                       device, options.collective_timeout_s)
    log.info("tensor parallel: rank %d of %d joined at %s", group.rank, group.world_size,
             options.rendezvous)
    channel = StepChannel(group)
    channel.agree(group_settings(options))
    return Parallel(group, channel, pipeline=options.pipeline_parallel_size > 1)


def group_settings(options: WorkerOptions) -> dict[str, object]:
    """What every rank of a group must be started with alike: all flags but the rank and the rank-local ones."""
    local = ("rank", "host", "port", "threads", "kv_sizing_record")
    return {item.name: getattr(options, item.name) for item, _ in options.flagged_fields() if item.name not in local}


def rank_threads(options: WorkerOptions) -> int:
    """torch threads of one rank: --threads, else the cores shared by the group's ranks on this machine (all of
    them where rank 0 started them here, one rank's worth where each has a machine)."""
    if options.threads:
        return options.threads
    local_ranks = options.group_size if started_here(options) else 1
    return max(1, (os.cpu_count() or 1) // local_ranks)


def started_here(options: WorkerOptions) -> bool:
    """Whether rank 0 started this group's ranks itself, on this machine (start_local_ranks' rendezvous)."""
    return (options.rendezvous or "").startswith("tcp://127.0.0.1:")


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when rank 0 goes, however it goes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_local_ranks(options: WorkerOptions) -> WorkerOptions:
    """Rank 0 without a rendezvous: starts ranks 1..N-1 here, watched; returns rank 0's options with theirs."""
    leader = replace(options, rendezvous=f"tcp://127.0.0.1:{free_port()}")
    children = []
    for rank in range(1, options.group_size):
        argv = replace(leader, rank=rank).to_argv()
        children.append(subprocess.Popen([sys.executable, "-m", "worker.main", *argv],
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None))
    log.info("worker group: started ranks 1..%d (pids %s), rendezvous %s", options.group_size - 1,
             [child.pid for child in children], leader.rendezvous)
    threading.Thread(target=_watch, args=(children,), name="tensor-parallel-ranks", daemon=True).start()
    return leader


def _watch(children: list[subprocess.Popen]) -> None:
    """Rank 0 goes down with any rank it started: a group with a dead rank cannot run another step."""
    while True:
        for rank, child in enumerate(children, start=1):
            code = child.poll()
            if code is not None:
                log.error("tensor parallel: rank %d (pid %d) exited with %s; stopping rank 0 so the whole group "
                          "restarts", rank, child.pid, code)
                os._exit(GROUP_LOST_EXIT)
        time.sleep(WATCH_INTERVAL_S)
