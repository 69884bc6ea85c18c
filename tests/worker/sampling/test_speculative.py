"""Verification of draft tokens (worker.sampling.speculative): greedy acceptance is decoding one token at a
time, and the rejection sampler's output follows the target distribution (fixed seeds, a total-variation
bound and a chi-square test over many draws), for a point-mass draft (n-gram) and a draft with a
distribution of its own."""
from collections import Counter

import pytest
import torch

from core.sampling import SamplingParams
from worker.sampling.sampler import SamplingRow, filtered_probs, sample
from worker.sampling.speculative import (accept_greedy, rejection_sample, rejection_sample_point_mass, target_logits,
                                        verify)

GREEDY = SamplingRow(SamplingParams(temperature=0.0), [1, 2, 3], 3)


def test_greedy_accepts_the_prefix_the_argmax_agrees_with_then_its_own_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7], 8)  # all accepted: the bonus token
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == ([5], 9)  # the correction at the first disagreement
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == ([], 4)  # none: exactly a plain decode step
    assert accept_greedy([4], []) == ([], 4)


def test_verify_reads_each_requests_block_of_rows():
    vocab = 10
    logits = torch.full((3 + 1 + 3, vocab), -5.0)
    for row, token in enumerate([4, 2, 9, 3, 1, 1, 1]):  # the argmax of each row
        logits[row, token] = 5.0
    rows = [GREEDY, GREEDY, SamplingRow(SamplingParams(temperature=0.0, logit_bias=((7, 20.0),)), [1], 1)]
    # request 0: drafts 4 2 (argmax 4 2 9: both accepted, bonus 9); request 1: no drafts (argmax 3);
    # request 2: drafts 1 1, but its bias makes 7 the argmax of every row: none accepted, token 7
    assert verify(logits, rows, [[4, 2], [], [1, 1]]) == [([4, 2], 9), ([], 3), ([], 7)]
    with pytest.raises(ValueError, match="logits must be"):
        verify(logits, rows, [[4], [], [1, 1]])


