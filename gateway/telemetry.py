"""A request's telemetry at the gateway: OpenTelemetry GenAI attributes and the first-token event on
the request's SERVER span, the client-facing latency histograms, token counters, and one log line
when it ends, however it ends.

    with request_scope(request_id, "chat"):      # around tokenizing + validating (refusals noted)
        prepared = prepare(...)
    observer = RequestObserver(prepared.request, arrival)  # in gateway.generation.stream
    observer.on_tokens(len(token_ids))                      # per message from the scheduler
    observer.on_finish(finish)     # stop / length / abort (CancelRequest) / ...
    observer.on_error(error)       # refused by the scheduler, failed, deadline, unavailable
    observer.on_cut(error, DEADLINE)  # the call was cut by its deadline or this gateway's shutdown
    observer.on_disconnect()       # the client went away mid-stream
    note_constraint(constraint, field, check_s)   # gateway.prepare, once its grammar sandbox check passed
    note_tools(names, tool_choice)                # the OpenAI chat API, when the client offered tools

Constraints and tools: the request span gets `tokenmill.constraint.kind` / `.hash` / `.compile_ms`, the
offered tools and `tool_choice`; RequestObserver.on_finish(finish, tool_calls=...) the parsed calls, the
parse outcome and the finish reason `tool_calls`, in the span, the metrics' labels and the log line alike.

The SERVER span itself is the gRPC instrumentation's (tokenmill.v1, KServe), or http_server_span's
for the OpenAI-compatible HTTP API; both continue a client's incoming `traceparent`. The error's
status and its one exception event are set where the error is mapped to a status (plumbing.rpc,
gateway.apis.openai.errors), except for a call that gRPC itself cut (on_cut), which no edge sees; here,
what the request was and how it ended.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import time

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram

from core.errors import DeadlineExceeded, ServingError
from core.outputs import FinishReason
from core.requests import GenerationRequest
from core.sampling import OutputConstraint
from plumbing.telemetry import metrics
from plumbing.telemetry.logs import bind_request, log_fields
from plumbing.telemetry.span_policies import record_error
from plumbing.telemetry.tracing import tracer, tracing_enabled

logger = logging.getLogger("tokenmill.gateway.requests")
_UNTRACED_PATHS = frozenset({"/health", "/ready"})  # probes poll; they are not request work
PROVIDER = "tokenmill"  # gen_ai.provider.name: who runs the model (a self-hosted server names itself)
CHAT, TEXT_COMPLETION = "chat", "text_completion"  # gen_ai.operation.name values
# tokenmill.finish_cause: what ended a request when its finish reason and status do not say it all
CLIENT_DISCONNECT = "client_disconnect"  # the client went away
DEADLINE = "deadline"  # the client's deadline passed
DRAINED = "drained"  # this gateway shut down (SIGTERM) and its drain timeout passed first
_model_name = ""
# span attributes the request-end log line also carries as JSON fields (plumbing.telemetry.logs)
_LOG_FIELDS = (("error_code", "error.type"), ("finish_cause", "tokenmill.finish_cause"))
_server_address: tuple[str, int] | None = None  # the gRPC listen address (HTTP spans use the URL's)
_operation: contextvars.ContextVar[str] = contextvars.ContextVar("gen_ai_operation", default=TEXT_COMPLETION)
# the request's SERVER span, set by request_scope (inside it the current span is gateway.tokenize)
_request_span: contextvars.ContextVar[trace.Span | None] = contextvars.ContextVar("request_span", default=None)
TOOL_CALLS = "tool_calls"  # the finish reason of a chat that ended by calling tools (OpenAI's)
# tokenmill.tool_calls.outcome: what parsing a tools chat's output found
PARSED, NO_CALL, FAILED = "parsed", "none", "failed"

# The gateway's own families beside plumbing.telemetry.metrics' (registered once the model is known)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONSTRAINED_REQUESTS = Counter("tokenmill:constrained_requests_total",
                               "Requests with an output constraint, by its kind (json_schema, json_object, regex, "
                               "choice, grammar)", ["model_name", "kind"], registry=None)
CONSTRAINT_COMPILE_TIME = Histogram("tokenmill:constraint_compile_seconds",
                                    "Time the gateway's check of a request's constraint took in the grammar sandbox "
                                    "(a cached verdict: ~0)", ["model_name"], buckets=_COMPILE_BUCKETS, registry=None)
TOOL_CALLS_PARSED = Counter("tokenmill:tool_calls_total",
                            "Tool calls parsed from chat outputs (outcome=parsed), and outputs that began a tool call "
                            "that did not parse (outcome=failed)", ["model_name", "outcome"], registry=None)
GATEWAY_FAMILIES = (CONSTRAINED_REQUESTS, CONSTRAINT_COMPILE_TIME, TOOL_CALLS_PARSED)
_registered = False


def set_model_name(name: str) -> None:
    """The model this gateway serves (gen_ai.request.model, the metrics' model_name label); set once
    the scheduler has told it."""
    global _model_name, _registered
    _model_name = name
    metrics.set_model_name(name)
    if not _registered:
        _registered = True
        for family in GATEWAY_FAMILIES:
            with contextlib.suppress(ValueError):  # already there (a test's second gateway in one process)
                metrics.REGISTRY.register(family)


def set_server_address(host: str, port: int) -> None:
    global _server_address
    _server_address = (host, port)


def _base_attributes(request_id: str) -> dict:
    attributes = {"gen_ai.operation.name": _operation.get(), "gen_ai.provider.name": PROVIDER,
                  "gen_ai.request.model": _model_name, "tokenmill.request_id": request_id}
    if _server_address is not None and "server.address" not in getattr(trace.get_current_span(), "attributes", {}):
        attributes["server.address"], attributes["server.port"] = _server_address
    return attributes


@contextlib.contextmanager
def request_scope(request_id: str, operation: str = TEXT_COMPLETION):
    """Around turning a public request into a prepared one: tags the span and log lines with what is
    known already, so a request refused here (invalid, too long, unknown model) is still found by its
    id and operation. request_id: the client's ("" when it sent none)."""
    _operation.set(operation)
    if request_id:
        bind_request(request_id)
    span = trace.get_current_span()
    _request_span.set(span)
    if span.is_recording():
        span.set_attributes(_base_attributes(request_id) if request_id else
                            {k: v for k, v in _base_attributes("").items() if k != "tokenmill.request_id"})
    try:
        with tracer().start_as_current_span("gateway.tokenize"):
            yield
    except ServingError as error:
        if span.is_recording():
            span.set_attributes({"gen_ai.response.finish_reasons": [FinishReason.ERROR.value],
                                 "tokenmill.refused": True})
        logger.info("request %s refused: %s: %s", request_id or "(no id)", error.code.name, error,
                    extra={"request_id": request_id} if request_id else None)
        raise


class RequestObserver:
    __slots__ = ("request_id", "arrival", "span", "first_token", "last_token", "num_tokens", "num_prompt_tokens",
                 "counts_prompt", "ended", "_itl")

    def __init__(self, request: GenerationRequest, arrival: float, counts_prompt: bool = True) -> None:
        self.request_id = request.request_id
        self.arrival = arrival  # time.monotonic() when the request reached the gateway
        self.first_token: float | None = None
        self.last_token = arrival
        self.num_tokens = 0
        self.num_prompt_tokens = request.num_prompt_tokens
        # False for samples 1.. of an n > 1 request: tokenmill:prompt_tokens_total counts a client's prompt
        # once (as vLLM does), though each sample is a request of its own everywhere else
        self.counts_prompt = counts_prompt
        self.ended = False
        self._itl = None  # the inter-token histogram's child for this model, looked up at the first gap
        self.span = trace.get_current_span()
        bind_request(request.request_id)
        if self.span.is_recording():
            params = request.sampling_params
            self.span.set_attributes({
                **_base_attributes(request.request_id),
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            })

    def on_tokens(self, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        self.num_tokens += count
        model = _model_name
        if self.first_token is None:
            self.first_token = now
            metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(now - self.arrival)
            if self.span.is_recording():
                self.span.add_event("gen_ai.first_token", {"gen_ai.usage.output_tokens": count})
            count -= 1  # the first token has no inter-token gap
        if count:
            # tokens that arrive together (coalesced while the stream was slow to read) share the gap
            gap = (now - self.last_token) / count
            itl = self._itl
            if itl is None:  # labels() once a request: ~2.7 us a call, against ~1.5 for observe()
                itl = self._itl = metrics.INTER_TOKEN_LATENCY.labels(model)
            for _ in range(count):
                itl.observe(gap)
        self.last_token = now

    def on_finish(self, finish, tool_calls: ToolCallsSeen | None = None) -> None:
        """finish: gateway.generation.stream.Finish (stop, length, or abort after a CancelRequest).
        tool_calls: a tools chat's output, parsed: a stop after calls ends as `tool_calls`."""
        attributes = {"tokenmill.cached_prompt_tokens": finish.cached_prompt_tokens}
        reason = finish.reason
        if tool_calls is not None:
            attributes.update(tool_calls.attributes())
            tool_calls.count()
            if tool_calls.names and reason is FinishReason.STOP:
                reason = TOOL_CALLS
        self._end(reason, finish.prompt_tokens, finish.completion_tokens, attributes)

    def on_error(self, error: ServingError) -> None:
        """The request ended with an error status (its count and span status are the edge's)."""
        attributes = {"error.type": error.code.name}
        if isinstance(error, DeadlineExceeded):
            attributes["tokenmill.finish_cause"] = DEADLINE
        self._end(FinishReason.ERROR, self.num_prompt_tokens, self.num_tokens, attributes,
                  detail=f"{error.code.name}: {error}", level=logging.WARNING)

    def on_cut(self, error: ServingError, cause: str) -> None:
        """gRPC cut the call (its deadline passed, or the server stopped) with the status error stands
        for: no exception reaches the edge, so the status, the exception event and the error count are
        recorded here. cause: DEADLINE or DRAINED."""
        if self.ended:
            return
        record_error(self.span, error, error.code.name)
        metrics.count_error(error.code.name)
        # the line plumbing.rpc's edge writes for a status it sends: gRPC sent this one itself
        logger.info("%s -> %s: %s", getattr(self.span, "name", "") or "RPC", error.code.name, error,
                    extra={"request_id": self.request_id})
        self._end(FinishReason.ERROR, self.num_prompt_tokens, self.num_tokens,
                  {"error.type": error.code.name, "tokenmill.finish_cause": cause},
                  detail=f"{error.code.name}: {error}", level=logging.WARNING)

    def on_disconnect(self) -> None:
        """The client cancelled the call or closed the connection before the request finished."""
        self._end(FinishReason.ABORT, self.num_prompt_tokens, self.num_tokens,
                  {"tokenmill.finish_cause": CLIENT_DISCONNECT}, detail="the client went away")

    def _end(self, reason: FinishReason | str, prompt_tokens: int, completion_tokens: int, attributes: dict,
             detail: str = "", level: int = logging.INFO) -> None:
        if self.ended:
            return
        self.ended = True
        reason = getattr(reason, "value", reason)
        now = time.monotonic()
        e2e_s = now - self.arrival
        model = _model_name
        metrics.E2E_REQUEST_LATENCY.labels(model).observe(e2e_s)
        if self.counts_prompt:
            metrics.PROMPT_TOKENS.labels(model).inc(prompt_tokens)
        metrics.GENERATION_TOKENS.labels(model).inc(completion_tokens)
        metrics.REQUEST_PROMPT_TOKENS.labels(model).observe(prompt_tokens)
        metrics.REQUEST_GENERATION_TOKENS.labels(model).observe(completion_tokens)
        if completion_tokens > 1 and self.first_token is not None:
            metrics.REQUEST_TIME_PER_OUTPUT_TOKEN.labels(model).observe(
                (self.last_token - self.first_token) / (completion_tokens - 1))
        if reason != FinishReason.ERROR.value:  # errors are counted by status code, at the edge
            metrics.REQUEST_SUCCESS.labels(model, reason).inc()
        if self.span.is_recording():
            self.span.set_attributes({
                **attributes,
                "gen_ai.usage.output_tokens": completion_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "gen_ai.response.id": self.request_id,
                "gen_ai.response.model": model,
            })
        ttft_ms = (self.first_token - self.arrival) * 1e3 if self.first_token is not None else float("nan")
        logger.log(level, "request %s ended: %s%s, %d prompt + %d output tokens, TTFT %.1f ms, total %.1f ms",
                   self.request_id, reason, f" ({detail})" if detail else "", prompt_tokens,
                   completion_tokens, ttft_ms, e2e_s * 1e3, extra=log_fields(
                       self.request_id, finish_reason=getattr(reason, "value", reason), prompt_tokens=prompt_tokens,
                       output_tokens=completion_tokens, ttft_ms=None if self.first_token is None else round(ttft_ms, 3),
                       e2e_ms=round(e2e_s * 1e3, 3), **{key: attributes[name] for key, name in _LOG_FIELDS
                                                        if name in attributes}))


def _span_of_request() -> trace.Span:
    span = _request_span.get()
    return span if span is not None else trace.get_current_span()


def constraint_hash(constraint: OutputConstraint) -> str:
    """A constraint's content hash (16 hex digits): the same schema, regex or grammar, the same hash."""
    body = "\0".join((constraint.kind.value, constraint.value, *constraint.choices))
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def note_constraint(constraint: OutputConstraint, field: str | None, check_s: float) -> None:
    """A request's constraint passed the gateway's check (check_s: its time in the grammar sandbox).
    field: the client's field it came in ("tools": the grammar tool_choice required or named)."""
    kind = constraint.kind.value
    CONSTRAINED_REQUESTS.labels(_model_name, kind).inc()
    CONSTRAINT_COMPILE_TIME.labels(_model_name).observe(check_s)
    span = _span_of_request()
    if span.is_recording():
        span.set_attributes({"tokenmill.constraint.kind": kind, "tokenmill.constraint.hash": constraint_hash(constraint),
                             "tokenmill.constraint.compile_ms": round(check_s * 1e3, 3),
                             **({"tokenmill.constraint.field": field} if field else {})})


def note_tools(names: list[str], tool_choice: str) -> None:
    """The tools a chat request offered, and its tool_choice (auto, none, required, or the named function)."""
    span = _span_of_request()
    if span.is_recording():
        span.set_attributes({"tokenmill.tools.names": list(names), "tokenmill.tools.count": len(names),
                             "tokenmill.tool_choice": tool_choice})


class ToolCallsSeen:
    """What parsing a tools chat's output found: the called functions' names, or a call that began and did
    not parse (failed)."""

    __slots__ = ("names", "failed")

    def __init__(self, names: list[str], failed: bool = False) -> None:
        self.names, self.failed = names, failed

    @property
    def outcome(self) -> str:
        return PARSED if self.names else FAILED if self.failed else NO_CALL

    def attributes(self) -> dict:
        return {"tokenmill.tool_calls.outcome": self.outcome, "tokenmill.tool_calls.names": list(self.names),
                "tokenmill.tool_calls.count": len(self.names)}

    def count(self) -> None:
        if self.names:
            TOOL_CALLS_PARSED.labels(_model_name, PARSED).inc(len(self.names))
        if self.failed:
            TOOL_CALLS_PARSED.labels(_model_name, FAILED).inc()


async def http_server_span(request, handler):
    """aiohttp middleware: a SERVER span per HTTP request, continuing the client's traceparent.

    (opentelemetry-instrumentation-aiohttp-server has no release matching the 0.66b2 gRPC and Redis
    instrumentations, and this is all of it we need.) A client that goes away cancels the handler:
    that is how the request ended (RequestObserver.on_disconnect), not an exception to record. So
    does the gateway's stop after its drain timeout, which the observer records as drained (on_cut):
    a cause the observer set stands."""
    if not tracing_enabled() or request.path in _UNTRACED_PATHS:
        return await handler(request)
    route = request.match_info.route.resource
    name = f"{request.method} {route.canonical if route is not None else request.path}"
    attributes = {"http.request.method": request.method, "url.path": request.path}
    if request.url.host:
        attributes["server.address"] = request.url.host
        if request.url.port:
            attributes["server.port"] = request.url.port
    with tracer().start_as_current_span(name, context=propagate.extract(request.headers), kind=SpanKind.SERVER,
                                        attributes=attributes, record_exception=False,
                                        set_status_on_exception=False) as span:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            if "tokenmill.finish_cause" not in (getattr(span, "attributes", None) or {}):
                span.set_attribute("tokenmill.finish_cause", CLIENT_DISCONNECT)
            raise
        span.set_attribute("http.response.status_code", response.status)
        return response
