"""Arrows point down only (DESIGN.md, STYLE.md habit 13): every import of ours, read from the source.

    tokenmill (the roof: CLI, supervisor, client, in-process engine)
        -> gateway | scheduler | worker   (services: never each other)
            -> kvstore, protos
                -> plumbing (rpc, tls, telemetry, process helpers)
                    -> core (the contract; imports nothing of ours)

Imports inside functions count too: a late import is still an arrow.

Inside each service the rooms have arrows of their own (ROOM_RULES, at the end): gateway.text imports
no other gateway room, worker.model (the reference, the oracle) never imports worker.paths, the
scheduler's page accounting knows nothing of its rule or its process, and so on.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.test_rooms import arrows_between_rooms

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


# ---- inside a service: its rooms (STYLE.md habit 19), arrows pointing down there too --------------------

_GATEWAY_ROOMS = ("gateway.apis", "gateway.generation", "gateway.prepare", "gateway.text", "gateway.upstream",
                  "gateway.access")
# the scheduling rule and what composes it, at scheduler/'s top; the process room drives it
_SCHEDULER_RULE = tuple(f"scheduler.{name}" for name in (
    "scheduler", "request", "config", "queue_policy", "latency_targets", "step_time", "admission", "stats",
    "step_pipeline", "engine", "executor", "options", "speculation"))
_WORKER_PROCESS = ("worker.main", "worker.service", "worker.build")
_WORKER_ABOVE_KERNELS = ("main", "service", "build", "model_runner", "kv_sizing", "step_batch", "options", "memory",
                         "paths", "model", "linears", "sampling", "loader", "step_order", "step_telemetry", "parallel")
# room (a dotted module or package prefix) -> what it never imports
ROOM_RULES: dict[str, tuple[str, ...]] = {
    # the gateway: text at the bottom; access and upstream beside it; prepare over text; generation over
    # those; the API edges on top; the process (main) imported by nobody
    "gateway.text": tuple(room for room in _GATEWAY_ROOMS if room != "gateway.text") + ("gateway.main",),
    "gateway.access": tuple(room for room in _GATEWAY_ROOMS if room != "gateway.access") + ("gateway.main",),
    "gateway.upstream": tuple(room for room in _GATEWAY_ROOMS if room != "gateway.upstream") + ("gateway.main",),
    "gateway.prepare": ("gateway.apis", "gateway.generation", "gateway.upstream", "gateway.access", "gateway.main"),
    "gateway.generation": ("gateway.apis", "gateway.main"),
    "gateway.apis": ("gateway.main",),
    # the scheduler: page accounting knows pages and a protocol of a request, nothing of the rule or the process
    "scheduler.pages": ("scheduler.process", "scheduler.main", *_SCHEDULER_RULE),
    **{module: ("scheduler.process", "scheduler.main") for module in _SCHEDULER_RULE},
    "scheduler.process": ("scheduler.main",),
    # the worker: kernels at the bottom; the plain reference model (the oracle) knows no path, no fast
    # linear, no sampler; linears know kernels but no path or model; a path picks among them; the
    # process files (main, service, build) sit on top of everything
    "worker.kernels": tuple(f"worker.{name}" for name in _WORKER_ABOVE_KERNELS),
    "worker.model": ("worker.paths", "worker.linears", "worker.sampling", "worker.parallel", *_WORKER_PROCESS),
    # a rank's share cuts the model's linears, quantized ones along their groups: parallel sits over model and
    # linears (neither knows it), beside the paths
    "worker.parallel": ("worker.paths", "worker.sampling", *_WORKER_PROCESS),
    "worker.linears": ("worker.paths", "worker.model", "worker.sampling", "worker.parallel", *_WORKER_PROCESS),
    "worker.sampling": ("worker.paths", "worker.model", "worker.linears", *_WORKER_PROCESS),
    "worker.paths": (*_WORKER_PROCESS, "worker.model_runner", "worker.kv_sizing"),
    "worker.options": tuple(f"worker.{name}" for name in _WORKER_ABOVE_KERNELS if name != "options"),
    "worker.step_batch": tuple(f"worker.{name}" for name in _WORKER_ABOVE_KERNELS if name != "step_batch"),
    "worker.memory": tuple(f"worker.{name}" for name in _WORKER_ABOVE_KERNELS if name != "memory"),
    # the roof: process management and the client know neither the benchmarks nor the CLI nor the engine
    "tokenmill.cluster": ("tokenmill.bench", "tokenmill.client", "tokenmill.cli", "tokenmill.client_cli",
                          "tokenmill.llm"),
    "tokenmill.client": ("tokenmill.cluster", "tokenmill.bench", "tokenmill.cli", "tokenmill.llm"),
    "tokenmill.llm": ("tokenmill.cluster", "tokenmill.bench"),
    "tokenmill.cli": ("tokenmill.bench",),  # it names the benchmarks' modules as strings, imported when run
    "tokenmill.bench.workload": ("tokenmill.bench",),
    "tokenmill.cluster.restart_monitor": ("tokenmill.cluster.supervisor",),
}


def test_rooms_inside_each_service_keep_their_arrows():
    assert arrows_between_rooms(ROOM_RULES) == []
