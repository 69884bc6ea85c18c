"""A small kustomize, enough for deploy/k8s, so CI can render the overlays without the kustomize
binary (tests/deploy/test_kustomize_renderer.py proves it renders what `kubectl kustomize` renders,
wherever kubectl is installed).

Supported, as kustomize does it: `resources` (files and directories holding a kustomization.yaml,
rendered recursively), `namespace` (set on every namespaced object), `images` (name -> newName /
newTag / digest on containers and initContainers), `patches` (strategic-merge patches from `path`
or inline `patch`, applied to the object of the same apiVersion kind and name; `$patch: delete` removes it). Anything else in a
kustomization is refused with an error naming the field, so a manifest change that needs more of
kustomize fails here instead of rendering something different.

Strategic merge: maps merge key by key; lists of objects merge by their Kubernetes merge key
(containers, env, volumes... by name; volumeMounts by mountPath; ports by containerPort) with new
entries put first, as kustomize does; every other list is replaced whole; `null` deletes a key.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# list field name -> merge key (k8s.io/api patchMergeKey tags for the fields our manifests use)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "imagePullSecrets": "name", "volumeClaimTemplates": None}


class UnsupportedKustomization(ValueError):
    pass


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects `kustomize build directory` would output (order aside)."""
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{directory}/kustomization.yaml uses {sorted(unknown)}; "
                                       f"tests/helpers/kustomize.py supports only {sorted(SUPPORTED_FIELDS)}")
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        if set(patch) - {"path", "patch"}:
            raise UnsupportedKustomization(f"patch {patch} in {directory}: only path/patch (no target) supported")
        body = yaml.safe_load((directory / patch["path"]).read_text() if "path" in patch else patch["patch"])
        _apply_patch(objects, body, directory)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _apply_patch(objects: list[dict], patch: dict, directory: Path) -> None:
    name = patch["metadata"]["name"]
    for index, obj in enumerate(objects):
        if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == name and \
                obj["apiVersion"].split("/")[0] == patch["apiVersion"].split("/")[0]:
            if patch.get("$patch") == "delete":  # the whole object goes, as kustomize's delete directive
                del objects[index]
            else:
                objects[index] = strategic_merge(obj, patch)
            return
    raise UnsupportedKustomization(f"patch in {directory} targets {patch['kind']}/{name}, which no resource defines")


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    if isinstance(original, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    merge_key = MERGE_KEYS.get(field)
    if isinstance(original, list) and isinstance(patch, list) and merge_key:
        by_key = {item[merge_key]: item for item in original}
        patched = {item[merge_key]: item for item in patch}
        new = [copy.deepcopy(item) for item in patch if item[merge_key] not in by_key]
        kept = [strategic_merge(item, patched[item[merge_key]], "") if item[merge_key] in patched
                else copy.deepcopy(item) for item in original]
        return new + kept
    return copy.deepcopy(patch)


def _set_image(obj: dict, image: dict) -> None:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, sep, tag = container["image"].partition("@")
        if not sep:
            name, _, tag = name.partition(":")
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
        elif "newTag" in image:
            container["image"] = f"{name}:{image['newTag']}"
        else:
            container["image"] = f"{name}{'@' if sep else ':' if tag else ''}{tag}"


def normalized(objects: list[dict]) -> dict[tuple, dict]:
    """Objects keyed by (kind, namespace, name), lists with merge keys sorted by them: two renders
    that differ only in order compare equal."""
    def sort_lists(value: Any, field: str = "") -> Any:
        if isinstance(value, dict):
            return {key: sort_lists(item, key) for key, item in value.items()}
        if isinstance(value, list):
            items = [sort_lists(item) for item in value]
            key = MERGE_KEYS.get(field)
            return sorted(items, key=lambda item: str(item.get(key)) + json.dumps(item, sort_keys=True)) if key else items
        return value

    return {(obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]): sort_lists(obj)
            for obj in objects}
