"""Builds tokenmill's compiled CPU ops (worker/csrc) into worker/_ops/, at install time.

Never run from a serving process: worker/native_ops.py only loads what this left behind, and falls back
to torch's own ops (slower, same results) when it is missing. The output name carries a hash of the
sources and the torch version, so a stale build is never loaded after either changes.
Usage: python scripts/build_cpu_ops.py [--quiet] [--installed]
  --installed: build for the `worker` package this Python imports (an image's pip-installed copy), not
  the checkout this script sits in.

torch/extension.h (the C++ frontend and pybind11) is a large share of each file's compile, and 7 of the 10
files include it first. It is compiled once into a precompiled header that those files load instead (GCC
takes DIR/torch/extension.h.gch for <torch/extension.h> when DIR comes first in the include path and the
include precedes any code; elsewhere, kv_quant_ops.cpp, it reads the header beside it, which includes the
real one). Same header, flags and macros: the objects' code is what it was (a 2-core EPYC: 236 -> 209 s,
391 -> 311 s of CPU). Including fewer torch headers would save more (~3x the CPU) but changes GCC's
inlining in the kernels (its growth limits are per file), so it waits for a benchmark.

A finished build is also kept in a cache outside the checkout ($TOKENMILL_OPS_CACHE, default
~/.cache/tokenmill/cpu-ops; "off" keeps none), under the same hash plus the compiler's own version line, with
its sha256 beside it. A fresh clone on a machine that built these sources before (CI's clone, a worktree)
copies that file instead of compiling for ~3.5 minutes; any other change of sources, flags, torch or
compiler builds anew. A cached file whose bytes no longer match its sha256 is ignored and rebuilt.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
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
    cached = cached_build_path(target)
    if target.exists():
        if cached is not None and not cached.exists():  # built before the cache existed, or by a cache-less run
            keep_in_cache(target, cached)
        print(f"[build_cpu_ops] up to date: {target}")
        return 0
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"[build_cpu_ops] skipped: the ops are written for x86-64 AVX2, this is {platform.machine()}")
        return 0
    if cached is not None and copy_verified(cached, target):
        remove_stale(target)
        print(f"[build_cpu_ops] copied the build of these sources from {cached}")
        return 0
    build_dir = OPS_DIR / ("build-" + target.stem)
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"[build_cpu_ops] compiling {', '.join(p.name for p in SOURCES)} (about 3.5 minutes on 2 cores)", flush=True)
    header_dir = build_dir / "precompiled"
    try:
        precompiled = precompile_torch_extension_header(cpp_extension, target.stem, header_dir, quiet)
        cpp_extension.load(
            name=target.stem, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
            extra_cflags=list(COMPILE_FLAGS), extra_ldflags=list(LINK_FLAGS),
            extra_include_paths=[str(header_dir)] if precompiled else None, is_python_module=False, verbose=not quiet,
        )
    finally:
        (header_dir / "torch" / "extension.h.gch").unlink(missing_ok=True)  # ~800 MB, only needed while compiling
    built = build_dir / f"{target.stem}.so"
    built.replace(target)
    remove_stale(target)
    print(f"[build_cpu_ops] built {target} in {time.monotonic() - started:.0f} s")
    if cached is not None:
        keep_in_cache(target, cached)
    return 0


KEPT_BUILDS = 8  # ~1.2 MB each


def remove_stale(target: Path) -> None:
    for stale in OPS_DIR.glob("tokenmill_cpu_ops_*.so"):
        if stale != target:
            stale.unlink()


def cached_build_path(target: Path) -> Path | None:
    """The cache's name for target's build: the sources' hash plus the compiler's version line (another GCC makes
    other code from the same sources). None when the cache is off or the compiler does not answer."""
    root = os.environ.get("TOKENMILL_OPS_CACHE", str(Path.home() / ".cache" / "tokenmill" / "cpu-ops"))
    if root.lower() in ("", "off", "0", "none"):
        return None
    try:
        version = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None
    compiler = hashlib.sha256(version.encode()).hexdigest()[:8]
    return Path(root) / f"{target.stem}-cxx{compiler}.so"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_verified(cached: Path, target: Path) -> bool:
    """Copies cached to target when its bytes match the sha256 kept beside it (a cut-off or altered file is not
    loaded: the ops would be missing and their tests skipped, not failed). False when there is nothing usable."""
    try:
        expected = cached.with_suffix(".sha256").read_text().strip()
        if _sha256(cached) != expected:
            print(f"[build_cpu_ops] {cached} does not match its sha256: building instead", flush=True)
            return False
        target.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no worker/_ops yet
        partial = target.with_suffix(".partial")
        shutil.copyfile(cached, partial)
        partial.chmod(0o755)
        partial.replace(target)
        return True
    except OSError:
        return False


def keep_in_cache(target: Path, cached: Path) -> None:
    """Keeps the newest KEPT_BUILDS builds; a cache that cannot be written only costs the next clone a build."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".partial{os.getpid()}")
        shutil.copyfile(target, partial)
        cached.with_suffix(".sha256").write_text(_sha256(partial) + "\n")
        partial.replace(cached)
        builds = sorted(cached.parent.glob("tokenmill_cpu_ops_*.so"), key=lambda path: path.stat().st_mtime)
        for old in builds[:-KEPT_BUILDS]:
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)
    except OSError as error:
        print(f"[build_cpu_ops] could not keep the build in {cached.parent}: {error}", flush=True)


def precompile_torch_extension_header(cpp_extension, name: str, header_dir: Path, quiet: bool) -> bool:
    """header_dir/torch/extension.h.gch, under the flags cpp_extension.load gives each source (its
    _write_ninja_file_to_build_library: the two macros, the include paths as -isystem, -fPIC -std=c++20,
    then ours), with header_dir/torch/extension.h beside it; header_dir goes first in the sources' include path.
    False where it cannot be made (another compiler, no header found): the build goes on without it, slower."""
    (header_dir / "torch").mkdir(parents=True, exist_ok=True)
    system_includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    header = next((path for path in (Path(p) / "torch" / "extension.h" for p in system_includes) if path.exists()), None)
    if header is None:
        print("[build_cpu_ops] torch/extension.h not found on torch's include path: building without a precompiled "
              "header", flush=True)
        return False
    command = [os.environ.get("CXX", "c++"), f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *(flag for include in system_includes for flag in ("-isystem", include)), "-fPIC", "-std=c++20",
               *COMPILE_FLAGS, "-x", "c++-header", str(header), "-o", str(header_dir / "torch" / "extension.h.gch")]
    if not quiet:
        print(" ".join(command), flush=True)
    done = subprocess.run(command, capture_output=quiet, text=True)  # quiet: GCC's "#pragma once in main file" unsaid
    if done.returncode != 0:  # the sources still compile against the real header, only slower
        print(f"[build_cpu_ops] precompiling {header} failed, building without it:\n{done.stderr or ''}", flush=True)
        return False
    # where the include follows code (kv_quant.h in kv_quant_ops.cpp) GCC skips the .gch and reads this header
    (header_dir / "torch" / "extension.h").write_text("#include_next <torch/extension.h>\n")
    return True


if __name__ == "__main__":
    raise SystemExit(main())
