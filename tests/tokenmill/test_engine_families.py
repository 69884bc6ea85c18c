"""The in-process engine (scheduler + worker, torch path) on every family's tiny Hugging Face folder, the
mixtures of experts too: greedy tokens equal to transformers `generate` on the same weights, 30 tokens past a
10-token prompt (well past the 7-token sliding windows of the mistral / gemma flavours)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core.sampling import SamplingParams
from tests.helpers.tiny_models import EOS_ID, FLAVOURS, MOE_FLAVOURS, make_tiny_hf_model
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
NEW_TOKENS = 30


@pytest.mark.parametrize("flavour", FLAVOURS + MOE_FLAVOURS)
def test_engine_greedy_equals_transformers_generate(tmp_path, flavour):
    folder, hf_model = make_tiny_hf_model(tmp_path, flavour)
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), num_blocks=64)))
    out = llm.generate_token_ids([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    ours = list(getattr(out, "token_ids", out))
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == expected[: len(ours)]
    assert len(ours) == NEW_TOKENS or ours[-1] == EOS_ID  # shorter only by stopping at end of sequence
