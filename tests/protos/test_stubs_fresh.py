"""The committed stubs are exactly what `python -m protos.generate` produces from the .proto sources."""
from __future__ import annotations

from protos.generate import REPO_ROOT, generate, generated_files


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = {path.relative_to(tmp_path): path for path in generate(tmp_path)}
    committed = {path.relative_to(REPO_ROOT): path for path in generated_files(REPO_ROOT)}
    hint = "run `python -m protos.generate` and commit the result"

    missing = sorted(str(name) for name in fresh.keys() - committed.keys())
    assert not missing, f"generated files not committed: {missing}; {hint}"
    orphans = sorted(str(name) for name in committed.keys() - fresh.keys())
    assert not orphans, f"generated files without a .proto source: {orphans}; delete them"
    stale = sorted(str(name) for name in fresh if fresh[name].read_bytes() != committed[name].read_bytes())
    assert not stale, f"stale generated files: {stale}; {hint}"
