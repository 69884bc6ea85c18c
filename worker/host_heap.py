"""How the process's C heap treats the large blocks a step frees (glibc's malloc, which torch's CPU tensors use).

glibc serves a block over 32 MiB (its largest dynamic mmap threshold), and any block over 64 MiB asked for by a
thread other than the main one, with a fresh mmap, and gives it back with munmap when freed. Every step then
faults each 4 KiB page of its large tensors in again and the kernel zeroes it: a 256-row decode step's float32
logits over a 49k vocabulary are 48 MiB (12,289 faults: its matmul took 49 ms where 64 rows, 12 MiB, take 4.7,
on the 2-core AMD EPYC of docs/benchmarks.md), a 2,048-token prefill chunk's MLP activations 70 MiB a tensor for
a 1.5B model. vLLM's CPU backend has users preload tcmalloc for the same reason; here glibc is told at start-up
instead:

- one arena (M_ARENA_MAX 1): the step runs on a worker thread, and only the main arena grows without the
  64 MiB heap limit of the others, which falls back to mmap;
- no mmap (M_MMAP_MAX 0) and no trimming of the heap's top (M_TRIM_THRESHOLD at its largest): a freed block
  stays mapped and the next step's tensor of that size reuses its pages;
- no per-thread cache of small chunks (glibc.malloc.tcache_count=0, a tunable glibc reads from GLIBC_TUNABLES
  at start only, so whoever starts the worker sets it: heap_environment). torch allocates with posix_memalign,
  which cuts a ~96-byte tail off each block; that tail lands in the thread's cache, sits between the freed
  block and the heap's top and keeps them from merging, so a next tensor of the same size does not fit the
  hole and takes fresh pages (measured: a 148 MiB logits tensor beside three 9 MiB ones, on a thread, faulted
  in again for 4 of 6 steps with the cache on, for none with it off). Without it (a worker started by hand),
  a lone large tensor a step is still reused.

What is kept is the largest step's working set, as with tcmalloc. What start-up freed (a loader's temporaries)
is given back once it is done (give_back_freed_memory: malloc_trim, which also releases the free pages inside
the heap). Elsewhere than glibc (musl, macOS) the two calls do nothing.
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_LARGEST_INT = 2**31 - 1  # mallopt takes an int
_THREAD_CACHE_TUNABLE = "glibc.malloc.tcache_count"
THREAD_CACHE_OFF = f"{_THREAD_CACHE_TUNABLE}=0"


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Freed blocks stay in the heap for the next step's tensors. Call before any thread other than the main one
    allocates (a thread keeps the arena of its first allocation). False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _LARGEST_INT)))
    if not done:
        logger.warning("glibc refused a malloc setting: large freed blocks may still go back to the system")
    return done


def give_back_freed_memory() -> bool:
    """Returns the heap's free pages to the system (after loading: the loader's temporaries). False where the
    C library is not glibc or nothing could be released."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def heap_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variable a process that starts a worker adds (THREAD_CACHE_OFF joined to any tunables
    already set), or {} where they already say how the thread cache behaves."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if f"{_THREAD_CACHE_TUNABLE}=" in tunables:
        return {}
    return {"GLIBC_TUNABLES": ":".join(part for part in (tunables, THREAD_CACHE_OFF) if part)}


def thread_cache_off(environ: Mapping[str, str] = os.environ) -> bool:
    return THREAD_CACHE_OFF in environ.get("GLIBC_TUNABLES", "").split(":")
