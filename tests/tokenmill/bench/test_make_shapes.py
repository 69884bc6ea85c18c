"""scripts/peers/make_shapes.py: random-weight GGUF files with a real model's Q4_K_M shapes, quant mix and
metadata (issue 34 item 4). The files here have 1 or 2 layers and a small vocabulary (--layers / --vocab),
so each is tens of MB; the full-size files are written by hand (docs/benchmarks.md, "Real-shape models").

Checked: the tensor names, shapes and types against llama.cpp's Q4_K_M rule (written out here as tables,
not through the script's own rule), every tensor finite through gguf-py's dequantize, the tokenizer through
the gateway's GGUF tokenizer and chat template, and the worker's own build (worker.build.build_runner) loading
the file and running a prefill and a decode step to finite logits; and the bfloat16 HF folder's config,
safetensors header and a transformers forward pass."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.make_shapes_script import load_make_shapes

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "peers" / "make_shapes.py"
SMALL_VOCAB = 2048


@pytest.fixture(scope="module")
def make_shapes():
    return load_make_shapes()


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory) -> Path:
    """Qwen2.5-1.5B's shapes with 2 layers and a 2048-token vocabulary, written by the command line."""
    out = tmp_path_factory.mktemp("shapes")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "qwen2.5-1.5b", "--layers", "2", "--vocab",
                          str(SMALL_VOCAB), "--out", str(out), "--hf"], capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr
    # per-group progress; of 2 layers use_more_bits picks the last only (7 * 2 // 8 = 1)
    assert "blk.0: 5xF32 7xQ4_K," in run.stdout and "blk.1: 5xF32 5xQ4_K 2xQ6_K" in run.stdout
    path = out / f"qwen2.5-1.5b-2l-v{SMALL_VOCAB}.Q4_K_M.gguf"
    again = subprocess.run([sys.executable, str(SCRIPT), "--model", "qwen2.5-1.5b", "--layers", "2", "--vocab",
                            str(SMALL_VOCAB), "--out", str(out), "--hf"], capture_output=True, text=True, timeout=60,
                           cwd=REPO, check=False)
    assert again.returncode == 0 and f"{path}: there already" in again.stdout  # complete files are kept
    return path


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory, make_shapes) -> Path:
    """Llama-3.2-1B's shapes with 1 layer and a 2048-token vocabulary (rope_freqs, tied Q6_K embedding)."""
    model = make_shapes.shaped("llama3.2-1b", 1, SMALL_VOCAB)
    path, _ = make_shapes.make(model, tmp_path_factory.mktemp("llama"), hf=True, log=lambda line: None)
    return path


