"""A request's telemetry at the gateway: GenAI attributes and the first-token event on the request's
SERVER span, the client-facing latency histograms, token counters, and one log line when it ends.

gateway.generation_stream.stream_generation (the path every public API shares) drives it:

    observer = RequestObserver(prepared.request, arrival)   # under the request's SERVER span
    observer.on_tokens(len(token_ids))                      # per message from the scheduler
    observer.on_finish(finish)                              # the last one

The SERVER span itself is the gRPC instrumentation's (tokenmill.v1, KServe), or http_server_span's
for the OpenAI-compatible HTTP API; both continue a client's incoming `traceparent`.
"""
from __future__ import annotations

import logging
import time

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from core.requests import GenerationRequest
from plumbing.telemetry import metrics
from plumbing.telemetry.logs import bind_request
from plumbing.telemetry.tracing import tracer, tracing_enabled

logger = logging.getLogger("tokenmill.gateway.requests")
_UNTRACED_PATHS = frozenset({"/health", "/ready"})  # probes poll; they are not request work
_model_name = ""


def set_model_name(name: str) -> None:
    """The model this gateway serves (gen_ai.request.model); set once the scheduler has told it."""
    global _model_name
    _model_name = name


class RequestObserver:
    __slots__ = ("request_id", "arrival", "span", "first_token", "last_token", "num_tokens")

    def __init__(self, request: GenerationRequest, arrival: float) -> None:
        self.request_id = request.request_id
        self.arrival = arrival  # time.monotonic() when the request reached the gateway
        self.first_token: float | None = None
        self.last_token = arrival
        self.num_tokens = 0
        self.span = trace.get_current_span()
        bind_request(request.request_id)
        if self.span.is_recording():
            params = request.sampling_params
            self.span.set_attributes({
                "gen_ai.operation.name": "text_completion",
                "gen_ai.system": "tokenmill",
                "gen_ai.request.model": _model_name,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                "tokenmill.request_id": request.request_id,
            })

    def on_tokens(self, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        self.num_tokens += count
        if self.first_token is None:
            self.first_token = now
            metrics.TIME_TO_FIRST_TOKEN.observe(now - self.arrival)
            if self.span.is_recording():
                self.span.add_event("gen_ai.first_token", {"gen_ai.usage.output_tokens": count})
            count -= 1  # the first token has no inter-token gap
        if count:
            # tokens that arrive together (coalesced while the stream was slow to read) share the gap
            gap = (now - self.last_token) / count
            for _ in range(count):
                metrics.INTER_TOKEN_LATENCY.observe(gap)
        self.last_token = now

    def on_finish(self, finish) -> None:
        """finish: gateway.generation_stream.Finish."""
        e2e_s = time.monotonic() - self.arrival
        metrics.E2E_REQUEST_LATENCY.observe(e2e_s)
        metrics.PROMPT_TOKENS.inc(finish.prompt_tokens)
        metrics.GENERATION_TOKENS.inc(finish.completion_tokens)
        metrics.REQUEST_SUCCESS.labels(finished_reason=finish.reason.value).inc()
        if self.span.is_recording():
            self.span.set_attributes({
                "gen_ai.usage.output_tokens": finish.completion_tokens,
                "gen_ai.response.finish_reasons": [finish.reason.value],
                "gen_ai.response.id": self.request_id,
                "tokenmill.cached_prompt_tokens": finish.cached_prompt_tokens,
            })
        logger.info("request %s finished: %s, %d prompt + %d output tokens, TTFT %.1f ms, total %.1f ms",
                    self.request_id, finish.reason.value, finish.prompt_tokens, finish.completion_tokens,
                    finish.time_to_first_token_ns / 1e6, e2e_s * 1e3, extra={"request_id": self.request_id})


def tokenize_span():
    """A child span around tokenizing and validating a request (a no-op span when tracing is off)."""
    return tracer().start_as_current_span("gateway.tokenize")


async def http_server_span(request, handler):
    """aiohttp middleware: a SERVER span per HTTP request, continuing the client's traceparent.

    (opentelemetry-instrumentation-aiohttp-server has no release matching the 0.66b2 gRPC and Redis
    instrumentations, and this is all of it we need.)"""
    if not tracing_enabled() or request.path in _UNTRACED_PATHS:
        return await handler(request)
    route = request.match_info.route.resource
    name = f"{request.method} {route.canonical if route is not None else request.path}"
    with tracer().start_as_current_span(name, context=propagate.extract(request.headers), kind=SpanKind.SERVER,
                                        attributes={"http.request.method": request.method,
                                                    "url.path": request.path}) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        return response
