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


def test_quantized_experts_run_on_their_blocks_as_cpu_block_kernels_says(tmp_path):
    """A layer's experts stay in the file's blocks (worker.linears.ggml_experts) when --cpu-block-kernels takes all
    three of its expert tensors' types (Q8_0: `all`, not `auto`): logits within the activations' int8 rounding of the
    dequantized experts'. Under auto / off, or with the down experts in a type without a kernel (F32), the experts
    are dequantized floats as before."""
    from worker.linears.ggml_blocks import block_types
    from worker.linears.ggml_experts import GGMLBlocksExperts, describe_experts
    from worker.linears.group_quant import weight_formats
    from worker.native_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the compiled CPU ops are not built")
    _, hf_model = make_tiny_hf_model(tmp_path, "qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "q8.gguf"
    write_converter_gguf(path, hf_model, quantize={f"ffn_{p}_exps.weight": "Q8_0" for p in ("gate", "up", "down")})
    loaded = {mode: load_model(path, progress=False, keep_quantized=True, block_types=block_types(mode))[0]
              for mode in ("all", "auto", "off")}
    on_blocks = {mode: [isinstance(layer.mlp.experts, GGMLBlocksExperts) for layer in model.layers]
                 for mode, model in loaded.items()}
    assert on_blocks == {"all": [True] * 3, "auto": [False] * 3, "off": [False] * 3}
    assert weight_formats(loaded["all"]).endswith("experts Q8_0")
    assert "3 layers' experts on the file's own blocks (Q8_0" in describe_experts(loaded["all"])
    assert "3 layers' experts in float32" in describe_experts(loaded["off"])
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(loaded["all"].layers, loaded["off"].layers):  # one routing: the int8 rounding only
        assert (ours.mlp(x) - theirs.mlp(x)).norm() <= 3e-2 * theirs.mlp(x).norm()
    _, blocks = run_scenario(loaded["all"], loaded["all"].config, block_size=16)
    _, floats = run_scenario(loaded["off"], loaded["off"].config, block_size=16)
    diffs = sorted((ours - theirs).abs().max().item() for (_, _, ours), (_, _, theirs) in zip(blocks, floats))
    print(f"Q8_0 experts on blocks vs dequantized: |logit diff| median {diffs[len(diffs) // 2]:.3e}, max {diffs[-1]:.3e}")
    # through the whole model a near-tie router may pick another expert for a row (measured: 1 of 125 rows, 0.27)
    assert 0 < diffs[len(diffs) // 2] < 0.02 and diffs[int(0.95 * len(diffs))] < 0.05
    mixed = tmp_path / "q8-down-f32.gguf"
    write_converter_gguf(mixed, hf_model, quantize={f"ffn_{p}_exps.weight": "Q8_0" for p in ("gate", "up")})
    model, _ = load_model(mixed, progress=False, keep_quantized=True, block_types=block_types("all"))
    assert not any(isinstance(layer.mlp.experts, GGMLBlocksExperts) for layer in model.layers)


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


@pytest.mark.parametrize("arch, missing", [("deepseek2", "multi-head latent attention"),
                                           ("gpt-oss", "reader for gpt-oss GGUF files \\(llama.cpp's converter stores "
                                                       "their experts as MXFP4 blocks"),
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
