"""What the deploy tests read: the rendered overlays and the compose file, loaded once."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """overlay name -> its rendered objects."""
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def pod_spec(obj: dict) -> dict | None:
    return obj.get("spec", {}).get("template", {}).get("spec") if obj["kind"] in ("Deployment", "StatefulSet") else None


def workloads(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if pod_spec(obj) is not None]


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(objects: list[dict], workload: str, name: str) -> dict:
    obj = next(o for o in workloads(objects) if o["metadata"]["name"] == workload)
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)
