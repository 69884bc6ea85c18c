"""What each weight format and dtype costs in accuracy: `tokenmill accuracy [--model M]`.

Teacher-forced over a fixed text (int8_agreement's corpus: its prose, then files of this checkout in a
fixed order, cut into windows): at every position, the greedy next token of each variant is compared
with the float32 reference's (the plain-torch path with every weight dequantized: exact to
transformers, tests/worker/loader/test_gguf_loader.py), and each variant's perplexity of the text is printed
beside the reference's. Variants: the file's own formats (GGUF: as stored; a folder: floats) in float32
and bfloat16, every linear re-quantized at load to int8 and int4 (group 32), bfloat16 alone, and the
dequantized weights over quantized KV pages (--kv-cache-dtype int8 / fp8_e4m3: run a token a pass, as decode
runs, so every position reads the earlier ones' K/V back from the quantized pages; --kv-only: just those).
Prints a markdown table (docs/models.md keeps this machine's).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch

from tokenmill.bench.int8_agreement import CHECKOUT, corpus, window_logits, windows


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    quantization: str  # worker.options.QUANTIZATIONS
    dtype: torch.dtype
    int8_activations: bool = False  # --cpu-int8-activations (run a token at a time, as decode does)
    blocks: bool = False  # a GGUF file's tensors on its own blocks (the CPU default), a token at a time as decode
    # rows of x per forward pass where the kernels differ with the count: 1 (decode), 16 (a batched decode or
    # prefill chunk: the blocks' AMX-INT8 tiles where the CPU has them); 0 a whole window at once
    pass_rows: int = 0
    kv_cache_dtype: str = "auto"  # worker.options.KV_CACHE_DTYPES: quantized pages run a token a pass

    @property
    def rows_per_pass(self) -> int:
        decode_only = self.int8_activations or self.blocks or self.kv_cache_dtype != "auto"
        return self.pass_rows or (1 if decode_only else 0)


# the weights as the reference holds them, so the rows measure what the KV pages' format alone costs
KV_VARIANTS = (
    # the same passes on float pages: how far running a token a pass alone moves from the one-prefill reference
    Variant("dequantized, KV pages in float32 (a token a pass)", "none", torch.float32, pass_rows=1),
    Variant("dequantized, KV pages in int8 (a token a pass)", "none", torch.float32, kv_cache_dtype="int8"),
    Variant("dequantized, KV pages in fp8_e4m3 (a token a pass)", "none", torch.float32, kv_cache_dtype="fp8_e4m3"),
)
DEFAULT_VARIANTS = (
    Variant("as the file holds it", "auto", torch.float32),
    Variant("as the file holds it", "auto", torch.bfloat16),
    Variant("as the file holds it, int8 activations", "auto", torch.float32, int8_activations=True),
    Variant("on the file's blocks (decode: q8_K activations)", "auto", torch.float32, blocks=True),
    Variant("on the file's blocks (decode: q8_K activations)", "auto", torch.bfloat16, blocks=True),
    Variant("on the file's blocks, 16 rows a pass (AMX-INT8 tiles where the CPU has them)", "auto", torch.bfloat16,
            blocks=True, pass_rows=16),
    Variant("int8 at load (group 32)", "int8", torch.float32),
    Variant("int4 at load (group 32)", "int4", torch.float32),
    Variant("dequantized", "none", torch.bfloat16),
    *KV_VARIANTS,
)
REFERENCE = Variant("reference: dequantized", "none", torch.float32)


@torch.inference_mode()
def decode_logits(model, config, token_ids: list[int], dtype: torch.dtype, device: torch.device,
                  rows: int = 1, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits [T, vocab] for every position, `rows` tokens per forward pass (1: as decode runs them; more: as
    a chunked prefill does, after the earlier chunks' KV), over KV pages of kv_cache_dtype."""
    from worker.step_batch import RequestSpan
    from worker.model.attention import build_attention_metadata
    from worker.model.kv_cache import allocate_kv_cache
    from worker.model.kv_quant import kv_cache_dtype as storage_dtype

    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, storage_dtype(kv_cache_dtype, dtype), device)
    table = list(range(num_blocks))
    logits = []
    for start in range(0, len(token_ids), rows):
        chunk = token_ids[start:start + rows]
        metadata = build_attention_metadata([RequestSpan(0, len(chunk), start + len(chunk), table)], block_size, device)
        hidden = model(torch.tensor(chunk, device=device), torch.arange(start, start + len(chunk), device=device),
                       kv_cache, metadata)
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@dataclass(slots=True)
class Score:
    agree: int = 0
    positions: int = 0
    nll: float = 0.0  # summed negative log-likelihood of each next token of the text

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.positions)


