"""scripts/build_cpu_ops.py's cache of finished builds outside the checkout: a fresh clone copies the build of the
same sources, flags, torch and compiler instead of compiling; a changed, cut-off or foreign-compiler file is not
used; the cache can be turned off. The copying is tested here on stand-in bytes (compiling takes minutes)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_cpu_ops.py"


@pytest.fixture
def build(tmp_path, monkeypatch):
    """The script as a module, its output folder and hashed name moved under tmp_path (never the checkout's)."""
    spec = importlib.util.spec_from_file_location("build_cpu_ops_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ops_dir = tmp_path / "ops"
    ops_dir.mkdir()
    monkeypatch.setattr(module, "OPS_DIR", ops_dir)
    monkeypatch.setattr(module, "built_library_path", lambda: ops_dir / "tokenmill_cpu_ops_0123456789ab.so")
    monkeypatch.setenv("TOKENMILL_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["build_cpu_ops.py", "--quiet"])
    return module


def _fake_compiler(tmp_path: Path, version: str) -> str:
    script = tmp_path / f"cxx-{abs(hash(version))}"
    script.write_text(f"#!/bin/sh\necho '{version}'\n")
    script.chmod(0o755)
    return str(script)


def test_a_clone_copies_the_cached_build_of_the_same_sources_instead_of_compiling(build, tmp_path, monkeypatch):
    target = build.built_library_path()
    target.write_bytes(b"\x7fELF stand-in library " * 100)
    cached = build.cached_build_path(target)
    build.keep_in_cache(target, cached)
    assert cached.read_bytes() == target.read_bytes()

    original = target.read_bytes()
    shutil.rmtree(build.OPS_DIR)  # a fresh clone: no build of its own, not even the folder (git ignores it)
    monkeypatch.setattr(build, "precompile_torch_extension_header", lambda *args: pytest.fail("compiled anyway"))
    assert build.main() == 0
    assert target.read_bytes() == original and os.access(target, os.X_OK)

    stale = build.OPS_DIR / "tokenmill_cpu_ops_ba9876543210.so"  # an older build beside it goes
    stale.write_bytes(b"old")
    target.unlink()
    assert build.main() == 0
    assert target.read_bytes() == original and not stale.exists()


def test_a_cut_off_or_altered_cached_file_is_not_used(build, tmp_path):
    target = build.built_library_path()
    target.write_bytes(b"library bytes" * 1000)
    cached = build.cached_build_path(target)
    build.keep_in_cache(target, cached)
    cached.write_bytes(cached.read_bytes()[:5000])  # cut off after its sha256 was written
    elsewhere = tmp_path / "clone.so"
    assert not build.copy_verified(cached, elsewhere)
    assert not elsewhere.exists()


def test_another_compiler_or_the_cache_turned_off_finds_no_cached_build(build, tmp_path, monkeypatch):
    target = build.built_library_path()
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, "c++ (Debian 12.2.0-14) 12.2.0"))
    gcc12 = build.cached_build_path(target)
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, "c++ (Debian 13.1.0-1) 13.1.0"))
    gcc13 = build.cached_build_path(target)
    assert gcc12 != gcc13 and gcc12.parent == gcc13.parent == tmp_path / "cache"
    assert target.stem in gcc12.name  # the sources' hash stays in the name
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build.cached_build_path(target) is None
    monkeypatch.setenv("TOKENMILL_OPS_CACHE", "off")
    assert build.cached_build_path(target) is None


def test_the_cache_keeps_only_the_newest_builds(build, tmp_path):
    for index in range(build.KEPT_BUILDS + 3):
        library = build.OPS_DIR / f"tokenmill_cpu_ops_{index:012x}.so"
        library.write_bytes(bytes([index]) * 64)
        cached = build.cached_build_path(library)
        build.keep_in_cache(library, cached)
        os.utime(cached, (1_000_000 + index, 1_000_000 + index))  # file times 1 s apart, oldest first
    kept = sorted(path.name for path in (tmp_path / "cache").glob("*.so"))
    assert len(kept) == build.KEPT_BUILDS
    assert kept[0].startswith("tokenmill_cpu_ops_000000000003")  # the three oldest went, with their sha256
    assert len(list((tmp_path / "cache").glob("*.sha256"))) == build.KEPT_BUILDS


def test_an_up_to_date_build_made_before_the_cache_is_kept_in_it(build):
    target = build.built_library_path()
    target.write_bytes(b"built by an earlier run" * 50)
    assert build.main() == 0
    cached = build.cached_build_path(target)
    assert cached.read_bytes() == target.read_bytes()
    assert build.copy_verified(cached, build.OPS_DIR / "copy.so")
