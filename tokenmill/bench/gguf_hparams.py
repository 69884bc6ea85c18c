"""The hyperparameter keys every llama-family GGUF file carries, written from a Hugging Face config.

Two writers of GGUF files share it: scripts/peers/make_shapes.py (random-weight files with a real
model's shapes, for the benchmarks) and the tests' tiny converter (tests/helpers/tiny_gguf.py). Both
describe their model as config.json does, so one function keeps the two files' key sets from drifting.
"""
from __future__ import annotations


def rope_parameters(config) -> dict:
    """transformers 5's rope_parameters; gemma3 nests them per attention kind, the global one counts."""
    params = dict(config.rope_parameters)
    return params.get("full_attention", params)


def write_hparams(writer, config) -> None:
    """config: attributes named as in config.json (a transformers config, or a namespace over one)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(rope_parameters(config)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if num_experts:  # the converter's MoE keys (Qwen3-MoE also its experts' own width)
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
