"""scripts/peers/make_shapes.py's mixture of experts, qwen3-30b-a3b (issue 36): Qwen3-30B-A3B's shapes and llama.cpp's
Q4_K_M mix for its experts (gate/up Q4_K, down Q6_K on use_more_bits' layers, the router F32), checked against a
table written out here; a 2-layer file with a small vocabulary (--layers / --vocab: 128 experts still, ~0.7 GB)
loads in tokenmill with its experts on the file's blocks, and in llama-server, and the two take the same greedy
tokens up to a near-tie (skipped without a llama-server binary: $LLAMA_SERVER or .peers/bin/llama-server)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers.make_shapes_script import load_make_shapes

REPO = Path(__file__).resolve().parents[3]
SMALL_VOCAB = 2048


@pytest.fixture(scope="module")
def make_shapes():
    return load_make_shapes()


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, make_shapes) -> Path:
    model = make_shapes.shaped("qwen3-30b-a3b", 2, SMALL_VOCAB)
    lines: list[str] = []
    path, folder = make_shapes.make(model, tmp_path_factory.mktemp("moe"), hf=True, log=lines.append)
    assert folder is None and any("no bfloat16 Hugging Face folder" in line for line in lines)
    # of 2 layers use_more_bits picks the last only: its attn_v and down experts Q6_K
    assert "  blk.0: 5xF32 7xQ4_K," in "\n".join(lines) and "  blk.1: 5xF32 5xQ4_K 2xQ6_K," in "\n".join(lines), lines
    return path


def test_full_size_plan_is_qwen3_30b_a3b_q4_k_m(make_shapes):
    model = make_shapes.MODELS["qwen3-30b-a3b"]
    plan = {entry.name: entry for entry in make_shapes.tensor_plan(model)}
    assert len(plan) == 3 + 48 * 12  # embedding, output norm, output; 12 a layer
    shape_type = lambda name: (plan[name].shape, plan[name].qtype.name)  # noqa: E731
    assert shape_type("token_embd.weight") == ((151936, 2048), "Q4_K")  # untied: Q4_K, output Q6_K
    assert shape_type("output.weight") == ((151936, 2048), "Q6_K")
    more_bits = [i for i in range(48) if make_shapes.use_more_bits(i, 48)]
    assert more_bits == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    for i in range(48):
        wide = "Q6_K" if i in more_bits else "Q4_K"
        assert shape_type(f"blk.{i}.attn_q.weight") == ((4096, 2048), "Q4_K")
        assert shape_type(f"blk.{i}.attn_k.weight") == ((512, 2048), "Q4_K")
        assert shape_type(f"blk.{i}.attn_v.weight") == ((512, 2048), wide)
        assert shape_type(f"blk.{i}.attn_output.weight") == ((2048, 4096), "Q4_K")
        assert shape_type(f"blk.{i}.attn_q_norm.weight") == ((128,), "F32")
        assert shape_type(f"blk.{i}.ffn_gate_inp.weight") == ((128, 2048), "F32")
        assert shape_type(f"blk.{i}.ffn_gate_exps.weight") == ((128, 768, 2048), "Q4_K")
        assert shape_type(f"blk.{i}.ffn_up_exps.weight") == ((128, 768, 2048), "Q4_K")
        assert shape_type(f"blk.{i}.ffn_down_exps.weight") == ((128, 2048, 768), wide)
    size = sum(make_shapes.tensor_nbytes(entry) for entry in plan.values())
    assert 17.0 * 2**30 < size < 17.6 * 2**30  # the published Qwen3-30B-A3B-Q4_K_M.gguf files: about 17.3 GiB


def test_the_small_file_loads_with_its_experts_on_blocks(moe_file):
    from worker.linears.ggml_experts import GGMLBlocksExperts
    from worker.loader import load_model
    from worker.linears.ggml_blocks import block_types
    from worker.native_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the compiled CPU ops are not built")
    model, config = load_model(moe_file, progress=False, keep_quantized=True, block_types=block_types("auto"))
    assert (config.architecture, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.qk_norm, config.vocab_size) == ("qwen3_moe", 128, 8, 768, True, True, SMALL_VOCAB)
    experts = [layer.mlp.experts for layer in model.layers]
    assert all(isinstance(e, GGMLBlocksExperts) for e in experts)
    assert [e.expert_blocks[1].formats for e in experts] == ["Q4_K", "Q6_K"]
    floats, _ = load_model(moe_file, progress=False, keep_quantized=True, block_types=block_types("off"))
    assert not any(isinstance(layer.mlp.experts, GGMLBlocksExperts) for layer in floats.layers)


LLAMA_SERVER = Path(__import__("os").environ.get("LLAMA_SERVER") or REPO / ".peers/bin/llama-server")
PROMPTS = ([300, 301, 302, 303, 304, 305, 306, 307], [500, 42, 977, 1500, 9])
MIN_AGREED = 8


@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason=f"no llama-server at {LLAMA_SERVER} (set $LLAMA_SERVER)")
def test_tokenmill_and_llama_server_take_the_same_greedy_tokens(moe_file, tmp_path, monkeypatch):
    from core.sampling import SamplingParams
    from tests.worker.loader import test_gguf_moe_llama_server as llama
    from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
    from worker.native_ops import cpu_ops_available

    if not cpu_ops_available():
        pytest.skip("the compiled CPU ops are not built")
    monkeypatch.setattr(llama, "LLAMA_SERVER", LLAMA_SERVER)
    # --no-repack: this build's repacked (extra buffer) K-quant path dies on the stacked experts here (SIGSEGV /
    # SIGILL at load on this AMX CPU); the file's own blocks, as tokenmill runs them, load and run
    theirs = llama.llama_server_greedy(moe_file, PROMPTS, tmp_path / "llama-server.log", ("--no-repack",))
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(moe_file), num_blocks=64)))
    outputs = llm.generate_token_ids(list(PROMPTS), SamplingParams(max_tokens=llama.NEW_TOKENS, temperature=0.0,
                                                                   ignore_eos=True))
    ours = [list(getattr(out, "token_ids", out)) for out in outputs]
    for mine, llama_cpp in zip(ours, theirs):
        agreed = next((i for i, (a, b) in enumerate(zip(mine, llama_cpp)) if a != b), len(mine))
        print(f"qwen3-30b-a3b 2 layers: tokenmill and llama-server agree on the first {agreed} of {len(mine)} tokens")
        assert agreed >= MIN_AGREED, (agreed, mine, llama_cpp)
