"""The rendered overlays: valid Kubernetes objects, and the properties the deployment promises
(probes, security, secrets, network isolation, graceful shutdown, GPUs where they belong)."""
from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.conftest import OVERLAYS, container, find, pod_spec, workloads
from plumbing import rpc

# the oldest release with GA gRPC probes that is still common, and the newest the package knows
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
# CRDs have no schema in kubernetes-validate; their shape is checked by hand below
CRD_KINDS = {"ServiceMonitor"}
SECRETS = {"tokenmill-redis": {"password"}, "tokenmill-api-keys": {"keys.jsonl"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    objects = rendered[overlay]
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "NetworkPolicy", "ServiceMonitor", "ConfigMap"} <= kinds
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            if obj["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_misspelled_field(rendered):
    import copy

    broken = copy.deepcopy(find(rendered["cpu"], "Deployment", "tokenmill-gateway"))
    pod_spec(broken)["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_selects_services_and_ports_that_exist(rendered, overlay):
    objects = rendered[overlay]
    monitor = find(objects, "ServiceMonitor", "tokenmill")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in objects if s["kind"] == "Service"
                and wanted.items() <= s["metadata"].get("labels", {}).items()]
    port_names = {port["name"] for service in services for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    assert {"metrics", "sched-metrics", "worker-metrics"} <= {e["port"] for e in monitor["spec"]["endpoints"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_locked_down(rendered, overlay):
    for obj in workloads(rendered[overlay]):
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec.get("automountServiceAccountToken") is False
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            where = f"{obj['metadata']['name']}/{c['name']}"
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{where}: /tmp must be a writable emptyDir"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), f"{where}: image {c['image']} unpinned"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tokenmill_probes_use_grpc_health_with_our_service_names(rendered, overlay):
    expected = {("tokenmill-gateway", "gateway"): rpc.GENERATION_SERVICE,
                ("tokenmill-model", "scheduler"): rpc.SCHEDULER_SERVICE,
                ("tokenmill-model", "worker"): rpc.WORKER_SERVICE}
    for (workload, name), service in expected.items():
        c = container(rendered[overlay], workload, name)
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] in ("grpc", "worker"))
        # readiness and startup wait for the named service (SERVING only after warm-up); liveness
        # asks for "" (SERVING as soon as the server answers), so a long model load is not a restart
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port, "service": service}, f"{workload}/{name} {probe}"
        assert c["livenessProbe"]["grpc"].get("service", "") == "" and c["livenessProbe"]["grpc"]["port"] == grpc_port
    worker = container(rendered[overlay], "tokenmill-model", "worker")
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading gets at least 10 minutes"


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_outlasts_prestop_and_drain(rendered, overlay):
    for workload, name in (("tokenmill-gateway", "gateway"), ("tokenmill-model", "scheduler")):
        obj = next(o for o in workloads(rendered[overlay]) if o["metadata"]["name"] == workload)
        c = container(rendered[overlay], workload, name)
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain_s = float(_flag(c["args"], "--drain-timeout-s"))
        # the gateway then keeps /metrics up for a last scrape of the requests its drain cut
        linger_s = float(_flag(c["args"], "--metrics-linger-s")) if name == "gateway" else 0.0
        assert pod_spec(obj)["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain_s + linger_s, workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_credentials_come_from_secrets_only(rendered, overlay):
    objects = rendered[overlay]
    assert not [o for o in objects if o["kind"] == "Secret"], "no Secret belongs in git: create them (docs/deploy.md)"
    referenced = set()
    for obj in workloads(objects):
        for c in pod_spec(obj)["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in SECRETS[ref["name"]]
                    referenced.add(ref["name"])
                if "redis://" in env.get("value", ""):
                    assert "redis://:$(REDIS_PASSWORD)@" in env["value"], f"password must come from the Secret: {env}"
            assert not [a for a in c.get("args", []) if "redis://" in a], "no Redis password in argv (ps shows it)"
        for volume in pod_spec(obj).get("volumes", []):
            if "secret" in volume:
                assert {item["key"] for item in volume["secret"]["items"]} <= SECRETS[volume["secret"]["secretName"]]
                referenced.add(volume["secret"]["secretName"])
    assert referenced == set(SECRETS)
    # API keys guard every public API (not only HTTP), read from the mounted Secret, never from argv
    gateway_pod = pod_spec(find(objects, "Deployment", "tokenmill-gateway"))
    gateway = container(objects, "tokenmill-gateway", "gateway")
    keys_file = _flag(gateway["args"], "--api-keys-file")
    mount = next(m for m in gateway["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in gateway_pod["volumes"] if v["name"] == mount["name"])
    assert mount.get("readOnly") and volume["secret"]["secretName"] == "tokenmill-api-keys"
    assert not [a for a in gateway["args"] if a.startswith("--http-api-key")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_expose_only_the_gateway(rendered, overlay):
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered[overlay] if p["kind"] == "NetworkPolicy"}
    deny = policies["tokenmill-default-deny"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    open_to_all = [name for name, spec in policies.items()
                   if any("from" not in rule for rule in spec.get("ingress", []))]
    assert open_to_all == ["tokenmill-gateway-ingress"]
    assert policies["tokenmill-gateway-ingress"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "tokenmill-gateway"}
    redis = policies["tokenmill-redis-ingress"]
    assert redis["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "tokenmill"}}}],
                                 "ports": [{"protocol": "TCP", "port": 6379}]}]
    model = policies["tokenmill-model-ingress"]["ingress"]
    assert [peer["podSelector"]["matchLabels"] for rule in model for peer in rule["from"]] == [
        {"app.kubernetes.io/name": "tokenmill-gateway"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pods_and_services_target_named_ports(rendered, overlay):
    objects = rendered[overlay]
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in workloads(objects)}
    for obj in workloads(objects):
        assert obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in (o for o in objects if o["kind"] == kind):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
            assert len(matched) == 1, f"{kind}/{obj['metadata']['name']} selects {len(matched)} workloads"
            if kind == "Service":
                names = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
                for port in obj["spec"]["ports"]:
                    assert port["targetPort"] in names, f"{obj['metadata']['name']}: no container port {port['targetPort']}"
    hpa = find(objects, "HorizontalPodAutoscaler", "tokenmill-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] in pods and hpa["spec"]["minReplicas"] >= 2
    assert find(objects, "Service", "tokenmill-model")["spec"]["clusterIP"] == "None"  # the gateway resolves every pod


def test_only_the_gpu_overlay_asks_for_gpus_and_the_cuda_image(rendered):
    for overlay in OVERLAYS:
        worker = container(rendered[overlay], "tokenmill-model", "worker")
        scheduler = container(rendered[overlay], "tokenmill-model", "scheduler")
        gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == ("1" if overlay == "gpu" else None)
        assert "nvidia.com/gpu" not in scheduler["resources"].get("limits", {})
        assert worker["image"].endswith("-cuda") == (overlay == "gpu")
        assert scheduler["image"].endswith("-cpu")
