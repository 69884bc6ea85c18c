"""The HTTP API's connection limits (gateway.apis.openai.http_connections) on real sockets against a real aiohttp
server from start_http: a client trickling its headers is cut off after the header timeout (a slow body
is not), an idle keep-alive connection is closed after its timeout, and one address gets no more than
its cap of connections while its others, and other addresses, still work. Timeouts are tiny here; the
scheduler is never asked (/health and a refused body need none)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest

from gateway.apis.openai.http_connections import ConnectionLimits
from gateway.apis.served_model import ServedModel
from gateway.generation.generations import Generations
from gateway.apis.openai.http import OpenAIHTTP, start_http
from gateway.upstream.scheduler_client import SchedulerClient
from gateway.text.tokenizer import load_tokenizer
from gateway.prepare.validation import Limits
from protos.tokenmill.v1 import common_pb2
from tokenmill.cluster.readiness import free_port

HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@contextlib.asynccontextmanager
async def http_server(tokenizer, limits: ConnectionLimits):
    scheduler = SchedulerClient(f"127.0.0.1:{free_port('127.0.0.1')}")  # nobody there; never asked
    info = common_pb2.GetModelInfoResponse(model_config=common_pb2.ModelConfig(name="m", max_context_length=2048))
    api = OpenAIHTTP(ServedModel(Generations(tokenizer, scheduler), info,
                                 Limits(max_model_len=2048, vocab_size=tokenizer.vocab_size)))
    port = free_port("127.0.0.1")
    runner = await start_http(api, "127.0.0.1", port, connections=limits)
    try:
        yield port
    finally:
        await runner.cleanup()
        await scheduler.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(status line, body) of one response with a Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0], body


async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(HEALTH)
    await writer.drain()
    return (await read_response(reader))[0]


async def seconds_until_closed(reader: asyncio.StreamReader, limit_s: float) -> float:
    """How long until the server closes (or resets) the connection; fails if it is open after limit_s."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(limit_s):
            while await reader.read(4096):
                pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection is still open after {limit_s}s")
    return loop.time() - started


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """Writes data one byte at a time until it is all sent or the server hangs up."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)


async def test_a_client_trickling_headers_is_cut_off_after_the_header_timeout_but_a_slow_body_is_not(tokenizer):
    async with http_server(tokenizer, ConnectionLimits(header_timeout_s=0.5, keepalive_timeout_s=30)) as port:
        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
        # a slowloris: a request line, then a header that never ends, a byte every 50 ms (forever at this pace)
        dripping = asyncio.create_task(trickle(slow_writer, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000, 0.05))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await health(reader, writer) == b"HTTP/1.1 200 OK"  # others are served meanwhile
        closed_after = await seconds_until_closed(slow_reader, 5.0)
        assert 0.3 < closed_after < 3.0
        dripping.cancel()
        # headers complete at once, then a body that takes 3 header timeouts: a request in progress is not cut
        body = json.dumps({"model": "m", "prompt": "hi", "temperature": -1}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        await trickle(writer, body, 1.5 / len(body))
        status, answer = await read_response(reader)
        assert status == b"HTTP/1.1 400 Bad Request" and json.loads(answer)["error"]["param"] == "temperature"
        writer.close()
        slow_writer.close()


async def test_an_idle_keepalive_connection_is_closed_after_its_timeout(tokenizer):
    async with http_server(tokenizer, ConnectionLimits(header_timeout_s=10, keepalive_timeout_s=0.5)) as port:
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await health(idle_reader, idle_writer) == b"HTTP/1.1 200 OK"
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)  # never sends a byte
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
        closed = asyncio.gather(seconds_until_closed(idle_reader, 5.0), seconds_until_closed(silent_reader, 5.0))
        for _ in range(5):  # a request every 0.3 s keeps a connection open past the timeout
            assert await health(busy_reader, busy_writer) == b"HTTP/1.1 200 OK"
            await asyncio.sleep(0.3)
        idle_after, silent_after = await closed
        assert 0.3 < idle_after < 3.0 and 0.3 < silent_after < 3.0
        for writer in (idle_writer, silent_writer, busy_writer):
            writer.close()


async def test_one_address_gets_at_most_its_cap_of_connections_while_the_others_still_work(tokenizer):
    async with http_server(tokenizer, ConnectionLimits(max_connections_per_client=2)) as port:
        first, second = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for reader, writer in (first, second):
            assert await health(reader, writer) == b"HTTP/1.1 200 OK"
        # the third from 127.0.0.1: a 429 naming the limit, then closed, whatever it sent
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEALTH)
        status, body = await read_response(reader)
        assert status == b"HTTP/1.1 429 Too Many Requests"
        message = json.loads(body)["error"]["message"]
        assert "127.0.0.1" in message and "at most 2" in message and "--http-max-connections-per-client" in message
        assert await seconds_until_closed(reader, 3.0) < 3.0
        writer.close()
        for open_reader, open_writer in (first, second):  # the two admitted ones still work
            assert await health(open_reader, open_writer) == b"HTTP/1.1 200 OK"
        # another address is counted on its own
        other = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        assert await health(*other) == b"HTTP/1.1 200 OK"
        # one closes: its place is free again
        first[1].close()
        await first[1].wait_closed()
        for _ in range(50):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEALTH)
            status, _ = await read_response(reader)
            writer.close()
            if status == b"HTTP/1.1 200 OK":
                break
            await asyncio.sleep(0.05)
        assert status == b"HTTP/1.1 200 OK"
        for _, open_writer in (second, other):
            open_writer.close()
