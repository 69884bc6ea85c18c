"""Fixtures shared across the test tree; each lives in tests/helpers and is only exposed here."""
import os
import shutil

# Triton kernels run under the interpreter where there is no GPU. Triton reads this when a kernel is
# decorated, so it must be set before any kernel module is imported; the GPU script sets it to 0.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.redis_server import fresh_redis, own_redis, redis_server  # noqa: E402, F401
