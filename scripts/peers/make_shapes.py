"""Random-weight benchmark models with the exact shapes of real ones (issue 34 item 4): a GGUF file with the
tensor shapes, quant mix and metadata of llama.cpp's Q4_K_M of Llama-3.2-1B, Qwen2.5-1.5B-Instruct,
Llama-3.2-3B, Llama-3.1-8B or the mixture of experts Qwen3-30B-A3B (issue 36), and with --hf the dense ones' same
shapes as a bfloat16 Hugging Face folder (vLLM CPU).
Serving speed does not depend on weight values, so these stand in for the real checkpoints, which are
not available offline. Outside CI; scripts/peers/compare.sh --model NAME serves them.

    .venv/bin/python scripts/peers/make_shapes.py --model qwen2.5-1.5b [--out .peers/shapes] [--hf]
    .venv/bin/python scripts/peers/make_shapes.py --model all --hf
    writes OUT/NAME.Q4_K_M.gguf (and OUT/NAME-bf16/), skipping what is there already (a file is written
    under a .partial name and renamed when complete). --layers N / --vocab N shrink a model for tests.

Quant mix: llama.cpp's rule for LLAMA_FTYPE_MOSTLY_Q4_K_M (llama_tensor_get_type_impl in
src/llama-quant.cpp), for one-expert models whose rows are whole 256-blocks (all four here):
  - output.weight Q6_K, and token_embd.weight too when the embedding is tied (no output.weight);
    an untied token_embd.weight stays Q4_K;
  - attn_v.weight and ffn_down.weight Q6_K on the layers use_more_bits picks (the first and last eighth,
    and every third layer between), Q4_K elsewhere; every other matrix Q4_K;
  - a mixture of experts (qwen3-30b-a3b, 128 experts): ffn_gate_exps / ffn_up_exps Q4_K, ffn_down_exps Q6_K on
    use_more_bits' layers and Q4_K elsewhere (llama-quant.cpp's FFN_DOWN rule matches any name holding
    "ffn_down" and reads the layer from the name when the model has experts); the router ffn_gate_inp F32 (never
    quantized; random values here), attn_q_norm / attn_k_norm F32; its 8-expert special cases (attn_v / attn_k
    Q8_0) apply to Mixtral-like models only;
  - 1-D tensors (norms, biases, rope_freqs) F32.
Blocks: random code bytes; the f16 scale fields (d, dmin) are small positive values and Q6_K's int8
sub-block scales small, so dequantized weights are finite with a spread like a trained model's (~0.02-0.06).

Tokenizer: a byte-level BPE ("gpt2") of the model's exact vocabulary size: the 256 byte tokens in GPT-2's
spelling, chain merges that make each word of tokenmill bench's prompt vocabulary (with its leading space)
one token, filler tokens up to the model's count of ordinary tokens, then the model's own control tokens
at their real ids (Llama 3's 256 from 128000, Qwen2's 22 from 151643 plus its [PAD] rows), a pre-tokenizer
name llama.cpp knows, and a minimal chat template in the model's own format.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGML_QUANT_SIZES, GGUFWriter, LlamaFileType, TokenType

from tokenmill.bench.gguf_hparams import write_hparams
from tokenmill.bench.shape_vocabulary import Vocabulary, vocabulary

REPO = Path(__file__).resolve().parents[2]
SEED = 34  # the number; every file is the same bytes on every run
F16_SCALE_RANGE = (1e-4, 2e-4)  # d (and dmin / its multiple) of every block
ROUTER_STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    """One model's architecture, as its Hugging Face config.json gives it, and its tokenizer's layout."""

    name: str
    title: str
    arch: str  # GGUF general.architecture
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_theta: float
    norm_eps: float
    tied: bool
    qkv_bias: bool
    rope_scaling: dict | None  # HF's llama3 rope_scaling, or None
    pre_tokenizer: str  # tokenizer.ggml.pre
    specials: tuple[tuple[str, int], ...]  # (text, TokenType) from the first control token's id
    pads: int  # [PAD{id}] rows after the specials (the converter pads to config.vocab_size)
    bos: str
    eos: str
    add_bos: bool
    chat_template: str
    hf_architecture: str = "LlamaForCausalLM"
    hf_extra: dict = field(default_factory=dict)
    qk_norm: bool = False  # Qwen3: RMS norms over each head's q and k (attn_q_norm / attn_k_norm)
    experts: int = 0  # a mixture of experts: experts a layer, chosen per token, each expert's width
    experts_used: int = 0
    expert_intermediate: int = 0


LLAMA3_SPECIALS = (("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
                   + tuple(f"<|reserved_special_token_{i}|>" for i in range(3, 248)))
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
QWEN3_ADDED = ("<tool_response>", "</tool_response>", "<think>", "</think>")  # Qwen3's added tokens after Qwen2's
QWEN2_NOT_SPECIAL = 14  # from <tool_call> on, Qwen2.5's added tokens are special=False: USER_DEFINED in GGUF
LLAMA3_TEMPLATE = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
CHATML_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _llama3(name: str, title: str, layers: int, hidden: int, intermediate: int, heads: int, head_dim: int,
            factor: float, tied: bool) -> ModelShape:
    return ModelShape(
        name, title, "llama", layers, hidden, intermediate, heads, 8, head_dim, 128256, 131072, 500000.0, 1e-5, tied,
        False, {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
        "llama-bpe", tuple((text, TokenType.CONTROL) for text in LLAMA3_SPECIALS), 0,
        "<|begin_of_text|>", "<|eot_id|>", True, LLAMA3_TEMPLATE)


MODELS = {
    "llama3.2-1b": _llama3("llama3.2-1b", "Llama-3.2-1B-Instruct", 16, 2048, 8192, 32, 64, 32.0, tied=True),
    "qwen2.5-1.5b": ModelShape(
        "qwen2.5-1.5b", "Qwen2.5-1.5B-Instruct", "qwen2", 28, 1536, 8960, 12, 2, 128, 151936, 32768, 1000000.0, 1e-6,
        True, True, None, "qwen2",
        tuple((text, TokenType.CONTROL if i < QWEN2_NOT_SPECIAL else TokenType.USER_DEFINED)
              for i, text in enumerate(QWEN2_SPECIALS)), 151936 - 151665,
        "<|endoftext|>", "<|im_end|>", False, CHATML_TEMPLATE, "Qwen2ForCausalLM",
        {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}),
    # Qwen3-30B-A3B: every layer a mixture of 128 experts, 8 a token, renormalised (norm_topk_prob); its
    # intermediate_size (6144) is in the config but no layer is dense
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b", "Qwen3-30B-A3B", "qwen3moe", 48, 2048, 6144, 32, 4, 128, 151936, 40960, 1000000.0, 1e-6,
        False, False, None, "qwen2",
        tuple((text, TokenType.CONTROL if i < QWEN2_NOT_SPECIAL else TokenType.USER_DEFINED)
              for i, text in enumerate(QWEN2_SPECIALS + QWEN3_ADDED)), 151936 - 151669,
        "<|endoftext|>", "<|im_end|>", False, CHATML_TEMPLATE, "Qwen3MoeForCausalLM",
        {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
         "sliding_window": None, "max_window_layers": 48},
        qk_norm=True, experts=128, experts_used=8, expert_intermediate=768),
    "llama3.2-3b": _llama3("llama3.2-3b", "Llama-3.2-3B-Instruct", 28, 3072, 8192, 24, 128, 32.0, tied=True),
    "llama3.1-8b": _llama3("llama3.1-8b", "Llama-3.1-8B-Instruct", 32, 4096, 14336, 32, 128, 8.0, tied=False),
}


# ---------------------------------------------------------------- the tensors and their types (Q4_K_M)

@dataclass(frozen=True)
class TensorPlan:
    name: str  # the GGUF name
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix, (n,) for a vector
    qtype: QType
    hf_name: str | None  # None: no Hugging Face tensor (rope_freqs)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(name: str, shape: tuple[int, ...], layer: int | None, num_layers: int, tied: bool) -> QType:
    """The type llama.cpp's Q4_K_M quantization gives a tensor (see the module docstring)."""
    if len(shape) < 2 or name.endswith("ffn_gate_inp.weight"):  # llama-quant.cpp never quantizes the router
        return QType.F32
    if shape[-1] % 256:
        raise ValueError(f"{name}: {shape[-1]} columns is not a whole number of 256-blocks; llama.cpp would fall "
                         "back to a 32-block type there, which this script does not write")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return QType.Q6_K
    # ffn_down_exps too: llama-quant.cpp's FFN_DOWN category is any name holding "ffn_down", its layer read from the
    # name when the model has experts (one stacked tensor a layer, so the same layers as a dense model's)
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and use_more_bits(layer, num_layers):
        return QType.Q6_K
    return QType.Q4_K


