"""CI renders the overlays with tests/helpers/kustomize.py (no kustomize binary there); here, where
kubectl is installed, that renderer must produce exactly what `kubectl kustomize` does."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.conftest import K8S, OVERLAYS
from tests.helpers.kustomize import UnsupportedKustomization, normalized, render, strategic_merge


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the renderer is checked against it where it is")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert normalized(render(K8S / "overlays" / overlay)) == normalized(list(yaml.safe_load_all(out)))


def test_strategic_merge_merges_named_lists_and_replaces_plain_ones():
    base = {"containers": [{"name": "a", "args": ["x", "y"], "env": [{"name": "K", "value": "1"}]},
                           {"name": "b", "image": "b"}]}
    patch = {"containers": [{"name": "a", "args": ["z"], "env": [{"name": "L", "value": "2"}]},
                            {"name": "c", "image": "c"}]}
    merged = strategic_merge(base, patch)
    assert [c["name"] for c in merged["containers"]] == ["c", "a", "b"]
    assert merged["containers"][1] == {"name": "a", "args": ["z"],
                                       "env": [{"name": "L", "value": "2"}, {"name": "K", "value": "1"}]}


def test_a_kustomize_feature_the_renderer_lacks_is_refused(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(UnsupportedKustomization, match="commonLabels"):
        render(tmp_path)
