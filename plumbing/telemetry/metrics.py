"""Every Prometheus metric tokenmill exports, named like vLLM's (`vllm:` -> `tokenmill:`).

Each process updates the ones that are its to see and serves them all on its --metrics-port
(plumbing.telemetry.metrics_server); those it never touches simply stay at zero there.

    gateway    TTFT, inter-token and end-to-end latency as the client sees them, prompt and
               generation tokens, finished requests by reason, errors by gRPC status code
    scheduler  queue time; running / waiting requests, KV cache usage, prefix cache, preemptions
               (read from the scheduler's stats at scrape time: nothing on the step loop's path)
    worker     step time by kind (prefill, decode, mixed)

The metrics live in their own registry (not prometheus_client's global one), so importing this
module registers nothing process-wide; an update costs about a microsecond whether or not anything
is served.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry()

# latency buckets as vLLM's, so dashboards and alerts written for vLLM read the same
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                  300.0, 600.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)

# ---- gateway -----------------------------------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    "tokenmill:time_to_first_token_seconds", "From the request reaching the gateway to its first token",
    buckets=_TTFT_BUCKETS, registry=REGISTRY)
INTER_TOKEN_LATENCY = Histogram(
    "tokenmill:inter_token_latency_seconds", "Between consecutive output tokens of a request, at the gateway",
    buckets=_ITL_BUCKETS, registry=REGISTRY)
E2E_REQUEST_LATENCY = Histogram(
    "tokenmill:e2e_request_latency_seconds", "From the request reaching the gateway to its last token",
    buckets=_REQUEST_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("tokenmill:prompt_tokens_total", "Prompt tokens of finished requests",
                        registry=REGISTRY)
GENERATION_TOKENS = Counter("tokenmill:generation_tokens_total", "Output tokens streamed to clients",
                            registry=REGISTRY)
REQUEST_SUCCESS = Counter("tokenmill:request_success_total", "Requests that ended with a finish reason",
                          ["finished_reason"], registry=REGISTRY)
REQUEST_ERRORS = Counter("tokenmill:request_errors_total", "Calls that ended with a gRPC error status "
                         "(HTTP errors by the status they map to)", ["code"], registry=REGISTRY)

# ---- scheduler ---------------------------------------------------------------------------------
REQUEST_QUEUE_TIME = Histogram(
    "tokenmill:request_queue_time_seconds", "From a request reaching the scheduler to its first step",
    buckets=_QUEUE_BUCKETS, registry=REGISTRY)

# ---- worker ------------------------------------------------------------------------------------
WORKER_STEP_TIME = Histogram(
    "tokenmill:worker_step_seconds", "Wall time of one worker step (forward pass and sampling), by kind",
    ["kind"], buckets=_STEP_BUCKETS, registry=REGISTRY)

# The scheduler's figures, read at scrape time by SchedulerStatsCollector (names listed here so the
# dashboard test can check every expression against what is exported).
SCHEDULER_METRICS = {
    "tokenmill:num_requests_running": "Requests in the running batch",
    "tokenmill:num_requests_waiting": "Requests waiting to be scheduled (preempted ones included)",
    "tokenmill:kv_cache_usage_perc": "Fraction of KV cache pages in use (0..1)",
    "tokenmill:kv_cache_utilization": "Live tokens / reserved token slots of running requests (0..1)",
    "tokenmill:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
    "tokenmill:prefix_cache_hits_total": "Prompt tokens found in the prefix cache",
    "tokenmill:num_preemptions_total": "Requests preempted (pages freed, recomputed later)",
}


def exported_metric_names() -> set[str]:
    """Every series name a scrape can show (histograms with their _bucket/_sum/_count)."""
    names = set(SCHEDULER_METRICS)
    for metric in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME,
                   WORKER_STEP_TIME):
        for family in metric.describe():
            names |= {family.name, f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
    for metric in (PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, REQUEST_ERRORS):
        names |= {f"{family.name}_total" for family in metric.describe()}  # the family name drops _total
    return names


class SchedulerStatsCollector(Collector):
    """Reads scheduler.stats.SchedulerStats at scrape time.

    The metrics server runs on the scheduler's event loop, so the read happens between two
    iterations of the step loop, never during one (invariant 4: one owner of scheduler state)."""

    def __init__(self, read_stats: Callable[[], object]) -> None:
        self.read_stats = read_stats

    def collect(self):
        stats = self.read_stats()
        values = {
            "tokenmill:num_requests_running": stats.num_running,
            "tokenmill:num_requests_waiting": stats.num_waiting,
            "tokenmill:kv_cache_usage_perc": stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0,
            "tokenmill:kv_cache_utilization": stats.kv_utilization,
        }
        for name, value in values.items():
            yield GaugeMetricFamily(name, SCHEDULER_METRICS[name], value=value)
        for name, value in (("tokenmill:prefix_cache_queries_total", stats.prefix_cache_queries),
                            ("tokenmill:prefix_cache_hits_total", stats.prefix_cache_hits),
                            ("tokenmill:num_preemptions_total", stats.num_preemptions)):
            yield CounterMetricFamily(name.removesuffix("_total"), SCHEDULER_METRICS[name], value=value)


def watch_scheduler(read_stats: Callable[[], object]) -> None:
    """Exports the scheduler's live figures; read_stats() returns a SchedulerStats."""
    REGISTRY.register(SchedulerStatsCollector(read_stats))
