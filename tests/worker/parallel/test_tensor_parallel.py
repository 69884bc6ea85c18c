"""Tensor parallelism over gloo (issue 37): a model split over 2 and 4 ranks, in real processes, gives the
logits of the whole model within 1e-4 (float32) and the same greedy tokens, on several architectures."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.helpers.tensor_parallel_ranks import greedy_run, rank_main
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.model.config import ModelConfig
from worker.parallel.pipeline import check_stages, stage_layers
from worker.parallel.shard import check_split

MAX_ABS_ERR = 1e-4
RANK_TIMEOUT_S = 240


def run_ranks(folder, world_size: int, tmp_path, pipeline: bool = False, kv_dtype: torch.dtype = torch.float32) -> dict:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter per rank, as a worker process is
    kind = "pp" if pipeline else "tp"
    out = tmp_path / f"rank0-of-{kind}{world_size}.pt"
    init_method = f"file://{tmp_path}/store-{kind}{world_size}"
    ranks = [context.Process(target=rank_main, args=(rank, world_size, init_method, str(folder), str(out), pipeline,
                                                     kv_dtype))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(RANK_TIMEOUT_S)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert codes == [0] * world_size, f"rank exit codes {codes}"
    return torch.load(out, weights_only=True)


# llama: 4 KV heads split; qwen2: q/k/v bias, 2 KV heads (TP=4 shares each by 2 ranks); gemma2: soft-caps,
# sandwich norms, tied embeddings, 258-token vocabulary padded to 4 x 65; qwen3_moe: experts split
@pytest.mark.parametrize("flavour, world_sizes", [("llama", (2, 4)), ("qwen2", (2, 4)), ("gemma2", (2,)),
                                                  ("qwen3_moe", (2,))])
def test_split_model_matches_the_whole_one(tmp_path, flavour, world_sizes):
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    whole_logits, whole_tokens = greedy_run(folder)
    for world_size in world_sizes:
        split = run_ranks(folder, world_size, tmp_path)
        assert split["tokens"] == whole_tokens, f"TP={world_size}"
        for step, (expected, got) in enumerate(zip(whole_logits, split["logits"])):
            assert got.shape == expected.shape
            err = (got - expected).abs().max().item()
            assert err <= MAX_ABS_ERR, f"TP={world_size} step {step}: max |logit diff| {err:.2e}"


# pipeline stages: llama's 2 layers one a stage; gemma2's sliding-window and global layers on different
# stages (each stage's rotary tables and windows are its layers' own); qwen3_moe 3 layers over 2 stages
@pytest.mark.parametrize("flavour", ["llama", "gemma2", "qwen3_moe"])
def test_pipeline_stages_match_the_whole_model(tmp_path, flavour):
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    whole_logits, whole_tokens = greedy_run(folder)
    split = run_ranks(folder, 2, tmp_path, pipeline=True)
    assert split["tokens"] == whole_tokens
    for step, (expected, got) in enumerate(zip(whole_logits, split["logits"])):
        err = (got - expected).abs().max().item()
        assert err <= MAX_ABS_ERR, f"PP=2 step {step}: max |logit diff| {err:.2e}"


# quantized KV pages (--kv-cache-dtype) on a split model: each rank writes and reads its own heads' (or layers')
# int8 rows with their scales; a row is one token and one head, the same row whole or split, so only float rounding
# before the quantizer differs, which can move a value across a rounding boundary: hence 1e-2, not 1e-4
@pytest.mark.parametrize("pipeline", [False, True], ids=["tp2", "pp2"])
def test_a_split_model_on_int8_pages_matches_the_whole_one_on_int8_pages(tmp_path, pipeline):
    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    whole_logits, whole_tokens = greedy_run(folder, kv_dtype=torch.int8)
    split = run_ranks(folder, 2, tmp_path, pipeline=pipeline, kv_dtype=torch.int8)
    assert split["tokens"] == whole_tokens
    for step, (expected, got) in enumerate(zip(whole_logits, split["logits"])):
        err = (got - expected).abs().max().item()
        assert err <= 1e-2, f"step {step}: max |logit diff| {err:.2e}"


def test_stages_take_contiguous_layers_and_refuse_more_stages_than_layers():
    assert [list(stage_layers(rank, 3, 8)) for rank in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 5 is more stages than the model's 4 layers"):
        check_stages(4, 5)


def _config(**sizes) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=1,
                num_heads=8, num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, max_position_embeddings=128,
                bos_token_id=None, eos_token_id=None)
    return ModelConfig(**(base | sizes))


@pytest.mark.parametrize("world_size, sizes, message", [
    (16, {}, "larger than the model's 8 query heads allow"),
    (4, {"num_heads": 6}, "does not divide the model's 6 query heads"),
    (4, {"num_kv_heads": 6, "num_heads": 12}, "must divide the model's 6 KV heads or be a multiple of them"),
    (4, {"intermediate_size": 90}, "does not divide the model's intermediate_size 90"),
    (0, {}, "must be at least 1"),
    (2, {"architecture": "olmoe", "qk_norm": True, "qk_norm_whole": True, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32}, "q/k norms span the whole projection"),
])
def test_sizes_a_model_cannot_be_split_over_are_refused(world_size, sizes, message):
    with pytest.raises(ValueError, match=message):
        check_split(_config(**sizes), world_size)
    check_split(_config(**sizes), 1)  # one rank takes any model
