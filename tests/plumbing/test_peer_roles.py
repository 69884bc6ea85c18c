"""Internal servers admit callers by the role their client certificate names: a real grpc.aio server
over mutual TLS with certificates from tests/helpers/certificates.py, and the scheduler's own servicer
for the rule that only a gateway may set a request's owner."""
from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from plumbing import peer_roles, rpc
from plumbing.tls import ClientTLS, ServerTLS, aio_channel, listen
from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.process.service import SchedulerServicer
from tests.helpers.certificates import make_pki
from tests.helpers.open_services import assert_health_and_reflection_answer


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(pki, allowed_roles, reflection_on=True):
    tls = ServerTLS(pki.server_cert, pki.server_key, pki.ca)
    server = rpc.create_server(interceptors=peer_roles.interceptors(tls, allowed_roles, "scheduler"))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(), server)  # no loop: "starting"
    rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE], reflection_on=reflection_on)
    port = listen(server, "127.0.0.1:0", tls)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _submit(address, tls: ClientTLS, owner: str) -> tuple[grpc.StatusCode, str]:
    async with aio_channel(address, tls) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Submit(
            scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1], owner=owner), timeout=10)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def test_only_an_allowed_role_gets_past_health_and_reflection(pki):
    server, address = await _serve(pki, {"gateway"})
    try:
        as_gateway = ClientTLS(pki.ca, pki.gateway_cert, pki.gateway_key)
        for cert, key in ((pki.scheduler_cert, pki.scheduler_key), (pki.roleless_cert, pki.roleless_key)):
            code, details = await _submit(address, ClientTLS(pki.ca, cert, key), "")
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "needs a client certificate naming the role gateway" in details
            async with aio_channel(address, ClientTLS(pki.ca, cert, key)) as channel:  # open to any certificate
                await assert_health_and_reflection_answer(channel, rpc.SCHEDULER_SERVICE)
        # the gateway's certificate gets through to the servicer, which is still starting
        assert (await _submit(address, as_gateway, "alice"))[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_only_a_gateway_may_set_owner_even_where_schedulers_are_admitted(pki):
    server, address = await _serve(pki, {"gateway", "scheduler"})
    try:
        as_scheduler = ClientTLS(pki.ca, pki.scheduler_cert, pki.scheduler_key)
        code, details = await _submit(address, as_scheduler, "alice")
        assert code == grpc.StatusCode.PERMISSION_DENIED and "only a caller whose certificate names the gateway" in details
        assert (await _submit(address, as_scheduler, ""))[0] == grpc.StatusCode.UNAVAILABLE  # no owner: admitted
    finally:
        await server.stop(None)


async def test_reflection_can_be_turned_off(pki):
    server, address = await _serve(pki, {"gateway"}, reflection_on=False)
    try:
        async with aio_channel(address, ClientTLS(pki.ca, pki.gateway_cert, pki.gateway_key)) as channel:
            listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in listed:
                    pass
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, caught.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize("main", ["scheduler.main", "worker.main"])
def test_a_non_loopback_host_without_mutual_tls_refuses_to_start(main):
    done = subprocess.run([sys.executable, "-m", main, "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--host 0.0.0.0 is not a loopback address" in done.stderr and "--insecure-internal" in done.stderr


def test_insecure_internal_is_allowed_and_logged_loudly(caplog):
    with caplog.at_level(logging.WARNING):
        peer_roles.check_internal_exposure("scheduler", "0.0.0.0", mutual_tls=False, insecure_internal=True)
    assert "INSECURE: scheduler listens on 0.0.0.0 without mutual TLS" in caplog.text
    peer_roles.check_internal_exposure("worker", "::1", mutual_tls=False, insecure_internal=False)  # loopback
    peer_roles.check_internal_exposure("worker", "10.0.0.7", mutual_tls=True, insecure_internal=False)
