"""Fixtures shared across the test tree; each lives in tests/helpers and is only exposed here."""
import os
import platform
import shutil

# Triton kernels run under the interpreter where there is no GPU. Triton reads this when a kernel is
# decorated, so it must be set before any kernel module is imported; the GPU script sets it to 0.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter's tl.dot is numpy's matmul, and OpenBLAS's AVX2 sgemm kernels (Haswell, Zen: the ones it
    # picks on a CPU without AVX-512) give a row other last bits at another place in its tile: they cut the rows
    # in strips of 6 and 4 with different summation. The deterministic-mode tests (a row alone vs in a batch)
    # then fail on the interpreter, not on the kernels. SandyBridge's kernel gives every place the same bits
    # (and is nearly as fast); OpenBLAS reads this when numpy loads, so before anything imports numpy.
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault("OPENBLAS_CORETYPE", "SandyBridge")

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.helpers.triton_interpreter import cache_builtin_lookup

    cache_builtin_lookup()

from tests.helpers.default_cluster import default_cluster  # noqa: E402, F401
from tests.helpers.redis_server import fresh_redis, own_redis, redis_server  # noqa: E402, F401
