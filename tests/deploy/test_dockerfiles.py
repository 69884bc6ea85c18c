"""Invariants of the images that can be checked without a docker engine (there is none on our
machines, so the images are not built in CI): multi-stage, a non-root user in the final stage,
pinned base images and packages, and a build context limited by .dockerignore."""
from __future__ import annotations

import fnmatch
import re
import tomllib

import pytest

from tests.deploy.conftest import ROOT

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
LOCK = ROOT / "deploy" / "docker" / "requirements.lock"


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / "deploy" / "docker" / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def _args(instructions) -> dict[str, str]:
    return dict(value.split("=", 1) for op, value in instructions if op == "ARG" and "=" in value)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_with_a_non_root_final_stage(name):
    instructions = _instructions(name)
    stages = [value for op, value in instructions if op == "FROM"]
    assert len(stages) >= 2 and all(" AS " in s.upper() for s in stages), stages
    final = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    final_stage = instructions[final:]
    users = [value for op, value in final_stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name} must end as a non-root user"
    assert any(op == "COPY" and "--from=build" in value for op, value in final_stage), "runtime copies from build"
    assert any(op == "HEALTHCHECK" and "tokenmill.cluster.healthcheck" in value for op, value in final_stage)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_and_packages_are_pinned(name):
    instructions = _instructions(name)
    args = _args(instructions)
    for op, value in instructions:
        if op == "FROM":
            image = value.split()[0]
            image = args.get(image.strip("${}"), image) if image.startswith("$") else image
            if image in ("build",):
                continue
            assert re.search(r":\d+\.\d+\.\d+", image), f"{name}: base image {image} not pinned to a version"
        if op == "RUN" and "pip install" in value:
            for command in re.split(r"&&|;", value):
                if "pip install" not in command:
                    continue
                words = command.split("pip install", 1)[1].split()
                specs = [w.strip('"') for i, w in enumerate(words)
                         if not w.startswith("-") and not words[i - 1].startswith(("--index-url", "-r")) and
                         not w.startswith("/") and w not in ("fi",)]
                for spec in specs:
                    assert "==" in spec, f"{name}: `pip install {spec}` is not pinned"
    assert any(op == "RUN" and "-r /tmp/requirements.lock" in value for op, value in instructions)


def test_lock_pins_every_runtime_dependency():
    from packaging.requirements import Requirement

    pinned = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock line {line!r} is not pinned with =="
            pinned[name] = version
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dependency in dependencies:
        name = Requirement(dependency).name.lower().replace("_", "-")
        assert name == "torch" or name in pinned, f"runtime dependency {name} missing from requirements.lock " \
                                                  "(re-run scripts/lock_runtime_deps.py)"
    assert "torch" not in pinned  # each Dockerfile pins it from its own index


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or \
                (pattern.startswith("**/") and fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern[3:])):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_images_copy_and_nothing_else():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = set()
    for name in DOCKERFILES:
        for op, value in _instructions(name):
            if op == "COPY" and "--from" not in value:
                copied.update(value.split()[:-1])
    for source in copied:
        assert not _ignored(source, patterns), f"{source} is copied but .dockerignore leaves it out"
    for private in (".venv", ".git", "tests", "docs/benchmarks", "bench_out", "gateway/__pycache__"):
        assert _ignored(private, patterns), f"{private} would be sent to the docker build context"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_package_of_the_project_is_copied_into_the_image(name):
    """pip install /src installs only what was copied there: a package left out imports nowhere."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in found}
    copied = {value.split()[0] for op, value in _instructions(name) if op == "COPY" and value.split()[-1].startswith("/src/")}
    assert packages <= copied, f"{name}: not copied into /src: {sorted(packages - copied)}"


def test_the_cpu_image_builds_the_compiled_cpu_ops_for_the_installed_package():
    runs = [value for op, value in _instructions("Dockerfile.cpu") if op == "RUN"]
    install = next(i for i, value in enumerate(runs) if "pip install --no-deps /src" in value)
    assert any("build_cpu_ops.py --installed" in value for value in runs[install + 1:])
    assert {"csrc/*.cpp", "csrc/*.h"} <= set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["worker"])
