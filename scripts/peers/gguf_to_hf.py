"""A Hugging Face folder from a GGUF file, for a peer that loads only such folders (vLLM's CPU backend
in scripts/peers/compare.sh), so it serves the same weights as tokenmill and llama-server.

    .venv/bin/python scripts/peers/gguf_to_hf.py OUT_DIR [--gguf FILE]   (default: SmolLM2-135M-Instruct Q4_1)

Weights: tokenmill's own GGUF loader (worker.loader.gguf_loader.read_gguf) dequantizes them and undoes
llama.cpp's q/k row permutation, giving Hugging Face names; its parity tests hold it to transformers.
They are written in float32, which holds every dequantized value exactly, so a peer told `--dtype
bfloat16` rounds the same values tokenmill rounds. Tokenizer: the one tokenmill builds from the file's
metadata (gateway.text.tokenizer), saved as tokenizer.json.

The JSON files are written here rather than by transformers' save_pretrained: transformers 5 writes
`rope_parameters` without `rope_theta` and names its tokenizer class `TokenizersBackend`, which the
transformers 4 that a peer's own environment may hold reads as rope base 10000 and an unknown class.
These files carry both spellings of the rope base and the class name every version knows.
Llama-architecture files only (the default model's family), with plain RoPE.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def write_model(gguf_path: Path, out_dir: Path) -> dict:
    """config.json, generation_config.json and model.safetensors; returns the config written."""
    import torch
    from safetensors.torch import save_file

    from worker.loader.gguf_loader import read_gguf

    config, tensors = read_gguf(gguf_path, torch.float32, progress=True)
    if config.architecture != "llama" or config.rope_scaling is not None:
        raise SystemExit(f"{gguf_path}: architecture {config.architecture!r}"
                         f"{' with RoPE scaling' if config.rope_scaling is not None else ''}: "
                         "this converter writes plain-RoPE llama folders only")
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,  # transformers 4
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # transformers 5
        "rope_scaling": None, "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias, "mlp_bias": False,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32", "dtype": "float32",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, indent=2) + "\n")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding is the output projection
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return hf_config


def write_tokenizer(gguf_path: Path, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    from gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {name: token for name, token in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token))
               if token is not None}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the default model's)")
    args = parser.parse_args(argv)
    from worker.loader import default_model_path

    gguf_path = args.gguf or default_model_path()
    hf_config = write_model(gguf_path, args.out_dir)
    write_tokenizer(gguf_path, args.out_dir, hf_config["max_position_embeddings"])
    print(f"{args.out_dir}: {gguf_path.name} as a Hugging Face folder (float32 weights)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
