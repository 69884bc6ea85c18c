"""Secure defaults: every process listens on loopback unless told otherwise, scheduler and worker stay
there when only the gateway is exposed, message limits are set, Redis passwords stay out of argv, and
`tokenmill serve` rejects TLS and Redis credential flags that cannot work before starting anything."""
from __future__ import annotations

import pytest

from gateway.main import parse_args as gateway_args
from scheduler.main import parse_args as scheduler_args
from tests.helpers.certificates import make_pki
from tokenmill import cli
from tokenmill.cluster.config import ClusterConfig, resolve_ports
from tokenmill.cluster.specs import cluster_specs
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, PUBLIC_MAX_MESSAGE_BYTES
from tokenmill.cluster.redis_process import redis_spec
from plumbing.tls import ClusterTLS
from worker.main import parse_args as worker_args

LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_process_listens_on_loopback_by_default_with_a_message_limit():
    for parse, limit in ((gateway_args, PUBLIC_MAX_MESSAGE_BYTES), (scheduler_args, INTERNAL_MAX_MESSAGE_BYTES),
                         (worker_args, INTERNAL_MAX_MESSAGE_BYTES)):
        args = parse([])
        assert (args.host, args.max_message_bytes, args.tls) == (LOOPBACK, limit, None), parse.__module__
    assert PUBLIC_MAX_MESSAGE_BYTES == 4 * 2**20
    assert _flag(list(redis_spec(6379).argv), "--bind") == LOOPBACK
    serve = cli.build_parser().parse_args(["serve"])
    assert (serve.host, serve.internal_host) == (LOOPBACK, LOOPBACK)
    assert (ClusterConfig().host, ClusterConfig().internal_host) == (LOOPBACK, LOOPBACK)


def test_exposing_the_gateway_keeps_scheduler_and_worker_on_loopback():
    config = resolve_ports(ClusterConfig(host="0.0.0.0", gateway_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, redis_password="secret"))
    redis, worker, scheduler, gateway = cluster_specs(config)
    assert _flag(list(gateway.argv), "--host") == "0.0.0.0"
    for spec, parse in ((worker, worker_args), (scheduler, scheduler_args)):  # past "python -m x.main"
        assert parse(list(spec.argv[3:])).host == LOOPBACK and spec.address.startswith(f"{LOOPBACK}:")
    for spec in (redis, worker, scheduler, gateway):
        assert "secret" not in " ".join(spec.argv), spec.name  # the URL travels in TOKENMILL_REDIS_URL
    assert gateway.env["TOKENMILL_REDIS_URL"] == f"redis://:secret@127.0.0.1:{config.redis_port}/0"
    assert _flag(list(gateway.argv), "--max-message-bytes") == str(PUBLIC_MAX_MESSAGE_BYTES)
    assert _flag(list(worker.argv), "--max-message-bytes") == str(INTERNAL_MAX_MESSAGE_BYTES)


def test_tls_reaches_every_link_and_every_readiness_probe(pki):
    tls = ClusterTLS(pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key)
    config = resolve_ports(ClusterConfig(gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0, tls=tls))
    _, worker, scheduler, gateway = cluster_specs(config)
    server_flags = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca]
    for spec in (worker, scheduler, gateway):
        argv = " ".join(spec.argv)
        assert " ".join(server_flags) in argv and spec.tls == tls.client(), spec.name
    assert f"--worker-tls-ca {pki.ca} --worker-tls-cert {pki.client_cert}" in " ".join(scheduler.argv)
    assert f"--scheduler-tls-ca {pki.ca} --scheduler-tls-cert {pki.client_cert}" in " ".join(gateway.argv)


def _serve_options(*argv: str) -> dict:
    return cli.serve_security_options(cli.build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "TLS needs all of --tls-ca, --tls-cert and --tls-key"),
    (["--tls-ca", "{ca}", "--tls-cert", "{cert}", "--tls-key", "/nonexistent.key"], "--tls-key /nonexistent.key"),
    (["--redis-user", "app"], "--redis-user needs --redis-password-file"),
    (["--redis-password-file", "/nonexistent"], "--redis-password-file /nonexistent"),
    (["--redis-url", "redis://h:1/0", "--redis-password-file", "{ca}"], "put the credentials of an external Redis"),
])
def test_serve_rejects_security_flags_that_cannot_work(pki, argv, message):
    files = dict(ca=pki.ca, cert=pki.server_cert)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        _serve_options(*(arg.format(**files) for arg in argv))


def test_serve_reads_the_redis_password_from_a_file(tmp_path):
    (tmp_path / "pw").write_text("hunter2\n")
    options = _serve_options("--redis-user", "app", "--redis-password-file", str(tmp_path / "pw"))
    assert (options["redis_user"], options["redis_password"]) == ("app", "hunter2")


def test_serve_makes_a_secret_per_cluster_that_travels_in_the_environment_not_argv(monkeypatch):
    monkeypatch.delenv("TOKENMILL_INTERNAL_SECRET", raising=False)
    first, second = _serve_options()["internal_secret"], _serve_options()["internal_secret"]
    assert first != second and len(first) >= 32
    config = resolve_ports(ClusterConfig(gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
                                         internal_secret=first))
    assert first not in repr(config)
    redis, *servers = cluster_specs(config)
    for spec in servers:
        assert spec.env["TOKENMILL_INTERNAL_SECRET"] == first and first not in " ".join(spec.argv), spec.name
    assert first not in " ".join(redis.argv) and "TOKENMILL_INTERNAL_SECRET" not in (redis.env or {})
    # a config without one hands its children an empty value: none inherited from the supervisor's environment
    _, *servers = cluster_specs(resolve_ports(ClusterConfig(gateway_port=0, scheduler_port=0, worker_port=0,
                                                            redis_port=0)))
    assert {spec.env["TOKENMILL_INTERNAL_SECRET"] for spec in servers} == {""}
    # processes started by hand without one check nothing, as before
    for parse in (gateway_args, scheduler_args, worker_args):
        assert parse([]).internal_secret is None, parse.__module__


def test_the_http_api_has_header_and_keepalive_timeouts_and_a_per_client_cap_by_default():
    limits = gateway_args([]).http_connections
    assert (limits.header_timeout_s, limits.keepalive_timeout_s, limits.max_connections_per_client) == (10.0, 30.0, 1024)
    serve = cli.build_parser().parse_args(["serve", "--http-header-timeout-s", "5", "--http-keepalive-timeout-s", "20",
                                           "--http-max-connections-per-client", "32"])
    config = resolve_ports(ClusterConfig(gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
                                         http_header_timeout_s=serve.http_header_timeout_s,
                                         http_keepalive_timeout_s=serve.http_keepalive_timeout_s,
                                         http_max_connections_per_client=serve.http_max_connections_per_client))
    limits = gateway_args(list(cluster_specs(config)[-1].argv[3:])).http_connections
    assert (limits.header_timeout_s, limits.keepalive_timeout_s, limits.max_connections_per_client) == (5.0, 20.0, 32)
