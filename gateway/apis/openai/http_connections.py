"""Connection limits of the HTTP API: a header-read timeout, an idle keep-alive timeout and a cap on
concurrent connections per client address (issue 31: slowloris and idle connections held forever).

    limits = ConnectionLimits(header_timeout_s=10, keepalive_timeout_s=30, max_connections_per_client=1024)
    app.middlewares.insert(0, track_requests)      # outermost: where a request begins, its header wait ends
    runner = web.AppRunner(app, keepalive_timeout=limits.keepalive_timeout_s)
    await runner.setup()
    await GuardedSite(runner, host, port, limits=limits).start()

aiohttp closes a connection that waits for a request longer than keepalive_timeout (from its start and
after each response), whether or not a client is trickling header bytes; it has no shorter header
timeout. So every connection is an asyncio protocol in front of aiohttp's (GuardedConnection):

    accept ─ over the cap for its address? ─► 429 Too Many Requests, closed (aiohttp never sees it)
      │
     idle ──first byte──► headers arriving ──the request reaches the app──► in a request ──► idle
     (keep-alive timeout:  (header_timeout_s:                               (no limit here: a stream
      aiohttp closes it)    then the connection is aborted)                  runs as long as it runs)

A pipelined request that arrives while another is in flight waits under the keep-alive timeout only.
TLS handshakes have asyncio's own timeout (60 s).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from plumbing.options import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT

logger = logging.getLogger(__name__)

REFUSED_LINGER_S = 1.0  # how long a refused connection may take to read its 429 and close


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # first byte of a request to its complete headers; 0: no limit
    keepalive_timeout_s: float = 30.0  # idle between requests (and before the first); longer than clients' pools keep
    # open connections per client address (clients behind one proxy or NAT share one); 0: no cap. Well above
    # a load generator's concurrency: one that opens a connection per request (vLLM's benchmark_serving,
    # tokenmill bench) briefly holds more than c of them, and at 256 a c=256 run got 6 of 512 requests
    # refused (scripts/peers/compare.sh --near-free, 2026-12-06)
    max_connections_per_client: int = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags, and `tokenmill serve`'s (tokenmill.cluster.config), which passes them on."""
    defaults = ConnectionLimits()
    parser.add_argument("--http-header-timeout-s", type=NON_NEGATIVE_FLOAT, default=defaults.header_timeout_s,
                        help="an HTTP client that has not sent a request's complete headers this long after their "
                             "first byte is disconnected (slowloris); 0: no limit (default: %(default)s)")
    parser.add_argument("--http-keepalive-timeout-s", type=POSITIVE_FLOAT, default=defaults.keepalive_timeout_s,
                        help="an HTTP connection idle this long between requests, or before its first, is closed "
                             "(default: %(default)s)")
    parser.add_argument("--http-max-connections-per-client", type=NON_NEGATIVE_INT,
                        default=defaults.max_connections_per_client,
                        help="open HTTP connections one client address may hold; more are answered 429 and closed "
                             "at once; clients behind one proxy share an address; 0: no cap (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The flags' values (their types refuse what is out of range)."""
    return ConnectionLimits(args.http_header_timeout_s, args.http_keepalive_timeout_s,
                            args.http_max_connections_per_client)


class ClientConnections:
    """Open connections per client address, at most limit each (0: no cap)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()
        self._refusing: set[str] = set()

    def admit(self, address: str) -> bool:
        if self.limit and self._open[address] >= self.limit:
            if address not in self._refusing:  # logged once each time an address reaches the cap
                self._refusing.add(address)
                logger.warning("HTTP client %s holds %d connections: more are refused with 429 until some close "
                               "(--http-max-connections-per-client)", address, self._open[address])
            return False
        self._open[address] += 1
        return True

    def release(self, address: str) -> None:
        self._open[address] -= 1
        self._refusing.discard(address)
        if self._open[address] <= 0:
            del self._open[address]

    def open_connections(self, address: str) -> int:
        return self._open[address]


def too_many_connections_response(address: str, limit: int) -> bytes:
    """A whole HTTP/1.1 429 in OpenAI's error shape, sent before the client's request is read."""
    body = json.dumps({"error": {
        "message": f"too many connections from {address}: at most {limit} open at once "
                   "(the gateway's --http-max-connections-per-client); close idle ones or reuse them",
        "type": "rate_limit_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class GuardedConnection(asyncio.Protocol):
    """One accepted connection: admitted under the per-address cap, then handed to aiohttp's protocol
    (make_handler()) with a deadline on each request's headers."""

    def __init__(self, make_handler: Callable[[], asyncio.Protocol], limits: ConnectionLimits,
                 clients: ClientConnections) -> None:
        self._make_handler = make_handler
        self._limits = limits
        self._clients = clients
        self._handler: asyncio.Protocol | None = None  # None: refused, or gone
        self._transport: asyncio.Transport | None = None
        self.address = ""
        self._in_request = False
        self._deadline: asyncio.TimerHandle | None = None  # of the headers; for a refused connection, its linger

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer or "")
        if not self._clients.admit(self.address):
            self._refuse(transport)
            return
        self._handler = self._make_handler()
        self._handler.connection_made(transport)

    def _refuse(self, transport: asyncio.Transport) -> None:
        """A 429, then the end of the stream; the client's request is read and dropped meanwhile (closing
        with it unread would reset the connection, and the client might never see the 429)."""
        transport.write(too_many_connections_response(self.address, self._clients.limit))
        if not transport.can_write_eof():  # TLS
            transport.close()
            return
        transport.write_eof()
        # a client that neither reads nor closes is cut off soon
        self._deadline = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._handler is None:
            return  # refused: dropped
        if not self._in_request and self._deadline is None and self._limits.header_timeout_s > 0:
            self._deadline = asyncio.get_running_loop().call_later(
                self._limits.header_timeout_s, self._headers_overdue)
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        handler, self._handler = self._handler, None
        if handler is not None:
            self._clients.release(self.address)
            handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def request_started(self) -> None:
        """The request's headers are in: the app has it (track_requests)."""
        self._in_request = True
        self._cancel_deadline()

    def request_finished(self) -> None:
        self._in_request = False

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_overdue(self) -> None:
        self._deadline = None
        if self._in_request or self._transport is None or self._handler is None:
            return
        logger.info("HTTP client %s sent no complete request headers within %gs: disconnected "
                    "(--http-header-timeout-s)", self.address, self._limits.header_timeout_s)
        self._transport.abort()  # not close(): a TLS close would wait for the slow client's reply


@web.middleware
async def track_requests(request: web.Request, handler):
    """Outermost middleware: tells the request's GuardedConnection when a request is in the app."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    if not isinstance(connection, GuardedConnection):
        return await handler(request)
    connection.request_started()
    try:
        return await handler(request)
    finally:
        connection.request_finished()


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, each connection a GuardedConnection sharing one per-address count."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, limits: ConnectionLimits,
                 ssl_context=None, backlog: int = 128, reuse_port: bool = False) -> None:
        """reuse_port: SO_REUSEPORT, the port shared with the gateway's other processes (gateway.processes)."""
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.host, self.port, self.limits, self.reuse_port = host, port, limits, reuse_port
        self.clients = ClientConnections(limits.max_connections_per_client)

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()  # registers with the runner, which stops it on cleanup
        factory = functools.partial(GuardedConnection, self._runner.server, self.limits, self.clients)
        self._server = await asyncio.get_running_loop().create_server(
            factory, self.host, self.port, ssl=self._ssl_context, backlog=self._backlog, reuse_port=self.reuse_port)
