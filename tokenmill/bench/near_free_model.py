"""The near-free model (DESIGN.md, "Benchmark methodology"): a 1-layer, hidden-64 random-weight Llama with
the default model's tokenizer, so a step costs almost nothing but its 49k-vocabulary head and what a
benchmark measures is the serving stack around it (issue 33).

    python -m tokenmill.bench.near_free_model OUT_DIR     a Hugging Face folder (also for vLLM: compare.sh)

The folder is what a real one holds: config.json (both spellings of the rope base, as
scripts/peers/gguf_to_hf.py writes them, so transformers 4 and 5 read the same model), float32
model.safetensors, and the default tokenizer's tokenizer.json / tokenizer_config.json. Heads of 32:
vLLM's CPU attention takes head sizes from 32 up, tokenmill any.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the shapes: hidden 64, one layer; the vocabulary is the default tokenizer's (49152 for SmolLM2)
NEAR_FREE_SHAPE = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048}
ROPE_THETA = 100000.0


def write_near_free_model(out_dir: Path, seed: int = 0) -> Path:
    """Writes the folder (weights drawn from seed) and returns it."""
    import torch
    from safetensors.torch import save_file

    from gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    shape = NEAR_FREE_SHAPE
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size, **shape,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}, "rope_scaling": None,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32", "dtype": "float32",
    }
    hidden, heads, kv_heads, head_dim = (shape["hidden_size"], shape["num_attention_heads"],
                                         shape["num_key_value_heads"], shape["head_dim"])
    weight_shapes = {
        "model.embed_tokens.weight": (vocab_size, hidden),  # tied: also the output head
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (shape["intermediate_size"], hidden),
        "model.layers.0.mlp.up_proj.weight": (shape["intermediate_size"], hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, shape["intermediate_size"]),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(size, generator=generator) * 0.02 for name, size in weight_shapes.items()}
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.norm.weight"):
        tensors[name] = torch.ones(hidden)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {name: token for name, token in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token))
               if token is not None}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                "model_max_length": shape["max_position_embeddings"], "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.near_free_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_near_free_model(args.out_dir, args.seed)
    print(f"{args.out_dir}: the near-free model (1 layer, hidden 64, the default tokenizer)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
