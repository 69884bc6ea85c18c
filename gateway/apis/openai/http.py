"""OpenAI-compatible HTTP API on the gateway: aiohttp on the gateway's own event loop, beside gRPC.

    api = OpenAIHTTP(model, access, constraints, api_key="")   # model: gateway.apis.served_model.ServedModel
    runner = await start_http(api, host, port)                       # listening
    ...
    unfinished = await api.drain(drain_timeout_s)   # /ready and new requests 503; in-flight ones finish
    await runner.cleanup()                          # stops; what still runs is cut (after 1 s of grace)

Routes: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions
(`stream: true` as server-sent events ending with `data: [DONE]`), GET /health (liveness), GET /ready.
With Redis a one-sample request is resumable (gateway.generation.generations chooses the route): X-Request-Id is claimed (a different request
under a taken id: 409), each delta's last event carries `id: <request id>:<tokens sent>`, the same body
POSTed again with `Last-Event-ID` resumes after that event on any gateway, and a scheduler restart does
not cut the stream (gateway.generation.resume).
Thin: JSON -> openai.requests -> the same prepare_request and Generations.stream (the route every API
shares) as the gRPC API -> openai.responses -> JSON. Errors are OpenAI's JSON shape
(openai.errors). A client that goes away cancels its handler (handler_cancellation), which cancels the
scheduler call and frees its pages. A streaming client that stays connected but stops reading is cut
off after stream_idle_timeout_s (gateway.apis.stream_idle): its request is cancelled, its record says why,
and its connection is reset.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import socket
import ssl
import struct
import time
import uuid

from aiohttp import web

from gateway.access.control import API_KEY, AccessControl, access_middleware
from gateway.apis.served_model import ServedModel
from gateway.apis.openai.http_connections import ConnectionLimits, GuardedSite, track_requests
from gateway.generation.stream import GenerationDelta
from gateway.apis.openai.errors import OpenAIError, openai_error
from gateway.apis.openai.requests import MODELS_HINT, parse_chat, parse_completion
from gateway.apis.openai.responses import ResponseBuilder
from gateway.generation.context import CallContext
from gateway.generation.samples import sample_ids
from gateway.prepare.request_builder import check_constraints, sandbox_or_default
from gateway.apis.stream_idle import IdleWatchdog, StreamIdle, record_idle, write_within
from gateway.text.tool_syntax import choose_tool_syntax
from plumbing.drain import InFlight
from plumbing.grammar_sandbox import GrammarSandbox
from core.errors import InvalidArgument, Unauthenticated, Unavailable, UnknownModel
from core.json_limits import check_document
from gateway.telemetry import CHAT, TEXT_COMPLETION, http_server_span, request_scope

logger = logging.getLogger(__name__)
_dumps = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STOP_GRACE_S = 1.0  # after the drain, what still runs gets this long before it is cut (the gRPC server's grace)


class OpenAIHTTP:
    def __init__(self, model: ServedModel, access: AccessControl | None = None,
                 constraints: GrammarSandbox | None = None, *, api_key: str = "", stream_idle_timeout_s: float = 0.0,
                 tool_call_parser: str = "auto") -> None:
        # the route choice (gateway.generation.generations): with Redis a one-sample request is resumable,
        # with records and a claimed X-Request-Id, resumes by Last-Event-ID and goes on through a scheduler restart
        self.generations = model.generations
        self.tokenizer = model.tokenizer
        self.constraints = sandbox_or_default(constraints)  # compiles client constraints off the event loop
        self.limits = model.limits
        self.model_name = model.name
        self.model_facts = model.info.model_config  # architecture, context length, dtype, quantization
        self.api_key = api_key  # "": no authentication
        self.access = access  # API keys and rate limits; None: none
        # a stream=true client must take each event within this (--stream-idle-timeout-s); 0: no limit
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.state_reader = model.generations.records  # records an idle stream's reason; None without Redis
        # how the model writes tool calls (--tool-call-parser; auto: read from its chat template)
        self.tool_format = choose_tool_syntax(tool_call_parser, self.tokenizer.chat_template)
        self.created = int(time.time())
        self.ready = True  # False once the gateway is draining
        self._generating = InFlight()  # completion handlers running, which a drain waits for
        # resumable SSE handlers: a drain that times out ends each with an error event saying how to go on
        self._resumable_streams: set[asyncio.Task] = set()
        self._cutting = False  # set once the drain timed out: what it cancels is told so

    def refuse_new(self) -> None:
        """Refuses new requests from now on (as DrainInterceptor.refuse_new: before readiness flips)."""
        self.ready = False

    async def drain(self, timeout_s: float) -> int:
        """Refuses new requests from now on and waits (up to timeout_s) for the ones generating; returns
        how many were still running when it gave up. The drain is done here, not by aiohttp's shutdown
        timeout, so the gateway knows when it starts cutting requests (they end drained, not as
        clients gone away)."""
        self.refuse_new()
        unfinished = await self._generating.wait_idle(timeout_s, "HTTP requests")
        if unfinished and self._resumable_streams:
            await self._end_resumable_streams()
        return unfinished

    async def _end_resumable_streams(self) -> None:
        """The drain timeout passed: each resumable SSE stream still running gets an error event that says
        how to go on (its Last-Event-ID, to another replica) before the server's stop cuts its connection,
        which would otherwise end it with no word. Their requests run on in the scheduler."""
        self._cutting = True
        self.generations.shutting_down = True  # what is cut now is the drain's doing (gateway.generation.stream)
        streams = list(self._resumable_streams)
        for task in streams:
            task.cancel()
        await asyncio.wait(streams, timeout=STOP_GRACE_S)

    def app(self, max_body_bytes: int | None = None) -> web.Application:
        """max_body_bytes: the gateway's --max-message-bytes; a larger body is answered 413."""
        # a prompt of max_prompt_chars characters may take 4 bytes each in UTF-8, plus the JSON around it
        max_body = min(4 * self.limits.max_prompt_chars + 2**20, max_body_bytes or 2**62)
        middlewares = [web.middleware(http_server_span), _errors, self._auth]
        if self.access is not None:
            middlewares.append(access_middleware(self.access, skip=lambda: not self.ready))
        app = web.Application(middlewares=middlewares, client_max_size=max_body)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.readiness)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                reason = "wrong API key" if sent else "no API key"
                raise Unauthenticated(f"{reason}: send the header 'Authorization: Bearer <key>'")
        return await handler(request)

    # -- models and health ---------------------------------------------------------------------------

    def _model_card(self) -> dict:
        facts = self.model_facts
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tokenmill",
                "max_model_len": self.limits.max_model_len, "architecture": facts.architecture,
                "max_context_length": facts.max_context_length, "dtype": facts.dtype,
                "quantization": facts.quantization or "none"}

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise UnknownModel(request.match_info["model"], self.model_name, MODELS_HINT)
        return web.json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready", "model": self.model_name})

    # -- completions -------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=True)

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        if not self.ready:
            raise Unavailable("the gateway is shutting down; retry on another replica")
        with self._generating:
            return await self._generate(request, chat, arrival)

    async def _generate(self, request: web.Request, chat: bool, arrival: float) -> web.StreamResponse:
        body = await _json_object(request)
        request_id, chosen_id, resume_from = _request_id(request, chat)
        parse = functools.partial(parse_chat, tool_format=self.tool_format) if chat else parse_completion
        with request_scope(request_id, CHAT if chat else TEXT_COMPLETION):  # a refusal still names its request
            parsed = parse(body, self.tokenizer, self.limits, self.model_name, request_id)
            await check_constraints(parsed.prepared, self.constraints)
        request_id = parsed.prepared.request.request_id
        key = request.get(API_KEY)
        if key is not None:  # its latency targets travel with the request
            parsed.prepared.request = key.with_targets(parsed.prepared.request)
        builder = ResponseBuilder(chat=chat, request_id=request_id, model=self.model_name, logprobs=parsed.logprobs,
                                  include_usage=parsed.stream and parsed.include_usage,
                                  echo=parsed.echo if resume_from is None else "", echo_first_token=parsed.echo_first_token,
                                  n=parsed.prepared.n, tool_syntax=parsed.tool_syntax if chat else None)
        headers = {"X-Request-Id": request_id}
        # no deadline: HTTP carries none (a client that gives up closes the connection, which cancels this)
        call = CallContext(arrival, owner=None if key is None else key.name, chosen_id=chosen_id,
                           resume_from=resume_from, resume_field="Last-Event-ID")
        deltas = self.generations.stream(parsed.prepared, call)
        async with contextlib.aclosing(deltas):
            if parsed.stream:
                resumable = self.generations.is_resumable(parsed.prepared)
                event_ids = EventIds(request_id, resume_from or 0) if resumable else None
                return await self._stream(request, deltas, builder, headers, sample_ids(parsed.prepared), event_ids)
            async for delta in deltas:
                builder.add(delta)
        if builder.finish is None:
            raise Unavailable("the scheduler ended the request without a result; retry")
        return web.json_response(builder.body(), headers=headers, dumps=_dumps)

    async def _stream(self, request: web.Request, deltas, builder: ResponseBuilder, headers: dict,
                      ids: list[str], event_ids: EventIds | None) -> web.StreamResponse:
        """Server-sent events. The headers go out with the first delta, so a request the scheduler refuses
        (queue full, unavailable) still gets its own HTTP status; a failure after that becomes an error
        event. Each write must complete within the stream idle timeout (aiohttp has none: a write waits
        for a client that reads nothing for as long as the connection stays up). ids: the request's
        scheduler request ids (one per sample), whose records say why when that timeout cuts it.
        event_ids: a resumable request's events carry `id: <request id>:<tokens sent>` (None: no ids).
        A delta's events go out in one write (a delta is every token that came since the last write)."""
        response = None
        watchdog = IdleWatchdog(self.stream_idle_timeout_s)

        async def send(data: bytes) -> None:
            await watchdog.write(response.write(data))

        if event_ids is not None:
            self._resumable_streams.add(asyncio.current_task())
        try:
            with watchdog:
                try:
                    async for delta in deltas:
                        if response is None:
                            response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
                            await response.prepare(request)
                        last_id = event_ids.after(delta) if event_ids is not None else None
                        if events := _events(builder.chunks(delta), last_id):
                            await send(events)
                        if last_id is not None:
                            event_ids.last_sent = last_id
                    if builder.finish is None:  # some choice never ended
                        raise Unavailable("the scheduler ended the request without a result; retry")
                except (ConnectionResetError, StreamIdle):
                    raise  # the client went away, or reads nothing: nobody to tell
                except Exception as exc:  # noqa: BLE001 - after the headers, the error travels as an event
                    if response is None:
                        raise
                    await send(_event(openai_error(exc, request.path).body()))
                else:
                    usage = _event(builder.usage_chunk()) if builder.include_usage else b""
                    await send(usage + b"data: [DONE]\n\n")
                await watchdog.write(response.write_eof())
        except StreamIdle as error:
            # record why before the request is aborted (its record would say only "cancelled"), abort it
            # (frees its pages), then drop the connection: HTTP/1.1 has no way to end a response early
            request_id = builder.request_id
            await record_idle(self.state_reader, ids, error)
            await deltas.aclose()
            logger.info("HTTP stream %r cancelled: %s", request_id, error)
            _reset_connection(request)
        except asyncio.CancelledError:
            if self._cutting and response is not None and event_ids is not None:
                await _tell_drained(response, event_ids)
            raise
        finally:
            self._resumable_streams.discard(asyncio.current_task())
        return response


