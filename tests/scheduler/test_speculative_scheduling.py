"""Speculative decoding in the scheduling rule, fed by the fake worker (tests/helpers/fake_executor.py), which
verifies drafts greedily against the tokens its pages give: k lookahead slots in the page budget, 1 + k
tokens in the token budget, accepted tokens appended one by one with every stop condition checked, rejected
slots (and whole pages) given back, and any sequence of steps, aborts and preemptions keeping the pools
consistent."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from scheduler.pages.kv_manager import cdiv
from scheduler.request import RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.speculation import Speculation
from tests.helpers.fake_executor import FakeExecutor, next_token
from tests.scheduler.conftest import make_request
from tests.scheduler.pages.test_page_pool_property import check_pool


class OracleProposer:
    """Proposes the fake model's own continuation, each draft wrong with probability error_rate (and the
    ones after a wrong draft follow the wrong text: the worker rejects them all)."""

    on_worker = False  # proposes on the scheduler's side

    def __init__(self, error_rate: float, seed: int = 0, sliding_window: int | None = None) -> None:
        self.error_rate, self.rng, self.sliding_window = error_rate, random.Random(seed), sliding_window
        self.proposed = 0

    def propose(self, request, k):
        tokens, drafts = list(request.all_token_ids), []
        for _ in range(k):
            token = next_token(tokens, self.sliding_window)
            if self.rng.random() < self.error_rate:
                token = (token + 1) % 1000
            drafts.append(token)
            tokens.append(token)
        self.proposed += len(drafts)
        return drafts

    def could_propose(self, request):
        return True  # it always proposes: a request that would sits out


def make_engine(num_blocks=64, block_size=4, error_rate=0.3, seed=0, k=4, async_scheduling=True, **config):
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, speculative="ngram",
                                          num_speculative_tokens=k, **config))
    scheduler.speculation = Speculation(OracleProposer(error_rate, seed, config.get("sliding_window")), k)
    executor = FakeExecutor(num_blocks, block_size, config.get("sliding_window"))
    return EngineCore(scheduler, executor, async_scheduling=async_scheduling)


def plain_engine(num_blocks=64, block_size=4, **config):
    return EngineCore(Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **config)),
                      FakeExecutor(num_blocks, block_size, config.get("sliding_window")), async_scheduling=False)


def outputs_of(engine, prompts, **params):
    requests = [make_request(prompt, request_id=f"q{i}", **params) for i, prompt in enumerate(prompts)]
    results = engine.run_to_completion(requests)
    return {request_id: [t for output in outputs for t in output.new_token_ids] for request_id, outputs in results.items()}


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4] * 11, [5, 6]]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_output_is_the_same_with_drafts_and_takes_fewer_steps(async_scheduling):
    plain = plain_engine()
    expected = outputs_of(plain, PROMPTS, max_tokens=24)
    engine = make_engine(error_rate=0.2, async_scheduling=async_scheduling)
    assert outputs_of(engine, PROMPTS, max_tokens=24) == expected
    speculation = engine.scheduler.speculation
    assert speculation.num_accepted_tokens > 0 and speculation.num_draft_tokens > speculation.num_accepted_tokens
    assert len(engine.executor.plans) < len(plain.executor.plans)
    assert engine.pipeline.depth == (2 if async_scheduling else 1)  # n-gram proposals keep the overlap
    for plan in engine.executor.plans:  # the budget counts the drafts: 1 + k rows per verifying request
        for request_id, drafts in plan.spec_token_ids.items():
            assert plan.num_scheduled_tokens[request_id] == 1 + len(drafts) <= 1 + 4
    assert engine.scheduler.kv.pool.num_free == 64


class OverlapRecorder(FakeExecutor):
    """The fake worker, noting for each plan whether it was sent while the step before it was still in flight."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.pipeline, self.sent_ahead = None, []

    def execute(self, plan):
        self.sent_ahead.append(self.pipeline.num_in_flight > 0)
        return super().execute(plan)


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_async_scheduling_plans_past_every_request_but_those_whose_drafts_or_proposals_need_the_step_in_flight(
        error_rate):
    """Every draft right: each step verifies every request, so none can be planned past and the loop runs as the
    synchronous one. Every draft wrong (an open-ended text): k falls to 0 and the steps overlap again, but for a
    probe now and then. Between them, the steps overlap for the requests not speculating. No plan sent while a
    step is in flight names a request that step verifies, and the output is the plain engine's."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, speculative="ngram", num_speculative_tokens=4))
    scheduler.speculation = Speculation(OracleProposer(error_rate), 4)
    engine = EngineCore(scheduler, OverlapRecorder(64, 4), async_scheduling=True)
    engine.executor.pipeline = engine.pipeline
    assert outputs_of(engine, PROMPTS, max_tokens=60) == outputs_of(plain_engine(), PROMPTS, max_tokens=60)
    plans, sent_ahead = engine.executor.plans, engine.executor.sent_ahead
    for previous, plan, ahead in zip(plans, plans[1:], sent_ahead[1:]):
        assert not (ahead and set(previous.spec_token_ids) & set(plan.num_scheduled_tokens))
    share_ahead = sum(sent_ahead) / len(sent_ahead)
    assert {0.0: share_ahead == 0, 0.3: 0.5 < share_ahead < 0.95, 1.0: share_ahead > 0.8}[error_rate], sent_ahead
    speculation = scheduler.speculation
    if error_rate == 1.0:  # the requests still probe while their steps overlap: more verifications than requests
        assert len(PROMPTS) < speculation.num_drafts < len(plans) / 2
    else:
        assert speculation.num_accepted_tokens > 0
    assert scheduler.kv.pool.num_free == 64


def test_a_perfect_proposer_never_runs_past_max_tokens_or_the_model_length():
    for max_tokens in (1, 2, 5, 13):
        engine = make_engine(error_rate=0.0, k=8)
        outputs = outputs_of(engine, PROMPTS, max_tokens=max_tokens)
        assert all(len(tokens) == max_tokens for tokens in outputs.values()), (max_tokens, outputs)
        assert outputs == outputs_of(plain_engine(), PROMPTS, max_tokens=max_tokens)
    engine = make_engine(error_rate=0.0, k=8, max_model_len=12)
    outputs = outputs_of(engine, [[1, 2, 3, 4, 5]], max_tokens=100)
    assert len(outputs["q0"]) == 7


def test_nothing_past_a_stop_token_among_the_accepted_drafts():
    expected = outputs_of(plain_engine(), [[3, 1, 4]], max_tokens=30)["q0"]
    stop = expected[9]
    cut = expected[:expected.index(stop) + 1]  # the first occurrence ends it
    assert outputs_of(plain_engine(), [[3, 1, 4]], max_tokens=30, params={"stop_token_ids": (stop,)})["q0"] == cut
    engine = make_engine(error_rate=0.0, k=8)
    outputs = engine.run_to_completion([make_request([3, 1, 4], request_id="s", max_tokens=30,
                                                     params={"stop_token_ids": (stop,)})])["s"]
    assert [t for output in outputs for t in output.new_token_ids] == cut
    assert outputs[-1].finished and outputs[-1].finish_reason.value == "stop"
    assert max(len(output.new_token_ids) for output in outputs) > 1  # several tokens in one step
    assert engine.scheduler.kv.pool.num_free == 64


def test_drafts_never_crowd_out_another_requests_decode():
    """Budget 12, eight decoding requests that could each verify 8 drafts: every request that decodes gets its
    token every step, and the drafts share what is left."""
    engine = make_engine(error_rate=0.0, k=8, max_num_batched_tokens=12, async_scheduling=False)
    for i in range(8):
        engine.add_request(make_request([i + 1, 2, 3], request_id=f"d{i}", max_tokens=30))
    num_drafts = 0
    while engine.has_unfinished():
        decoding = {r.request_id for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1}
        engine.step()
        plan = engine.executor.plans[-1]
        assert decoding <= set(plan.num_scheduled_tokens) and plan.total_num_scheduled_tokens <= 12
        num_drafts += sum(map(len, plan.spec_token_ids.values()))
    assert num_drafts > 0


def test_rejected_drafts_give_their_whole_pages_back():
    # block size 4: a decode at position 9 with 8 drafts takes 3 more pages; all rejected -> given back
    engine = make_engine(error_rate=1.0, k=8, block_size=4, async_scheduling=False)
    request = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], request_id="p", max_tokens=20)
    engine.add_request(request)
    engine.step()  # prefill: samples token 10
    assert len(engine.scheduler.kv.block_table("p")) == 3
    engine.step()  # 8 drafts (every one wrong): 9 slots, positions 9..17, two more pages
    assert engine.executor.plans[-1].cached_requests[0].new_block_ids.__len__() == 2
    assert request.num_computed_tokens == 10 and request.num_tokens == 11
    assert len(engine.scheduler.kv.block_table("p")) == cdiv(11, 4)  # the page of 12..15 and 16..17 went back
    assert engine.scheduler.kv.pool.num_free == 64 - 3
    state = request.speculation
    assert state.k == 0  # a request that never accepts stops paying
    scheduled = [engine.executor.plans[-1].num_scheduled_tokens["p"]]
    for _ in range(5):
        engine.step()
        scheduled.append(engine.executor.plans[-1].num_scheduled_tokens["p"])
    assert scheduled == [9, 1, 1, 1, 1, 1]
    assert engine.executor.plans[2].cached_requests[0].num_dropped_block_ids == 2


def test_the_worker_hears_of_dropped_pages_in_the_next_plan():
    engine = make_engine(error_rate=0.5, k=8, block_size=2, seed=3)
    outputs_of(engine, [[1, 2, 3]] * 3, max_tokens=40)
    dropped = [cached.num_dropped_block_ids for plan in engine.executor.plans for cached in plan.cached_requests]
    assert sum(dropped) > 0  # and the fake worker's reads through its trimmed tables found every page


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, 6), min_size=1, max_size=14), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("preempt"), st.integers(0, 50)),
    ),
    max_size=40,
)


def check_tails(scheduler) -> None:
    """After each applied step no running request holds a page past those its tokens need (paged), but for one
    whose drafts a step in flight verifies (async scheduling)."""
    for request in scheduler.running:
        if scheduler.config.kv_policy == "paged" and not request.verifying:
            assert len(scheduler.kv.block_table(request.request_id)) <= cdiv(request.num_tokens, 4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations, st.sampled_from(["paged", "static"]), st.sampled_from([0.0, 0.3, 1.0]), st.integers(1, 8),
       st.sampled_from([0, 3]), st.sampled_from([None, 5]), st.integers(0, 1000), st.booleans())
def test_page_pool_stays_consistent_with_rejections(ops, kv_policy, error_rate, k, num_host_blocks, sliding_window,
                                                    seed, async_scheduling):
    """async_scheduling: steps planned while the last one runs, verifying requests sitting the next one out."""
    engine = make_engine(num_blocks=12, block_size=4, error_rate=error_rate, seed=seed, k=k,
                         max_num_batched_tokens=9, kv_policy=kv_policy, num_host_blocks=num_host_blocks,
                         sliding_window=sliding_window, async_scheduling=async_scheduling)
    added = []
    for op in ops:
        if op[0] == "add":
            request = make_request(op[1], max_tokens=op[2])
            if engine.scheduler.kv.blocks_needed_at_most(request) <= 12:
                engine.add_request(request)
                added.append(request)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check_tails(engine.scheduler)
        elif op[0] == "abort" and added:
            engine.abort_request(added[op[1] % len(added)].request_id)
        elif op[0] == "preempt":  # as the scheduler picks victims: never one whose drafts are in flight
            candidates = [request for request in engine.scheduler.running if not request.verifying]
            if candidates:
                engine.scheduler._preempt(candidates[op[1] % len(candidates)])
        check_pool(engine)
    while engine.has_unfinished():  # finish everything, still checking each step
        engine.step()
        check_tails(engine.scheduler)
        check_pool(engine)
    assert engine.scheduler.kv.pool.num_free == 12
    for request in added:
        assert request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.sampling_params.max_tokens
            tokens = request.all_token_ids
            for end in range(request.num_prompt_tokens, len(tokens)):  # the fake model's own output, exactly
                assert tokens[end] == next_token(tokens[:end], sliding_window)


class DraftingExecutor(FakeExecutor):
    """The fake worker with a draft model (--speculative draft): after each step it guesses the fake model's own
    continuation for each request the plan names (each guess wrong with probability error_rate), where the
    request's pages must hold every slot the draft writes (its last token and all but the last guess)."""

    def __init__(self, num_blocks: int, block_size: int, error_rate: float, seed: int = 0) -> None:
        super().__init__(num_blocks, block_size)
        self.error_rate, self.rng = error_rate, random.Random(seed)

    def execute(self, plan):
        result = super().execute(plan)
        for request_id, num_guesses in plan.num_draft_tokens.items():
            tokens = list(self.tokens[request_id])
            self._slot(request_id, len(tokens) - 1 + num_guesses - 1)  # asserts the lookahead page is there
            guesses = []
            for _ in range(num_guesses):
                token = next_token(tokens)
                guesses.append((token + 1) % 1000 if self.rng.random() < self.error_rate else token)
                tokens.append(guesses[-1])
            result.draft_token_ids[request_id] = guesses
        return result


