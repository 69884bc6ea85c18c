"""plumbing.tls against a real grpc.aio server in this process with certificates made here: who gets
in under TLS and mutual TLS, the supervisor's readiness probe over mTLS, and the flags' errors."""
from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.certificates import make_pki
from plumbing import rpc, tls
from tokenmill.cluster.readiness import GrpcHealthProbe

SERVICE = rpc.WORKER_SERVICE


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(server_tls: tls.ServerTLS | None):
    server = rpc.create_server()
    health = rpc.add_health_and_reflection(server, [SERVICE])
    port = tls.listen(server, "127.0.0.1:0", server_tls)
    await server.start()
    await health.set_ready(True)
    return server, f"127.0.0.1:{port}"


async def _check(address: str, client_tls: tls.ClientTLS | None) -> grpc.StatusCode | int:
    """SERVING's number when the call got through, else the status code the client saw."""
    async with tls.aio_channel(address, client_tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=20)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return reply.status


@pytest.fixture
async def mtls_server(pki):
    server, address = await _serve(tls.ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca))
    yield address
    await server.stop(0)


async def test_mutual_tls_admits_only_clients_with_a_certificate_from_its_ca(pki, mtls_server):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await _check(mtls_server, tls.ClientTLS(pki.ca, pki.client_cert, pki.client_key)) == serving
    refused = {
        "plaintext": None,
        "TLS without a client certificate": tls.ClientTLS(pki.ca),
        "client certificate from another CA": tls.ClientTLS(pki.ca, pki.stranger_client_cert, pki.stranger_client_key),
        "a client that trusts another CA, not the server's": tls.ClientTLS(pki.stranger_ca, pki.client_cert,
                                                                            pki.client_key),
    }
    for what, client_tls in refused.items():
        assert await _check(mtls_server, client_tls) == grpc.StatusCode.UNAVAILABLE, what


async def test_tls_without_client_ca_admits_any_tls_client_but_not_plaintext(pki):
    server, address = await _serve(tls.ServerTLS(pki.server_cert, pki.server_key))
    try:
        assert await _check(address, tls.ClientTLS(pki.ca)) == health_pb2.HealthCheckResponse.SERVING
        assert await _check(address, None) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_readiness_probe_goes_over_mutual_tls(pki, mtls_server):
    probe = GrpcHealthProbe(mtls_server, SERVICE, timeout_s=20, tls=tls.ClientTLS(pki.ca, pki.client_cert, pki.client_key))
    plaintext_probe = GrpcHealthProbe(mtls_server, SERVICE, timeout_s=1)
    try:
        # the probe blocks: run it off the loop that serves the server
        assert await asyncio.to_thread(probe) == (True, "SERVING")
        assert (await asyncio.to_thread(plaintext_probe))[0] is False
    finally:
        probe.close()
        plaintext_probe.close()


def _parse(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    tls.add_server_arguments(parser)
    tls.add_client_arguments(parser, "worker")
    return parser.parse_args(argv), parser


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "{ca}"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/server.key"], "--tls-key /nonexistent/server.key: cannot read"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{not_pem}"], "not a PEM file"),
    (["--worker-tls-cert", "{cert}", "--worker-tls-key", "{key}"], "--worker-tls-cert needs --worker-tls-ca"),
    (["--worker-tls-ca", "{ca}", "--worker-tls-cert", "{cert}"], "--worker-tls-cert and --worker-tls-key go together"),
])
def test_flag_mistakes_fail_at_start_naming_the_flag(pki, tmp_path, capsys, argv, message):
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    files = dict(cert=pki.server_cert, key=pki.server_key, ca=pki.ca, not_pem=str(not_pem))
    args, parser = _parse(*(arg.format(**files) for arg in argv))
    with pytest.raises(SystemExit):
        tls.server_tls_from_args(parser, args)
        tls.client_tls_from_args(parser, args, "worker")
    assert message in capsys.readouterr().err


def test_flags_build_the_configuration_and_give_it_back_as_argv(pki):
    argv = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca,
            "--worker-tls-ca", pki.ca, "--worker-tls-cert", pki.client_cert, "--worker-tls-key", pki.client_key]
    args, parser = _parse(*argv)
    server_tls, client_tls = tls.server_tls_from_args(parser, args), tls.client_tls_from_args(parser, args, "worker")
    assert server_tls == tls.ServerTLS(pki.server_cert, pki.server_key, pki.ca)
    assert (client_tls.ca, client_tls.cert, client_tls.key) == (pki.ca, pki.client_cert, pki.client_key)
    assert server_tls.argv() + client_tls.argv("worker") == argv
    args, parser = _parse()
    assert tls.server_tls_from_args(parser, args) is None and tls.client_tls_from_args(parser, args, "worker") is None


async def test_a_server_named_only_by_its_service_is_reached_by_ip_with_server_name(tmp_path):
    """Replicas found by --scheduler-dns are dialed by pod IP; their certificate names the Service."""
    from tests.helpers.certificates import issue, make_authority, write_pem

    authority = make_authority("replica CA")
    ca, _ = write_pem(tmp_path, "ca", authority.cert, None)
    service = "tokenmill-model.tokenmill.svc.cluster.local"
    cert, key = write_pem(tmp_path, "replica", *issue(authority, "replica", server=True, dns_names=[service]))
    server, address = await _serve(tls.ServerTLS(cert, key))  # dialed as 127.0.0.1:port
    try:
        assert await _check(address, tls.ClientTLS(ca)) == grpc.StatusCode.UNAVAILABLE  # name mismatch
        named = tls.ClientTLS(ca, server_name=service)
        assert await _check(address, named) == health_pb2.HealthCheckResponse.SERVING
        assert await _check(address, tls.ClientTLS(ca, server_name="someone-else.example")) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


def test_server_name_flag_builds_the_option_and_needs_the_ca(pki, capsys):
    args, parser = _parse("--worker-tls-ca", pki.ca, "--worker-tls-server-name", "worker.svc")
    client_tls = tls.client_tls_from_args(parser, args, "worker")
    assert client_tls.server_name == "worker.svc"
    assert client_tls.argv("worker") == ["--worker-tls-ca", pki.ca, "--worker-tls-server-name", "worker.svc"]
    args, parser = _parse("--worker-tls-server-name", "worker.svc")
    with pytest.raises(SystemExit):
        tls.client_tls_from_args(parser, args, "worker")
    assert "--worker-tls-server-name needs --worker-tls-ca" in capsys.readouterr().err
