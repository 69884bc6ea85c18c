"""Every Prometheus metric tokenmill exports, named like vLLM's (`vllm:` -> `tokenmill:`), each with a
`model_name` label (what vLLM's dashboards and the production-stack / llm-d tooling filter on).

Each process serves only the metrics it owns (register_owned, called by start_process):

    gateway    TTFT, inter-token, time per output token and end-to-end latency as the client sees them,
               prompt / generation tokens (totals and per-request histograms), requests by finish reason,
               constraint checks by outcome (a crashing grammar helper shows as `crashed`)
    scheduler  queue / prefill / decode / inference time per request; running / waiting requests, KV
               cache usage, prefix cache, preemptions, cache config (read at scrape time: nothing on
               the step loop's path)
    worker     step time by kind, tokens per step (vLLM's iteration tokens)
    all        calls that ended with an error status, by code

Beside our names each process also serves the vLLM families a stock vLLM Grafana dashboard reads
(`vllm:e2e_request_latency_seconds`, ...), made at scrape time from ours (VllmNames): same meaning,
same buckets, no second update on the request path.

The metrics live in their own registry (not prometheus_client's global one), so importing this
module registers nothing process-wide; an update costs about a microsecond whether or not anything
is served.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry()  # what this process serves: filled by register_owned()
VLLM_REGISTRY = CollectorRegistry()  # the vLLM-named copies of REGISTRY's families
MODEL = ("model_name",)
_model_name = ""

# buckets as vLLM's, so dashboards and alerts written for vLLM read the same
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM builds 1-2-5 buckets up to max_model_len; ours stop at 100k tokens whatever the model's length
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= 100_000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
# queue and prefill times: vLLM's request buckets start at 0.3 s, where a healthy queue or prefill has long
# ended; these resolve 1 ms .. 100 ms as well (the TTFT buckets), and reach as far
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 7680.0)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's


def _histogram(name: str, doc: str, buckets, labels=MODEL) -> Histogram:
    return Histogram(name, doc, labels, buckets=buckets, registry=None)


# ---- gateway -----------------------------------------------------------------------------------
TIME_TO_FIRST_TOKEN = _histogram("tokenmill:time_to_first_token_seconds",
                                 "From the request reaching the gateway to its first token", _TTFT_BUCKETS)
INTER_TOKEN_LATENCY = _histogram("tokenmill:inter_token_latency_seconds",
                                 "Between consecutive output tokens of a request, at the gateway", _ITL_BUCKETS)
REQUEST_TIME_PER_OUTPUT_TOKEN = _histogram(
    "tokenmill:request_time_per_output_token_seconds",
    "Per request: (last token - first token) / (output tokens - 1), at the gateway", _ITL_BUCKETS)
E2E_REQUEST_LATENCY = _histogram("tokenmill:e2e_request_latency_seconds",
                                 "From the request reaching the gateway to its end", _REQUEST_BUCKETS)
REQUEST_PROMPT_TOKENS = _histogram("tokenmill:request_prompt_tokens", "Prompt tokens per ended request",
                                   _TOKEN_COUNT_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram("tokenmill:request_generation_tokens",
                                       "Output tokens per ended request (streamed to the client)",
                                       _TOKEN_COUNT_BUCKETS)
PROMPT_TOKENS = Counter("tokenmill:prompt_tokens_total",
                        "Prompt tokens of ended requests (an n > 1 request's prompt once, not per sample)", MODEL,
                        registry=None)
GENERATION_TOKENS = Counter("tokenmill:generation_tokens_total", "Output tokens streamed to clients", MODEL,
                            registry=None)
REQUEST_SUCCESS = Counter("tokenmill:request_success_total",
                          "Requests that ended with a finish reason (abort: the client cancelled or went away)",
                          [*MODEL, "finished_reason"], registry=None)
REQUEST_PARAMS_N = _histogram("tokenmill:request_params_n", "The n parameter of each client request (samples asked)",
                              _PARAMS_N_BUCKETS)
REQUEST_PARAMS_MAX_TOKENS = _histogram("tokenmill:request_params_max_tokens",
                                       "The max_tokens of each client request (as the gateway filled it in)",
                                       _TOKEN_COUNT_BUCKETS)

# ---- gateway, KServe endpoint: Triton's names and labels, so Triton dashboards and alerts read them ----
# In TRITON_REGISTRY, served by triton_text() without prometheus_client's "_total" suffix (Triton's
# counters have none: nv_inference_request_success, not ..._total).
TRITON_REGISTRY = CollectorRegistry()
TRITON = ("model", "version")
NV_REQUEST_SUCCESS = Counter("nv_inference_request_success", "Number of successful inference requests, all batch "
                             "sizes (KServe ModelInfer / ModelStreamInfer requests that ended with a finish reason)",
                             TRITON, registry=None)
NV_REQUEST_FAILURE = Counter("nv_inference_request_failure", "Number of failed inference requests, all batch sizes, "
                             "by reason (REJECTED: refused before it ran, CANCELED: the client went away, "
                             "BACKEND: failed while running)", [*TRITON, "reason"], registry=None)
NV_INFERENCE_COUNT = Counter("nv_inference_count", "Number of inferences performed (one per successful request: "
                             "a KServe request is a batch of one)", TRITON, registry=None)
NV_EXEC_COUNT = Counter("nv_inference_exec_count", "Number of model executions performed (one per successful "
                        "request)", TRITON, registry=None)
NV_REQUEST_DURATION = Counter("nv_inference_request_duration_us", "Cumulative inference request duration in "
                              "microseconds (successful requests, from arrival at the gateway to their end)",
                              TRITON, registry=None)
NV_QUEUE_DURATION = Counter("nv_inference_queue_duration_us", "Cumulative inference queuing duration in "
                            "microseconds (successful requests: the scheduler's queue time)", TRITON, registry=None)
NV_COMPUTE_INFER_DURATION = Counter("nv_inference_compute_infer_duration_us", "Cumulative compute inference "
                                    "duration in microseconds (successful requests: their end-to-end time less the "
                                    "queue time)", TRITON, registry=None)

TRITON_OWNED = (NV_REQUEST_SUCCESS, NV_REQUEST_FAILURE, NV_INFERENCE_COUNT, NV_EXEC_COUNT, NV_REQUEST_DURATION,
                NV_QUEUE_DURATION, NV_COMPUTE_INFER_DURATION)

# ---- scheduler (per request, observed when it ends) ----------------------------------------------
REQUEST_QUEUE_TIME = _histogram("tokenmill:request_queue_time_seconds",
                                "From a request reaching the scheduler to its first step", _PHASE_BUCKETS)
REQUEST_PREFILL_TIME = _histogram("tokenmill:request_prefill_time_seconds",
                                  "From a request's first step to its first token", _PHASE_BUCKETS)
REQUEST_DECODE_TIME = _histogram("tokenmill:request_decode_time_seconds",
                                 "From a request's first token to its end", _REQUEST_BUCKETS)
REQUEST_INFERENCE_TIME = _histogram("tokenmill:request_inference_time_seconds",
                                    "From a request's first step to its end", _REQUEST_BUCKETS)

# ---- worker ------------------------------------------------------------------------------------
WORKER_STEP_TIME = _histogram("tokenmill:worker_step_seconds",
                              "Wall time of one worker step (forward pass and sampling), by kind", _STEP_BUCKETS,
                              [*MODEL, "kind"])
ITERATION_TOKENS = _histogram("tokenmill:iteration_tokens_total", "Tokens computed in one step",
                              _ITERATION_BUCKETS)

# ---- every process -------------------------------------------------------------------------------
CONSTRAINT_CHECKS = Counter("tokenmill:constraint_checks_total",
                            "Output constraints checked by the gateway's grammar helpers, by outcome: compiled, "
                            "refused (invalid or over a limit), crashed (the compiler crashed its helper), "
                            "timed_out (killed at --grammar-timeout-s), cached (a verdict reused)",
                            [*MODEL, "outcome"], registry=None)
REQUEST_ERRORS = Counter("tokenmill:request_errors_total", "Calls that ended with a gRPC error status "
                         "(HTTP errors by the status they map to)", [*MODEL, "code"], registry=None)

# The scheduler's figures, read at scrape time by SchedulerStatsCollector (names listed here so the
# dashboard test can check every expression against what is exported).
SCHEDULER_METRICS = {
    "tokenmill:num_requests_running": "Requests in the running batch",
    "tokenmill:num_requests_waiting": "Requests waiting to be scheduled (preempted and just-arrived ones included)",
    "tokenmill:kv_cache_usage_perc": "Fraction of KV cache pages in use (0..1)",
    "tokenmill:kv_cache_utilization": "Live tokens / reserved token slots of running requests (0..1)",
    "tokenmill:num_requests_swapped": "Preempted requests whose pages are in the host swap tier now",
    "tokenmill:cpu_cache_usage_perc": "Fraction of the host swap tier's pages in use (0..1; 0 without --swap-space-gb)",
    "tokenmill:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
    "tokenmill:prefix_cache_hits_total": "Prompt tokens found in the prefix cache",
    "tokenmill:num_preemptions_total": "Requests preempted (pages freed, recomputed later)",
    "tokenmill:num_swapped_preemptions_total": "Preempted requests whose pages went to the host swap tier "
                                               "instead of being recomputed",
    "tokenmill:step_token_budget": "Token budget of the latest step (lower than max_num_batched_tokens when "
                                   "--target-itl-ms holds it back)",
    "tokenmill:step_time_prediction_error_seconds": "Latest step's time (planning to result) minus the "
                                                    "step-time model's prediction for it",
    "tokenmill:itl_target_headroom": "Share of --target-itl-ms the step plans aim at (one over the 99.5th "
                                     "percentile of observed / predicted time of recent steps predicted at half the "
                                     "target or more)",
    "tokenmill:itl_target_misses_total": "Steps whose time (planning to result) exceeded --target-itl-ms",
    "tokenmill:cache_config_info": "The KV cache's configuration, as labels (value 1)",
    "tokenmill:spec_decode_num_drafts_total": "Speculative decoding: verifications of a request's draft tokens "
                                              "(one per request and step)",
    "tokenmill:spec_decode_num_draft_tokens_total": "Speculative decoding: draft tokens verified",
    "tokenmill:spec_decode_num_accepted_tokens_total": "Speculative decoding: draft tokens accepted",
    "tokenmill:spec_decode_num_accepted_tokens_per_pos_total": "Speculative decoding: draft tokens accepted at each "
                                                               "draft position (0: the first draft)",
}
# the speculative-decoding counters (SchedulerStatsCollector), all vLLM's names too
SPEC_DECODE_COUNTERS = ("tokenmill:spec_decode_num_drafts", "tokenmill:spec_decode_num_draft_tokens",
                        "tokenmill:spec_decode_num_accepted_tokens", "tokenmill:spec_decode_num_accepted_tokens_per_pos")

REDIS_WRITES_DROPPED = "tokenmill:redis_writes_dropped_total"
REDIS_WRITES_DROPPED_HELP = ("Request-record changes and token-stream entries the scheduler dropped, oldest first, "
                             "because Redis stayed away longer than its in-memory buffers could hold")
REDIS_ROUND_TRIPS = "tokenmill:redis_round_trips_total"
REDIS_ROUND_TRIPS_HELP = ("Calls the scheduler's Redis writers sent (one round trip each, failed ones included), by "
                          "writer: divided by tokenmill:scheduler_steps_total, the round trips per step")
SCHEDULER_STEPS = "tokenmill:scheduler_steps_total"
SCHEDULER_STEPS_HELP = "Steps whose results the scheduler applied"

OWNED = {
    "gateway": (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, REQUEST_TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY,
                REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, PROMPT_TOKENS, GENERATION_TOKENS,
                REQUEST_SUCCESS, REQUEST_ERRORS, CONSTRAINT_CHECKS, REQUEST_PARAMS_N, REQUEST_PARAMS_MAX_TOKENS),
    "scheduler": (REQUEST_QUEUE_TIME, REQUEST_PREFILL_TIME, REQUEST_DECODE_TIME, REQUEST_INFERENCE_TIME,
                  REQUEST_ERRORS),
    "worker": (WORKER_STEP_TIME, ITERATION_TOKENS, REQUEST_ERRORS),
}

# our family -> the vLLM families that mean the same (vLLM >= 0.10 names, plus the older ones the
# stock dashboard still reads: time_per_output_token_seconds, gpu_cache_usage_perc)
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "tokenmill:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tokenmill:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tokenmill:request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "tokenmill:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tokenmill:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "tokenmill:request_generation_tokens": ("vllm:request_generation_tokens",),
    "tokenmill:prompt_tokens": ("vllm:prompt_tokens",),
    "tokenmill:generation_tokens": ("vllm:generation_tokens",),
    "tokenmill:request_success": ("vllm:request_success",),
    "tokenmill:request_params_n": ("vllm:request_params_n",),
    "tokenmill:request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "tokenmill:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tokenmill:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "tokenmill:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "tokenmill:request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "tokenmill:iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "tokenmill:num_requests_running": ("vllm:num_requests_running",),
    "tokenmill:num_requests_waiting": ("vllm:num_requests_waiting",),
    "tokenmill:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tokenmill:num_requests_swapped": ("vllm:num_requests_swapped",),
    "tokenmill:cpu_cache_usage_perc": ("vllm:cpu_cache_usage_perc",),
    "tokenmill:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tokenmill:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tokenmill:num_preemptions": ("vllm:num_preemptions",),
    "tokenmill:cache_config_info": ("vllm:cache_config_info",),
    **{family: (family.replace("tokenmill:", "vllm:"),) for family in SPEC_DECODE_COUNTERS},
}


def set_model_name(name: str) -> None:
    """The model this process serves, the model_name label of every sample it records from now on."""
    global _model_name
    _model_name = name


def model_name() -> str:
    return _model_name


def register_owned(service: str) -> None:
    """Puts the metrics `service` owns in REGISTRY (and their vLLM names in VLLM_REGISTRY), with
    prometheus_client's process, platform and GC collectors (process_cpu_seconds_total,
    process_resident_memory_bytes, process_open_fds, python_gc_*, python_info), which the default
    registry would have had: REGISTRY is our own."""
    for metric in OWNED.get(service, (REQUEST_ERRORS,)):
        REGISTRY.register(metric)
    ProcessCollector(registry=REGISTRY)
    PlatformCollector(registry=REGISTRY)
    GCCollector(registry=REGISTRY)
    VLLM_REGISTRY.register(VllmNames(REGISTRY))
    if service == "gateway":
        for metric in TRITON_OWNED:
            TRITON_REGISTRY.register(metric)


def triton_text() -> bytes:
    """TRITON_REGISTRY in the text format, its counters under Triton's names (no "_total")."""
    return generate_latest(TRITON_REGISTRY).replace(b"_total", b"")


