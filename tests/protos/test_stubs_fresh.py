"""The committed stubs are exactly what `python -m protos.generate` produces from the .proto sources."""
from __future__ import annotations

import importlib.metadata
import re
import tomllib

from protos.generate import REPO_ROOT, generate, generated_files


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = {path.relative_to(tmp_path): path for path in generate(tmp_path)}
    committed = {path.relative_to(REPO_ROOT): path for path in generated_files(REPO_ROOT)}
    # a stale stub is either a .proto edited without regenerating, or a grpcio-tools other than the
    # pinned one (it writes its version into every *_pb2_grpc.py): the hint names the installed one
    hint = (f"run `python -m protos.generate` and commit the result (grpcio-tools "
            f"{importlib.metadata.version('grpcio-tools')} installed; pyproject.toml pins the one that wrote them)")

    missing = sorted(str(name) for name in fresh.keys() - committed.keys())
    assert not missing, f"generated files not committed: {missing}; {hint}"
    orphans = sorted(str(name) for name in committed.keys() - fresh.keys())
    assert not orphans, f"generated files without a .proto source: {orphans}; delete them"
    stale = sorted(str(name) for name in fresh if fresh[name].read_bytes() != committed[name].read_bytes())
    assert not stale, f"stale generated files: {stale}; {hint}"


def test_pyproject_pins_the_grpcio_tools_that_wrote_the_stubs():
    # CI installs fresh: an unpinned grpcio-tools took a newer release that wrote 1.85.4 into every stub
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    pins = [dep for dep in pyproject["project"]["optional-dependencies"]["test"] if dep.startswith("grpcio-tools")]
    written = {re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", path.read_text()).group(1)
               for path in generated_files(REPO_ROOT) if path.name.endswith("_pb2_grpc.py")}
    assert pins == [f"grpcio-tools=={version}" for version in sorted(written)], (pins, written)
