"""Arrows point down only (DESIGN.md, STYLE.md habit 13): every import of ours, read from the source.

    tokenmill (the roof: CLI, supervisor, client, in-process engine)
        -> gateway | scheduler | worker   (services: never each other)
            -> kvstore, protos
                -> plumbing (rpc, tls, telemetry, process helpers)
                    -> core (the contract; imports nothing of ours)

Imports inside functions count too: a late import is still an arrow.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("core", "plumbing", "protos", "kvstore", "gateway", "scheduler", "worker", "tokenmill")
SERVICES = ("gateway", "scheduler", "worker")
# package -> the packages of ours it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "plumbing": {"core"},
    "protos": {"core"},
    "kvstore": {"core", "plumbing"},
    **{service: {"core", "plumbing", "protos", "kvstore"} for service in SERVICES},
    "tokenmill": set(OURS),
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package of ours, line) for each import in path."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in OURS}
    return found


def arrows_against_the_layering(root: Path = ROOT) -> list[str]:
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            for imported, line in sorted(imported_packages(path)):
                if imported != package and imported not in allowed:
                    wrong.append(f"{path.relative_to(root)}:{line} imports {imported}")
    return wrong


def test_every_import_points_down():
    assert arrows_against_the_layering() == []


def test_the_check_sees_a_wrong_arrow(tmp_path):
    """The check itself: a service importing a sibling service is reported with its file and line."""
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / "gateway" / "bad.py").write_text("import os\n\ndef late():\n    from scheduler.loop import EngineLoop\n")
    (tmp_path / "core" / "fine.py").write_text("from core.errors import InvalidArgument\n")
    (tmp_path / "tokenmill" / "roof.py").write_text("import gateway.main\nimport worker.main\n")
    assert arrows_against_the_layering(tmp_path) == ["gateway/bad.py:4 imports scheduler"]


def test_the_ground_floor_imports_nothing_but_the_standard_library():
    """core/ is the contract every process shares: no grpc, no torch, no protobuf in it."""
    third_party = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
            elif isinstance(node, ast.Import):
                top = node.names[0].name.split(".")[0]
            else:
                continue
            if top not in ("core", "__future__") and top not in sys.stdlib_module_names:
                third_party.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {top}")
    assert third_party == []