def observe_request_params(n: int, max_tokens: int | None) -> None:
    """One client request's n and max_tokens (vllm:request_params_n / _max_tokens), once per request."""
    REQUEST_PARAMS_N.labels(_model_name).observe(n)
    if max_tokens is not None:
        REQUEST_PARAMS_MAX_TOKENS.labels(_model_name).observe(max_tokens)


def exported_metric_names() -> set[str]:
    """Every series name a scrape of some process can show (histograms with _bucket/_sum/_count,
    counters with _total), ours and the vLLM ones."""
    families = {name.removesuffix("_total") for name in SCHEDULER_METRICS}
    kinds = {name: "gauge" for name in families}
    for metric in {metric for owned in OWNED.values() for metric in owned}:
        for family in metric.describe():
            families.add(family.name)
            kinds[family.name] = family.type
    families.add(REDIS_WRITES_DROPPED.removesuffix("_total"))
    families |= {REDIS_ROUND_TRIPS.removesuffix("_total"), SCHEDULER_STEPS.removesuffix("_total")}
    for name in (REDIS_ROUND_TRIPS.removesuffix("_total"), SCHEDULER_STEPS.removesuffix("_total"),
                 "tokenmill:prefix_cache_queries", "tokenmill:prefix_cache_hits", "tokenmill:num_preemptions",
                 "tokenmill:num_swapped_preemptions", "tokenmill:itl_target_misses",
                 REDIS_WRITES_DROPPED.removesuffix("_total"), *SPEC_DECODE_COUNTERS):
        kinds[name] = "counter"
    names = set()
    for family in families:
        for alias in (family, *VLLM_ALIASES.get(family, ())):
            names |= _series_names(alias, kinds[family])
    return names