def _events(chunks: list[dict], last_id: str | None) -> bytes:
    """A delta's events as one write; its last event carries its id."""
    return b"".join(_event(chunk, last_id if number == len(chunks) else None) for number, chunk in enumerate(chunks, 1))


async def _tell_drained(response: web.StreamResponse, event_ids: EventIds) -> None:
    """The last event of a resumable stream that the gateway's drain cuts (best effort: a second each)."""
    error = OpenAIError(503, f"this gateway is shutting down and its drain timeout passed; the request goes on: "
                             f"send it again to another replica with the header 'Last-Event-ID: {event_ids.last_sent}' "
                             "for the rest", "server_error", code="service_unavailable")
    with contextlib.suppress(Exception):  # noqa: BLE001 - the connection may be gone already
        await write_within(response.write(_event(error.body())), 1.0)
        await write_within(response.write_eof(), 1.0)


def _reset_connection(request: web.Request) -> None:
    """Closes the client's connection with a TCP reset (SO_LINGER 0): the events it never read are
    dropped at once instead of lingering in the kernel, and the client sees the stream cut off."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _event(payload: dict, event_id: str | None = None) -> bytes:
    head = b"" if event_id is None else b"id: " + event_id.encode() + b"\n"
    return head + b"data: " + _dumps(payload).encode() + b"\n\n"


class EventIds:
    """The ids of a resumable request's server-sent events: `<request id>:<tokens sent so far>`. An
    SSE client keeps the last id it got and sends it back as the Last-Event-ID header when it
    reconnects; POSTed with the same body to any gateway, it resumes the stream right after that event
    (_request_id). Only the last event of a delta carries one (an id covers the whole delta)."""

    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens  # handed to the stream so far (counting a resumed stream's earlier ones)
        self.last_sent = f"{request_id}:{num_tokens}"  # the id of the last event written out

    def after(self, delta: GenerationDelta) -> str:
        self.num_tokens += len(delta.token_ids)
        return f"{self.request_id}:{self.num_tokens}"


def _request_id(request: web.Request, chat: bool) -> tuple[str, bool, int | None]:
    """The request's id, whether the client chose it, and the token index to resume from. Last-Event-ID
    (an EventIds id: `<request id>:<tokens received>`) resumes that request, sent again with the same
    body; X-Request-Id names a new one (claimed: a different request under a taken id is a 409);
    neither: a fresh id."""
    chosen = request.headers.get("X-Request-Id", "")
    last_event = request.headers.get("Last-Event-ID")
    if last_event is None:
        return chosen or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, bool(chosen), None
    request_id, _, index = last_event.strip().rpartition(":")
    if not request_id or not index.isdigit():
        raise InvalidArgument("Last-Event-ID", last_event, "must be the id of an event of this API's stream: "
                                                           "'<request id>:<tokens received>'")
    if chosen and chosen != request_id:
        raise InvalidArgument("X-Request-Id", chosen, f"must name the request Last-Event-ID resumes ({request_id!r})")
    return request_id, True, int(index)


async def _json_object(request: web.Request) -> dict:
    _check_json_content_type(request)
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are
        raise InvalidArgument("body", raw[:80].decode(errors="replace"), f"is not valid JSON ({error})") from None
    except RecursionError:  # a body of 100,000 "[" would otherwise be a 500
        raise InvalidArgument("body", raw[:80].decode(errors="replace"),
                              "nests arrays or objects deeper than the JSON parser allows (about 1,000 levels)") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", body, f"must be a JSON object, not {type(body).__name__}")
    check_document(body, "body")  # deep nesting, and lone surrogates ("\ud800") in any string, by path
    return body


def _check_json_content_type(request: web.Request) -> None:
    """415 for a body that says it is something else (text/plain, a form). No Content-Type at all is
    read as JSON, as OpenAI's server does, so a bare `curl --data-binary` keeps working."""
    if "Content-Type" not in request.headers:
        return
    media_type = request.content_type  # lower-cased, without parameters such as charset
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Type {request.headers['Content-Type']!r} is not JSON; send 'Content-Type: application/json'")


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ConnectionResetError:
        raise
    except Exception as exc:  # noqa: BLE001 - the one place HTTP errors are answered
        where = f"{request.method} {request.path}"
        return openai_error(exc, where).response()


