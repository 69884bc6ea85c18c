"""Turn one step's logits into next tokens (and logprobs), with vLLM's sampling semantics.

Per row, in vLLM's order: penalties (worker.sampling.penalties) on the raw logits; greedy rows take the
argmax (SamplingParams.greedy: core.sampling's one threshold, which the sampling kernel shares); the
others divide by the temperature, then min-p, top-k and top-p remove tokens, then one
token is drawn from the softmax of what is left. Greedy rows ignore the filters: none of them can
remove the most likely token.

The draw is an exponential race, argmax(probs / q) with q ~ Exp(1) per token, which picks token i
with probability probs[i]. A seeded request draws its q from a generator seeded by (seed, number of
output tokens so far): its tokens depend on nothing else in the batch nor on the batch order, and a
request that resumes after a preemption continues the same sequence. Rows without a seed share the
default RNG. Every filter is applied only to rows that ask for it, so a row's probabilities are
bit-identical whatever its neighbours ask for.

Logprobs are vLLM's default "raw" logprobs: log_softmax of the logits the model produced, before
penalties, temperature and filters. They describe the model, not the sampling distribution.

A row's logit_bias is added to its raw logits first (OpenAI semantics; logprobs stay unbiased).
Constrained rows (worker.sampling.structured_output) come with a token bitmask: their disallowed tokens are
set to -inf before anything else, so every mode (greedy, temperature, filters, seeds) picks among
allowed tokens only; logprobs still describe the model's raw distribution.

Hot path: an all-greedy batch without penalties or logprobs is one argmax and one .tolist(). Other
batches only send the rows that need it through penalties and filters, vectorized across rows, and
still copy to the host once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from core.sampling import SamplingParams
from core.step import TokenLogprobs
from worker.sampling.penalties import apply_penalties, has_penalties
from worker.sampling.structured_output import TokenBitmask


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far (the worker's own copy)
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           token_bitmask: TokenBitmask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [B, V] float32, one row per request that samples this step, in the order of rows;
    token_bitmask: the allowed tokens of the constrained rows, if any.

    Returns the chosen token id of each row and, per row, its TokenLogprobs (None where
    params.logprobs is None). The caller's logits are not modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sample: logits must be [len(rows)={len(rows)}, V], got {list(logits.shape)}")
    if not rows:
        return [], []
    choice_logits = biased_logits(logits, rows)
    if token_bitmask is not None:
        choice_logits = masked_logits(choice_logits, token_bitmask)
    if all(_is_plain_greedy(row.params) for row in rows):
        return argmax_rows(choice_logits).tolist(), [None] * len(rows)

    token_ids = _choose_tokens(choice_logits, rows)  # [B] int64, on the logits' device
    logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not logprob_rows:
        return token_ids.tolist(), [None] * len(rows)
    return _with_logprobs(logits, rows, token_ids, logprob_rows)


def biased_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits, or a copy with each row's logit_bias added (OpenAI: to the raw logits, before anything)."""
    biased_rows = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased_rows:
        return logits
    biased = logits.clone()
    row_index = [i for i, bias in biased_rows for _ in bias]
    token_index = [token_id for _, bias in biased_rows for token_id, _ in bias]
    values = torch.tensor([value for _, bias in biased_rows for _, value in bias], dtype=logits.dtype,
                          device=logits.device)
    biased.index_put_((torch.tensor(row_index, device=logits.device), torch.tensor(token_index, device=logits.device)),
                      values, accumulate=True)
    return biased


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[C, W] int32 bitmask -> [C, vocab_size] bool, True where the token is allowed (tokens past the
    mask's 32 * W are not)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [C, 32 * W]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def masked_logits(logits: torch.Tensor, token_bitmask: TokenBitmask) -> torch.Tensor:
    """A copy of logits [B, V] with the disallowed tokens of the constrained rows at -inf."""
    masked = logits.clone()
    index = torch.tensor(token_bitmask.rows, device=logits.device)
    rows = masked.index_select(0, index)
    rows.masked_fill_(~unpack_bitmask(token_bitmask.bits.to(logits.device), logits.shape[1]), float("-inf"))
    masked.index_copy_(0, index, rows)
    return masked


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and params.logprobs is None and not has_penalties(params)


# argmax_rows on CPU: columns per chunk whose maximum amax finds before the one chunk a row's answer is in is
# searched; below ARGMAX_CHUNKED_FROM values in all, max(dim) is as fast (measured: 2-8 rows of 49k and 152k)
ARGMAX_CHUNK = 1024
ARGMAX_CHUNKED_FROM = 2**18


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    """argmax(dim=-1)'s answer: the first maximum, NaN before any number.

    torch's reductions that keep an index (argmax, max(dim)) are not vectorized on CPU: ~2.5 ns a value, where
    amax runs at a fifth of that. So on CPU each row's chunks of ARGMAX_CHUNK columns get their maximum from amax,
    and only the first chunk holding the row's maximum is searched for its index: [256, 49152] float32 on the
    2-core EPYC of docs/benchmarks.md, two threads, 14.9 -> 4.5 ms (max(dim) was 30% of the served near-free
    worker's samples at 256 streams). An input with a NaN in any row takes max(dim) whole (a NaN chunk maximum
    never compares equal)."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab < 4 * ARGMAX_CHUNK or x.numel() < ARGMAX_CHUNKED_FROM:
        return x.max(dim=-1).indices  # on CUDA one fused reduction already; small inputs have nothing to save
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    chunk_max = x[:, :whole].reshape(rows, -1, ARGMAX_CHUNK).amax(dim=-1)  # [B, C]; a view of x, no copy
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    row_max = chunk_max.amax(dim=-1, keepdim=True)  # [B, 1]
    if row_max.isnan().any():
        return x.max(dim=-1).indices
    first_chunk = (chunk_max == row_max).to(torch.uint8).argmax(dim=-1)  # [B]: the first chunk with the maximum
    starts = first_chunk * ARGMAX_CHUNK
    # the last chunk may be short: its columns past the end repeat column V - 1, after the real ones
    columns = (starts[:, None] + torch.arange(ARGMAX_CHUNK, device=x.device)).clamp_(max=vocab - 1)
    return starts + x.gather(1, columns).max(dim=-1).indices


def _choose_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[B] int64 token ids. Plain greedy rows read the raw logits; only the others are copied."""
    device = logits.device
    work_rows = [i for i, row in enumerate(rows) if has_penalties(row.params) or not row.params.greedy]
    token_ids = argmax_rows(logits)  # [B]; final for rows outside work_rows
    if not work_rows:
        return token_ids
    work_index = torch.tensor(work_rows, device=device)  # [W]
    work = logits.index_select(0, work_index).float()  # [W, V], a copy: logprobs need the raw logits
    work_requests = [rows[i] for i in work_rows]

    penalized = [j for j, row in enumerate(work_requests) if has_penalties(row.params)]
    if penalized:
        _update_rows(work, penalized, lambda sub: apply_penalties(sub, [work_requests[j] for j in penalized]))

    random_rows = [j for j, row in enumerate(work_requests) if not row.params.greedy]
    if len(random_rows) < len(work_rows):
        chosen = argmax_rows(work)  # [W]; final for the greedy rows with penalties
    else:
        chosen = torch.empty(len(work_rows), dtype=torch.long, device=device)
    if random_rows:
        random_index = torch.tensor(random_rows, device=device)  # [R]
        drawn = _draw(work.index_select(0, random_index), [work_requests[j] for j in random_rows])  # [R]
        chosen.index_copy_(0, random_index, drawn)
    token_ids.index_copy_(0, work_index, chosen)
    return token_ids


def _update_rows(logits: torch.Tensor, row_indices: list[int], update: Callable[[torch.Tensor], None]) -> None:
    """Run an in-place update on logits[row_indices] only (all rows: no gather/scatter)."""
    if len(row_indices) == logits.shape[0]:
        update(logits)
        return
    index = torch.tensor(row_indices, device=logits.device)
    subset = logits.index_select(0, index)
    update(subset)
    logits.index_copy_(0, index, subset)


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: [R, V] penalized, one row per sampling (non-greedy) request; modified. Returns [R] int64."""
    probs = filtered_probs(logits, rows)  # [R, V]
    noise = _exponential_noise(probs, rows)  # [R, V]
    return argmax_rows(probs.div_(noise))


def filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: [R, V], one row per non-greedy request; modified. Temperature, then min-p, top-k and top-p
    remove tokens; -> the softmax of what is left, [R, V]."""
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype, device=device)
    logits.div_(temperature.unsqueeze(1))

    min_ps = [row.params.min_p for row in rows]
    if any(min_p > 0.0 for min_p in min_ps):
        _apply_min_p(logits, torch.tensor(min_ps, dtype=logits.dtype, device=device))

    vocab_size = logits.shape[1]
    # Rows are grouped by their own k (V when off) so that each row's candidates, and so its result,
    # never depend on what its neighbours ask for; rows without top-k/top-p skip this entirely (a
    # "neutral" top-p of 1 is not bit-exact: the cumulative sum can round to 1 before the tail).
    groups: dict[int, list[int]] = {}
    for j, row in enumerate(rows):
        top_k = row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size
        if top_k < vocab_size or row.params.top_p < 1.0:
            groups.setdefault(top_k, []).append(j)
    for top_k, members in groups.items():
        top_ps = [rows[j].params.top_p for j in members]
        top_p = torch.tensor(top_ps, dtype=logits.dtype, device=device) if any(p < 1.0 for p in top_ps) else None
        _update_rows(logits, members, lambda sub: _apply_top_k_top_p(sub, top_k, top_p))

    return logits.softmax(dim=-1)  # [R, V]


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Remove tokens with prob < min_p * max prob, in place. logits: [R, V]; min_p: [R].

    In log space that is logit < max logit + log(min_p), which needs no softmax; min_p = 0 gives a
    threshold of -inf and removes nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [R, 1]
    logits.masked_fill_(logits < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: torch.Tensor | None) -> None:
    """Keep the top_k best tokens, then the smallest set of those whose mass reaches p, in place.

    logits: [R, V]; top_k in [1, V]; top_p: [R] in (0, 1] (1 is off), or None when no row uses it.
    As vLLM, top-p reads the probabilities renormalized after top-k. A top-k alone needs no sort.
    """
    vocab_size = logits.shape[1]
    if top_k < vocab_size:
        candidate_logits, candidate_ids = logits.topk(top_k, dim=-1)  # [R, k] best first
    else:
        candidate_logits, candidate_ids = logits.sort(dim=-1, descending=True)  # [R, V]
    keep = torch.ones_like(candidate_logits, dtype=torch.bool)  # [R, k]
    if top_p is not None:
        candidate_probs = candidate_logits.softmax(dim=-1)
        mass_before = candidate_probs.cumsum(dim=-1) - candidate_probs  # 0 for the best: always kept
        # p = 1 is tested apart: the mass before a tail token can round up to exactly 1.
        keep = (mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    remove = torch.ones_like(logits, dtype=torch.bool).scatter_(1, candidate_ids, ~keep)  # vocab order
    logits.masked_fill_(remove, float("-inf"))


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[R, V] q ~ Exp(1); seeded rows from their own per-draw generator, the rest from the default RNG."""
    noise = torch.empty_like(probs)
    seeded = [(j, row) for j, row in enumerate(rows) if row.params.seed is not None]
    if len(seeded) < len(rows):
        noise.exponential_()
    for j, row in seeded:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(draw_seed(row.params.seed, row.num_output_tokens))
        noise[j].exponential_(generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax prefers over any number.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a request's draw of output token number num_output_tokens.

    splitmix64 of (seed, position): neighbouring seeds and positions give unrelated streams, and a
    resumed request recomputes the same seed for the same position.
    """
    state = ((seed & _MASK64) + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) & _MASK64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (state ^ (state >> 31)) & ((1 << 63) - 1)


def prompt_logprobs(logits: torch.Tensor, target_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Raw logprobs of prompt tokens (SamplingParams.prompt_logprobs). logits: [Q, V] float32, row q the
    prediction at the position before target_ids[q]; num_top[q]: alternatives wanted for that row. One
    device->host copy, as _with_logprobs."""
    if not len(target_ids):
        return []
    raw = torch.log_softmax(logits.float(), dim=-1)  # [Q, V]
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device)
    chosen = raw.gather(1, targets.unsqueeze(1)).squeeze(1)  # [Q]
    width = min(max(num_top), logits.shape[1])
    top_logprobs, top_ids = raw.topk(width, dim=-1)  # [Q, width] best first
    packed = torch.cat([chosen.double(), top_ids.double().flatten(), top_logprobs.double().flatten()]).tolist()
    num_rows = len(target_ids)
    ids_start, values_start = num_rows, num_rows + num_rows * width
    return [TokenLogprobs(logprob=packed[q], top=[
        (int(packed[ids_start + q * width + n]), packed[values_start + q * width + n])
        for n in range(min(num_top[q], width))]) for q in range(num_rows)]


def _with_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor, logprob_rows: list[int]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Raw logprobs for logprob_rows; everything comes to the host in one copy."""
    device = logits.device
    index = torch.tensor(logprob_rows, device=device)  # [L]
    raw = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [L, V]
    chosen = raw.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)  # [L]
    num_top = min(max(rows[i].params.logprobs for i in logprob_rows), logits.shape[1])
    top_logprobs, top_ids = raw.topk(num_top, dim=-1)  # [L, num_top] each, best first

    # One device->host copy: token ids are exact in float64 (they are far below 2**53).
    packed = torch.cat(
        [token_ids.double(), chosen.double(), top_ids.double().flatten(), top_logprobs.double().flatten()]
    ).tolist()
    batch, num_logprob_rows = len(rows), len(logprob_rows)
    sampled = [int(token_id) for token_id in packed[:batch]]
    chosen_host = packed[batch : batch + num_logprob_rows]
    ids_start = batch + num_logprob_rows
    values_start = ids_start + num_logprob_rows * num_top

    results: list[TokenLogprobs | None] = [None] * batch
    for position, i in enumerate(logprob_rows):
        count = min(rows[i].params.logprobs, num_top)
        row_start = position * num_top
        top = [
            (int(packed[ids_start + row_start + n]), packed[values_start + row_start + n])
            for n in range(count)
        ]
        results[i] = TokenLogprobs(logprob=chosen_host[position], top=top)
    return sampled, results
