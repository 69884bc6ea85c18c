"""Folders are rooms (STYLE.md habits 7 and 19): what the layout promises, read from the source.

- no import circle anywhere in our tree (an import inside a function counts: it runs too);
- no folder holds more than 20 modules, in the code or in its tests;
- no function is over 60 lines, outside worker/kernels/ (a kernel is one launch, read top to bottom);
- the rooms inside a service keep their arrows (the rules are in tests/test_layering.py);
- a package's `__init__.py` map names each of its rooms, and every file it names exists.

Imports under `if TYPE_CHECKING:` are left out: they never run, so they cannot close a circle.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "plumbing", "protos", "kvstore", "gateway", "scheduler", "worker", "tokenmill")
MAX_MODULES = 20
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED = ("worker/kernels/",)


def source_files(root: Path = ROOT, packages=PACKAGES) -> Iterator[Path]:
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")) and "csrc" not in path.parts:
                yield path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, root: Path, modules: set[str]) -> set[tuple[str, int]]:
    """(module of ours, line) for each import that runs, resolved to the most specific module that exists."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_lines(tree)
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != here:
                found.add((target, node.lineno))
                break
    return found


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    paths = {module_name(path, root): path for path in source_files(root, packages)}
    modules = set(paths)
    return {name: {target for target, _ in imports_of(path, root, modules)} for name, path in paths.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def crowded_folders(root: Path = ROOT) -> list[str]:
    crowded = []
    for top in (*PACKAGES, "tests"):
        for folder in [root / top, *sorted(p for p in (root / top).rglob("*") if p.is_dir())]:
            if "csrc" in folder.parts or "__pycache__" in folder.parts:
                continue
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES:
                crowded.append(f"{folder.relative_to(root)}: {count} modules")
    return crowded


def long_functions(root: Path = ROOT, packages=(*PACKAGES, "scripts")) -> list[str]:
    long = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(LONG_FUNCTIONS_ALLOWED) or relative.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{relative}:{node.lineno} {node.name} ({lines} lines)")
    return long


def arrows_between_rooms(rules: dict[str, tuple[str, ...]], root: Path = ROOT) -> list[str]:
    """rules: room (a dotted module or package prefix) -> what it never imports (tests/test_layering.py
    holds the project's)."""
    paths = {module_name(path, root): path for path in source_files(root)}
    modules = set(paths)
    wrong = []
    for name, path in sorted(paths.items()):
        for room, forbidden in rules.items():
            if name != room and not name.startswith(room + "."):
                continue
            for target, line in sorted(imports_of(path, root, modules)):
                for other in forbidden:
                    if target == other or target.startswith(other + "."):
                        wrong.append(f"{path.relative_to(root)}:{line} imports {target} ({room} never imports {other})")
    return wrong


def _named_file_exists(root: Path, folder: Path, named: str) -> bool:
    """A map may name a file of its own subtree (`model_runner.py`), a path from the checkout's root
    (`tests/test_layering.py`), or a test by its name (`test_layering.py`)."""
    base = named.rpartition("/")[2]
    if "/" in named:
        return (root / f"{named}.py").exists() or (folder / f"{named}.py").exists()
    if base.startswith("test_"):
        return any((root / "tests").rglob(f"{base}.py"))
    return any(folder.rglob(f"{base}.py"))


def drifting_maps(root: Path = ROOT) -> list[str]:
    """Each package map names its rooms; a file it names (`name.py`) exists in or under that package."""
    drift = []
    for init in sorted(p for package in PACKAGES for p in (root / package).rglob("__init__.py")):
        folder = init.parent
        if "csrc" in folder.parts:
            continue
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        rooms = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists())
        for room in rooms:
            if not re.search(rf"\b{re.escape(room)}\b", text):
                drift.append(f"{init.relative_to(root)}: the map does not name the room {room}/")
        for named in sorted(set(re.findall(r"([A-Za-z_][A-Za-z0-9_/.]*)\.py\b", text))):
            if not _named_file_exists(root, folder, named):
                drift.append(f"{init.relative_to(root)}: the map names {named}.py, which is not there")
    return drift


def test_no_import_circle_anywhere():
    assert import_circles(import_graph()) == []


def test_no_folder_holds_more_than_twenty_modules():
    assert crowded_folders() == []


def test_no_function_over_sixty_lines_outside_the_kernels():
    assert long_functions() == []


def test_package_maps_name_their_rooms_and_only_files_that_exist():
    assert drifting_maps() == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """Each check on a tree made to break it: a circle through a late import, a crowded folder, a long
    function, a wrong arrow between rooms, a map that forgot a room and names a file that is gone."""
    service = tmp_path / "gateway"
    (service / "text").mkdir(parents=True)
    (service / "apis").mkdir()
    (service / "__init__.py").write_text('"""The gateway: apis/ only; see gone.py."""\n')
    (service / "text" / "__init__.py").write_text('"""Text."""\n')
    (service / "apis" / "__init__.py").write_text('"""APIs."""\n')
    (service / "text" / "tokenizer.py").write_text("def late():\n    from gateway.apis.http import serve\n")
    (service / "apis" / "http.py").write_text("from gateway.text.tokenizer import late\n\ndef serve():\n"
                                              + "    x = 1\n" * 61)
    for index in range(MAX_MODULES + 1):
        (service / "apis" / f"m{index}.py").write_text("")
    graph = import_graph(tmp_path, ("gateway",))
    assert import_circles(graph) == [["gateway.apis.http", "gateway.text.tokenizer"]]
    assert crowded_folders(tmp_path) == [f"gateway/apis: {MAX_MODULES + 2} modules"]
    assert long_functions(tmp_path, ("gateway",)) == ["gateway/apis/http.py:3 serve (62 lines)"]
    wrong = arrows_between_rooms({"gateway.text": ("gateway.apis",)}, tmp_path)
    assert wrong == ["gateway/text/tokenizer.py:2 imports gateway.apis.http (gateway.text never imports gateway.apis)"]
    assert drifting_maps(tmp_path) == ["gateway/__init__.py: the map does not name the room text/",
                                       "gateway/__init__.py: the map names gone.py, which is not there"]


def test_type_checking_imports_close_no_circle(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from core.b import B\n")
    (tmp_path / "core" / "b.py").write_text("from core.a import A\n")
    assert import_circles(import_graph(tmp_path, ("core",))) == []