def tensor_plan(model: ModelShape) -> list[TensorPlan]:
    """Every tensor of the GGUF file, in the converter's order (rope_freqs, embedding, layers, final norm, output)."""
    q_rows, kv_rows = model.heads * model.head_dim, model.kv_heads * model.head_dim
    entries: list[tuple[str, tuple[int, ...], int | None, str | None]] = []
    if model.rope_scaling is not None:
        entries.append(("rope_freqs.weight", (model.head_dim // 2,), None, None))
    entries.append(("token_embd.weight", (model.vocab, model.hidden), None, "model.embed_tokens.weight"))
    for i in range(model.layers):
        hf = f"model.layers.{i}."
        layer = [("attn_norm.weight", (model.hidden,), "input_layernorm.weight"),
                 ("attn_q.weight", (q_rows, model.hidden), "self_attn.q_proj.weight"),
                 ("attn_k.weight", (kv_rows, model.hidden), "self_attn.k_proj.weight"),
                 ("attn_v.weight", (kv_rows, model.hidden), "self_attn.v_proj.weight")]
        if model.qkv_bias:
            layer += [("attn_q.bias", (q_rows,), "self_attn.q_proj.bias"),
                      ("attn_k.bias", (kv_rows,), "self_attn.k_proj.bias"),
                      ("attn_v.bias", (kv_rows,), "self_attn.v_proj.bias")]
        layer += [("attn_output.weight", (model.hidden, q_rows), "self_attn.o_proj.weight")]
        if model.qk_norm:
            layer += [("attn_q_norm.weight", (model.head_dim,), "self_attn.q_norm.weight"),
                      ("attn_k_norm.weight", (model.head_dim,), "self_attn.k_norm.weight")]
        layer += [("ffn_norm.weight", (model.hidden,), "post_attention_layernorm.weight"), *_ffn(model)]
        entries += [(f"blk.{i}.{name}", shape, i, hf_name and hf + hf_name) for name, shape, hf_name in layer]
    entries.append(("output_norm.weight", (model.hidden,), None, "model.norm.weight"))
    if not model.tied:
        entries.append(("output.weight", (model.vocab, model.hidden), None, "lm_head.weight"))
    return [TensorPlan(name, shape, q4_k_m_type(name, shape, layer, model.layers, model.tied), hf_name)
            for name, shape, layer, hf_name in entries]


def _ffn(model: ModelShape) -> list[tuple[str, tuple[int, ...], str | None]]:
    """A layer's feed-forward tensors: a dense SwiGLU, or the router and the stacked experts [E, rows, cols] (no
    single Hugging Face tensor: transformers stores them per expert)."""
    if model.experts:
        experts, inter = model.experts, model.expert_intermediate
        return [("ffn_gate_inp.weight", (experts, model.hidden), None),
                ("ffn_gate_exps.weight", (experts, inter, model.hidden), None),
                ("ffn_up_exps.weight", (experts, inter, model.hidden), None),
                ("ffn_down_exps.weight", (experts, model.hidden, inter), None)]
    return [("ffn_gate.weight", (model.intermediate, model.hidden), "mlp.gate_proj.weight"),
            ("ffn_up.weight", (model.intermediate, model.hidden), "mlp.up_proj.weight"),
            ("ffn_down.weight", (model.hidden, model.intermediate), "mlp.down_proj.weight")]


def rope_freqs(model: ModelShape) -> np.ndarray:
    """The llama3 per-frequency divisors, computed as convert_hf_to_gguf.py's LlamaModel does."""
    scaling = model.rope_scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (model.rope_theta ** (np.arange(0, model.head_dim, 2, dtype=np.float32) / model.head_dim))
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


# ---------------------------------------------------------------- tensor data

def _f16_scales(rng: np.random.Generator, count: int, multiple: float = 1.0) -> np.ndarray:
    """count f16 scales in F16_SCALE_RANGE (times multiple), as [count, 2] bytes."""
    low, high = F16_SCALE_RANGE
    values = rng.uniform(low * multiple, high * multiple, count).astype(np.float16)
    return values.view(np.uint8).reshape(count, 2)


def random_blocks(rng: np.random.Generator, qtype: QType, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row] uint8: random codes, finite small scales (layouts: ggml-common.h's block_q*_K)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype in (QType.Q4_K, QType.Q5_K):  # d, dmin, scales[12] (6-bit scale and min pairs), codes
        blocks[:, 0:2] = _f16_scales(rng, len(blocks))
        # dmin = d * the mean code: the mean weight (d*sc*q - dmin*m, sc and m alike) is zero
        blocks[:, 2:4] = _f16_scales(rng, len(blocks), 7.5 if qtype == QType.Q4_K else 15.5)
    elif qtype == QType.Q6_K:  # ql[128], qh[64], int8 scales[16], d
        blocks[:, 192:208] = rng.integers(-16, 17, (len(blocks), 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = _f16_scales(rng, len(blocks))
    elif qtype == QType.Q8_0:  # d, int8 codes[32]
        blocks[:, 0:2] = _f16_scales(rng, len(blocks))
    else:
        raise ValueError(f"random_blocks: {qtype.name} is not one of Q4_K, Q5_K, Q6_K, Q8_0")
    return blocks.reshape(rows, -1)


def float_tensor(rng: np.random.Generator, plan: TensorPlan, model: ModelShape) -> np.ndarray:
    """An F32 tensor: norms 1, biases small random, rope_freqs the llama3 divisors, a MoE router random (N(0, 0.02):
    router logits of about unit spread, so tokens spread over the experts as a trained router's do)."""
    if plan.name == "rope_freqs.weight":
        return rope_freqs(model)
    if plan.name.endswith("ffn_gate_inp.weight"):
        return rng.normal(0.0, ROUTER_STD, plan.shape).astype(np.float32)
    if plan.name.endswith(".bias"):
        return rng.normal(0.0, 0.02, plan.shape).astype(np.float32)
    return np.ones(plan.shape, dtype=np.float32)


def tensor_data(rng: np.random.Generator, plan: TensorPlan, model: ModelShape) -> np.ndarray:
    if plan.qtype == QType.F32:
        return float_tensor(rng, plan, model)
    return random_blocks(rng, plan.qtype, math.prod(plan.shape[:-1]), plan.shape[-1])  # stacked experts: E * rows


def tensor_nbytes(plan: TensorPlan) -> int:
    block_size, type_size = GGML_QUANT_SIZES[plan.qtype]
    return math.prod(plan.shape) // block_size * type_size


# ---------------------------------------------------------------- the GGUF file

def add_metadata(writer: GGUFWriter, model: ModelShape, vocab: Vocabulary) -> None:
    writer.add_type("model")
    writer.add_name(f"{model.title} (random weights, tokenmill scripts/peers/make_shapes.py)")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(2)
    write_hparams(writer, SimpleNamespace(**hf_config(model, vocab)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(model.pre_tokenizer)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if model.arch == "qwen2":
        writer.add_pad_token_id(vocab.id(model.bos))
    writer.add_add_bos_token(model.add_bos)
    writer.add_chat_template(model.chat_template)


def write_gguf(model: ModelShape, path: Path, log=print) -> Path:
    """model's Q4_K_M-shaped GGUF file at path, streamed one tensor at a time (written as path.partial, then
    renamed). Returns path."""
    rng = np.random.default_rng(SEED)
    plans = tensor_plan(model)
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(partial, model.arch)
    add_metadata(writer, model, vocabulary(model))
    for plan in plans:
        if plan.qtype == QType.F32:
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), tensor_nbytes(plan))
        else:
            byte_shape = (*plan.shape[:-1], tensor_nbytes(plan) // math.prod(plan.shape[:-1]))
            writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), tensor_nbytes(plan), raw_dtype=plan.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    group, group_bytes, group_types = None, 0, {}
    for plan in plans:
        name_group = plan.name.rsplit(".", 2)[0] if plan.name.startswith("blk.") else plan.name
        if name_group != group and group is not None:
            log(f"  {group}: {_types_text(group_types)}, {group_bytes / 2**20:.1f} MiB")
            group_bytes, group_types = 0, {}
        group = name_group
        writer.write_tensor_data(tensor_data(rng, plan, model))
        group_bytes += tensor_nbytes(plan)
        group_types[plan.qtype.name] = group_types.get(plan.qtype.name, 0) + 1
    log(f"  {group}: {_types_text(group_types)}, {group_bytes / 2**20:.1f} MiB")
    writer.close()
    partial.rename(path)
    return path


def _types_text(counts: dict[str, int]) -> str:
    return " ".join(f"{count}x{name}" for name, count in counts.items())


# ---------------------------------------------------------------- the bfloat16 Hugging Face folder

def hf_config(model: ModelShape, vocab: Vocabulary) -> dict:
    """config.json; rope_theta in both transformers 4's and 5's spelling (as gguf_to_hf.py writes it)."""
    rope_parameters = {"rope_type": "default", "rope_theta": model.rope_theta, **(model.rope_scaling or {})}
    return {"architectures": [model.hf_architecture], "model_type": model.arch, "vocab_size": model.vocab,
            "hidden_size": model.hidden, "intermediate_size": model.intermediate,
            "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
            "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "hidden_act": "silu",
            "rms_norm_eps": model.norm_eps, "max_position_embeddings": model.context_length,
            "rope_theta": model.rope_theta, "rope_scaling": model.rope_scaling, "rope_parameters": rope_parameters,
            "tie_word_embeddings": model.tied, "attention_bias": model.qkv_bias, "mlp_bias": False,
            "bos_token_id": vocab.id(model.bos), "eos_token_id": vocab.id(model.eos),
            "torch_dtype": "bfloat16", "dtype": "bfloat16", **model.hf_extra}


def random_bf16(rng: np.random.Generator, count: int) -> np.ndarray:
    """count bfloat16 bit patterns: random sign and mantissa, magnitude in [2**-7, 2**-5) (~0.008-0.03)."""
    bits = rng.integers(0, 2**16, count, dtype=np.uint16)
    exponent = (120 + ((bits >> 7) & 1)).astype(np.uint16)
    return (bits & 0x807F) | (exponent << 7)


def hf_tensor_bytes(rng: np.random.Generator, plan: TensorPlan, model: ModelShape, chunk: int = 2**26):
    """The tensor's bfloat16 bytes, in chunks (an 8B embedding is 1 GiB): norms 1.0, the rest random."""
    count = math.prod(plan.shape)
    if plan.qtype == QType.F32:
        values = float_tensor(rng, plan, model)
        yield (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return
    for start in range(0, count, chunk):
        yield random_bf16(rng, min(chunk, count - start)).tobytes()


def write_hf_folder(model: ModelShape, gguf_path: Path, folder: Path, log=print) -> Path:
    """config.json, generation_config.json, model.safetensors (bfloat16, written tensor by tensor) and the GGUF
    file's tokenizer (gguf_to_hf.write_tokenizer), written as folder.partial and renamed."""
    rng = np.random.default_rng(SEED + 1)
    vocab = vocabulary(model)
    plans = [plan for plan in tensor_plan(model) if plan.hf_name is not None]
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for plan in plans:
        nbytes = 2 * math.prod(plan.shape)
        header[plan.hf_name] = {"dtype": "BF16", "shape": list(plan.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(partial / "model.safetensors", "wb") as out:
        out.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
        for index, plan in enumerate(plans):
            for chunk in hf_tensor_bytes(rng, plan, model):
                out.write(chunk)
            if plan.hf_name.endswith("mlp.down_proj.weight") or index == len(plans) - 1:  # a layer's last, the end
                log(f"  {plan.hf_name.removesuffix('.mlp.down_proj.weight')}: {out.tell() / 2**30:.2f} GiB written")
    config = hf_config(model, vocab)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (partial / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
    _gguf_to_hf().write_tokenizer(gguf_path, partial, model.context_length)
    partial.rename(folder)
    return folder


def _gguf_to_hf():
    spec = importlib.util.spec_from_file_location("gguf_to_hf", Path(__file__).with_name("gguf_to_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- command line

def shaped(name: str, layers: int | None = None, vocab: int | None = None) -> ModelShape:
    """MODELS[name], with fewer layers or a smaller vocabulary where asked (tests)."""
    model = MODELS[name]
    return replace(model, layers=layers or model.layers, vocab=vocab or model.vocab)


def file_stem(model: ModelShape) -> str:
    base = MODELS[model.name]
    suffix = "".join([f"-{model.layers}l" if model.layers != base.layers else "",
                      f"-v{model.vocab}" if model.vocab != base.vocab else ""])
    return model.name + suffix


def gguf_path(out: Path, model: ModelShape) -> Path:
    return out / f"{file_stem(model)}.Q4_K_M.gguf"


def hf_path(out: Path, model: ModelShape) -> Path:
    return out / f"{file_stem(model)}-bf16"


def make(model: ModelShape, out: Path, hf: bool, log=print) -> tuple[Path, Path | None]:
    """The model's GGUF file (and HF folder), each written unless it is there already."""
    path = gguf_path(out, model)
    if path.is_file():
        log(f"{path}: there already ({path.stat().st_size / 2**30:.2f} GiB)")
    else:
        log(f"{path}: writing {model.title}'s Q4_K_M shapes")
        write_gguf(model, path, log)
        log(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")
    if hf and model.experts:
        log(f"--hf: no bfloat16 Hugging Face folder for {model.name} (a mixture of experts: not written yet)")
    folder = hf_path(out, model) if hf and not model.experts else None
    if folder is not None and (folder / "model.safetensors").is_file():
        log(f"{folder}: there already")
    elif folder is not None:
        log(f"{folder}: writing {model.title}'s shapes in bfloat16")
        write_hf_folder(model, path, folder, log)
        log(f"{folder}: {(folder / 'model.safetensors').stat().st_size / 2**30:.2f} GiB")
    return path, folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=[*MODELS, "all"],
                        help="all: the dense shapes (qwen3-30b-a3b, ~18 GB, only by name)")
    parser.add_argument("--out", type=Path, default=REPO / ".peers" / "shapes")
    parser.add_argument("--hf", action="store_true", help="also the bfloat16 Hugging Face folder (vLLM CPU)")
    parser.add_argument("--layers", type=int, help="fewer layers (tests); the Q4_K_M rule counts these")
    parser.add_argument("--vocab", type=int, help="a smaller vocabulary (tests): fewer filler tokens")
    args = parser.parse_args(argv)
    for name in [name for name in MODELS if not MODELS[name].experts] if args.model == "all" else [args.model]:
        make(shaped(name, args.layers, args.vocab), args.out, args.hf, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # tokenmill.bench.workload (the prompt words), gateway (the tokenizer)
    sys.exit(main())
