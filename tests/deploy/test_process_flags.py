"""The command lines in the Kubernetes manifests and in docker-compose.yml are ones our processes
accept: each is parsed by that process's own argparse parser (gateway/main.py, scheduler/main.py,
worker/main.py build_parser()), and the ports the probes, Services, health checks and peer addresses
use are the ports the processes are told to listen on."""
from __future__ import annotations

import importlib
import re

import pytest

from tests.deploy.conftest import OVERLAYS, container, find
from plumbing import rpc

MODULES = ("gateway.main", "scheduler.main", "worker.main")
METRICS_PORTS = {"gateway.main": 9400, "scheduler.main": 9401, "worker.main": 9402}


def _parser(module: str):
    return importlib.import_module(module).build_parser()


def _interpolate(arg: str) -> str:
    """Kubernetes $(VAR) and compose ${VAR:-default} / ${VAR:?message} as a value would look."""
    arg = re.sub(r"\$\(([A-Z_]+)\)", lambda m: "10.0.0.7" if m.group(1) == "POD_IP" else "secret", arg)
    return re.sub(r"\$\{([A-Z_]+)(?::([-?])([^}]*))?\}",
                  lambda m: m.group(3) if m.group(2) == "-" else "secret", arg)


def parse(command: list[str]):
    """(module, argparse Namespace) for `python -m MODULE ARGS...`; fails if the parser refuses them."""
    assert command[:2] == ["python", "-m"] and command[2] in MODULES, command
    module, args = command[2], [_interpolate(a) for a in command[3:]]
    parser = _parser(module)
    known = set(parser._option_string_actions)
    for arg in args:
        flag = arg.split("=", 1)[0]
        assert not flag.startswith("--") or flag in known, f"{module} has no flag {flag} (used in {command})"
    try:
        namespace = parser.parse_args(args)
    except SystemExit as exit_:
        raise AssertionError(f"{module} refuses {args}") from exit_
    metrics = [a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args)
               if a.split("=", 1)[0] == "--metrics-port"]
    return module, namespace, metrics


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_command_lines_parse_and_ports_agree(rendered, overlay):
    objects = rendered[overlay]
    parsed = {}
    for workload, name in (("tokenmill-gateway", "gateway"), ("tokenmill-model", "scheduler"),
                           ("tokenmill-model", "worker")):
        c = container(objects, workload, name)
        module, args, metrics = parse(c["args"])
        parsed[name] = args
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert args.host == "0.0.0.0"
        grpc_port = ports["grpc" if name != "worker" else "worker"]
        assert args.port == grpc_port and c["readinessProbe"]["grpc"]["port"] == grpc_port
        metrics_port_name = {"gateway": "metrics", "scheduler": "sched-metrics", "worker": "worker-metrics"}[name]
        assert metrics == [str(ports[metrics_port_name])] and ports[metrics_port_name] == METRICS_PORTS[module]
    gateway, scheduler, worker = parsed["gateway"], parsed["scheduler"], parsed["worker"]
    assert parsed["gateway"].http_port == container(objects, "tokenmill-gateway", "gateway")["ports"][1]["containerPort"]
    # the gateway finds the replicas through the headless Service, on the scheduler's port
    host, _, port = gateway.scheduler_dns.rpartition(":")
    model = find(objects, "Service", "tokenmill-model")
    assert host.split(".")[0] == model["metadata"]["name"] and host.split(".")[1] == model["metadata"]["namespace"]
    assert int(port) == scheduler.port == next(p["port"] for p in model["spec"]["ports"] if p["name"] == "grpc")
    # the scheduler reaches its worker inside the pod and advertises the address gateways resolve
    assert scheduler.worker == f"127.0.0.1:{worker.port}"
    assert scheduler.advertise_address == f"10.0.0.7:{scheduler.port}"
    redis = find(objects, "Service", "tokenmill-redis")
    for workload, name in (("tokenmill-gateway", "gateway"), ("tokenmill-model", "scheduler")):
        env = {e["name"]: e.get("value") for e in container(objects, workload, name)["env"]}
        url = _interpolate(env["TOKENMILL_REDIS_URL"])
        assert url == f"redis://:secret@{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
        with pytest.MonkeyPatch.context() as patch:  # the process must take its --redis-url from there
            patch.setenv("TOKENMILL_REDIS_URL", url)
            assert _parser(f"{name}.main").parse_args([]).redis_url == url


def test_compose_command_lines_parse_and_ports_agree(compose):
    services = compose["services"]
    parsed = {}
    for name in ("gateway", "scheduler", "worker", "worker-gpu"):
        module, args, metrics = parse(services[name]["command"])
        parsed[name] = args
        assert metrics == [str(METRICS_PORTS[module])]
        check = services[name]["healthcheck"]["test"]
        assert check[:4] == ["CMD", "python", "-m", "tokenmill.cluster.healthcheck"]
        assert check[4] == f"127.0.0.1:{args.port}"
        assert check[5] == {"gateway.main": rpc.GENERATION_SERVICE, "scheduler.main": rpc.SCHEDULER_SERVICE,
                            "worker.main": rpc.WORKER_SERVICE}[module]
    assert parsed["gateway"].scheduler == [f"scheduler:{parsed['scheduler'].port}"]
    assert parsed["scheduler"].worker == f"worker:{parsed['worker'].port}" and parsed["worker-gpu"].port == parsed["worker"].port
    assert parsed["scheduler"].advertise_address == f"scheduler:{parsed['scheduler'].port}"
    assert services["gateway"]["ports"] == [f"{parsed['gateway'].port}:{parsed['gateway'].port}",
                                            f"{parsed['gateway'].http_port}:{parsed['gateway'].http_port}"]


def test_an_unknown_flag_is_caught():
    with pytest.raises(AssertionError, match="no flag --schedulr"):
        parse(["python", "-m", "gateway.main", "--schedulr=x:1"])
    with pytest.raises(AssertionError, match="refuses"):
        parse(["python", "-m", "worker.main", "--dtype=float64"])
