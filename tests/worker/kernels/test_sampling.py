"""Device sampling against worker.sampling.sampler's own filters, drawing with the same Philox noise; greedy and
top-k = 1 rows are the argmax; filtered tokens never come out; no host sync happens inside."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from worker.kernels.sampling import exponential_noise, sample_tokens
from worker.sampling.sampler import _apply_min_p, _apply_top_k_top_p

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB_SIZE = 50
# probabilities with gaps wide enough that float rounding never decides a top-p / min-p boundary
KNOWN_PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def _logits(num_rows: int, seed: int, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    return (torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3).to(DEVICE)


def _seeds(num_rows: int, first: int = 0) -> torch.Tensor:
    return torch.arange(first, first + num_rows, dtype=torch.int64, device=DEVICE) * 7919 + 12345


def _rows(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _reference(logits, temperature, top_k, top_p, min_p, noise) -> torch.Tensor:
    """worker.sampling.sampler's filters row by row, then argmax(softmax / q) with the kernel's own q."""
    tokens = []
    for row in range(logits.shape[0]):
        if temperature[row] < 1e-5:
            tokens.append(int(logits[row].argmax()))
            continue
        scaled = logits[row : row + 1].float() / temperature[row]
        _apply_min_p(scaled, min_p[row : row + 1])
        k = int(top_k[row]) if 0 < int(top_k[row]) < scaled.shape[1] else scaled.shape[1]
        _apply_top_k_top_p(scaled, k, top_p[row : row + 1])
        tokens.append(int((scaled.softmax(dim=-1) / noise[row]).argmax()))
    return torch.tensor(tokens, device=logits.device)


def test_greedy_rows_are_the_argmax_whatever_their_filters():
    logits = _logits(6, seed=0)

    tokens = sample_tokens(
        logits, torch.zeros(6, device=DEVICE), _rows([0, 1, 3, 0, 5, 2], torch.int32),
        _rows([1.0, 0.1, 0.5, 0.9, 1.0, 0.3], torch.float32), _seeds(6),
    )  # fmt: skip

    assert tokens.dtype == torch.int64 and tokens.device == logits.device
    assert torch.equal(tokens, logits.argmax(dim=-1))
    unfiltered = sample_tokens(logits, torch.zeros(6, device=DEVICE), None, None, _seeds(6))
    assert torch.equal(unfiltered, logits.argmax(dim=-1))


def test_top_k_of_one_is_the_argmax_at_any_temperature():
    logits = _logits(8, seed=1, vocab_size=2100)  # three vocabulary blocks per row
    temperature = _rows([0.5, 1.0, 1.5, 3.0] * 2, torch.float32)

    tokens = sample_tokens(logits, temperature, torch.ones(8, dtype=torch.int32, device=DEVICE), None, _seeds(8))

    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.float16])
def test_draw_equals_the_sampler_filters_with_the_same_noise(logits_dtype):
    num_rows = 12
    logits = _logits(num_rows, seed=2).to(logits_dtype)
    temperature = _rows([0.0, 0.7, 1.0, 1.3] * 3, torch.float32)
    top_k = _rows([0, 0, 5, 20, 0, 3, 0, 10, 1, 0, 7, 50], torch.int32)
    top_p = _rows([1.0, 0.9, 1.0, 0.8, 0.5, 1.0, 1.0, 0.95, 1.0, 0.3, 0.6, 1.0], torch.float32)
    min_p = _rows([0.0] * 6 + [0.05, 0.0, 0.0, 0.1, 0.0, 0.0], torch.float32)
    seeds = _seeds(num_rows)

    tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, min_p=min_p)

    expected = _reference(logits, temperature, top_k, top_p, min_p, exponential_noise(seeds, VOCAB_SIZE))
    assert tokens.tolist() == expected.tolist()
    # without filters the sort is skipped; the draw is still the reference's
    unfiltered = sample_tokens(logits, temperature, None, None, seeds)
    off = torch.zeros(num_rows, device=DEVICE)
    expected_unfiltered = _reference(
        logits, temperature, off.int(), off + 1.0, off, exponential_noise(seeds, VOCAB_SIZE)
    )
    assert unfiltered.tolist() == expected_unfiltered.tolist()


def _draw_many(probs: torch.Tensor, num_draws: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """[V] counts of the tokens drawn from num_draws rows of the same logits, each row with its own seed."""
    logits = probs.log().to(DEVICE).expand(num_draws, -1).contiguous()
    tokens = sample_tokens(
        logits,
        torch.ones(num_draws, device=DEVICE),
        torch.full((num_draws,), top_k, dtype=torch.int32, device=DEVICE),
        torch.full((num_draws,), top_p, device=DEVICE),
        _seeds(num_draws),
        min_p=torch.full((num_draws,), min_p, device=DEVICE),
    )
    return torch.bincount(tokens.cpu(), minlength=probs.shape[0])


@pytest.mark.parametrize(
    "filters, kept",
    [
        ({"top_k": 2}, {1, 3}),
        ({"top_p": 0.7}, {1, 3}),  # mass before token 3 is 0.5 < 0.7, before token 2 it is 0.8
        ({"top_k": 3, "top_p": 0.9}, {1, 3, 2}),
        ({"min_p": 0.4}, {1, 3}),  # prob >= 0.2
    ],
)
def test_filtered_tokens_never_come_out_and_all_kept_ones_do(filters, kept):
    counts = _draw_many(KNOWN_PROBS, 500, **filters)

    assert set(counts.nonzero().flatten().tolist()) == kept


def test_unfiltered_frequencies_follow_the_probabilities():
    num_draws = 2000
    counts = _draw_many(KNOWN_PROBS, num_draws)

    # fixed seeds make this deterministic; 0.035 is about three standard deviations at p = 0.5
    assert torch.allclose(counts.float() / num_draws, KNOWN_PROBS, atol=0.035)


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    logits = _logits(6, seed=3)
    temperature = torch.ones(6, device=DEVICE)
    top_p = torch.full((6,), 0.95, device=DEVICE)
    seeds = _seeds(6)
    alone = sample_tokens(logits[4:5], temperature[:1], None, top_p[:1], seeds[4:5])

    order = torch.tensor([4, 0, 5, 1, 3, 2], device=DEVICE)
    shuffled = sample_tokens(logits[order], temperature, None, top_p, seeds[order])
    # same seed, other neighbours (different logits and parameters next to it)
    neighbours = torch.cat([_logits(2, seed=9), logits[4:5]])
    mixed = sample_tokens(
        neighbours, _rows([0.0, 2.0, 1.0], torch.float32), None, _rows([1.0, 0.5, 0.95], torch.float32),
        torch.cat([_seeds(2, first=100), seeds[4:5]]),
    )  # fmt: skip

    assert shuffled[0] == alone[0] and mixed[2] == alone[0]
    # and another seed gives an independent draw: over the six rows, not every token repeats
    reseeded = sample_tokens(logits, temperature, None, top_p, _seeds(6, first=1000))
    assert not torch.equal(reseeded, sample_tokens(logits, temperature, None, top_p, seeds))


class _HostReadRecorder(TorchFunctionMode):
    """Records every torch call that reads a tensor's value on the host (a device sync on CUDA) or sizes
    its output by the data. It sees the Python-level calls, which is where sample_tokens could make one."""

    HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                  "nonzero", "masked_select", "unique", "equal"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.host_reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.HOST_READS:
            self.host_reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_sampling_never_waits_for_the_device():
    logits = _logits(4, seed=4)
    arguments = (logits, _rows([0.0, 1.0, 0.8, 1.2], torch.float32), _rows([0, 3, 10, 0], torch.int32),
                 _rows([1.0, 0.9, 0.5, 0.7], torch.float32), _seeds(4))  # fmt: skip
    min_p = torch.zeros(4, device=DEVICE)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call inside raises
        try:
            sample_tokens(*arguments, min_p=min_p)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with _HostReadRecorder() as recorder:
        sample_tokens(*arguments, min_p=min_p)
    assert recorder.host_reads == []
    # the recorder does see host reads where there are some
    with _HostReadRecorder() as recorder:
        logits.sum().item()
        logits.argmax(dim=-1).tolist()
        bool(logits[0, 0] > 0)
    assert recorder.host_reads == ["item", "tolist", "__bool__"]


def test_inputs_are_validated_with_the_argument_named():
    logits = _logits(3, seed=5)
    temperature, seeds = torch.ones(3, device=DEVICE), _seeds(3)
    with pytest.raises(ValueError, match=r"sample_tokens: logits has shape \[150\], expected \[\*, \*\]"):
        sample_tokens(logits.flatten(), temperature, None, None, seeds)
    with pytest.raises(ValueError, match=r"sample_tokens: temperature has shape \[4\], expected \[3\]"):
        sample_tokens(logits, torch.ones(4, device=DEVICE), None, None, seeds)
    with pytest.raises(ValueError, match=r"temperature has dtype torch.float64, expected torch.float32"):
        sample_tokens(logits, temperature.double(), None, None, seeds)
    with pytest.raises(ValueError, match=r"top_k has dtype torch.float32, expected torch.int32 or torch.int64"):
        sample_tokens(logits, temperature, temperature, None, seeds)
    with pytest.raises(ValueError, match=r"sample_tokens: top_p has shape \[2\], expected \[3\]"):
        sample_tokens(logits, temperature, None, temperature[:2], seeds)
    with pytest.raises(ValueError, match=r"sample_tokens: top_k has strides \[2\], expected stride 1"):
        sample_tokens(logits, temperature, torch.ones(6, dtype=torch.int32, device=DEVICE)[::2], None, seeds)
    with pytest.raises(ValueError, match=r"sample_tokens: seeds has dtype torch.int32, expected torch.int64"):
        sample_tokens(logits, temperature, None, None, seeds.int())
    with pytest.raises(ValueError, match=r"logits has shape \[3, 0\], expected a vocabulary of at least 1"):
        sample_tokens(torch.zeros(3, 0, device=DEVICE), temperature, None, None, seeds)
