"""Token sampling on the device, without a host sync: temperature, min-p, top-k, top-p, exponential race.

Semantics are worker.sampling.sampler's (vLLM's order): greedy rows (temperature < GREEDY_TEMPERATURE) take
the argmax of the raw logits and ignore every filter; the others divide by their temperature, min-p,
then top-k, then top-p on the probabilities renormalised after top-k remove tokens, and one token is
drawn as argmax(probs / q), q ~ Exp(1) per token. The kernel draws it in log space, as
argmax(logits / T - log q), the same argmax without a softmax pass (Gumbel-max).

Filters become one threshold per row, on the raw logits (division by T > 0 keeps the order, so a raw
comparison is exact however the device rounds the division): every filter keeps a prefix of the
sorted row, so the row keeps exactly the tokens whose logit is >= that of its last kept token. A
torch sort finds it (only when some filter is on: the caller passes None otherwise); the masking and
the draw are one Triton pass over the vocabulary. Tokens tied with the last kept one are all kept
(torch.topk would keep exactly k of them), the one place where this differs from worker.sampling.sampler.

Noise source: q for token i of a row is -log(u), u = Philox(seed of that row, i) (tl.rand), so a
row's token depends only on its logits, its parameters and its seed, never on its neighbours in the
batch nor on the batch order. The caller supplies seeds [B] int64: for a seeded request
worker.sampling.sampler.draw_seed(seed, num_output_tokens) (a resumed request redraws the same tokens); for
the others any fresh random int64 (e.g. drawn on the host with the other step inputs).
exponential_noise() materialises the same q for tests and debugging.

Constrained decoding: an optional token bitmask [B, W] int32 (bit t % 32 of word t // 32 allows token
t; -1 words allow everything) removes tokens before anything else, for greedy rows too. The kernel
reads it in the same pass; the filters' thresholds are found on the masked logits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from core.sampling import GREEDY_TEMPERATURE
from worker.kernels.checks import FLOAT_DTYPES, check_tensor

BLOCK_VOCAB = 1024  # vocabulary entries per loop step of the sampling program
ROW_BLOCK_ELEMENTS = 1024  # a program's tile is at most this many [rows x vocabulary] entries


@triton.jit
def _exponential(seed, offsets):
    """q ~ Exp(1) per offset, from Philox(seed, offset); never 0 nor inf, so log q is finite.

    seed: a scalar or a block that broadcasts against offsets (one seed per row)."""
    uniform = tl.rand(seed, offsets)  # [0, 1)
    # 2**-31 is below tl.rand's resolution; 1 - 2**-24 is the largest float32 under 1
    uniform = tl.minimum(tl.maximum(uniform, 4.656612873e-10), 0.99999994)
    return -tl.log(uniform)


@triton.jit
def _sample_kernel(
    # pointers
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    threshold_ptr,  # [B] float32: lowest raw logit the row keeps (-inf keeps all)
    seeds_ptr,  # [B] int64
    bitmask_ptr,  # [B, num_words] int32, contiguous: allowed tokens (read when USE_BITMASK)
    out_ptr,  # [B] int64
    # sizes
    batch_size,
    vocab_size,
    num_words,  # bitmask words per row; tokens past 32 * num_words are not allowed
    greedy_temperature,
    # strides (the vocabulary dimension is contiguous)
    stride_logits_row,
    # meta-parameters
    USE_THRESHOLD: tl.constexpr,
    USE_BITMASK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,  # rows per program: 1 for real vocabularies, more for small ones
    BLOCK_VOCAB: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    in_batch = rows < batch_size
    temperature = tl.load(temperature_ptr + rows, mask=in_batch, other=1.0)[:, None]  # [BLOCK_ROWS, 1]
    greedy = temperature < greedy_temperature
    safe_temperature = tl.where(greedy, 1.0, temperature)  # no division by 0 on greedy rows
    if USE_THRESHOLD:
        threshold = tl.load(threshold_ptr + rows, mask=in_batch, other=float("-inf"))[:, None]
    else:
        threshold = tl.full((BLOCK_ROWS, 1), float("-inf"), tl.float32)
    seeds = tl.load(seeds_ptr + rows, mask=in_batch, other=0)[:, None]  # [BLOCK_ROWS, 1]
    row_offsets = rows.to(tl.int64)[:, None] * stride_logits_row  # [BLOCK_ROWS, 1]
    best_score = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    best_index = tl.zeros((BLOCK_ROWS,), tl.int32)
    for start in range(0, vocab_size, BLOCK_VOCAB):
        cols = start + tl.arange(0, BLOCK_VOCAB)[None, :]  # [1, BLOCK_VOCAB]
        valid = in_batch[:, None] & (cols < vocab_size)  # [BLOCK_ROWS, BLOCK_VOCAB]
        logits = tl.load(logits_ptr + row_offsets + cols, mask=valid, other=float("-inf")).to(tl.float32)
        if USE_BITMASK:
            words = tl.load(bitmask_ptr + rows.to(tl.int64)[:, None] * num_words + cols // 32,
                            mask=valid & (cols // 32 < num_words), other=0)
            logits = tl.where(((words >> (cols % 32)) & 1) != 0, logits, float("-inf"))
        # noise offsets are vocabulary indices: a row's q depends on its seed alone
        drawn = logits / safe_temperature - tl.log(_exponential(seeds, cols))
        drawn = tl.where(logits >= threshold, drawn, float("-inf"))
        score = tl.where(valid, tl.where(greedy, logits, drawn), float("-inf"))
        block_best = tl.max(score, axis=1)  # [BLOCK_ROWS]
        block_index = start + tl.argmax(score, axis=1)  # lowest index among ties, as torch.argmax
        # strictly greater: an earlier block keeps a tie, so the lowest index wins across blocks too
        better = block_best > best_score
        best_index = tl.where(better, block_index, best_index)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + rows, best_index.to(tl.int64), mask=in_batch)


@triton.jit
def _exponential_noise_kernel(
    seeds_ptr,  # [B] int64
    out_ptr,  # [B, V] float32, contiguous
    batch_size,
    vocab_size,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # [BLOCK_ROWS, 1]
    cols = tl.program_id(1) * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)[None, :]  # [1, BLOCK_VOCAB]
    seeds = tl.load(seeds_ptr + rows, mask=rows < batch_size, other=0)
    noise = _exponential(seeds, cols)
    tl.store(out_ptr + rows.to(tl.int64) * vocab_size + cols, noise, mask=(rows < batch_size) & (cols < vocab_size))


def _block_sizes(batch_size: int, vocab_size: int) -> tuple[int, int]:
    """(BLOCK_VOCAB, BLOCK_ROWS): several rows per program only when a row is a fraction of one block
    (tests, tiny models); a real vocabulary gets one program per row."""
    block_vocab = min(BLOCK_VOCAB, triton.next_power_of_2(vocab_size))
    return block_vocab, min(max(1, ROW_BLOCK_ELEMENTS // block_vocab), triton.next_power_of_2(batch_size))


def _check_row_params(
    logits: torch.Tensor, name: str, values: torch.Tensor | None, dtypes: tuple[torch.dtype, ...]
) -> None:
    if values is not None:
        check_tensor("sample_tokens", name, values, (logits.shape[0],), dtypes, logits.device)


def _keep_thresholds(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor | None,  # [B] int, <= 0 or >= V: off
    top_p: torch.Tensor | None,  # [B] float, >= 1: off
    min_p: torch.Tensor | None,  # [B] float, <= 0: off
) -> torch.Tensor:
    """[B] float32: the lowest raw logit each row keeps after min-p, top-k and top-p. Device ops only."""
    vocab_size = logits.shape[1]
    sorted_logits = logits.float().sort(dim=-1, descending=True).values  # [B, V]
    safe_temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    scaled = sorted_logits / safe_temperature.unsqueeze(1)  # [B, V], still sorted
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
    keep = torch.ones_like(scaled, dtype=torch.bool)  # [B, V], always a prefix of the sorted row
    if min_p is not None:
        # prob >= min_p * max prob, in log space; min_p = 0 gives -inf and keeps all
        keep &= scaled >= scaled[:, :1] + min_p.float().log().unsqueeze(1)
    if top_k is not None:
        k = top_k.long()
        keep &= (ranks < k.unsqueeze(1)) | (k.unsqueeze(1) <= 0)
    if top_p is not None:
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # renormalised after top-k
        mass_before = probs.cumsum(dim=-1) - probs  # 0 for the best: it is always kept
        top_p = top_p.float().unsqueeze(1)
        keep &= (mass_before < top_p) | (top_p >= 1.0)
    num_kept = keep.sum(dim=-1).clamp_min(1)  # [B]
    return sorted_logits.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)


def _masked(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] as float32 with the tokens token_bitmask [B, W] disallows at -inf (device ops only)."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((token_bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [B, 32 * W]
    vocab_size = logits.shape[1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return logits.float().masked_fill(~allowed[:, :vocab_size], float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
    min_p: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: [B, V] float (the vocab dim contiguous) -> token ids [B] int64, on logits' device.

    temperature: [B] float32 (< GREEDY_TEMPERATURE: greedy); top_k: [B] int32/int64 (<= 0: off);
    top_p: [B] float32 (>= 1: off); min_p: [B] float32 (0: off); seeds: [B] int64, see the module
    docstring. Pass None for a filter no row uses: that skips the sort. Penalties are the caller's
    (apply them to the logits first). token_bitmask: [B, W] int32, contiguous, the allowed tokens of
    each row (-1 words for an unconstrained row); None: no constraint. Nothing here waits for the
    device or reads a value on the host.
    """
    check_tensor("sample_tokens", "logits", logits, (None, None), FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError(f"sample_tokens: logits has shape {list(logits.shape)}, expected a vocabulary of at least 1")
    _check_row_params(logits, "temperature", temperature, (torch.float32,))
    _check_row_params(logits, "top_k", top_k, (torch.int32, torch.int64))
    _check_row_params(logits, "top_p", top_p, (torch.float32,))
    _check_row_params(logits, "min_p", min_p, (torch.float32,))
    _check_row_params(logits, "seeds", seeds, (torch.int64,))
    if token_bitmask is not None:
        check_tensor("sample_tokens", "token_bitmask", token_bitmask, (logits.shape[0], None), (torch.int32,),
                     logits.device)
        if not token_bitmask.is_contiguous():
            raise ValueError("sample_tokens: token_bitmask must be contiguous")
    batch_size, vocab_size = logits.shape
    token_ids = torch.empty(batch_size, dtype=torch.int64, device=logits.device)
    if batch_size == 0:
        return token_ids
    use_threshold = top_k is not None or top_p is not None or min_p is not None
    if use_threshold:
        # the filters keep a prefix of the allowed tokens: find it on the masked logits
        kept_from = logits if token_bitmask is None else _masked(logits, token_bitmask)
        thresholds = _keep_thresholds(kept_from, temperature, top_k, top_p, min_p)
    else:
        thresholds = temperature
    use_bitmask = token_bitmask is not None
    bitmask = token_bitmask if use_bitmask else seeds  # any pointer: unread without USE_BITMASK
    block_vocab, block_rows = _block_sizes(batch_size, vocab_size)
    _sample_kernel[(triton.cdiv(batch_size, block_rows),)](
        logits, temperature, thresholds, seeds, bitmask, token_ids,
        batch_size, vocab_size, bitmask.shape[1] if use_bitmask else 0, GREEDY_TEMPERATURE,
        logits.stride(0),
        USE_THRESHOLD=use_threshold, USE_BITMASK=use_bitmask, BLOCK_ROWS=block_rows, BLOCK_VOCAB=block_vocab,
    )  # fmt: skip
    return token_ids


def exponential_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds: [B] int64 -> q: [B, V] float32, the Exp(1) noise sample_tokens draws with for those seeds."""
    check_tensor("exponential_noise", "seeds", seeds, (None,), (torch.int64,))
    noise = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0] == 0 or vocab_size == 0:
        return noise
    block_vocab, block_rows = _block_sizes(seeds.shape[0], vocab_size)
    grid = (triton.cdiv(seeds.shape[0], block_rows), triton.cdiv(vocab_size, block_vocab))
    _exponential_noise_kernel[grid](
        seeds, noise, seeds.shape[0], vocab_size, BLOCK_ROWS=block_rows, BLOCK_VOCAB=block_vocab
    )
    return noise
