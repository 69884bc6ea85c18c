"""How often INT8 weight-only greedy next tokens agree with float32: `python -m tokenmill.bench.int8_agreement`.

Teacher-forced: fixed texts (the prose below, then files of this repository, in a fixed order) are
tokenized and cut into windows; every position of every window is one comparison of argmax(logits)
under the float32 model and under the same model with every linear quantized to INT8 (the torch path
on CPU, the Triton kernel on CUDA). bfloat16 against float32 is printed beside it for scale: it is the
precision most GPU serving runs at. Both run the torch backend, so only the weights differ.
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from worker.linears.int8 import quantize_linears_int8
from worker.model.attention import build_attention_metadata
from worker.model.config import ModelConfig
from worker.model.kv_cache import allocate_kv_cache
from worker.model.llama import LlamaModel
from worker.step_batch import RequestSpan

PROSE = """\
The river had been low all summer, and by September the old ferry landing stood a full meter above
the water. Children from the village walked out along the exposed stones to look for coins and
fishing lures, and the ferryman, who had not carried a passenger since July, sat on an upturned
crate and told anyone who would listen that the rains would come back before the harvest was in.

A paged key-value cache splits each sequence's attention state into fixed-size blocks, so that memory
is allocated as a request grows rather than reserved for its longest possible length. The scheduler
decides which block holds which tokens; the worker only follows the block table it is sent. When
blocks run out, the scheduler preempts the request that arrived last and recomputes it later.

To make bread without a mixer, combine the flour, salt and yeast in a large bowl, then add warm water
a little at a time until the dough holds together. Knead it on a floured surface for ten minutes,
until it is smooth and springs back when pressed. Let it rise in a covered bowl until doubled, about
an hour in a warm kitchen, then shape it, let it rise again and bake it in a hot oven.

In 1854 the physician John Snow mapped the cases of cholera around Broad Street in London and found
that they clustered around a single public water pump. He persuaded the local authorities to remove
the pump's handle, and the outbreak, which was already waning, came to an end. His map is often cited
as one of the founding works of epidemiology, though the germ theory of disease came decades later.

Question: A train leaves the station at 9:40 and arrives at 13:15. How long is the journey?
Answer: From 9:40 to 12:40 is three hours, and from 12:40 to 13:15 is another thirty-five minutes,
so the journey takes three hours and thirty-five minutes.
"""
CHECKOUT = Path(__file__).resolve().parents[2]  # the repository root, where REPO_FILES are
REPO_FILES = ("README.md", "docs/benchmarks.md", "worker/model/llama.py", "worker/model/attention.py", "scheduler/scheduler.py")


def corpus(root: Path) -> list[str]:
    """The prose, then the repository files under root (the checkout; absent from an installed package)."""
    texts = [PROSE]
    texts += [(root / name).read_text() for name in REPO_FILES if (root / name).is_file()]
    return texts


@torch.inference_mode()
def window_logits(model: LlamaModel, config: ModelConfig, token_ids: list[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Logits [T, vocab] float32 for every position of one sequence, run as one prefill."""
    block_size = 16
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
    metadata = build_attention_metadata([RequestSpan(0, num_tokens, num_tokens, list(range(num_blocks)))], block_size, device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), kv_cache, metadata)
    return model.compute_logits(hidden)


def windows(texts: list[str], encode, window: int, max_positions: int) -> list[list[int]]:
    out, total = [], 0
    for text in texts:
        ids = encode(text)
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window]
            if len(chunk) < 2 or total >= max_positions:
                continue
            out.append(chunk[: max_positions - total])
            total += len(out[-1])
    return out


def agreement(reference: LlamaModel, candidate: LlamaModel, config: ModelConfig, token_windows: list[list[int]],
              reference_dtype: torch.dtype, candidate_dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(positions where the greedy next tokens agree, positions compared)."""
    agree = total = 0
    for ids in token_windows:
        expected = window_logits(reference, config, ids, reference_dtype, device).argmax(dim=-1)
        actual = window_logits(candidate, config, ids, candidate_dtype, device).argmax(dim=-1)
        agree += int((expected == actual).sum())
        total += len(ids)
    return agree, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.int8_agreement", description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--positions", type=int, default=4096, help="positions compared (default: %(default)s)")
    parser.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-bfloat16", action="store_true", help="skip the bfloat16-vs-float32 comparison")
    args = parser.parse_args(argv)
    from gateway.text.tokenizer import load_tokenizer
    from worker.loader import load_model

    device = torch.device(args.device)
    started = time.perf_counter()
    model, config = load_model(args.model, dtype=torch.float32, progress=False)
    model = model.to(device).eval()
    tokenizer = load_tokenizer(args.model)
    token_windows = windows(corpus(CHECKOUT), lambda t: tokenizer.encode(t, add_special_tokens=False),
                            args.window, args.positions)
    quantized = copy.deepcopy(model)
    replaced = quantize_linears_int8(quantized, use_kernel=device.type == "cuda")
    agree, total = agreement(model, quantized, config, token_windows, torch.float32, torch.float32, device)
    print(f"int8 weight-only ({replaced} linears) vs float32: greedy next token agrees at {agree}/{total} positions "
          f"= {agree / total:.2%} ({len(token_windows)} windows of <= {args.window} tokens)")
    if not args.no_bfloat16:
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        agree, total = agreement(model, bf16, config, token_windows, torch.float32, torch.bfloat16, device)
        print(f"bfloat16 vs float32 (for scale): agrees at {agree}/{total} positions = {agree / total:.2%}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