def _series_names(family: str, kind: str) -> set[str]:
    if kind == "histogram":
        return {family, f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    if kind == "counter":
        return {f"{family}_total"}
    return {family}


class VllmNames(Collector):
    """At scrape time, a copy of each of the registry's families under its vLLM name(s)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def describe(self):
        return []  # nothing to check for clashes at registration (and no premature read of the stats)

    def collect(self):
        for family in self.registry.collect():
            for alias in VLLM_ALIASES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type)
                copy.samples = [sample._replace(name=alias + sample.name[len(family.name):])
                                for sample in family.samples]
                yield copy


class SchedulerStatsCollector(Collector):
    """Reads scheduler.stats.SchedulerStats at scrape time.

    The metrics server runs on the scheduler's event loop, so the read happens between two
    iterations of the step loop, never during one (invariant 4: one owner of scheduler state)."""

    def __init__(self, read_stats: Callable[[], object], cache_config: Mapping[str, object]) -> None:
        self.read_stats = read_stats
        self.cache_config = {key: str(value) for key, value in cache_config.items()}

    def describe(self):
        return []

    def collect(self) -> Iterable[Metric]:
        stats = self.read_stats()
        model = [_model_name]
        values = {
            "tokenmill:num_requests_running": stats.num_running,
            "tokenmill:num_requests_waiting": stats.num_waiting,
            "tokenmill:kv_cache_usage_perc": stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0,
            "tokenmill:kv_cache_utilization": stats.kv_utilization,
            "tokenmill:num_requests_swapped": stats.num_swapped,
            "tokenmill:cpu_cache_usage_perc": (stats.num_used_host_blocks / stats.num_host_blocks
                                               if stats.num_host_blocks else 0.0),
            "tokenmill:step_token_budget": stats.token_budget,
            "tokenmill:step_time_prediction_error_seconds": stats.step_time_error_s,
            "tokenmill:itl_target_headroom": stats.itl_target_headroom,
        }
        for name, value in values.items():
            gauge = GaugeMetricFamily(name, SCHEDULER_METRICS[name], labels=MODEL)
            gauge.add_metric(model, value)
            yield gauge
        for name, value in (("tokenmill:prefix_cache_queries_total", stats.prefix_cache_queries),
                            ("tokenmill:prefix_cache_hits_total", stats.prefix_cache_hits),
                            ("tokenmill:num_preemptions_total", stats.num_preemptions),
                            ("tokenmill:num_swapped_preemptions_total", stats.num_swapped_preemptions),
                            ("tokenmill:itl_target_misses_total", stats.num_itl_target_misses)):
            counter = CounterMetricFamily(name.removesuffix("_total"), SCHEDULER_METRICS[name], labels=MODEL)
            counter.add_metric(model, value)
            yield counter
        yield from _spec_decode_counters(stats, model)
        info = GaugeMetricFamily("tokenmill:cache_config_info", SCHEDULER_METRICS["tokenmill:cache_config_info"],
                                 labels=[*MODEL, *self.cache_config])
        info.add_metric([*model, *self.cache_config.values()], 1.0)
        yield info


def _spec_decode_counters(stats, model: list[str]) -> Iterable[Metric]:
    """Speculative decoding's counters (vLLM's spec_decode_* families), from SchedulerStats' spec_* fields."""
    for family, value in zip(SPEC_DECODE_COUNTERS[:3], (stats.spec_num_drafts, stats.spec_num_draft_tokens,
                                                        stats.spec_num_accepted_tokens)):
        counter = CounterMetricFamily(family, SCHEDULER_METRICS[family + "_total"], labels=MODEL)
        counter.add_metric(model, value)
        yield counter
    family = SPEC_DECODE_COUNTERS[3]
    per_position = CounterMetricFamily(family, SCHEDULER_METRICS[family + "_total"], labels=[*MODEL, "position"])
    for position, value in enumerate(stats.spec_accepted_per_position or (0,)):  # position 0 at least: a series
        per_position.add_metric([*model, str(position)], value)
    yield per_position