def build_variant(model_path, variant: Variant, device: torch.device):
    from worker.linears.group_quant import quantize_linears, use_int8_activations, weight_formats
    from worker.build import weight_bytes
    from worker.linears.ggml_blocks import block_types
    from worker.loader import load_model

    model, config = load_model(model_path, dtype=variant.dtype, progress=False, keep_quantized=variant.quantization == "auto",
                               block_types=block_types("all") if variant.blocks and device.type == "cpu" else ())
    if variant.quantization in ("int8", "int4"):
        quantize_linears(model, bits=int(variant.quantization.removeprefix("int")))
    if variant.int8_activations:
        use_int8_activations(model)
    model = model.to(device).eval()
    # parameters, buffers and GGML blocks (neither parameters nor buffers), every expert of a MoE included
    return model, config, weight_formats(model) or str(variant.dtype).removeprefix("torch."), weight_bytes(model)[0]


def score_windows(model, config, token_windows, dtype, device, reference_argmax: list | None,
                  rows_per_pass: int = 0, kv_cache_dtype: str = "auto") -> tuple[Score, list]:
    """rows_per_pass: run each window that many tokens a forward pass (1 as decode does; paths that differ with
    the row count); 0: each window in one pass."""
    score, argmaxes = Score(), []
    for index, ids in enumerate(token_windows):
        logits = (decode_logits(model, config, ids, dtype, device, rows_per_pass, kv_cache_dtype) if rows_per_pass
                  else window_logits(model, config, ids, dtype, device)).float()[:-1]
        targets = torch.tensor(ids[1:], device=logits.device)
        score.nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        argmax = logits.argmax(dim=-1)
        argmaxes.append(argmax)
        expected = argmax if reference_argmax is None else reference_argmax[index]
        score.agree += int((argmax == expected).sum())
        score.positions += len(ids) - 1
    return score, argmaxes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--positions", type=int, default=4096, help="positions compared, at least (default: %(default)s)")
    parser.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-bfloat16", action="store_true",
                        help="skip the bfloat16 rows (minutes each where the CPU emulates bfloat16)")
    parser.add_argument("--kv-only", action="store_true",
                        help="only the quantized KV page rows (--kv-cache-dtype int8, fp8_e4m3) beside the reference")
    args = parser.parse_args(argv)
    from gateway.text.tokenizer import load_tokenizer

    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model)
    texts = corpus(CHECKOUT)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # windows() counts tokens; each window of n tokens gives n - 1 next-token positions
    max_tokens, available = args.positions, sum(len(encode(text)) for text in texts)
    while True:
        token_windows = windows(texts, encode, args.window, max_tokens)
        shortfall = args.positions - sum(len(w) - 1 for w in token_windows)
        if shortfall <= 0:
            break
        if max_tokens >= available:
            raise SystemExit(f"the corpus holds fewer than --positions {args.positions} positions")
        max_tokens += shortfall
    print(f"{sum(len(w) - 1 for w in token_windows)} positions in {len(token_windows)} windows of <= {args.window} "
          f"tokens; model {args.model or 'default (SmolLM2-135M-Instruct Q4_1 GGUF)'}; device {device}", file=sys.stderr)
    rows = []
    reference_argmax = None
    reference_ppl = None
    variants = KV_VARIANTS if args.kv_only else DEFAULT_VARIANTS
    for variant in (REFERENCE, *(v for v in variants if not (args.no_bfloat16 and v.dtype == torch.bfloat16))):
        started = time.perf_counter()
        model, config, formats, weight_bytes = build_variant(args.model, variant, device)
        score, argmaxes = score_windows(model, config, token_windows, variant.dtype, device, reference_argmax,
                                        rows_per_pass=variant.rows_per_pass, kv_cache_dtype=variant.kv_cache_dtype)
        if reference_argmax is None:
            reference_argmax, reference_ppl = argmaxes, score.perplexity
        del model
        dtype = str(variant.dtype).removeprefix("torch.")
        rows.append(f"| {variant.label} | {dtype} | {formats} | {weight_bytes / 2**20:.3f} | "
                    f"{score.agree / score.positions:.2%} | {score.perplexity:.3f} | {score.perplexity - reference_ppl:+.3f} |")
        print(f"  {variant.label}, {dtype}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print("| weights | activations | linears run in | weight MiB | greedy agreement with the reference | perplexity | Δ perplexity |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