def test_use_more_bits_picks_llama_cpps_layers(make_shapes):
    # Llama-3.1-8B Q4_K_M: attn_v / ffn_down Q6_K on these 16 of 32 layers (as in the published files)
    assert [i for i in range(32) if make_shapes.use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                                          28, 29, 30, 31]
    assert [i for i in range(28) if make_shapes.use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25,
                                                                          26, 27]
    assert [i for i in range(16) if make_shapes.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


@pytest.mark.parametrize(("name", "expected"), [
    # name: (tensor count, token_embd (shape, type), output or None when tied, attn_q, attn_k, ffn_down shapes)
    ("qwen2.5-1.5b", (338, ((151936, 1536), "Q6_K"), None, (1536, 1536), (256, 1536), (1536, 8960))),
    ("llama3.2-1b", (147, ((128256, 2048), "Q6_K"), None, (2048, 2048), (512, 2048), (2048, 8192))),
    ("llama3.2-3b", (255, ((128256, 3072), "Q6_K"), None, (3072, 3072), (1024, 3072), (3072, 8192))),
    ("llama3.1-8b", (292, ((128256, 4096), "Q4_K"), ((128256, 4096), "Q6_K"), (4096, 4096), (1024, 4096),
                     (4096, 14336))),
])
def test_full_size_plans_follow_the_q4_k_m_rule(make_shapes, name, expected):
    count, embedding, output, attn_q, attn_k, ffn_down = expected
    model = make_shapes.MODELS[name]
    plan = {entry.name: entry for entry in make_shapes.tensor_plan(model)}
    assert len(plan) == count
    assert (plan["token_embd.weight"].shape, plan["token_embd.weight"].qtype.name) == embedding
    assert ("output.weight" not in plan) if output is None else (
        (plan["output.weight"].shape, plan["output.weight"].qtype.name) == output)
    assert plan["blk.0.attn_q.weight"].shape == attn_q and plan["blk.0.attn_k.weight"].shape == attn_k
    assert plan["blk.0.ffn_down.weight"].shape == ffn_down
    more_bits = [i for i in range(model.layers) if make_shapes.use_more_bits(i, model.layers)]
    for i in range(model.layers):
        wide = "Q6_K" if i in more_bits else "Q4_K"
        assert plan[f"blk.{i}.attn_v.weight"].qtype.name == plan[f"blk.{i}.ffn_down.weight"].qtype.name == wide
        for other in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert plan[f"blk.{i}.{other}.weight"].qtype.name == "Q4_K"
    vectors = {entry.qtype.name for entry in plan.values() if len(entry.shape) == 1}
    assert vectors == {"F32"}
    assert ("blk.0.attn_q.bias" in plan) == (name == "qwen2.5-1.5b")
    assert ("rope_freqs.weight" in plan) == name.startswith("llama")


def test_file_reads_back_with_every_tensor_finite(qwen_file, make_shapes):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(qwen_file))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    plan = make_shapes.tensor_plan(make_shapes.shaped("qwen2.5-1.5b", 2, SMALL_VOCAB))
    assert list(tensors) == [entry.name for entry in plan]
    expected = {"token_embd.weight": ((SMALL_VOCAB, 1536), "Q6_K"), "blk.1.attn_q.weight": ((1536, 1536), "Q4_K"),
                "blk.1.attn_k.weight": ((256, 1536), "Q4_K"), "blk.1.attn_v.weight": ((256, 1536), "Q6_K"),
                "blk.1.attn_v.bias": ((256,), "F32"), "blk.1.ffn_down.weight": ((1536, 8960), "Q6_K"),
                "blk.1.ffn_up.weight": ((8960, 1536), "Q4_K"), "output_norm.weight": ((1536,), "F32")}
    for name, (shape, kind) in expected.items():
        assert (tuple(int(d) for d in reversed(tensors[name].shape.tolist())), tensors[name].tensor_type.name) == (
            shape, kind), name
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(values).all(), tensor.name
        if tensor.tensor_type.name != "F32":  # a trained model's spread, not a huge or vanishing one
            assert 0.01 < float(values.std()) < 0.1 and abs(float(values.mean())) < 2e-3, tensor.name
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert (field("general.architecture"), field("general.file_type"), field("qwen2.block_count")) == ("qwen2", 15, 2)
    assert (field("qwen2.embedding_length"), field("qwen2.attention.head_count"),
            field("qwen2.attention.head_count_kv"), field("qwen2.rope.freq_base")) == (1536, 12, 2, 1e6)
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "qwen2")
    assert len(field("tokenizer.ggml.tokens")) == SMALL_VOCAB


def test_files_are_the_same_bytes_on_every_run(make_shapes, llama_file, tmp_path):
    again, _ = make_shapes.make(make_shapes.shaped("llama3.2-1b", 1, SMALL_VOCAB), tmp_path, hf=False,
                                log=lambda line: None)
    assert again.read_bytes() == llama_file.read_bytes()  # seeded: every machine benchmarks the same file


def test_llama3_rope_freqs_are_the_converters(make_shapes):
    freqs = make_shapes.rope_freqs(make_shapes.MODELS["llama3.1-8b"])
    # convert_hf_to_gguf.py's llama3 divisors for head_dim 128, factor 8: high frequencies 1, low ones 8
    assert freqs.shape == (64,) and freqs[0] == 1.0 and freqs[-1] == 8.0
    assert np.all(np.diff(freqs) >= 0) and abs(float(freqs[30]) - 1.553) < 1e-3  # the smooth band, indices 29-34


