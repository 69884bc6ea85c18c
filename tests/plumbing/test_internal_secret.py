"""The internal secret (plumbing.internal_secret) on a real grpc.aio server with the scheduler's own
servicer (no loop: a call that gets through is answered UNAVAILABLE, "starting"): calls without the
secret or with another one are UNAUTHENTICATED naming what is missing and never the secret; health and
reflection stay open; the client side sends it on unary and streaming calls; where it comes from."""
from __future__ import annotations

import argparse

import grpc
import pytest

from plumbing import internal_secret, rpc
from plumbing.internal_secret import METADATA_KEY, aio_channel_with_secret
from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.process.service import SchedulerServicer
from tests.helpers.open_services import assert_health_and_reflection_answer

SECRET = internal_secret.new_secret()


async def _serve(secret: str | None):
    server = rpc.create_server(interceptors=internal_secret.interceptors(secret, "scheduler"))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(), server)
    rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _calls(address: str, secret: str | None) -> dict[str, tuple[grpc.StatusCode, str]]:
    """GetLoad (unary) and Submit (a response stream) through a channel sending secret (None: none)."""
    outcomes = {}
    async with aio_channel_with_secret(address, None, secret=secret) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
            outcomes["GetLoad"] = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as error:
            outcomes["GetLoad"] = error.code(), error.details()
        try:
            async for _ in stub.Submit(scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1]), timeout=10):
                pass
            outcomes["Submit"] = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as error:
            outcomes["Submit"] = error.code(), error.details()
    return outcomes


async def test_calls_without_the_secret_are_unauthenticated_and_with_it_get_through():
    server, address = await _serve(SECRET)
    try:
        for sent, carried in ((None, "carried none"), ("not-" + SECRET, "carried a different one")):
            for method, (code, details) in (await _calls(address, sent)).items():
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
                assert f"/tokenmill.v1.Scheduler/{method} on the scheduler needs this cluster's internal secret" in details
                assert f"'{METADATA_KEY}' metadata" in details and carried in details
                assert SECRET not in details
        # with the secret the servicer answers itself (still starting)
        assert {code for code, _ in (await _calls(address, SECRET)).values()} == {grpc.StatusCode.UNAVAILABLE}
    finally:
        await server.stop(None)


async def test_health_and_reflection_stay_open_without_the_secret():
    server, address = await _serve(SECRET)
    try:
        for secret in (None, SECRET):  # reflection is a bidirectional stream: the client side sends it there too
            async with aio_channel_with_secret(address, None, secret=secret) as channel:
                await assert_health_and_reflection_answer(channel, rpc.SCHEDULER_SERVICE)
    finally:
        await server.stop(None)


async def test_without_a_secret_nothing_is_checked():
    assert internal_secret.interceptors(None, "worker") == [] and internal_secret.interceptors("", "worker") == []
    server, address = await _serve(None)
    try:
        assert {code for code, _ in (await _calls(address, None)).values()} == {grpc.StatusCode.UNAVAILABLE}
    finally:
        await server.stop(None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    internal_secret.add_arguments(parser, "test")
    return parser


def test_the_secret_comes_from_the_file_flag_else_the_environment(tmp_path, capsys):
    parser = _parser()
    environ = {internal_secret.ENV_VAR: "from-env"}
    assert internal_secret.secret_from_args(parser, parser.parse_args([]), environ) == "from-env"
    assert internal_secret.secret_from_args(parser, parser.parse_args([]), {}) is None
    assert internal_secret.secret_from_args(parser, parser.parse_args([]), {internal_secret.ENV_VAR: ""}) is None
    (tmp_path / "secret").write_text("from-file\nignored\n")
    args = parser.parse_args(["--internal-secret-file", str(tmp_path / "secret")])
    assert internal_secret.secret_from_args(parser, args, environ) == "from-file"
    (tmp_path / "empty").write_text("\n")
    for path, message in ((tmp_path / "empty", "the first line is empty"), (tmp_path / "absent", "cannot read it")):
        with pytest.raises(SystemExit):
            internal_secret.secret_from_args(parser, parser.parse_args(["--internal-secret-file", str(path)]), {})
        assert f"--internal-secret-file {path}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("kind, method", [
    (grpc.aio.UnaryUnaryClientInterceptor, "unary_unary"), (grpc.aio.UnaryStreamClientInterceptor, "unary_stream"),
    (grpc.aio.StreamUnaryClientInterceptor, "stream_unary"), (grpc.aio.StreamStreamClientInterceptor, "stream_stream"),
])
async def test_every_call_kind_has_one_sender_that_adds_the_secret_to_the_callers_metadata(kind, method):
    """grpc.aio files an interceptor under the first kind it implements: one sender per kind, each adding
    the secret beside what the caller sent and passing the request (or the request stream) on."""
    senders = [sender for sender in internal_secret._senders(SECRET) if isinstance(sender, kind)]
    assert len(senders) == 1

    async def continuation(details, request):
        return details, request

    sent = grpc.aio.ClientCallDetails("/tokenmill.v1.Scheduler/Submit", 5.0, grpc.aio.Metadata(("x-caller", "a")),
                                      None, None)
    details, request = await getattr(senders[0], f"intercept_{method}")(continuation, sent, "the-request")
    assert list(details.metadata) == [("x-caller", "a"), (METADATA_KEY, SECRET)]
    assert (details.method, details.timeout, request) == ("/tokenmill.v1.Scheduler/Submit", 5.0, "the-request")
