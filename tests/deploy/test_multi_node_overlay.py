"""deploy/k8s/overlays/multi-node: one model replica over several nodes as a LeaderWorkerSet group (issue 37).
Every built-in object validates against the Kubernetes schemas; the LeaderWorkerSet (a CRD, which
kubernetes-validate has no schema for) has its shape checked here and each of its pod templates validated as
a Pod; the ranks' flags agree with the group's size and address; probes, budgets and policies are in place."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.conftest import K8S, find
from tests.helpers.kustomize import render
from worker.main import parse_args

KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "LeaderWorkerSet"}
LWS_NAME = "tokenmill-group"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(K8S / "overlays" / "multi-node")


@pytest.fixture(scope="module")
def group(objects) -> dict:
    lws = find(objects, "LeaderWorkerSet", LWS_NAME)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    return lws


def templates(group: dict) -> dict[str, dict]:
    spec = group["spec"]["leaderWorkerTemplate"]
    return {"leader": spec["leaderTemplate"], "worker": spec["workerTemplate"]}


def as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": copy.deepcopy(template["metadata"]),
            "spec": copy.deepcopy(template["spec"])}


def worker_args(template: dict) -> list[str]:
    worker = next(c for c in template["spec"]["containers"] if c["name"] == "worker")
    assert worker["args"][:3] == ["python", "-m", "worker.main"]
    return worker["args"][3:]


def test_every_object_validates_and_the_group_replaces_the_statefulset(objects, group):
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            if obj["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(obj, version, strict=True)
        for template in templates(group).values():
            kubernetes_validate.validate(as_pod(template), version, strict=True)
    assert not [obj for obj in objects if obj["kind"] == "StatefulSet" and obj["metadata"]["name"] == "tokenmill-model"]
    spec = group["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"  # the group is one unit
    assert spec["startupPolicy"] == "LeaderCreated" and spec["replicas"] >= 1


def test_pod_template_validation_catches_a_misspelled_field(group):
    pod = as_pod(templates(group)["worker"])
    pod["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 50053}}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[0], strict=True)


def test_every_rank_takes_the_group_size_and_the_leader_rendezvous(group):
    size = group["spec"]["leaderWorkerTemplate"]["size"]
    leader = parse_args([arg.replace("$(LWS_LEADER_ADDRESS)", "leader") for arg in worker_args(templates(group)["leader"])])
    assert (leader.tensor_parallel_size, leader.rank) == (size, 0)
    assert leader.rendezvous == "tcp://leader:29500"  # set: rank 0 starts no local ranks
    follower_args = worker_args(templates(group)["worker"])
    assert "--rank=$(RANK)" in follower_args
    follower = parse_args([arg.replace("$(LWS_LEADER_ADDRESS)", "leader").replace("$(RANK)", "1")
                           for arg in follower_args])
    assert (follower.tensor_parallel_size, follower.rendezvous) == (size, leader.rendezvous)
    env = {e["name"]: e for e in templates(group)["worker"]["spec"]["containers"][0]["env"]}
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"


def test_every_rank_has_probes_and_only_leaders_are_replicas(objects, group):
    for role, template in templates(group).items():
        for container in template["spec"]["containers"]:
            assert {"startupProbe", "livenessProbe"} <= container.keys(), (role, container["name"])
            assert container["startupProbe"]["grpc"]["service"].startswith("tokenmill.v1."), (role, container["name"])
    replicas = find(objects, "Service", "tokenmill-model")["spec"]["selector"]
    assert replicas.items() <= templates(group)["leader"]["metadata"]["labels"].items()
    assert not replicas.items() <= templates(group)["worker"]["metadata"]["labels"].items()  # no scheduler there


def test_budgets_and_the_group_network(objects, group):
    members = {"leaderworkerset.sigs.k8s.io/name": LWS_NAME}
    overall = find(objects, "PodDisruptionBudget", "tokenmill-model")
    assert overall["spec"]["selector"]["matchLabels"] == members and overall["spec"]["maxUnavailable"] == 1
    groups = [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"
              and "leaderworkerset.sigs.k8s.io/group-index" in obj["spec"]["selector"]["matchLabels"]]
    assert sorted(b["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/group-index"] for b in groups) == \
        [str(index) for index in range(group["spec"]["replicas"])]
    policy = find(objects, "NetworkPolicy", LWS_NAME)
    assert policy["spec"]["podSelector"]["matchLabels"] == members
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": members}}]}]  # every port