def test_llama_tokenizer_adds_bos_and_renders_llama3_chat(llama_file):
    from gateway.text.chat_template import render_chat
    from gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(llama_file)
    bos = SMALL_VOCAB - 256  # Llama 3's 256 control tokens keep their place at the top: 128000 in the full file
    assert (tokenizer.bos_token_id, tokenizer.token_to_id("<|eot_id|>")) == (bos, bos + 9)
    assert tokenizer.encode("hi river") == [bos, ord("h"), ord("i"), tokenizer.token_to_id("\u0120river")]
    chat = render_chat(tokenizer.chat_template, [{"role": "user", "content": "hi"}], bos_token=tokenizer.bos_token)
    assert chat == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" \
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_tokenizer_encodes_prompts_and_chat(qwen_file):
    from gateway.text.chat_template import render_chat
    from gateway.text.tokenizer import load_tokenizer
    from tokenmill.bench.workload import text_prompts

    tokenizer = load_tokenizer(qwen_file)
    assert tokenizer.vocab_size == SMALL_VOCAB
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    text = "Hello, wörld! time river\n<|im_start|>user"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.token_to_id("<|im_start|>") in ids  # a control token, matched whole
    assert len(tokenizer.encode(" mountain")) == 1  # the bench's prompt words are one token each
    (prompt,) = text_prompts(tokenizer, 1, 128, seed=0)
    assert len(tokenizer.encode(prompt)) == 128
    chat = render_chat(tokenizer.chat_template, [{"role": "user", "content": "hi"}], bos_token=tokenizer.bos_token)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_worker_loads_the_file_and_a_step_gives_finite_logits(request, which):
    from core.sampling import SamplingParams
    from core.step import CachedRequestData, NewRequestData, StepPlan
    from worker.build import build_runner
    from worker.options import WorkerOptions

    path = request.getfixturevalue(f"{which}_file")
    runner = build_runner(WorkerOptions(model=str(path), dtype="float32", block_size=16, num_blocks=4, device="cpu"),
                          progress=False)
    config = runner.model_config
    expected = {"qwen": ("qwen2", 2, 1536, 12, 2, 128, True), "llama": ("llama", 1, 2048, 32, 8, 64, False)}[which]
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.attention_bias) == expected
    assert config.vocab_size == SMALL_VOCAB and config.tie_word_embeddings
    assert (config.rope_scaling is not None) == (which == "llama")  # llama3's rope_freqs
    logits = []
    network = runner.execution_path.model
    compute_logits = network.compute_logits
    network.compute_logits = lambda hidden: logits.append(compute_logits(hidden)) or logits[-1]
    prompt = list(range(300, 320))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = runner.execute(StepPlan(1, [NewRequestData("r", prompt, len(prompt), params, [0, 1], 0)],
                                    num_scheduled_tokens={"r": len(prompt)}))
    runner.execute(StepPlan(2, cached_requests=[CachedRequestData("r", [], len(prompt))], num_scheduled_tokens={"r": 1}))
    assert 0 <= first.sampled_token_ids["r"] < SMALL_VOCAB
    assert len(logits) == 2 and all(step.shape[-1] == SMALL_VOCAB and torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_hf_folder_loads_in_transformers(request, which):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"{which}_file")
    folder = path.with_name(path.name.removesuffix(".Q4_K_M.gguf") + "-bf16")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert type(model).__name__ == {"qwen": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[which]
    if which == "llama":  # llama3 rope scaling, as the real config has it
        assert model.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        logits = model(torch.arange(300, 316)[None]).logits
    assert logits.shape == (1, 16, SMALL_VOCAB) and torch.isfinite(logits).all()


def test_hf_folder_has_the_shapes_in_bfloat16(qwen_file):
    folder = qwen_file.with_name(qwen_file.name.removesuffix(".Q4_K_M.gguf") + "-bf16")
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["vocab_size"]) == (
        ["Qwen2ForCausalLM"], 2, SMALL_VOCAB)
    assert (config["num_key_value_heads"], config["tie_word_embeddings"], config["rope_theta"]) == (2, True, 1e6)
    raw = (folder / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    header.pop("__metadata__")
    assert header["model.layers.1.self_attn.k_proj.weight"] == {
        **header["model.layers.1.self_attn.k_proj.weight"], "dtype": "BF16", "shape": [256, 1536]}
    assert "lm_head.weight" not in header and header["model.layers.0.self_attn.q_proj.bias"]["shape"] == [1536]
    assert len(raw) == 8 + header_len + max(entry["data_offsets"][1] for entry in header.values())
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    assert all(tensor.dtype == torch.bfloat16 and torch.isfinite(tensor).all() for tensor in tensors.values())
    assert (folder / "tokenizer.json").is_file()
