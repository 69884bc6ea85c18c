"""No request data is ever pickled or evaluated (DESIGN.md invariant 7): the non-test source tree has
no pickle-family import, no eval/exec/compile, no yaml.load without a safe loader, no torch.load
without weights_only=True, no numpy load with allow_pickle=True, nothing that pickles between
processes (multiprocessing, ProcessPoolExecutor). Found by walking the syntax tree, not by grep, so
method names like `model.eval()` are not mistaken for the builtin. Exceptions need an entry in
ALLOWED with the reason."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("core", "plumbing", "gateway", "scheduler", "worker", "kvstore", "protos", "tokenmill", "scripts")

PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle",
                    "joblib", "multiprocessing"}
EVALUATING_BUILTINS = {"eval", "exec", "compile", "__import__"}
PICKLING_NAMES = {"ProcessPoolExecutor", "read_pickle", "unsafe_load", "full_load"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}

# (path relative to the repository root, what was found) -> why it is safe.
_GATEWAY_PROCESSES = ("--processes N spawns the gateway's other processes: spawn pickles only this gateway's own "
                      "GatewayOptions (parsed from its command line) and a pipe end; the pipe carries each "
                      "child's pid once. No request data crosses: each process reads its own clients' requests")
ALLOWED: dict[tuple[str, str], str] = {
    ("gateway/processes.py", "import multiprocessing"): _GATEWAY_PROCESSES,
    ("gateway/processes.py", "from multiprocessing.connection import"): _GATEWAY_PROCESSES,
    ("gateway/main.py", "from multiprocessing.connection import"): _GATEWAY_PROCESSES,
    ("scripts/bench_tensor_parallel.py", "import multiprocessing"):
        "a benchmark spawns its own ranks: spawn pickles the command line's argparse Namespace, the rank and a "
        "temp folder's paths; nothing from a client or a file crosses",
    ("scripts/bench_step_broadcast.py", "import multiprocessing"):
        "a benchmark spawns its own ranks and servers: spawn pickles their numbers, a temp folder's path and a queue; "
        "nothing from a client or a file crosses",
    ("scripts/bench_step_broadcast.py", "import pickle"):
        "pickle.dumps only: the bytes a step's broadcast carries, measured and sent as an opaque gRPC payload, never "
        "loaded",
}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) for each unsafe use in source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLING_MODULES:
                found.append((node.lineno, f"from {node.module} import"))
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in PICKLING_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in PICKLING_NAMES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call):
            function = node.func
            if isinstance(function, ast.Name) and function.id in EVALUATING_BUILTINS:
                found.append((node.lineno, f"{function.id}()"))
            elif isinstance(function, ast.Attribute):
                owner = function.value.id if isinstance(function.value, ast.Name) else ""
                if owner == "yaml" and function.attr in ("load", "load_all"):
                    loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                    loader_name = getattr(loader, "attr", getattr(loader, "id", None))
                    if loader_name not in SAFE_YAML_LOADERS:
                        found.append((node.lineno, f"yaml.{function.attr} without SafeLoader"))
                elif owner == "torch" and function.attr == "load" and not _is_constant(_keyword(node, "weights_only"), True):
                    found.append((node.lineno, "torch.load without weights_only=True"))
                elif owner in ("np", "numpy") and function.attr == "load" and \
                        not _is_constant(_keyword(node, "allow_pickle"), False) and _keyword(node, "allow_pickle"):
                    found.append((node.lineno, "numpy.load with allow_pickle"))
    return found


def test_the_checker_catches_each_unsafe_pattern():
    planted = """
import pickle
import marshal as m
from multiprocessing import Pool
from concurrent.futures import ProcessPoolExecutor
import yaml, torch, numpy as np
eval(request.text)
exec(code)
yaml.load(body)
yaml.load(body, Loader=yaml.FullLoader)
yaml.unsafe_load(body)
torch.load(path)
np.load(path, allow_pickle=True)
"""
    safe = """
model.eval()
yaml.load(body, Loader=yaml.SafeLoader)
yaml.safe_load(body)
torch.load(path, weights_only=True)
np.load(path)
json.loads(body)
"""
    assert sorted({line for line, _ in findings(planted)}) == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]  # all but line 6
    assert {what for _, what in findings(planted)} >= {
        "import pickle", "import marshal", "from multiprocessing import", "import ProcessPoolExecutor", "eval()",
        "exec()", "yaml.load without SafeLoader", ".unsafe_load", "torch.load without weights_only=True",
        "numpy.load with allow_pickle"}
    assert findings(safe) == []


def _source_files() -> list[Path]:
    return sorted(path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py"))


def test_the_source_tree_is_scanned():
    files = {path.relative_to(ROOT).as_posix() for path in _source_files()}
    assert {"gateway/apis/generation.py", "scheduler/main.py", "worker/model_runner.py", "kvstore/state_writer.py",
            "protos/codec.py", "tokenmill/cli.py"} <= files


@pytest.mark.parametrize("folder", SOURCE_DIRS)
def test_nothing_is_pickled_or_evaluated(folder):
    unexplained = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for line, what in findings(path.read_text()):
            if (relative, what) not in ALLOWED:
                unexplained.append(f"{relative}:{line}: {what}")
    assert not unexplained, "unsafe deserialization or evaluation (allow-list it with a reason if it is safe):\n" + \
        "\n".join(unexplained)
