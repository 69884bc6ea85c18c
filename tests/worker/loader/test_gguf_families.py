"""Every family from a GGUF file written in llama.cpp's converter layout (tests/helpers/tiny_gguf.py)
against transformers on the model it was written from: float32 logits within 1e-4 over the mixed
prefill/decode/prefix-hit scenario of test_model_parity.py, and greedy tokens equal to its argmax.

Some HF settings cannot be said in GGUF, so those flavours are written with the value llama.cpp
assumes: gemma's query_pre_attn_scalar equal to head_dim (llama.cpp scales by head_dim ** -0.5 except
at 27B), gemma3's local rope base 10000 and its 5:1 local/global pattern (6 layers). Mistral's
sliding window is not written by the converter (it writes Mistral as llama), so it is not tested here.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.worker.model.test_model_parity import MAX_REL_ERR, run_scenario
from worker.loader import load_model

GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
GGUF_CASES = {
    "llama": ("llama", {}),
    "llama_gqa": ("llama", {}),
    "llama3_rope": ("llama", {}),
    "llama_linear_rope": ("llama", {}),
    "llama_yarn_rope": ("llama", {}),
    "mistral": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": GEMMA3_LAYERS,
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    "phi3": ("phi3", {}),
}


@pytest.mark.parametrize("flavour", list(GGUF_CASES))
def test_gguf_family_matches_transformers(tmp_path, flavour):
    gguf_arch, overrides = GGUF_CASES[flavour]
    _, hf_model = make_tiny_hf_model(tmp_path, flavour, **overrides)
    path = tmp_path / f"tiny-{flavour}.gguf"
    write_converter_gguf(path, hf_model)
    model, config = load_model(path, progress=False)
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    builder, rows = run_scenario(model, config, block_size=16)
    with torch.no_grad():
        reference = {rid: hf_model(torch.tensor([tokens])).logits[0] for rid, tokens in builder.tokens.items()}
    for request_id, position, ours in rows:
        expected = reference[request_id][position]
        rel_err = ((ours - expected).norm() / expected.norm()).item()
        assert rel_err <= MAX_REL_ERR, f"{gguf_arch} {request_id} position {position}: relative error {rel_err:.2e}"
    prompt_lens = {"A": 37, "B": 25, "C": 45, "D": 37}
    for request_id, tokens in builder.tokens.items():
        generated = tokens[prompt_lens[request_id]:]
        assert generated == reference[request_id][prompt_lens[request_id] - 1 : len(tokens) - 1].argmax(-1).tolist()