def test_draft_model_guesses_come_from_the_last_result_within_allocated_lookahead_slots():
    expected = outputs_of(plain_engine(), PROMPTS, max_tokens=24)
    for error_rate in (0.0, 0.3):
        scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, speculative="draft",
                                              num_speculative_tokens=4))
        engine = EngineCore(scheduler, DraftingExecutor(64, 4, error_rate), async_scheduling=True)
        assert outputs_of(engine, PROMPTS, max_tokens=24) == expected
        speculation = scheduler.speculation
        assert speculation.num_draft_tokens > 0 and scheduler.kv.pool.num_free == 64
        if error_rate == 0.0:  # a perfect draft: every guess the scheduler sends is accepted
            assert speculation.num_accepted_tokens == speculation.num_draft_tokens
        for plan in engine.executor.plans:
            assert all(1 <= count <= 4 for count in plan.num_draft_tokens.values())
        first = engine.executor.plans[0]  # a prompt that completes in a step is asked for guesses right away
        assert set(first.num_draft_tokens) == {new.request_id for new in first.new_requests}
        # a request's last step that decodes one token (no drafts) makes its last token: no guesses asked after it
        last_plan = {}
        for plan in engine.executor.plans:
            last_plan.update(dict.fromkeys(plan.num_scheduled_tokens, plan))
        assert all(request_id not in plan.num_draft_tokens for request_id, plan in last_plan.items()
                   if request_id not in plan.spec_token_ids)


@pytest.mark.parametrize("seed", range(40))
def test_page_pool_stays_consistent_with_a_draft_model(seed):
    """Lookahead pages through random workloads, pools (paged, static, a swap tier) and preemptions: every slot
    the draft writes is the request's (DraftingExecutor), no page is lost, and everything ends with all pages free."""
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=12, block_size=4, speculative="draft", max_num_batched_tokens=9, num_speculative_tokens=rng.randint(1, 8),
        kv_policy=rng.choice(["paged", "static"]), num_host_blocks=rng.choice([0, 3])))
    engine = EngineCore(scheduler, DraftingExecutor(12, 4, rng.choice([0.0, 0.3, 1.0]), seed), async_scheduling=True)
    for index in range(rng.randint(1, 5)):
        request = make_request([rng.randint(1, 50) for _ in range(rng.randint(1, 12))], request_id=f"r{index}",
                               max_tokens=rng.randint(1, 16))
        if scheduler.kv.blocks_needed_at_most(request) <= 12:
            engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
        check_pool(engine)
        if rng.random() < 0.1 and scheduler.running:
            scheduler._preempt(scheduler.running[rng.randrange(len(scheduler.running))])
    assert scheduler.kv.pool.num_free == 12
