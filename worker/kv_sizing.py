"""How many KV pages the worker allocates: from a fixed budget, or from the memory there is.

--kv-cache-mb (or --num-blocks) fixes the size. Without it the cache takes --kv-cache-memory-fraction
of the memory left once the weights are loaded and a profile pass of the largest step has run:

    kv bytes = fraction * (free memory after the weights - activation peak of the profile pass)

On CUDA "free" is torch.cuda.mem_get_info() and the peak is max_memory_allocated() over the pass. On
CPU "free" is MemAvailable (the kernel's estimate of what can be allocated without swapping) and the
peak is the process's peak resident set over the pass (VmHWM, reset first through /proc/self/clear_refs;
where that is not allowed, the growth of ru_maxrss, 0 when loading the weights peaked higher). The
CPU default fraction is small because that memory is shared with the OS,
other processes and the swap tier, and a CPU step is compute-bound long before the cache is full.

A restart keeps the page count (--kv-sizing-record). The free memory a restarted worker finds differs
from the first start's (a CPU's MemAvailable moves with the page cache and the other processes; a
GPU's with whatever else runs on it), and so would a fresh sizing: the scheduler, built for the first
count, would meet a worker with another one. So the first start records its choice and the settings it
depended on (SizingRecord, a small JSON file), and a start with the same settings reuses the recorded
count when its pages fit in the memory free now (after the weights and the activation peak; the
fraction's headroom, kept for other processes, may be used up). Where they no longer fit the worker
sizes afresh and says so; the scheduler then adopts the smaller pool (scheduler.process.worker_recovery). The
record stays: memory that comes back brings the first count back. Only other settings (another
fraction, model, dtype, ...), a fixed --num-blocks / --kv-cache-mb, or removing the file size anew.
The record lives as long as the deployment, not the process: the local supervisor keeps it in the
worker's temp dir (kept across crash restarts); on Kubernetes an emptyDir volume does the same.

Why the worker and not the scheduler keeps it: the worker allocates its cache before it can
register, and the scheduler may itself have restarted; a file next to the worker needs no new RPC.
"""
from __future__ import annotations

import json
import logging
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from worker.memory import reset_peak_rss, status_bytes
from worker.paths.base import ExecutionPath
from worker.step_batch import RequestSpan, StepBatch

DEFAULT_MEMORY_FRACTION = {"cuda": 0.9, "cpu": 0.1}

logger = logging.getLogger("tokenmill.worker")
REUSED_SIZING = "the sizing recorded by the first start (reused)"  # how a reused count's reason begins


@dataclass(slots=True, frozen=True)
class KVCacheSizing:
    num_blocks: int
    kv_cache_bytes: int
    reason: str  # what the worker logs and reports in GetCapacity: the inputs of the choice


def default_memory_fraction(device: torch.device) -> float:
    return DEFAULT_MEMORY_FRACTION.get(device.type, DEFAULT_MEMORY_FRACTION["cpu"])


def profile_batch(num_tokens: int, block_size: int) -> StepBatch:
    """One prefill of num_tokens tokens over pages 0..: the largest step the scheduler may plan."""
    block_table = list(range(-(-num_tokens // block_size)))
    return StepBatch(-2, input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                     sample_rows=[num_tokens - 1], spans=[RequestSpan(0, num_tokens, num_tokens, block_table)])


def measure_activation_peak(path: ExecutionPath, batch: StepBatch, device: torch.device) -> int:
    """Bytes the forward pass of batch needs above what was allocated before it."""
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            path.forward(batch, path.prepare(batch))
            torch.cuda.synchronize(device)
            return max(torch.cuda.max_memory_allocated(device) - before, 0)
        if reset_peak_rss():
            before = status_bytes("VmRSS")
            path.forward(batch, path.prepare(batch))
            return max(status_bytes("VmHWM") - before, 0)
        before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        path.forward(batch, path.prepare(batch))
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb, 0) * 1024


def size_from_free_memory(free_bytes: int, activation_peak: int, fraction: float, bytes_per_block: int,
                          device: torch.device) -> KVCacheSizing:
    """The pages that fit in fraction of (free_bytes - activation_peak); ValueError if none do."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction={fraction} must be in (0, 1]")
    budget = int(fraction * (free_bytes - activation_peak))
    num_blocks = budget // bytes_per_block
    reason = (f"{fraction:g} x ({free_bytes / 2**20:.0f} MiB free on {device.type} after the weights - "
              f"{activation_peak / 2**20:.1f} MiB activation peak of the profile pass)")
    if num_blocks < 1:
        raise ValueError(f"the KV cache gets no page: {reason} = {budget} bytes, one page needs {bytes_per_block}")
    return KVCacheSizing(num_blocks, num_blocks * bytes_per_block, reason)


def size_from_budget(budget_bytes: int, bytes_per_block: int) -> KVCacheSizing:
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block: one block needs {bytes_per_block} bytes")
    return KVCacheSizing(num_blocks, num_blocks * bytes_per_block, f"--kv-cache-mb {budget_bytes / 2**20:g}")


@dataclass(slots=True, frozen=True)
class SizingRecord:
    """The first start's sizing from memory, reused by later starts with the same settings."""

    num_blocks: int
    bytes_per_block: int
    settings: str  # what the sizing depended on besides the memory (model, dtype, fraction, ...)
    reason: str  # the first start's KVCacheSizing.reason


def read_sizing_record(path: Path) -> SizingRecord | None:
    """The record at path; None when there is none yet, or (logged) when it cannot be read."""
    try:
        fields = json.loads(path.read_text())
        record = SizingRecord(int(fields["num_blocks"]), int(fields["bytes_per_block"]), str(fields["settings"]),
                              str(fields["reason"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("KV sizing record %s is unreadable (%s): sizing from memory anew", path, error)
        return None
    return record


def write_sizing_record(path: Path, record: SizingRecord) -> None:
    """Written whole or not at all (a crash mid-write leaves the old record or none)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(asdict(record), indent=1) + "\n")
    os.replace(partial, path)


def size_from_memory_or_record(record: SizingRecord | None, settings: str, free_bytes: int, activation_peak: int,
                               fraction: float, bytes_per_block: int,
                               device: torch.device) -> tuple[KVCacheSizing, SizingRecord | None]:
    """The recorded page count when the record has these settings and its pages fit in free_bytes -
    activation_peak, else size_from_free_memory(). Also returns the record to write (None: keep the one
    there): a first start's, or one for changed settings."""
    if record is None or (record.settings, record.bytes_per_block) != (settings, bytes_per_block):
        fresh = size_from_free_memory(free_bytes, activation_peak, fraction, bytes_per_block, device)
        return fresh, SizingRecord(fresh.num_blocks, bytes_per_block, settings, fresh.reason)
    needed, room = record.num_blocks * bytes_per_block, free_bytes - activation_peak
    if needed <= room:
        return KVCacheSizing(record.num_blocks, needed, (
            f"{REUSED_SIZING}: {record.num_blocks} pages from {record.reason}; "
            f"{room / 2**20:.0f} MiB free now after the weights and the activation peak")), None
    fresh = size_from_free_memory(free_bytes, activation_peak, fraction, bytes_per_block, device)
    return KVCacheSizing(fresh.num_blocks, fresh.kv_cache_bytes, (
        f"{fresh.reason}: the recorded {record.num_blocks} pages ({needed / 2**20:.1f} MiB) of the first start "
        f"no longer fit in {room / 2**20:.0f} MiB")), None
