"""GGUF loading: tiny GGUF files written the way llama.cpp's convert script writes them (q/k rows
permuted), error cases, split files, and (slow) the real default model against transformers' own GGUF
reader. Every family through the scheduler-shaped scenario: test_gguf_families.py."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.loader import ModelLoadError, default_model_path, load_model
from worker.model.attention import build_attention_metadata
from worker.model.kv_cache import allocate_kv_cache
from worker.step_batch import RequestSpan

MAX_REL_ERR = 1e-4


def write_gguf(path, hf_model, architecture: str | None = None, skip: tuple[str, ...] = ()) -> None:
    write_converter_gguf(path, hf_model, skip=skip, architecture=architecture)


def all_row_logits(model, config, token_ids: list[int]) -> torch.Tensor:
    """Our logits [S, V] for one sequence prefilled in one chunk (block size 16, scrambled pages)."""
    num_blocks = -(-len(token_ids) // 16)
    kv_cache = allocate_kv_cache(config, num_blocks + 3, 16, torch.float32)
    table = list(range(num_blocks + 2, 1, -1))[:num_blocks]
    metadata = build_attention_metadata([RequestSpan(0, len(token_ids), len(token_ids), table)], 16)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_cache, metadata)
        return model.compute_logits(hidden)


def max_rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()


@pytest.mark.parametrize("flavour", ["llama", "llama_gqa"])
def test_tiny_gguf_unpermutes_q_k_and_matches_transformers(tmp_path, flavour):
    _, hf_model = make_tiny_hf_model(tmp_path, flavour)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model)
    model, config = load_model(path, progress=False)
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert (config.num_heads, config.num_kv_heads, config.rope_theta) == (
        hf_model.config.num_attention_heads, hf_model.config.num_key_value_heads, hf_model.config.rope_parameters["rope_theta"],
    )  # fmt: skip
    token_ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = hf_model(torch.tensor([token_ids])).logits[0]
    assert max_rel_err(all_row_logits(model, config, token_ids), reference) <= MAX_REL_ERR


def test_unsupported_gguf_architecture_is_named(tmp_path):
    _, hf_model = make_tiny_hf_model(tmp_path, "llama")
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, hf_model, architecture="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2.gguf: GGUF general.architecture 'gpt2' is not supported; supported: llama"):
        load_model(path, progress=False)


def test_missing_gguf_tensor_is_named(tmp_path):
    _, hf_model = make_tiny_hf_model(tmp_path, "llama")
    path = tmp_path / "partial.gguf"
    write_gguf(path, hf_model, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelLoadError, match="partial.gguf: tensor 'blk.1.ffn_up.weight' is missing"):
        load_model(path, progress=False)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf: not a readable GGUF file"):
        load_model(path, progress=False)


def transformers_model_from_gguf(path):
    """transformers' own GGUF path (its dequantize + un-permute), independent of our loader.

    from_pretrained(gguf_file=...) needs `accelerate`, which this environment lacks, so the same
    reader it uses (load_gguf_checkpoint) fills a LlamaForCausalLM built from the GGUF's config.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.float().eval()


@pytest.mark.slow
def test_default_model_config_and_logits_match_transformers():
    path = default_model_path()
    model, config = load_model(None, progress=False)
    facts = (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads)
    assert facts == ("llama", 30, 576, 1536, 9)
    assert (config.num_kv_heads, config.head_dim, config.vocab_size, config.rope_theta) == (3, 64, 49152, 100000.0)
    assert config.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert config.eos_token_id == 2
    reference_model = transformers_model_from_gguf(path)
    token_ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 504, 3458, 282, 4649, 314, 2]
    with torch.no_grad():
        reference = reference_model(torch.tensor([token_ids])).logits[0]
    assert max_rel_err(all_row_logits(model, config, token_ids), reference) <= MAX_REL_ERR


def test_split_gguf_loads_from_any_part(tmp_path):
    _, hf_model = make_tiny_hf_model(tmp_path, "qwen2")
    write_converter_gguf(tmp_path / "tiny.gguf", hf_model, split_max_tensors=10)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) >= 3
    token_ids = torch.randint(0, 258, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = hf_model(torch.tensor([token_ids])).logits[0]
    for part in (parts[0], parts[-1]):
        model, config = load_model(part, progress=False)
        assert max_rel_err(all_row_logits(model, config, token_ids), reference) <= MAX_REL_ERR
    parts[1].unlink()
    with pytest.raises(ModelLoadError, match=f"split part {parts[1].name} \\(2 of {len(parts)}\\) does not exist"):
        load_model(parts[0], progress=False)
