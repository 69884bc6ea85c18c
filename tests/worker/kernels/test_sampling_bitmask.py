"""The sampling kernel's token bitmask (constrained decoding), under the Triton interpreter on CPU:
masked tokens never come out for greedy, temperature and filtered rows, and the draw equals the kernel's
own draw over logits masked by hand (the bitmask changes which tokens compete, nothing else)."""
from __future__ import annotations

import torch

from worker.kernels.sampling import sample_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB_SIZE = 1100  # two vocabulary blocks, 35 bitmask words


def _pack(allowed: list[set[int]]) -> torch.Tensor:
    words = -(-VOCAB_SIZE // 32)
    bits = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        if tokens is None:
            bits[row] = -1
            continue
        for token in tokens:
            bits[row, token // 32] |= 1 << (token % 32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).to(DEVICE)


def _case(num_rows: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 3
    allowed = [{int(t) for t in torch.randperm(VOCAB_SIZE, generator=generator)[:5]} for _ in range(num_rows)]
    for row, tokens in enumerate(allowed):
        logits[row, sorted(tokens)] -= 10  # the allowed tokens are unlikely ones
    seeds = torch.arange(num_rows, dtype=torch.int64) * 7919 + 11
    return logits.to(DEVICE), allowed, seeds.to(DEVICE)


def _masked_by_hand(logits: torch.Tensor, allowed: list[set[int]]) -> torch.Tensor:
    masked = torch.full_like(logits, float("-inf"))
    for row, tokens in enumerate(allowed):
        masked[row, sorted(tokens)] = logits[row, sorted(tokens)]
    return masked


def test_greedy_and_sampled_rows_pick_only_allowed_tokens():
    logits, allowed, seeds = _case()
    temperature = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 0.0, 1.0], device=DEVICE)

    tokens = sample_tokens(logits, temperature, None, None, seeds, token_bitmask=_pack(allowed)).tolist()

    assert all(token in allowed[row] for row, token in enumerate(tokens))
    expected = sample_tokens(_masked_by_hand(logits, allowed), temperature, None, None, seeds).tolist()
    assert tokens == expected


def test_filters_keep_a_prefix_of_the_allowed_tokens():
    logits, allowed, seeds = _case(seed=1)
    temperature = torch.ones(8, device=DEVICE)
    top_k = torch.full((8,), 2, dtype=torch.int32, device=DEVICE)
    top_p = torch.full((8,), 0.9, device=DEVICE)
    min_p = torch.full((8,), 0.01, device=DEVICE)

    tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, min_p=min_p, token_bitmask=_pack(allowed))

    expected = sample_tokens(_masked_by_hand(logits, allowed), temperature, top_k, top_p, seeds, min_p=min_p)
    assert tokens.tolist() == expected.tolist()
    best_two = [set(_masked_by_hand(logits, allowed)[row].topk(2).indices.tolist()) for row in range(8)]
    assert all(token in best_two[row] for row, token in enumerate(tokens.tolist()))


def test_an_all_ones_row_is_unconstrained():
    logits, allowed, seeds = _case(seed=2)
    temperature = torch.tensor([0.0, 1.0] * 4, device=DEVICE)
    mixed = [None if row % 2 else allowed[row] for row in range(8)]

    tokens = sample_tokens(logits, temperature, None, None, seeds, token_bitmask=_pack(mixed)).tolist()
    free = sample_tokens(logits, temperature, None, None, seeds).tolist()

    assert tokens[1::2] == free[1::2]
    assert all(tokens[row] in allowed[row] for row in range(0, 8, 2))