class DroppedWritesCollector(Collector):
    """What the scheduler's Redis writers dropped, at scrape time (read between step-loop iterations,
    like SchedulerStatsCollector)."""

    def __init__(self, read_dropped: Callable[[], Mapping[str, int]]) -> None:
        self.read_dropped = read_dropped

    def describe(self):
        return []

    def collect(self) -> Iterable[Metric]:
        counter = CounterMetricFamily(REDIS_WRITES_DROPPED.removesuffix("_total"), REDIS_WRITES_DROPPED_HELP,
                                      labels=[*MODEL, "kind"])
        for kind, value in self.read_dropped().items():
            counter.add_metric([_model_name, kind], value)
        yield counter


def watch_redis_writers(read_dropped: Callable[[], Mapping[str, int]]) -> None:
    """Exports tokenmill:redis_writes_dropped_total{model_name, kind="record"|"token_stream"}; read_dropped()
    returns those counts (kvstore's RequestStateWriter.stats.dropped, TokenStreamWriter.dropped)."""
    REGISTRY.register(DroppedWritesCollector(read_dropped))


class RedisRoundTripsCollector(Collector):
    """The scheduler's Redis round trips by writer and its step count, at scrape time (issue 33's
    target: at most 2 round trips per step)."""

    def __init__(self, read_round_trips: Callable[[], Mapping[str, int]], read_steps: Callable[[], int]) -> None:
        self.read_round_trips, self.read_steps = read_round_trips, read_steps

    def describe(self):
        return []

    def collect(self) -> Iterable[Metric]:
        trips = CounterMetricFamily(REDIS_ROUND_TRIPS.removesuffix("_total"), REDIS_ROUND_TRIPS_HELP, labels=["kind"])
        for kind, value in self.read_round_trips().items():
            trips.add_metric([kind], value)
        yield trips
        yield CounterMetricFamily(SCHEDULER_STEPS.removesuffix("_total"), SCHEDULER_STEPS_HELP, value=self.read_steps())


def watch_redis_round_trips(read_round_trips: Callable[[], Mapping[str, int]], read_steps: Callable[[], int]) -> None:
    """Exports tokenmill:redis_round_trips_total{kind="record"|"token_stream"|"live"} and
    tokenmill:scheduler_steps_total."""
    REGISTRY.register(RedisRoundTripsCollector(read_round_trips, read_steps))


def watch_scheduler(read_stats: Callable[[], object], cache_config: Mapping[str, object] | None = None) -> None:
    """Exports the scheduler's live figures; read_stats() returns a SchedulerStats (waiting requests
    counted at the moment of the scrape); cache_config: labels of cache_config_info (vLLM's names:
    block_size, num_gpu_blocks, enable_prefix_caching, ...)."""
    REGISTRY.register(SchedulerStatsCollector(read_stats, cache_config or {}))


def count_error(code: str) -> None:
    """One call ended with gRPC status `code` (its name: "INVALID_ARGUMENT", ...)."""
    REQUEST_ERRORS.labels(model_name=_model_name, code=code).inc()