async def start_http(api: OpenAIHTTP, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                     max_body_bytes: int | None = None,
                     connections: ConnectionLimits = ConnectionLimits(), reuse_port: bool = False) -> web.AppRunner:
    """Listening on host:port when it returns (HTTPS with ssl_context). Stopping: api.drain(timeout_s),
    then runner.cleanup(), which gives what still runs STOP_GRACE_S and then cancels it. connections:
    header and keep-alive timeouts, open connections per client address (gateway.apis.openai.http_connections),
    counted per process. reuse_port: the port is shared with the gateway's other processes (gateway.processes)."""
    app = api.app(max_body_bytes)
    app.middlewares.insert(0, track_requests)  # outermost: a request's header deadline ends where it begins
    # aiohttp's stop waits shutdown_timeout for a handler, cancels its request's body, waits as long
    # again, and only then cancels the handler: half the grace each
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=STOP_GRACE_S / 2,
                           access_log=None, keepalive_timeout=connections.keepalive_timeout_s)
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, limits=connections, ssl_context=ssl_context, reuse_port=reuse_port).start()
    except OSError as error:
        await runner.cleanup()
        raise SystemExit(f"gateway: cannot listen for HTTP on {host}:{port} ({error.strerror}); "
                         "change --http-port") from None
    return runner
