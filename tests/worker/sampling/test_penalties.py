"""Penalty values on hand-made logits: each case has one exact expected tensor."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from worker.sampling.penalties import apply_penalties, has_penalties
from worker.sampling.sampler import SamplingRow

#                      token:  0     1     2     3
BASE = torch.tensor([[4.0, -2.0, 1.0, 0.5]])


def _penalized(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> list[float]:
    logits = BASE.clone()
    apply_penalties(logits, [SamplingRow(params, token_ids, num_prompt_tokens)])
    return logits[0].tolist()


@pytest.mark.parametrize(
    "params, token_ids, num_prompt_tokens, expected",
    [
        # repetition over prompt (0) and output (1): positive divided, negative multiplied
        (SamplingParams(repetition_penalty=2.0), [0, 1], 1, [2.0, -4.0, 1.0, 0.5]),
        # frequency over the output only: token 2 twice, token 0 only in the prompt
        (SamplingParams(frequency_penalty=0.25), [0, 2, 2], 1, [4.0, -2.0, 0.5, 0.5]),
        # presence once per distinct output token
        (SamplingParams(presence_penalty=0.75), [0, 2, 2, 3], 1, [4.0, -2.0, 0.25, -0.25]),
        # repetition first, then frequency and presence: 4 / 2 - 2 * 0.5 - 1 = 0 (the other order gives 1)
        (SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0), [1, 0, 0], 1,
         [0.0, -4.0, 1.0, 0.5]),
        # negative penalties reward repetition (OpenAI allows -2..2)
        (SamplingParams(frequency_penalty=-1.0), [1, 3], 1, [4.0, -2.0, 1.0, 1.5]),
    ],
)
def test_penalty_values(params, token_ids, num_prompt_tokens, expected):
    assert _penalized(params, token_ids, num_prompt_tokens) == expected


def test_neutral_rows_are_bit_identical_next_to_penalized_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [
        SamplingRow(SamplingParams(), [1, 2, 3, 3], 2),
        SamplingRow(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2), [1, 2, 3, 3], 2),
        SamplingRow(SamplingParams(temperature=0.5), list(range(50)), 10),
    ]
    apply_penalties(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert not torch.equal(logits[1], before[1])


def test_out_of_vocab_token_is_named():
    with pytest.raises(ValueError, match="token id 9, outside vocab size 4"):
        apply_penalties(BASE.clone(), [SamplingRow(SamplingParams(presence_penalty=1.0), [0, 9], 1)])


def test_has_penalties():
    assert not has_penalties(SamplingParams())
    assert has_penalties(SamplingParams(repetition_penalty=1.1))
    assert has_penalties(SamplingParams(presence_penalty=-0.5))
    assert has_penalties(SamplingParams(frequency_penalty=0.1))
