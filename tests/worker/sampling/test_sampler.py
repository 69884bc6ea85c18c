"""The sampler on CPU with real torch: each test builds logits whose right answer is known."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from worker.sampling.sampler import SamplingRow, sample

# probabilities with gaps wide enough that float rounding never decides a top-p / min-p boundary
KNOWN_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
KNOWN_LOGITS = KNOWN_PROBS.log()


def _random_logits(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def _row(params: SamplingParams, token_ids: list[int] | None = None, num_prompt_tokens: int = 1) -> SamplingRow:
    return SamplingRow(params, token_ids if token_ids is not None else [0], num_prompt_tokens)


def _sample_counts(logits_row: torch.Tensor, params: SamplingParams, num_samples: int) -> torch.Tensor:
    """[V] how often each token came out of num_samples independent draws (unseeded: fixed global seed)."""
    logits = logits_row.expand(num_samples, -1).contiguous()
    rows = [_row(params) for _ in range(num_samples)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        tokens, _ = sample(logits, rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[0])


def _support(counts: torch.Tensor) -> set[int]:
    return set(counts.nonzero().flatten().tolist())


def test_greedy_is_argmax_alone_and_next_to_sampling_rows():
    logits = _random_logits(6, 40, seed=0)
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(6)])[0] == expected

    mixed = [_row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, logprobs=2 if i == 4 else None)) for i in range(6)]
    tokens, _ = sample(logits, mixed)
    assert tokens[0::2] == expected[0::2]


def test_sample_leaves_the_callers_logits_alone():
    logits = _random_logits(3, 20, seed=1)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.5,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=3)
    sample(logits, [_row(params, [1, 2, 2, 3]) for _ in range(3)])
    assert torch.equal(logits, before)


def test_rows_must_match_logits():
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        sample(torch.zeros(3, 5), [_row(SamplingParams()), _row(SamplingParams())])
    assert sample(torch.zeros(0, 5), []) == ([], [])


@pytest.mark.parametrize("temperature", [0.01, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = _random_logits(8, 50, seed=2)
    rows = [_row(SamplingParams(temperature=temperature, top_k=1, seed=i if i % 2 else None)) for i in range(8)]
    assert sample(logits, rows)[0] == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_the_k_best_and_all_of_them():
    logits_row = _random_logits(1, 12, seed=3)[0]
    counts = _sample_counts(logits_row, SamplingParams(temperature=1.5, top_k=3), 3000)
    assert _support(counts) == set(logits_row.topk(3).indices.tolist())


@pytest.mark.parametrize("top_p, nucleus", [(0.4, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    counts = _sample_counts(KNOWN_LOGITS, SamplingParams(temperature=1.0, top_p=top_p), 4000)
    assert _support(counts) == nucleus


@pytest.mark.parametrize("min_p, kept", [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p, kept):
    # thresholds 0.1, 0.25, 0.45 of the best prob 0.5
    counts = _sample_counts(KNOWN_LOGITS, SamplingParams(temperature=1.0, min_p=min_p), 4000)
    assert _support(counts) == kept


def test_top_p_off_keeps_a_negligible_tail_next_to_a_top_p_row():
    # The best token holds all but ~1e-13 of the mass, so the running sum rounds to exactly 1 after
    # it. A row with top_p = 1 must still keep its tail when it shares the pass with a top-p row, or
    # its seeded draw would depend on its neighbours. (Checked on the helper: no draw could see it.)
    from worker.sampling.sampler import _apply_top_k_top_p

    logits = torch.tensor([[0.0, -30.0, -30.0, -30.0, -31.0]] * 2)
    _apply_top_k_top_p(logits, 4, torch.tensor([0.5, 1.0]))
    assert logits[0].isinf().tolist() == [False, True, True, True, True]
    assert logits[1].isinf().tolist() == [False, False, False, False, True]


def test_temperature_changes_the_spread():
    logits_row = torch.linspace(2.0, -2.0, 20)  # token 0 best, gaps of ~0.21
    cold = _sample_counts(logits_row, SamplingParams(temperature=0.01), 2000)
    hot = _sample_counts(logits_row, SamplingParams(temperature=50.0), 2000)
    assert cold[0] == 2000
    assert len(_support(hot)) == 20
    assert hot.max() < 0.1 * 2000  # near uniform (0.05 each), far from cold's 1.0


# --- penalties through sample(): a greedy row whose choice flips ---------------------------------

@pytest.mark.parametrize(
    "params, token_ids, num_prompt_tokens, expected",
    [
        # no penalty: token 0 (3.0) wins
        (SamplingParams(temperature=0.0), [0, 0, 0], 1, 0),
        # frequency, output has token 0 twice: 3.0 - 2 * 0.3 = 2.4 < 2.5
        (SamplingParams(temperature=0.0, frequency_penalty=0.3), [5, 0, 0], 1, 1),
        # 3.0 - 2 * 0.2 = 2.6 > 2.5: still token 0
        (SamplingParams(temperature=0.0, frequency_penalty=0.2), [5, 0, 0], 1, 0),
        # presence counts once: 3.0 - 0.6 = 2.4 < 2.5
        (SamplingParams(temperature=0.0, presence_penalty=0.6), [5, 0, 0], 1, 1),
        # presence and frequency ignore the prompt
        (SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0), [0, 0, 5], 2, 0),
        # repetition covers the prompt: 3.0 / 1.5 = 2.0 < 2.5
        (SamplingParams(temperature=0.0, repetition_penalty=1.5), [0, 5], 1, 1),
    ],
)
def test_penalties_flip_the_greedy_choice(params, token_ids, num_prompt_tokens, expected):
    # token: 0     1     2     3     4     5
    logits = torch.tensor([[3.0, 2.5, -0.5, -1.0, 2.3, -3.0]])
    assert sample(logits, [_row(params, token_ids, num_prompt_tokens)])[0] == [expected]


def test_repetition_penalty_multiplies_negative_logits():
    # -1.0 * 1.2 = -1.2 < -1.1: token 1 wins. Dividing instead (-0.83) would keep token 0.
    logits = torch.tensor([[-1.0, -1.1, -4.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sample(logits, [_row(params, [2, 0], 1)])[0] == [1]
    assert sample(logits, [_row(params, [2, 2], 1)])[0] == [0]


# --- seeds ---------------------------------------------------------------------------------------

VOCAB = 64
PROMPT = [3, 1, 4, 1, 5]


def _step_logits(step: int) -> torch.Tensor:
    return _random_logits(1, VOCAB, seed=1000 + step)[0] / 3  # moderate spread: many plausible tokens


def _neighbour_params(i: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=4, seed=99),
        SamplingParams(temperature=1.0, min_p=0.3, frequency_penalty=0.5, logprobs=2),
    ][i % 4]


def _generate(params: SamplingParams, num_tokens: int, batch_size: int, output: list[int] | None = None) -> list[int]:
    """Decode num_tokens for one request, continuing output (the tokens before a preemption).

    With batch_size > 1 the request sits among random neighbours at a position that moves every
    step, and the global RNG is reseeded differently each step.
    """
    token_ids = PROMPT + list(output or [])
    generated: list[int] = []
    for _ in range(num_tokens):
        step = len(token_ids) - len(PROMPT)
        logits = _step_logits(step).unsqueeze(0)
        rows = [SamplingRow(params, token_ids, len(PROMPT))]
        if batch_size > 1:
            torch.manual_seed(step * 7 + batch_size)
            position = step % batch_size
            neighbours = _random_logits(batch_size - 1, VOCAB, seed=step + 50 * batch_size)
            logits = torch.cat([neighbours[:position], logits, neighbours[position:]])
            others = [SamplingRow(_neighbour_params(i + step), [7, 8, 9], 1) for i in range(batch_size - 1)]
            rows = others[:position] + rows + others[position:]
        else:
            position = 0
        token = sample(logits, rows)[0][position]
        token_ids = token_ids + [token]  # a new list: the sampler must not rely on object identity
        generated.append(token)
    return generated


SEEDED = [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=7),
]


@pytest.mark.parametrize("params", SEEDED)
def test_same_seed_same_tokens_alone_or_in_any_batch(params):
    with torch.random.fork_rng(devices=[]):
        alone = _generate(params, 12, batch_size=1)
        in_batch = _generate(params, 12, batch_size=5)
        in_bigger_batch = _generate(params, 12, batch_size=9)
    assert alone == in_batch == in_bigger_batch
    assert len(set(alone)) > 3  # really sampled, not a constant


@pytest.mark.parametrize("params", SEEDED)
def test_seeded_request_resumes_the_same_sequence_after_preemption(params):
    with torch.random.fork_rng(devices=[]):
        uninterrupted = _generate(params, 12, batch_size=3)
        resumed = _generate(params, 6, batch_size=4, output=uninterrupted[:6])
    assert resumed == uninterrupted[6:]


def test_different_seeds_give_different_tokens():
    first = _generate(SamplingParams(temperature=1.0, seed=1), 12, batch_size=1)
    second = _generate(SamplingParams(temperature=1.0, seed=2), 12, batch_size=1)
    assert first != second


# --- logprobs ------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = _random_logits(4, 30, seed=5)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=5)),
        # penalties, temperature and filters do not change the reported (raw) logprobs
        _row(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=3), [1, 2, 3]),
        _row(SamplingParams(temperature=1.0)),
        _row(SamplingParams(temperature=1.0, logprobs=0, seed=3)),
    ]
    tokens, logprobs = sample(logits, rows)
    assert logprobs[2] is None
    for i, expected_n in [(0, 5), (1, 3), (3, 0)]:
        result = logprobs[i]
        assert result.logprob == pytest.approx(raw[i, tokens[i]].item(), abs=1e-6)
        assert len(result.top) == expected_n
        top_ids = [token_id for token_id, _ in result.top]
        top_values = [value for _, value in result.top]
        assert top_ids == raw[i].topk(expected_n).indices.tolist()
        assert top_values == sorted(top_values, reverse=True)
        assert top_values == pytest.approx(raw[i, top_ids].tolist(), abs=1e-6)
    assert tokens[0] == logits[0].argmax().item()
    assert logprobs[0].top[0] == (tokens[0], pytest.approx(logprobs[0].logprob))


def test_logprobs_larger_than_the_vocab_return_the_whole_vocab():
    logits = _random_logits(1, 4, seed=6)
    _, logprobs = sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=20))])
    assert len(logprobs[0].top) == 4


# --- the draw matches the intended distribution --------------------------------------------------

CHI2_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 1.5, -1.0])
CHI2_CRITICAL_5_DOF = 20.5  # p = 0.001; with fixed seeds the test is deterministic anyway


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    total = counts.sum().item()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token the filters should have removed"
    expected = expected_probs[support] * total
    return (((counts[support] - expected) ** 2) / expected).sum().item()


def _renormalized(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    return kept / kept.sum()


@pytest.mark.parametrize(
    "params, expected_probs",
    [
        (SamplingParams(temperature=1.0), CHI2_LOGITS.softmax(-1)),
        (SamplingParams(temperature=0.5), (CHI2_LOGITS / 0.5).softmax(-1)),
        (SamplingParams(temperature=2.0), (CHI2_LOGITS / 2.0).softmax(-1)),
        # best three are tokens 4, 0, 1
        (SamplingParams(temperature=1.0, top_k=3), _renormalized(CHI2_LOGITS.softmax(-1), [4, 0, 1])),
        # probs 0.414, 0.251, 0.152, 0.092, 0.056, 0.034 (tokens 4, 0, 1, 2, 3, 5): the mass before
        # token 2 is 0.817 and before token 3 0.909, so p = 0.85 keeps four
        (SamplingParams(temperature=1.0, top_p=0.85), _renormalized(CHI2_LOGITS.softmax(-1), [4, 0, 1, 2])),
    ],
)
def test_unseeded_draws_follow_the_filtered_softmax(params, expected_probs):
    counts = _sample_counts(CHI2_LOGITS, params, 20000)
    assert _chi_square(counts, expected_probs) < CHI2_CRITICAL_5_DOF


def test_seeded_draws_across_seeds_follow_the_softmax():
    num_rows = 5000
    logits = CHI2_LOGITS.expand(num_rows, -1).contiguous()
    rows = [_row(SamplingParams(temperature=1.0, seed=seed)) for seed in range(num_rows)]
    tokens, _ = sample(logits, rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert _chi_square(counts, CHI2_LOGITS.softmax(-1)) < CHI2_CRITICAL_5_DOF


def test_seeded_draws_across_positions_follow_the_softmax():
    # one request over many steps: the per-step seeds must not be correlated with each other
    num_rows = 5000
    logits = CHI2_LOGITS.expand(num_rows, -1).contiguous()
    token_ids = [0] * (num_rows + 1)  # shared; num_prompt_tokens sets each row's output count
    params = SamplingParams(temperature=1.0, seed=42)
    rows = [SamplingRow(params, token_ids, num_rows + 1 - step) for step in range(num_rows)]
    tokens, _ = sample(logits, rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert _chi_square(counts, CHI2_LOGITS.softmax(-1)) < CHI2_CRITICAL_5_DOF


def test_argmax_rows_is_argmax_on_ties_and_nan():
    from worker.sampling.sampler import argmax_rows

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randint(0, 4, (16, 3000), generator=generator).to(dtype)  # every row ties
        logits[3, 5] = logits[9, 2999] = float("nan")
        logits[12] = float("-inf")
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [49152, 151936, 32000, 5000])  # whole chunks of 1024, and a short last one
def test_argmax_rows_by_chunks_is_argmax(vocab):
    """Inputs large enough for the chunked search (worker.sampling.sampler.ARGMAX_CHUNK): ties within and across
    chunks, the maximum in the first and last column, in the short last chunk, at a chunk's edges, rows of -inf,
    a NaN; float32 and bfloat16; a non-contiguous input."""
    from worker.sampling.sampler import ARGMAX_CHUNK, ARGMAX_CHUNKED_FROM, argmax_rows

    generator = torch.Generator().manual_seed(vocab)
    rows = -(-ARGMAX_CHUNKED_FROM // vocab) + 8
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randint(0, 4, (rows, vocab), generator=generator).to(dtype)  # every row ties, in many chunks
        logits[1] = float("-inf")
        logits[2, -1] = logits[3, 0] = logits[4, vocab - 5] = 9
        logits[5, ARGMAX_CHUNK - 1] = logits[5, ARGMAX_CHUNK] = 9  # equal maxima either side of a chunk edge
        logits[6, 2 * ARGMAX_CHUNK] = 9
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), dtype
        noise = torch.randn(rows, vocab, generator=generator).to(dtype)
        assert torch.equal(argmax_rows(noise), noise.argmax(dim=-1))
        assert torch.equal(argmax_rows(noise[::2]), noise[::2].argmax(dim=-1))  # rows of a larger tensor
        logits[7, 3] = float("nan")  # NaN comes before any number
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), dtype
