"""Builds tokenmill's compiled CPU ops (worker/csrc) into worker/_ops/, at install time.

Never run from a serving process: worker/native_ops.py only loads what this left behind, and falls back
to torch's own ops (slower, same results) when it is missing. The output name carries a hash of the
sources and the torch version, so a stale build is never loaded after either changes.
Usage: python scripts/build_cpu_ops.py [--quiet] [--installed]
  --installed: build for the `worker` package this Python imports (an image's pip-installed copy), not
  the checkout this script sits in.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--installed" not in sys.argv:
    sys.path.insert(0, str(ROOT))

from worker.native_ops import COMPILE_FLAGS, LINK_FLAGS, OPS_DIR, SOURCES, built_library_path  # noqa: E402


def main() -> int:
    import platform

    from torch.utils import cpp_extension

    quiet = "--quiet" in sys.argv
    target = built_library_path()
    if target.exists():
        print(f"[build_cpu_ops] up to date: {target}")
        return 0
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"[build_cpu_ops] skipped: the ops are written for x86-64 AVX2, this is {platform.machine()}")
        return 0
    build_dir = OPS_DIR / ("build-" + target.stem)
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"[build_cpu_ops] compiling {', '.join(p.name for p in SOURCES)} (about a minute on 2 cores)", flush=True)
    cpp_extension.load(
        name=target.stem, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
        extra_cflags=list(COMPILE_FLAGS), extra_ldflags=list(LINK_FLAGS), is_python_module=False, verbose=not quiet,
    )
    built = build_dir / f"{target.stem}.so"
    built.replace(target)
    for stale in OPS_DIR.glob("tokenmill_cpu_ops_*.so"):
        if stale != target:
            stale.unlink()
    print(f"[build_cpu_ops] built {target} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
