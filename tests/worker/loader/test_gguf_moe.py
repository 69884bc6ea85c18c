"""Mixtures of experts from GGUF files in llama.cpp's converter layout (tests/helpers/tiny_gguf.py): arch
`qwen3moe`, `olmoe`, and Mixtral written as `llama` with `llama.expert_count`; experts as the stacked
`blk.N.ffn_{gate,up,down}_exps` [n_expert, ...] tensors, the router as `ffn_gate_inp`. Float32 logits within 1e-4
of transformers over the mixed scenario, greedy equal to its argmax; quantized expert tensors are dequantized;
refused variants name what they lack.

llama.cpp has no Qwen3-MoE dense layers (mlp_only_layers) and always renormalises Qwen3-MoE's top-k weights
(OLMoE's never), so the transformers models here are made that way.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.worker.model.test_moe_parity import MAX_ABS_ERR, max_abs_diff
from tests.worker.model.test_model_parity import run_scenario
from worker.loader import ModelLoadError, load_model

GGUF_MOE_CASES = {"qwen3_moe": {"mlp_only_layers": []}, "mixtral": {}, "olmoe": {}}


@pytest.mark.parametrize("flavour", list(GGUF_MOE_CASES))
def test_gguf_moe_matches_transformers(tmp_path, flavour):
    _, hf_model = make_tiny_hf_model(tmp_path, flavour, **GGUF_MOE_CASES[flavour])
    path = tmp_path / f"tiny-{flavour}.gguf"
    write_converter_gguf(path, hf_model)
    model, config = load_model(path, progress=False)
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (flavour, 8, 2)
    builder, rows = run_scenario(model, config, block_size=16)
    worst = max_abs_diff(builder, rows, hf_model)
    print(f"GGUF {flavour}: max |logit diff| vs transformers {worst:.3e}")
    assert worst <= MAX_ABS_ERR


def test_quantized_experts_are_dequantized(tmp_path):
    """Q8_0 expert tensors (as a Q8_0 file holds them; the down projection's 48-value rows stay F32) load
    dequantized; the logits stay near the float model's."""
    _, hf_model = make_tiny_hf_model(tmp_path, "mixtral")
    path = tmp_path / "q8.gguf"
    write_converter_gguf(path, hf_model, quantize={"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0"})
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    model, _ = load_model(path, progress=False, keep_quantized=True)
    assert model.layers[0].mlp.experts.gate_up.dtype == torch.float32
    builder, rows = run_scenario(model, model.config, block_size=16)
    with torch.no_grad():
        reference = {rid: hf_model(torch.tensor([tokens])).logits[0] for rid, tokens in builder.tokens.items()}
    worst = max((ours - reference[rid][pos]).abs().max().item() for rid, pos, ours in rows)
    assert worst < 0.05  # Q8_0's rounding only


def _write_raw(path, arch: str, keys: dict) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, missing", [("deepseek2", "multi-head latent attention"), ("gpt-oss", "attention sinks"),
                                           ("qwen2moe", "shared expert")])
def test_unsupported_gguf_moe_variants_name_what_is_missing(tmp_path, arch, missing):
    path = tmp_path / "variant.gguf"
    _write_raw(path, arch, {})
    with pytest.raises(ModelLoadError, match=f"general.architecture '{arch}' is a mixture-of-experts variant that is "
                                             f"not supported: tokenmill has no .*{missing}"):
        load_model(path, progress=False)


def test_gguf_shared_experts_are_refused(tmp_path):
    path = tmp_path / "shared.gguf"
    _write_raw(path, "qwen3moe", {"qwen3moe.vocab_size": 4, "qwen3moe.embedding_length": 8, "qwen3moe.attention.head_count": 2,
                                  "qwen3moe.block_count": 1, "qwen3moe.feed_forward_length": 16,
                                  "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                                  "qwen3moe.expert_shared_count": 1})
    with pytest.raises(ModelLoadError, match="qwen3moe.expert_shared_count=1: shared experts are not supported"):
        load_model(path, progress=False)
