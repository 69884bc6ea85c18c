"""Verifying draft tokens (speculative decoding, issue 35): which of a request's drafts the target model accepts,
and the one token of its own that follows them.

A request that verifies k drafts d_1..d_k computes 1 + k rows in one step (its last known token, then the
drafts); row j's logits are the target's prediction after d_1..d_j (row 0: after its known tokens). So

    greedy          accept while argmax(row j) == d_{j+1}; the token after the accepted ones is the argmax of
                    the first row that disagreed (the correction) or of row k (the bonus): exactly the tokens
                    decoding one at a time gives, as many as the drafts got right plus one.
    temperature > 0 the standard rejection sampler (Leviathan et al. 2023; Chen et al. 2023): d_{j+1} drawn from
                    the draft distribution q_j is accepted with probability min(1, p_j(d) / q_j(d)), p_j the
                    target's sampling distribution at row j (target_logits, then worker.sampling.sampler.filtered_probs:
                    bias, penalties, temperature, min-p, top-k, top-p); at the first rejection the token is drawn from
                    max(0, p_j - q_j), renormalised; after k acceptances from p_k. Every emitted token then
                    follows the target's distribution exactly. A proposer with no distribution of its own (n-gram
                    prompt lookup) is a point mass q(d) = 1: d is accepted with probability p(d), and the
                    correction is drawn from p with d removed, renormalised. draft_probs carries q for a
                    proposer that has one. The draft model of --speculative draft (worker.draft_model) guesses
                    greedily, its argmax: a point mass too, so verify() stays exact for it as it is; a draft
                    that sampled its guesses would have to send its q here.

Row j's target is what sample() would draw from with the drafts before it as output so far: logit_bias, the
grammar's mask at the state after d_1..d_j (a constrained request), penalties over prompt + output + d_1..d_j
(so a draft the target saw already counts as repeated), then the filters.

    seeded          a request with a seed keeps its output whatever the drafts: its draw at output position n is
                    the exponential race with noise from (seed, n) (worker.sampling.sampler), so row j's token is
                    what decoding one token a step draws there, the path's own sampler (draw: its sample()) on row
                    j with the drafts before it as output; drafts are accepted while they equal those tokens, as
                    greedy ones are. The output is the one decoding without drafts gives, to the token, however
                    many drafts a step had room for (which depends on the rest of the batch); it costs acceptance:
                    a draft must be the very token drawn, not merely likely under p.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from worker.sampling.penalties import apply_penalties, has_penalties
from worker.sampling.sampler import SamplingRow, argmax_rows, biased_logits, filtered_probs, masked_logits
from worker.sampling.structured_output import TokenBitmask


Draw = Callable[[torch.Tensor, list[SamplingRow], TokenBitmask | None], list[int]]


def verify(logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]],
           generator: torch.Generator | None = None,
           masks: Sequence[torch.Tensor | None] | None = None, draw: Draw | None = None) -> list[tuple[list[int], int]]:
    """logits: [sum(1 + k_i), V] float32, request i's 1 + k_i rows in a block, in order; rows[i] and drafts[i]
    its sampling and its k_i drafts; masks[i]: a constrained request's [1 + k_i, W] token bitmask
    (StructuredOutput.draft_bitmask), None for the others; draw(logits, rows, bitmask) -> tokens: the sampler a
    step without drafts uses (the execution path's), for seeded requests (without it they take the rejection
    sampler, whose tokens depend on the drafts). -> per request (the accepted drafts, the token after them)."""
    masks = masks if masks is not None else [None] * len(rows)
    sizes = [1 + len(request_drafts) for request_drafts in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(sizes) or len(rows) != len(drafts):
        raise ValueError(f"verify: logits must be [{sum(sizes)}, V] for {len(rows)} requests, got {list(logits.shape)}")
    blocks = torch.split(logits, sizes)
    plain = [i for i, row in enumerate(rows)
             if row.params.greedy and not has_penalties(row.params) and masks[i] is None]
    verdicts: list[tuple[list[int], int] | None] = [None] * len(rows)
    if plain:  # one argmax and one host copy for every plain greedy request's rows
        expanded = [rows[i] for i in plain for _ in range(sizes[i])]
        choices = argmax_rows(biased_logits(torch.cat([blocks[i] for i in plain]), expanded)).tolist()
        offset = 0
        for i in plain:
            verdicts[i] = accept_greedy(choices[offset:offset + sizes[i]], drafts[i])
            offset += sizes[i]
    for i, row in enumerate(rows):
        if verdicts[i] is None and row.params.seed is not None and draw is not None:
            verdicts[i] = accept_greedy(draw(blocks[i], _with_drafts(row, drafts[i]), None if masks[i] is None else
                                             TokenBitmask(list(range(sizes[i])), masks[i])), drafts[i])
    targets = {i: target_logits(blocks[i], row, drafts[i], masks[i]) for i, row in enumerate(rows) if verdicts[i] is None}
    for i, row in enumerate(rows):
        if verdicts[i] is None and row.params.greedy:  # with penalties or a mask: each its own argmax
            verdicts[i] = accept_greedy(argmax_rows(targets[i]).tolist(), drafts[i])
    sampled = [i for i, verdict in enumerate(verdicts) if verdict is None]
    if sampled:  # the rejection sampler over all of them at once: one filter pass, two host copies
        target = torch.cat([targets[i] for i in sampled])
        probs = filtered_probs(target, [rows[i] for i in sampled for _ in range(sizes[i])])
        for i, verdict in zip(sampled, rejection_sample_point_mass(probs, [drafts[i] for i in sampled], generator)):
            verdicts[i] = verdict
    return verdicts


def target_logits(block: torch.Tensor, row: SamplingRow, drafts: Sequence[int],
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of one request's 1 + k rows of logits as sample() would choose from them: its logit_bias, its
    grammar's mask (mask: [1 + k, W], a row per state), then its penalties with the drafts before each row
    counted as output."""
    rows = _with_drafts(row, drafts)
    target = biased_logits(block, rows).float()
    if mask is not None:
        target = masked_logits(target, TokenBitmask(list(range(len(rows))), mask))
    target = target.clone() if target.data_ptr() == block.data_ptr() else target
    if has_penalties(row.params):
        apply_penalties(target, rows)
    return target