def test_a_seeded_request_accepts_drafts_while_they_are_its_own_draws():
    """A seeded request's tokens under verification are the ones its sampler draws one token a step (noise from
    (seed, output position)): drafts equal to them are accepted, the first other one is replaced by the draw."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 2  # 4 drafts + 1 row
    row = SamplingRow(SamplingParams(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.3), [3, 4, 5], 2)
    draws = []
    for j in range(5):  # decoding one token a step: row j sees the draws before it as output
        tokens, _ = sample(logits[j : j + 1], [SamplingRow(row.params, [*row.token_ids, *draws], 2)])
        draws.append(tokens[0])
    draw = lambda block, rows, bitmask: sample(block, rows, bitmask)[0]  # noqa: E731 - the path's sampler
    assert verify(logits, [row], [draws[:4]], draw=draw) == [(draws[:4], draws[4])]
    wrong = (draws[2] + 1) % 50
    assert verify(logits[:4], [row], [[*draws[:2], wrong]], draw=draw) == [(draws[:2], draws[2])]
    other_seed = SamplingRow(SamplingParams(temperature=0.9, top_p=0.95, seed=99, presence_penalty=0.3), [3, 4, 5], 2)
    first = sample(logits[:1], [other_seed])[0][0]
    assert verify(logits[:1], [other_seed], [[]], draw=draw) == [([], first)]


def test_verify_samples_with_temperature_through_the_rejection_sampler():
    logits = torch.tensor([[0.0, 10.0, 0.0], [0.0, 0.0, 10.0]])  # nearly certain: 1, then 2
    row = SamplingRow(SamplingParams(temperature=0.5), [0], 1)
    generator = torch.Generator().manual_seed(0)
    assert verify(logits, [row], [[1]], generator) == ([([1], 2)])
    accepted, token = verify(logits, [row], [[0]], generator)[0]
    assert accepted == [] and token == 1  # 0 is rejected; the correction avoids it


def total_variation(counts: Counter, probs: list[float], n: int) -> float:
    return 0.5 * sum(abs(counts.get(token, 0) / n - p) for token, p in enumerate(probs))


def chi_square(counts: Counter, probs: list[float], n: int) -> float:
    return sum((counts.get(token, 0) - n * p) ** 2 / (n * p) for token, p in enumerate(probs) if p > 0)


P0 = [0.1, 0.35, 0.05, 0.3, 0.2]  # the target at the first row
P1 = [0.4, 0.1, 0.2, 0.1, 0.2]  # ... at the row after the first draft
N = 20_000
CHI_SQUARE_4_DOF_999 = 18.47  # the 99.9th percentile of chi-square with 4 degrees of freedom


@pytest.mark.parametrize("draft_q", [None, [0.05, 0.15, 0.3, 0.4, 0.1]], ids=["point-mass", "draft-distribution"])
def test_rejection_sampler_keeps_the_target_distribution(draft_q):
    generator = torch.Generator().manual_seed(1234)
    target = torch.tensor([P0, P1, [0.2] * 5], dtype=torch.float64)
    draft_probs = None if draft_q is None else torch.tensor([draft_q, draft_q], dtype=torch.float64)
    drafts = torch.multinomial(draft_probs[0], N * 2, replacement=True, generator=generator).view(N, 2).tolist() \
        if draft_probs is not None else [[3, 0]] * N  # a point mass: always the same guesses
    first, pairs, num_accepted = Counter(), Counter(), 0
    for draft in drafts:
        accepted, token = rejection_sample(target, draft, draft_probs, generator)
        emitted = [*accepted, token]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the first draft was accepted: the second token is the target's at row 1
            pairs[emitted[1]] += 1
        num_accepted += len(accepted)
    assert total_variation(first, P0, N) < 0.015 and chi_square(first, P0, N) < CHI_SQUARE_4_DOF_999
    num_pairs = sum(pairs.values())
    assert total_variation(pairs, P1, num_pairs) < 0.03 and chi_square(pairs, P1, num_pairs) < CHI_SQUARE_4_DOF_999
    assert num_accepted > 0


def test_the_batched_point_mass_sampler_keeps_the_target_distribution():
    """What verify() runs for sampled requests: N requests at once, each with the drafts 3 then 0 (and every
    tenth with none), in one call."""
    generator = torch.Generator().manual_seed(99)
    drafts = [[] if i % 10 == 0 else [3, 0] for i in range(N)]
    block = {0: [P0], 2: [P0, P1, [0.2] * 5]}
    probs = torch.tensor([row for request_drafts in drafts for row in block[len(request_drafts)]], dtype=torch.float64)
    first, pairs = Counter(), Counter()
    for request_drafts, (accepted, token) in zip(drafts, rejection_sample_point_mass(probs, drafts, generator)):
        assert accepted == request_drafts[:len(accepted)]
        emitted = [*accepted, token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            pairs[emitted[1]] += 1
    assert total_variation(first, P0, N) < 0.015 and chi_square(first, P0, N) < CHI_SQUARE_4_DOF_999
    num_pairs = sum(pairs.values())
    assert num_pairs > 0.25 * N  # P0[3] = 0.3 of the 90 % that draft
    assert total_variation(pairs, P1, num_pairs) < 0.03 and chi_square(pairs, P1, num_pairs) < CHI_SQUARE_4_DOF_999


def test_the_point_mass_acceptance_rate_is_the_targets_probability_of_the_draft():
    generator = torch.Generator().manual_seed(7)
    target = torch.tensor([P0, P1], dtype=torch.float64)
    accepted = sum(len(rejection_sample(target, [1], None, generator)[0]) for _ in range(N))
    assert abs(accepted / N - P0[1]) < 0.015
    # a draft the target gives no mass is never accepted, and the correction never repeats it
    target = torch.tensor([[0.5, 0.0, 0.5], [1 / 3] * 3], dtype=torch.float64)
    for _ in range(200):
        accepted, token = rejection_sample(target, [1], None, generator)
        assert accepted == [] and token != 1


def test_the_target_is_what_sample_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.7, top_k=3), [0], 1)
    probs = filtered_probs(target_logits(logits, row, []), [row])[0]
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.7, dim=-1)
    assert torch.allclose(probs[:3], expected) and probs[3:].sum() == 0
    assert logits[0, 0] == 2.0  # the caller's logits are kept


def test_penalties_count_the_drafts_before_each_row():
    """Row j is penalized as sample() would after the request's tokens and the first j drafts: greedy
    verification with a repetition penalty accepts exactly what decoding one token at a time picks."""
    torch.manual_seed(0)
    vocab, prompt = 12, [3, 5]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.3)
    logits = torch.randn(4, vocab)
    logits[:, 7] += 3.0  # 7 is the raw favourite of every row: the penalties must turn it down once seen
    one_at_a_time, tokens = [], list(prompt)
    for row_logits in logits:
        token = sample(row_logits.unsqueeze(0), [SamplingRow(params, list(tokens), 2)])[0][0]
        one_at_a_time.append(token)
        tokens.append(token)
    drafts = one_at_a_time[:3]
    assert verify(logits, [SamplingRow(params, prompt, 2)], [drafts]) == [(drafts, one_at_a_time[3])]
    assert len(set(one_at_a_time)) > 1  # the penalties changed the choice along the way
    wrong = [drafts[0], (drafts[1] + 1) % vocab, drafts[2]]
    assert verify(logits, [SamplingRow(params, prompt, 2)], [wrong]) == [([drafts[0]], drafts[1])]
