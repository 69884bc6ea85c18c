"""The engine on the real default model produces exactly transformers' greedy tokens."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gateway.text.tokenizer import load_tokenizer
from core.sampling import SamplingParams
from tokenmill.bench.engine import load_transformers_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a forest, there lived an old woman who",
    "1, 2, 3, 4,",
    "Water boils at",
    "The three primary colours are red, yellow and",
    "In machine learning, a transformer is a neural network architecture that relies on attention. "
    "It was introduced in 2017 and has since become the basis of most large language models, because",
    "Q: What is the largest planet in the solar system?\nA:",
    "Roses are red,",
]
NEW_TOKENS = 32


def test_concurrent_greedy_equals_transformers_generate():
    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) >= 6  # different lengths, mixed in one batch
    # a small token budget forces chunked prefill mixed with other requests' decode steps
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, num_blocks=128),
                           scheduler=SchedulerOptions(max_num_batched_tokens=48)), progress=False)
    ours = llm.generate_token_ids(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))

    model = load_transformers_model(None)
    # EOS ignored on both sides: no stopping, and no min_new_tokens (which would mask EOS instead)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        for prompt, got in zip(prompts, ours):
            input_ids = torch.tensor([prompt])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=0)
            assert got == out[0, len(prompt):].tolist(), tokenizer.decode(prompt)