def _with_drafts(row: SamplingRow, drafts: Sequence[int]) -> list[SamplingRow]:
    """Row j of a request's 1 + k: its sampling with d_1..d_j as output after its own tokens."""
    return [SamplingRow(row.params, [*row.token_ids, *drafts[:j]], row.num_prompt_tokens) for j in range(len(drafts) + 1)]


def accept_greedy(choices: Sequence[int], drafts: Sequence[int]) -> tuple[list[int], int]:
    """choices: the target's argmax at each of the 1 + k rows. The longest prefix of drafts it agrees with,
    and its own choice after that prefix."""
    num_accepted = 0
    while num_accepted < len(drafts) and choices[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return list(drafts[:num_accepted]), int(choices[num_accepted])


def rejection_sample(target_probs: torch.Tensor, draft_ids: Sequence[int], draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """target_probs: [k + 1, V] the target's distribution at each row; draft_ids: the k drafts; draft_probs:
    [k, V] the distribution each was drawn from (None: a point mass on each draft). -> (the accepted
    drafts, the token after them), every emitted token distributed as the target's."""
    k = len(draft_ids)
    device = target_probs.device
    num_accepted = k
    if k:
        ids = torch.tensor(list(draft_ids), dtype=torch.long, device=device)  # [k]
        positions = torch.arange(k, device=device)
        p = target_probs[positions, ids]  # [k] the target's probability of each draft
        q = draft_probs[positions, ids] if draft_probs is not None else torch.ones_like(p)
        uniform = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
        rejected = (uniform * q >= p).tolist()  # accept with probability min(1, p / q)
        num_accepted = rejected.index(True) if True in rejected else k
    if num_accepted == k:
        return list(draft_ids), _draw_one(target_probs[k], generator)
    residual = target_probs[num_accepted].clone()
    if draft_probs is not None:
        residual.sub_(draft_probs[num_accepted]).clamp_(min=0.0)
    else:
        residual[draft_ids[num_accepted]] = 0.0
    if not float(residual.sum()) > 0.0:  # p == q to the last bit: any draw from p is as good
        residual = target_probs[num_accepted]
    return list(draft_ids[:num_accepted]), _draw_one(residual, generator)


def rejection_sample_point_mass(probs: torch.Tensor, drafts: Sequence[Sequence[int]],
                                generator: torch.Generator | None = None) -> list[tuple[list[int], int]]:
    """rejection_sample for many requests whose drafts are point masses (n-gram), vectorized: probs [sum(1 + k_i), V],
    request i's 1 + k_i rows of target distribution in a block. Draft d at row j is accepted with probability
    p_j(d); the token after the accepted ones is drawn from p_j with the rejected draft removed (renormalised),
    or from p_k after all k. -> per request (the accepted drafts, the token after them)."""
    device = probs.device
    starts = [0]
    for request_drafts in drafts:
        starts.append(starts[-1] + 1 + len(request_drafts))
    draft_rows = [starts[i] + j for i, request_drafts in enumerate(drafts) for j in range(len(request_drafts))]
    rejected: list[bool] = []
    if draft_rows:
        draft_ids = [token for request_drafts in drafts for token in request_drafts]
        p = probs[torch.tensor(draft_rows, device=device), torch.tensor(draft_ids, device=device)]  # [D]
        rejected = (torch.rand(len(draft_rows), generator=generator, device=device, dtype=p.dtype) >= p).tolist()
    accepted_counts, offset = [], 0
    for request_drafts in drafts:
        flags = rejected[offset:offset + len(request_drafts)]
        accepted_counts.append(flags.index(True) if True in flags else len(request_drafts))
        offset += len(request_drafts)
    final_rows = [starts[i] + n for i, n in enumerate(accepted_counts)]
    final = probs[torch.tensor(final_rows, device=device)]  # [B, V], a copy
    removed = [(b, drafts[b][n]) for b, n in enumerate(accepted_counts) if n < len(drafts[b])]
    if removed:  # the rejected draft leaves the distribution its correction is drawn from
        final[torch.tensor([b for b, _ in removed], device=device), torch.tensor([t for _, t in removed], device=device)] = 0.0
        empty = final.sum(dim=-1) <= 0.0  # p == the draft's point mass: any draw from p is as good
        final = torch.where(empty.unsqueeze(1), probs[torch.tensor(final_rows, device=device)], final)
    tokens = torch.multinomial(final, 1, generator=generator).squeeze(1).tolist()
    return [(list(request_drafts[:n]), int(token)) for request_drafts, n, token in zip(drafts, accepted_counts, tokens)]


def _draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (unnormalised weights)."""
    return int(torch.multinomial(probs, 1, generator=generator))
