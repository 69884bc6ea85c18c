"""Triton's metrics for the KServe endpoint (nv_inference_*, labels model and version), so dashboards and
alerts written for Triton read the gateway as they read a Triton server.

    @counted                                  # on KServeServicer._deltas: every KServe request, both RPCs
    async def _deltas(self, request, ...): ...

A request counts once when its deltas end: nv_inference_request_success, nv_inference_count and
nv_inference_exec_count by one (a KServe request is a batch of one), and the durations in microseconds
(request: arrival at the gateway to the end; queue: the scheduler's queue time; compute_infer: the
request's time less its queue time); or nv_inference_request_failure by one with Triton's reason:
CANCELED (the client went away, or cancelled it), REJECTED (refused for capacity before it ran: a full
queue), BACKEND (failed once running), OTHER (refused before it ran: invalid, unknown model, ...).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools

from core.errors import ErrorCode, ServingError
from core.outputs import FinishReason
from plumbing.telemetry import metrics

VERSION = "1"  # gateway.apis.kserve.MODEL_VERSION: one version per served model
CANCELED, REJECTED, BACKEND, OTHER = "CANCELED", "REJECTED", "BACKEND", "OTHER"


def counted(deltas_method):
    """Wraps an async generator method of deltas (self.model_name: the served model)."""

    @functools.wraps(deltas_method)
    async def deltas(self, *args, **kwargs):
        labels = (self.model_name, VERSION)
        finish, started = None, False
        inner = deltas_method(self, *args, **kwargs)
        try:
            async with contextlib.aclosing(inner):
                async for delta in inner:
                    started = True
                    finish = delta.finish if delta.finish is not None else finish
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):
            metrics.NV_REQUEST_FAILURE.labels(*labels, CANCELED).inc()
            raise
        except Exception as error:
            metrics.NV_REQUEST_FAILURE.labels(*labels, _failure_reason(error, started)).inc()
            raise
        _count_end(labels, finish)

    return deltas


def _failure_reason(error: Exception, started: bool) -> str:
    if started:
        return BACKEND
    if isinstance(error, ServingError) and error.code is ErrorCode.RESOURCE_EXHAUSTED:
        return REJECTED
    return OTHER if isinstance(error, ServingError) and error.code is not ErrorCode.INTERNAL else BACKEND


def _count_end(labels: tuple[str, str], finish) -> None:
    if finish is None or finish.reason in (FinishReason.ABORT, FinishReason.ERROR):
        metrics.NV_REQUEST_FAILURE.labels(*labels, CANCELED if finish is not None and
                                          finish.reason is FinishReason.ABORT else BACKEND).inc()
        return
    request_us = finish.e2e_ns // 1000
    queue_us = min(finish.queue_ns // 1000, request_us)
    metrics.NV_REQUEST_SUCCESS.labels(*labels).inc()
    metrics.NV_INFERENCE_COUNT.labels(*labels).inc()
    metrics.NV_EXEC_COUNT.labels(*labels).inc()
    metrics.NV_REQUEST_DURATION.labels(*labels).inc(request_us)
    metrics.NV_QUEUE_DURATION.labels(*labels).inc(queue_us)
    metrics.NV_COMPUTE_INFER_DURATION.labels(*labels).inc(request_us - queue_us)
