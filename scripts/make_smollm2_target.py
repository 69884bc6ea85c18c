"""A random-weight target for the draft-model benchmark (issue 35): a GGUF file with the shapes of SmolLM2-360M or
SmolLM2-1.7B and the tokenizer of the default model, SmolLM2-135M-Instruct, which the SmolLM2 family shares
(vocabulary 49152, <|im_start|> 1, <|im_end|> 2), so that the default model can draft for it.

    .venv/bin/python scripts/make_smollm2_target.py --shape 360m --out /tmp/smollm2-360m-random.gguf

Random F16 weights: serving speed does not depend on the values, so the file measures what drafting costs beside a
bigger target; a random target accepts almost none of a real draft's guesses, so what a trained pair accepts is
not measured here (no model hub on our machines).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, LlamaFileType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.loader import default_model_path  # noqa: E402

# the real checkpoints' shapes: layers, hidden, MLP, heads, KV heads (head dim 64, tied embeddings)
SHAPES = {"360m": (32, 960, 2560, 15, 5), "1.7b": (24, 2048, 8192, 32, 32)}
HEAD_DIM, VOCAB = 64, 49152


def write_target(shape: str, out: Path, seed: int = 0) -> Path:
    layers, hidden, intermediate, heads, kv_heads = SHAPES[shape]
    source = GGUFReader(default_model_path())
    writer = GGUFWriter(out, "llama")
    writer.add_name(f"SmolLM2-{shape} random weights")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, value in ((writer.add_block_count, layers), (writer.add_context_length, 8192),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, intermediate),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_dimension_count, HEAD_DIM), (writer.add_vocab_size, VOCAB)):
        key(value)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, field in source.fields.items():  # the default model's tokenizer, as is
        if name.startswith("tokenizer."):
            writer.add_key_value(name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(VOCAB, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(layers):
        prefix = f"blk.{layer}."
        for name, rows, cols in (("attn_q", heads * HEAD_DIM, hidden), ("attn_k", kv_heads * HEAD_DIM, hidden),
                                 ("attn_v", kv_heads * HEAD_DIM, hidden), ("attn_output", hidden, heads * HEAD_DIM),
                                 ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                 ("ffn_down", hidden, intermediate)):
            writer.add_tensor(f"{prefix}{name}.weight", matrix(rows, cols))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{prefix}{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="360m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_target(args.shape, args.out))


if __name__ == "__main__":
    main()
