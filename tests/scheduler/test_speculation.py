"""The proposer seam and each request's adaptive draft count (scheduler.speculation)."""
import pytest

from core.sampling import SamplingParams
from scheduler.request import Request
from scheduler.speculation import (MAX_PROBE_PAUSE_STEPS, PROBE_PAUSE_STEPS, DraftProposer, NgramProposer,
                                   Speculation, SpeculationState, check_draft_model)


def request(tokens, **params) -> Request:
    return Request("r", list(tokens), SamplingParams(**{"max_tokens": 64, "temperature": 0.0, **params}))


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(max_n=3, min_n=1)
    # "7 8 9" occurs twice before the end; the latest one is followed by 4 5 6
    tokens = [7, 8, 9, 1, 2, 3, 0, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert proposer.propose(request(tokens), 3) == [4, 5, 6]
    assert proposer.propose(request(tokens), 2) == [4, 5]
    # past the end, the period the match implies (7 tokens) goes on
    assert proposer.propose(request(tokens), 9) == [4, 5, 6, 0, 7, 8, 9, 4, 5]
    assert proposer.propose(request([1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_ngram_prefers_longer_matches_and_falls_back_to_shorter_ones():
    proposer = NgramProposer(max_n=3, min_n=2)
    # the last 3 tokens (1 2 3) occur at 0 (followed by 10); the last 2 (2 3) also at 5 (followed by 20)
    tokens = [1, 2, 3, 10, 9, 2, 3, 20, 1, 2, 3]
    assert proposer.propose(request(tokens), 1) == [10]
    # no 3-gram match: the latest 2-gram match wins
    assert proposer.propose(request([5, 6, 1, 6, 1, 9, 5, 6, 1]), 2) == [6, 1]
    assert NgramProposer(max_n=3, min_n=2).propose(request([4, 5, 6, 1]), 2) == []  # no match at all
    assert NgramProposer(max_n=2, min_n=2).propose(request([1, 2]), 2) == []  # too short


def test_ngram_index_grows_with_the_output_and_matches_the_plain_scan():
    proposer = NgramProposer(max_n=4, min_n=2)
    live = request([3, 1, 4, 1, 5, 9, 2, 6])
    live.speculation = SpeculationState(k=4)
    sequence = [1, 4, 1, 5, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1]
    for token in sequence:
        live.all_token_ids.append(token)
        fresh = request(live.all_token_ids)  # a new index each time: the plain scan
        assert proposer.propose(live, 4) == proposer.propose(fresh, 4)


def test_requests_that_need_more_than_the_verification_gives_do_not_speculate():
    speculation = Speculation(NgramProposer(), 4)
    repeating = [1, 2, 3, 4] * 4
    assert speculation.drafts(request(repeating), 4) == [1, 2, 3, 4]
    assert speculation.drafts(request(repeating, temperature=0.8, top_p=0.9), 4) == [1, 2, 3, 4]
    assert speculation.drafts(request(repeating, presence_penalty=0.5, repetition_penalty=1.2), 4) == [1, 2, 3, 4]
    assert speculation.drafts(request(repeating, logprobs=2), 4) == [1, 2, 3, 4]
    assert speculation.drafts(request(repeating, temperature=0.8, seed=7), 4) == [1, 2, 3, 4]  # the draws decide
    assert speculation.drafts(request(repeating, speculative=False), 4) == []
    assert speculation.drafts(request(repeating), 0) == []  # no room left (max_tokens, budget)
    assert speculation.drafts(request(repeating), 2) == [1, 2]


def test_k_grows_on_acceptance_shrinks_on_rejection_and_reprobes_at_zero():
    speculation = Speculation(NgramProposer(), 8)
    live = request([1, 2, 3, 4] * 8)
    assert len(speculation.drafts(live, 16)) == 8
    speculation.observe(live, 8, 3)
    assert live.speculation.k == 3 and len(speculation.drafts(live, 16)) == 3
    speculation.observe(live, 3, 3)
    assert live.speculation.k == 6
    speculation.observe(live, 6, 0)
    assert live.speculation.k == 0
    # paused: no drafts for PROBE_PAUSE_STEPS - 1 steps, then one probe
    assert [len(speculation.drafts(live, 16)) for _ in range(PROBE_PAUSE_STEPS)] == [0] * (PROBE_PAUSE_STEPS - 1) + [1]
    speculation.observe(live, 1, 0)  # a failed probe doubles the pause
    assert live.speculation.pause == 2 * PROBE_PAUSE_STEPS
    for _ in range(10):
        live.speculation.pause = min(MAX_PROBE_PAUSE_STEPS, 2 * live.speculation.pause)
    assert live.speculation.pause == MAX_PROBE_PAUSE_STEPS
    drafts = [len(speculation.drafts(live, 16)) for _ in range(MAX_PROBE_PAUSE_STEPS)]
    assert drafts[-1] == 1 and sum(drafts) == 1
    speculation.observe(live, 1, 1)  # a successful probe: drafting again, pause reset
    assert live.speculation.k == 1 and live.speculation.pause == PROBE_PAUSE_STEPS
    assert speculation.num_draft_tokens == 8 + 3 + 6 + 1 + 1 and speculation.num_accepted_tokens == 3 + 3 + 0 + 0 + 1
    assert speculation.accepted_per_position[:3] == [3, 2, 2] and speculation.num_drafts == 5


def test_a_request_whose_token_is_in_flight_sits_out_while_it_would_propose_and_counts_its_pause_otherwise():
    """Async scheduling: wants_drafts() says whether the request waits for its token in flight (k > 0, or its probe
    due); a decode at k = 0 past a token in flight still counts towards the probe; a request that sat out and then
    has nothing to propose pauses as a failed probe (in the synchronous loop an empty proposal leaves k alone)."""
    speculation = Speculation(NgramProposer(), 4)
    pending = request([7, 5, 6, 7, 8])  # 8 in flight; 7 occurred before, so a 2-gram could match
    pending.num_pending_tokens = 1
    assert speculation.wants_drafts(pending) and pending.speculation.k == 4  # a new request starts at k = max
    assert speculation.drafts(pending, 4) == []  # never proposes past a token it does not know
    pending.speculation.k = 0
    for waited in range(1, PROBE_PAUSE_STEPS):
        assert not speculation.wants_drafts(pending)
        assert speculation.drafts(pending, 4) == [] and pending.speculation.waited == waited
    assert speculation.wants_drafts(pending)  # its probe is due: it sits the step out for it
    assert not speculation.wants_drafts(request([1], speculative=False))

    no_match = request([5, 6, 7, 8])
    no_match.speculation = SpeculationState(k=3, sat_out=True)
    assert speculation.drafts(no_match, 4) == []
    assert (no_match.speculation.k, no_match.speculation.sat_out) == (0, False)
    probe = request([5, 6, 7, 8])
    probe.speculation = SpeculationState(k=0, waited=PROBE_PAUSE_STEPS - 1, sat_out=True)
    assert speculation.drafts(probe, 4) == []
    assert (probe.speculation.k, probe.speculation.pause) == (0, 2 * PROBE_PAUSE_STEPS)
    no_room = request([1, 2, 1, 2])
    no_room.speculation = SpeculationState(k=3, sat_out=True)
    assert speculation.drafts(no_room, 0) == [] and not no_room.speculation.sat_out  # no stale flag left behind
    assert speculation.drafts(no_room, 4) == [1, 2, 1] and no_room.speculation.k == 3
    synchronous = request([5, 6, 7, 8])
    synchronous.speculation = SpeculationState(k=3)
    assert speculation.drafts(synchronous, 4) == [] and synchronous.speculation.k == 3
    assert not Speculation(DraftProposer(), 4).wants_drafts(pending)  # its loop is synchronous


def test_a_request_whose_token_in_flight_could_complete_no_ngram_does_not_sit_out():
    """could_propose(): with one token in flight, prompt lookup can propose only if the last known token (min_n = 2)
    occurred earlier with a known token after it; it agrees with proposing after every possible value of the token
    in flight, and a request that cannot propose keeps its k (new) or passes its probe without sitting out."""
    proposer = NgramProposer(max_n=4, min_n=2)
    for known in ([5, 6, 7], [7, 5, 6, 7], [1, 2, 1, 2, 3, 9, 3], [4, 4], [4], [9, 8, 9, 8, 7, 7, 8]):
        pending = request([*known, 0])
        pending.num_pending_tokens = 1
        # every value the token in flight could take that matters: the known tokens, and one never seen
        possible = any(proposer.propose(request([*known, token]), 4) for token in {*known, 99})
        assert proposer.could_propose(pending) == possible, known
    grown = request([5, 6, 7, 0])  # the index grows with the tokens, as the proposer's does
    grown.num_pending_tokens = 1
    grown.speculation = SpeculationState(k=4)
    assert not proposer.could_propose(grown)
    grown.all_token_ids[-1:] = [8, 6, 0]
    assert proposer.could_propose(grown)
    two_in_flight = request([5, 6, 0, 0])
    two_in_flight.num_pending_tokens = 2
    assert proposer.could_propose(two_in_flight) and NgramProposer(min_n=1).could_propose(request([5, 6, 7]))

    speculation = Speculation(proposer, 4)
    new = request([5, 6, 7, 0])
    new.num_pending_tokens = 1
    assert not speculation.wants_drafts(new) and speculation.drafts(new, 4) == [] and new.speculation.k == 4
    paused = request([5, 6, 7, 0])
    paused.num_pending_tokens = 1
    paused.speculation = SpeculationState(k=0, waited=PROBE_PAUSE_STEPS - 1)
    assert not speculation.wants_drafts(paused)  # its probe is due, but nothing could be proposed
    assert speculation.drafts(paused, 4) == []
    assert (paused.speculation.waited, paused.speculation.pause) == (0, PROBE_PAUSE_STEPS)  # passed, not doubled


def test_num_speculative_tokens_range():
    for bad in (0, 17, -1):
        with pytest.raises(ValueError, match="1..16"):
            Speculation(NgramProposer(), bad)


def test_draft_proposer_hands_out_the_worker_guesses_while_they_follow_the_tokens():
    speculation = Speculation(DraftProposer(), 4)
    asking = request([1, 2, 3])
    assert speculation.lookahead(asking) == 4  # no state yet: the most it may verify
    assert speculation.drafts(asking, 8) == []  # nothing from the worker yet
    speculation.keep_worker_drafts(asking, [7, 8, 9, 10])
    assert speculation.drafts(asking, 8) == [7, 8, 9, 10] and speculation.drafts(asking, 2) == [7, 8]
    asking.append_output_token(7)  # the tokens moved on without a new result: the guesses no longer follow them
    assert speculation.drafts(asking, 8) == []
    asking.speculation.k = 1
    assert speculation.lookahead(asking) == 2  # a full acceptance doubles k: guesses for that
    asking.speculation.k = 0
    assert speculation.lookahead(asking) == 1  # paused: one, for the probe
    assert Speculation(NgramProposer(), 4).lookahead(request([1, 2, 3])) == 0  # n-gram proposes on the scheduler


@pytest.mark.parametrize("speculative, draft_model, message", [
    ("draft", None, "--speculative draft needs a draft model: start the worker with --draft-model PATH"),
    ("draft", "", "--speculative draft needs a draft model"),
    ("ngram", "small.gguf", "--draft-model small.gguf is only used with --speculative draft (got --speculative ngram)"),
    (None, "small.gguf", "got --speculative off"),
])
def test_a_draft_model_comes_exactly_with_speculative_draft(speculative, draft_model, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_draft_model(speculative, draft_model)
    check_draft_model("draft", "small.gguf")
    check_draft_model(None, None)
