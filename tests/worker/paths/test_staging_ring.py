"""Device-independent parts of staging step inputs in prepare(): the pinned slot ring's reuse rule, and
the (step, sample index) each placeholder row reads its token from on the device."""
from __future__ import annotations

import pytest
import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.paths.triton.staging import NUM_SLOTS, SlotRing


class PlainSlot:  # the ring's slot contract without CUDA: only what the rule reads
    def __init__(self, capacity: int) -> None:
        self.capacity, self.staged, self.used = capacity, False, False


def test_ring_reuses_a_slot_only_after_its_step_released_it():
    ring = SlotRing(PlainSlot, NUM_SLOTS, initial_capacity=16)
    first = [ring.take(8) for _ in range(NUM_SLOTS)]
    assert [reused for _, reused in first] == [False] * NUM_SLOTS  # never used: nothing to wait for
    for slot, _ in first[:-1]:
        ring.release(slot)
    # the first slot was released: handed out again, and its last copy and compute must be waited for
    again, reused = ring.take(8)
    assert again is first[0][0] and reused and again.staged


def test_ring_replaces_a_held_slot_instead_of_waiting_for_it():
    ring = SlotRing(PlainSlot, NUM_SLOTS, initial_capacity=16)
    held = [ring.take(8)[0] for _ in range(NUM_SLOTS)]  # e.g. prepared steps not run yet (one dropped)
    fresh, reused = ring.take(8)
    assert fresh is not held[0] and not reused and fresh.capacity == 16
    assert held[0].staged  # the step holding it still reads it
    ring.release(held[1])
    grown, reused = ring.take(100)  # too small: replaced by one that fits, nothing to wait for
    assert grown is not held[1] and grown.capacity == 100 and not reused
    assert ring.take(8)[0] is not held[2]  # still held: replaced


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model, config = load_model(make_tiny_hf_model(tmp_path_factory.mktemp("ring"), "llama_gqa")[0], progress=False)
    return ModelRunner(model, config, num_blocks=32, block_size=4, dtype=torch.float32)


def test_placeholder_rows_name_the_step_and_sample_index_of_their_token(runner):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = {"a": [5, 9, 2], "b": [7, 7], "c": [1, 2, 3, 4, 5, 6]}
    new = [NewRequestData(rid, p, len(p), greedy, list(range(8 * i, 8 * i + 8)), 0) for i, (rid, p) in enumerate(prompts.items())]
    # step 1: a and b whole (they sample, indices 0 and 1), c a first chunk (samples nothing)
    first = runner.prepare(StepPlan(1, new, num_scheduled_tokens={"a": 3, "b": 2, "c": 4}))
    assert first.sampling_ids == ["a", "b"] and first.batch.placeholder_rows == []
    cached = [CachedRequestData("a", [], 3), CachedRequestData("b", [], 2), CachedRequestData("c", [], 4)]
    # step 2, prepared before step 1 ran: c's chunk first, then b and a decode on step 1's tokens
    second = runner.prepare(StepPlan(2, cached_requests=cached, num_scheduled_tokens={"c": 2, "b": 1, "a": 1}))
    assert second.batch.placeholder_rows == [2, 3]
    assert second.batch.placeholder_sources == [(1, 1), (1, 0)]  # b was step 1's second sampled token
    runner.run(first)
    result = runner.run(second)
    assert sorted(result.sampled_token_ids) == ["a", "b", "c"]
    assert all(not state.pending_sources for state in runner.requests.values())  # consumed as tokens arrive
