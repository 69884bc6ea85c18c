"""Every Triton kernel compiles for sm_90 (H100/H200) without a GPU: the interpreter, which runs the other
kernel tests on CPU, accepts code the compiler rejects (tests/worker/kernels/sm90_compile_check.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_kernel_variant_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # bf16: every kernel; fp32: the dot-product kernels' ieee-precision branch
    result = subprocess.run([sys.executable, "-m", "tests.worker.kernels.sm90_compile_check", "--quiet", "bf16", "fp32"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    failures = [line for line in result.stdout.splitlines() if "FAILED" in line]
    assert result.returncode == 0 and "every kernel variant compiled" in result.stdout, (
        "\n".join(failures) or result.stdout[-2000:] + result.stderr[-2000:])
