"""Speculative decoding's counters at scrape time, under our names and vLLM's (issue 35): drafts, draft
tokens, accepted tokens, and accepted tokens per draft position."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plumbing.telemetry.metrics import SchedulerStatsCollector, VllmNames, exported_metric_names
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from tests.scheduler.test_speculative_scheduling import make_engine, outputs_of


def scrape(scheduler) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(SchedulerStatsCollector(scheduler.stats, {}))
    vllm = CollectorRegistry()
    vllm.register(VllmNames(registry))
    text = (generate_latest(registry) + generate_latest(vllm)).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_counters_follow_the_scheduler():
    engine = make_engine(error_rate=0.3, k=4)
    outputs_of(engine, [[1, 2, 3], [4, 5]], max_tokens=20)
    speculation = engine.scheduler.speculation
    samples = scrape(engine.scheduler)
    for prefix in ("tokenmill", "vllm"):
        assert samples[(f"{prefix}:spec_decode_num_draft_tokens_total", (("model_name", ""),))] \
            == speculation.num_draft_tokens > 0
        assert samples[(f"{prefix}:spec_decode_num_accepted_tokens_total", (("model_name", ""),))] \
            == speculation.num_accepted_tokens > 0
        assert samples[(f"{prefix}:spec_decode_num_drafts_total", (("model_name", ""),))] == speculation.num_drafts
        for position, accepted in enumerate(speculation.accepted_per_position):
            key = (f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", ""), ("position", str(position))))
            assert samples[key] == accepted
    assert speculation.accepted_per_position[0] >= speculation.accepted_per_position[-1]
    assert {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total"} <= exported_metric_names()


def test_zeros_without_speculation():
    samples = scrape(Scheduler(SchedulerConfig(num_blocks=8)))
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", (("model_name", ""),))] == 0
