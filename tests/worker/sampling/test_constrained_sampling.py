"""The token bitmask of constrained rows, applied by worker.sampling.sampler for every sampling mode: a masked
token never comes out, whatever the row's temperature, filters, seed, penalties or logprobs; the
unconstrained rows beside it are untouched; logprobs stay the model's raw ones."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from core.sampling import SamplingParams
from worker.sampling.sampler import SamplingRow, sample, unpack_bitmask
from worker.sampling.structured_output import TokenBitmask

VOCAB_SIZE = 70  # three bitmask words, the last one partly past the vocabulary


def pack(allowed: list[set[int]], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """[C, W] int32 bitmask with exactly the given tokens allowed per row."""
    words = -(-vocab_size // 32)
    bits = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            bits[row, token // 32] |= 1 << (token % 32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


MODES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=1.0, frequency_penalty=1.0, logprobs=3),
]


def test_unpack_reads_bit_t_of_word_t_over_32():
    allowed = [{0, 31, 32, 63, 64, 69}, set(range(VOCAB_SIZE))]
    unpacked = unpack_bitmask(pack(allowed), VOCAB_SIZE)
    assert [set(row.nonzero().flatten().tolist()) for row in unpacked] == allowed


@pytest.mark.parametrize("params", MODES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-seed{p.seed}")
def test_a_masked_token_never_comes_out_in_any_mode(params):
    generator = torch.Generator().manual_seed(0)
    num_rows = 64
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 4
    allowed = [{int(t) for t in torch.randperm(VOCAB_SIZE, generator=generator)[:3]} for _ in range(num_rows)]
    # the row's most likely tokens are all masked: an unmasked sampler would pick them
    for row, tokens in enumerate(allowed):
        logits[row, sorted(tokens)] -= 20
    rows = [SamplingRow(params, [1, 2, 3, 5], 1) for _ in range(num_rows)]
    before = logits.clone()

    tokens, logprobs = sample(logits, rows, TokenBitmask(list(range(num_rows)), pack(allowed)))

    assert all(token in allowed[row] for row, token in enumerate(tokens))
    assert torch.equal(logits, before)
    if params.logprobs is not None:  # the raw distribution: masked tokens keep their logprob
        raw = torch.log_softmax(before, dim=-1)
        assert logprobs[0].top[0][0] == int(raw[0].argmax())


def test_only_the_listed_rows_are_masked():
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [0], 1) for _ in range(4)]
    free = logits.argmax(dim=-1).tolist()
    target = (free[2] + 1) % VOCAB_SIZE

    tokens, _ = sample(logits, rows, TokenBitmask([2], pack([{target}])))

    assert tokens == [free[0], free[1], target, free[3]]


@pytest.mark.parametrize("params", MODES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-seed{p.seed}")
def test_logit_bias_forces_and_bans_tokens_in_any_mode(params):
    logits = torch.randn(8, VOCAB_SIZE, generator=torch.Generator().manual_seed(2))
    forced = [(5, 100.0), (int(logits[0].argmax()), -100.0)]
    rows = [SamplingRow(dataclasses.replace(params, logit_bias=tuple(forced)), [1, 2], 1) for _ in range(8)]

    tokens, logprobs = sample(logits, rows)

    assert tokens == [5] * 8
    if params.logprobs is not None:  # unbiased: the model's own distribution
        assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], dim=-1)[5]), abs=1e-5)


def test_logit_bias_applies_before_the_mask():
    logits = torch.zeros(1, VOCAB_SIZE)
    row = SamplingRow(SamplingParams(temperature=0.0, logit_bias=((3, 100.0),)), [0], 1)
    tokens, _ = sample(logits, [row], TokenBitmask([0], pack([{7, 9}])))
    assert tokens[0] in (7, 9)
