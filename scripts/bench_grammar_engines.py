"""Figures behind the choice of grammar engine (issue 18): compile time of a realistic JSON schema and
the per-step mask time, on the default model's vocabulary (SmolLM2, 49152 tokens), for llguidance,
xgrammar and outlines-core. Not a test: it prints figures.

Only llguidance is a dependency; to compare, install the others beside it, e.g.

    .venv/bin/pip install --target /tmp/geng --no-deps xgrammar apache-tvm-ffi outlines-core pydantic pydantic-core annotated-types typing-inspection
    PYTHONPATH=/tmp/geng .venv/bin/python scripts/bench_grammar_engines.py
"""
from __future__ import annotations

import json
import statistics
import time

from gateway.text.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "paid": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "paid"],
    "additionalProperties": False,
}
INSTANCE = {
    "order_id": "ABC-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [{"sku": "widget-7", "quantity": 3, "price": 9.5}, {"sku": "gadget", "quantity": 1, "price": 120}],
    "paid": True,
    "note": None,
}


def summary(name: str, compile_s: float, mask_s: list[float]) -> None:
    mask_us = sorted(s * 1e6 for s in mask_s)
    p99 = mask_us[min(len(mask_us) - 1, int(0.99 * len(mask_us)))]
    print(f"{name:14s} compile {compile_s * 1e3:9.1f} ms   mask/step mean {statistics.mean(mask_us):7.1f} us  "
          f"p50 {statistics.median(mask_us):7.1f} us  p99 {p99:7.1f} us  max {mask_us[-1]:7.1f} us  ({len(mask_us)} steps)")


def bench_llguidance(tokenizer, schema: str, tokens: list[int]) -> None:
    import llguidance
    import llguidance.torch

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.tokenizer.to_str())
    print(f"llguidance     tokenizer {(time.perf_counter() - started) * 1e3:.1f} ms (once per process)")
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for token in tokens:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    summary("llguidance", compile_s, times)


def bench_xgrammar(tokenizer, schema: str, tokens: list[int]) -> None:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, eos_token="<|im_end|>")
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar       tokenizer {(time.perf_counter() - started) * 1e3:.1f} ms (once per process)")
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - started
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in tokens:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    summary("xgrammar", compile_s, times)


def bench_outlines(tokenizer, schema: str, tokens: list[int]) -> None:
    import llguidance
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    lltok = llguidance.LLTokenizer(tokenizer.tokenizer.to_str())
    vocabulary: dict[bytes, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        if token_id != tokenizer.eos_token_id and not lltok.is_special_token(token_id):
            vocabulary.setdefault(lltok.decode_bytes([token_id]), []).append(token_id)
    vocab = Vocabulary(tokenizer.eos_token_id, vocabulary)
    started = time.perf_counter()
    index = Index(build_regex_from_schema(schema, r"[ ]?"), vocab)
    compile_s = time.perf_counter() - started
    guide = Guide(index)
    times = []
    for token in tokens:
        started = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - started)
        guide.advance(token)
    summary("outlines-core", compile_s, times)


def main() -> None:
    tokenizer = load_tokenizer(None)
    schema = json.dumps(SCHEMA)
    tokens = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"schema: {len(schema)} chars; instance: {len(tokens)} tokens; vocabulary {tokenizer.vocab_size}")
    for bench in (bench_llguidance, bench_xgrammar, bench_outlines):
        try:
            bench(tokenizer, schema, tokens)
        except ImportError as exc:
            print(f"{bench.__name__[6:]:14s} not installed ({exc})")


if __name__ == "__main__":
    main()
