"""docker-compose.yml against the Compose Specification's JSON schema (the copy check-jsonschema
ships, so no network and no docker engine are needed), plus what the stack promises."""
from __future__ import annotations

import copy
import json
from importlib import resources

import jsonschema
import pytest

from tests.deploy.conftest import ROOT

SERVICES = {"redis", "worker", "worker-gpu", "scheduler", "gateway", "otel-collector", "jaeger", "prometheus",
            "grafana"}
# the files deploy/observability (another branch) owns, mounted here at the paths their comments name
OBSERVABILITY_MOUNTS = {
    "./deploy/observability/otel-collector.yaml": "/etc/otelcol/config.yaml",
    "./deploy/observability/prometheus.yml": "/etc/prometheus/prometheus.yml",
    "./deploy/observability/grafana/provisioning/datasources": "/etc/grafana/provisioning/datasources",
    "./deploy/observability/grafana/provisioning/dashboards": "/etc/grafana/provisioning/dashboards",
    "./deploy/observability/grafana/dashboards": "/var/lib/grafana/dashboards",
}


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def test_compose_file_follows_the_compose_specification(compose, validator):
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["healthchek"] = broken["services"]["gateway"].pop("healthcheck")
    assert any("healthchek" in e.message for e in validator.iter_errors(broken)), "the schema must catch a typo"


def test_every_service_has_a_health_check(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


def test_redis_has_a_password_and_persistence(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in compose["volumes"]
    for name in ("gateway", "scheduler"):
        service = compose["services"][name]
        assert service["environment"]["TOKENMILL_REDIS_URL"].startswith("redis://:${REDIS_PASSWORD:?")
        assert not [a for a in service["command"] if "redis://" in a], "no password in the command line"


def test_cpu_worker_by_default_and_a_gpu_profile_with_a_device_reservation(compose):
    services = compose["services"]
    assert "profiles" not in services["worker"] and services["worker-gpu"]["profiles"] == ["gpu"]
    assert services["worker-gpu"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in services["worker"]


def test_tokenmill_containers_run_locked_down(compose):
    for name in ("gateway", "scheduler", "worker", "worker-gpu"):
        service = compose["services"][name]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"] and "/tmp" in service["tmpfs"]
        assert int(service["stop_grace_period"].rstrip("s")) > 30  # the processes' --drain-timeout-s


def test_observability_files_are_mounted_where_their_configs_expect(compose):
    mounts = {}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source, _, target = volume.partition(":")
            if source.startswith("./"):
                mounts[source] = target.removesuffix(":ro")
    assert mounts == OBSERVABILITY_MOUNTS
    missing = [source for source in mounts if not (ROOT / source).exists()]
    assert not missing
