"""Kernels sit at the bottom of the worker: a kernel module imports torch, triton, the ground floor (core)
and other kernel modules, never the worker code that calls it (the sampler, the paths, the runner)."""
from __future__ import annotations

import ast
from pathlib import Path

import worker.kernels

KERNELS = Path(worker.kernels.__file__).parent
# our packages that stand above the kernels (worker.kernels itself is below, so allowed)
ABOVE = ("worker", "scheduler", "gateway", "kvstore", "tokenmill", "plumbing", "protos")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # relative imports stay inside kernels
            modules.add(node.module)
    return modules


def is_above(module: str) -> bool:
    inside = module == "worker.kernels" or module.startswith("worker.kernels.")
    return module.split(".")[0] in ABOVE and not inside


def test_kernel_modules_import_nothing_above_them():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 5  # the directory was found
    above = {path.name: sorted(filter(is_above, imported_modules(path))) for path in files}
    assert {name: modules for name, modules in above.items() if modules} == {}
