"""Deterministic mode (worker.paths.batch_invariant): greedy tokens and their logprobs, to the bit, are the same for a
request run alone, in one batch with others, and through chunked prefill and preemption by recompute; without
the mode the logprobs differ. On a tiny random model (float32 and bfloat16, compiled ops and plain torch)
and on the default GGUF model."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
from worker.linears.dense_weights import dense_weight_for, onednn_bf16
from worker.linears.group_quant import GroupQuantLinear, quantize_weight
from worker.linears.packed import PackedLinear
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths.base import resolve_execution
from worker.paths.batch_invariant import (DenseTileLinear, ROW_TILE, RowTileLinear, plan_batch_invariant_attention,
                                          token_spans)
from worker.step_batch import RequestSpan

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)


def prompts(vocab_size: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 23))] for _ in range(count)]


def engine(model, config, dtype, deterministic: bool, fused: bool, num_blocks: int, token_budget: int,
           dense_weights: str = "auto") -> LLM:
    """A runner built now (it sets the model's kernels for its mode) and an engine over it."""
    options = WorkerOptions(deterministic=deterministic, cpu_fused_ops=fused, cpu_dense_weights=dense_weights)
    runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, options=options)
    return LLM(EngineConfig(worker=replace(ENGINE_WORKER, block_size=BLOCK_SIZE),
                            scheduler=SchedulerOptions(max_num_batched_tokens=token_budget, max_num_seqs=16)),
               runner=runner, progress=False)


def outputs(llm: LLM, batch: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(batch, params)
    return [([t for out in outs for t in out.new_token_ids], [lp.logprob for out in outs for lp in out.logprobs])
            for outs in results]


def three_ways(model, config, dtype, deterministic: bool, fused: bool, batch: list[list[int]], dense_weights="auto"):
    """(alone, batched, squeezed): each prompt alone; all in one batch; all with few pages and a small
    token budget, so prefills are chunked and requests are preempted and recomputed mid-generation."""
    llm = engine(model, config, dtype, deterministic, fused, 256, 256, dense_weights)
    alone = [outputs(llm, [prompt])[0] for prompt in batch]
    batched = outputs(engine(model, config, dtype, deterministic, fused, 256, 256, dense_weights), batch)
    squeezed_llm = engine(model, config, dtype, deterministic, fused, 24, 12, dense_weights)
    squeezed = outputs(squeezed_llm, batch)
    assert squeezed_llm.engine.scheduler.num_preemptions > 0, "the small cache preempted someone"
    return alone, batched, squeezed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("batch_invariant"), "llama_gqa")
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False], ids=["compiled-ops", "plain-torch"])
def test_tiny_model_greedy_output_is_identical_alone_batched_and_recomputed(tiny, dtype, fused):
    model, config = load_model(tiny, dtype=dtype, progress=False)
    batch = prompts(config.vocab_size)
    alone, batched, squeezed = three_ways(model, config, dtype, True, fused, batch)
    assert batched == alone, "tokens and logprobs (exact floats) of each request, batched vs alone"
    assert squeezed == alone, "chunked, preempted and recomputed vs alone"


def test_seeded_sampling_repeats_alone_batched_and_recomputed(tiny):
    """Identical logits make a seeded draw (noise from (seed, output index): worker.sampling.sampler) repeat too."""
    model, config = load_model(tiny, dtype=torch.bfloat16, progress=False)
    batch = prompts(config.vocab_size)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True, logprobs=0)
    runs = []
    for num_blocks, token_budget in ((256, 256), (24, 12)):
        llm = engine(model, config, torch.bfloat16, True, True, num_blocks, token_budget)
        runs.append(outputs(llm, batch, params))
    llm = engine(model, config, torch.bfloat16, True, True, 256, 256)
    runs.append([outputs(llm, [prompt], params)[0] for prompt in batch])
    assert runs[0] == runs[1] == runs[2]


def test_without_the_mode_batch_composition_changes_the_bits(tiny):
    model, config = load_model(tiny, dtype=torch.float32, progress=False)
    batch = prompts(config.vocab_size)
    alone, batched, squeezed = three_ways(model, config, torch.float32, False, True, batch)
    # the logprobs' last bits move with the batch (the tokens of a random tiny model seldom flip)
    assert any(a[1] != b[1] for a, b in zip(alone, batched)) or any(a[1] != s[1] for a, s in zip(alone, squeezed))


# bfloat16 dense copies are oneDNN's: not on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (there the worker
# keeps none and says why: tests/worker/linears/test_dense_weights.py)
NEEDS_ONEDNN_BF16 = pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bfloat16 matmul on this CPU")

DEFAULT_MODEL_PATHS = {  # dtype, GGUF weights kept quantized, compiled ops, --cpu-dense-weights, linear it runs
    "bf16-dense-tiles": (torch.bfloat16, True, True, "on", "DenseTileLinear"),
    "bf16-row-kernels": (torch.bfloat16, True, True, "off", "RowKernelLinear"),
    "f32-row-kernels": (torch.float32, True, True, "off", "RowKernelLinear"),
    "f32-reference": (torch.float32, False, False, "off", "RowTileLinear"),  # --quantization none --no-cpu-fused-ops
}


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(path, marks=NEEDS_ONEDNN_BF16) if path == "bf16-dense-tiles" else path
                                  for path in DEFAULT_MODEL_PATHS])
def test_default_model_greedy_output_is_identical_alone_batched_and_recomputed(path):
    """The default GGUF file on each deterministic variant: its group-quantized linears on dense copies in
    fixed tiles or on the row kernel for every row, and the plain-torch float32 reference."""
    dtype, keep_quantized, fused, dense_weights, linear_kind = DEFAULT_MODEL_PATHS[path]
    model, config = load_model(None, dtype=dtype, progress=False, keep_quantized=keep_quantized)
    batch = prompts(config.vocab_size, count=4, seed=1)
    alone, batched, squeezed = three_ways(model, config, dtype, True, fused, batch, dense_weights)
    assert linear_kind in {type(module).__name__ for module in model.modules()}
    assert batched == alone
    assert squeezed == alone


@pytest.mark.slow
@NEEDS_ONEDNN_BF16
def test_default_model_without_the_mode_batch_composition_changes_logprobs_and_tokens():
    model, config = load_model(None, dtype=torch.bfloat16, progress=False, keep_quantized=True)
    batch = prompts(config.vocab_size, count=4, seed=1)
    alone, batched, squeezed = three_ways(model, config, torch.bfloat16, False, True, batch, "on")
    assert any(a[1] != b[1] for a, b in zip(alone, batched))
    flipped = sum(a[0] != b[0] for a, b in zip(alone, batched)) + sum(a[0] != s[0] for a, s in zip(alone, squeezed))
    print(f"without --deterministic: {flipped} of 8 greedy outputs differ from the request's run alone")


def tiled_linears(dtype: torch.dtype) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    plain = torch.nn.Linear(576, 1536, bias=False).to(dtype)
    quantized = GroupQuantLinear(quantize_weight(torch.randn(1536, 576), 4))
    quantized.dense_weight = dense_weight_for(quantized, dtype)
    packed = [RowTileLinear(PackedLinear(plain))] if dtype == torch.float32 else []
    return [RowTileLinear(plain), DenseTileLinear(quantized), *packed]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NEEDS_ONEDNN_BF16)])
def test_tiled_linears_give_each_row_the_same_bits_whatever_the_rows_and_threads(dtype):
    x = torch.randn(3 * ROW_TILE + 5, 576).to(dtype)
    threads = torch.get_num_threads()
    for linear in tiled_linears(dtype):
        every_row = linear(x)
        for count in (1, 2, ROW_TILE - 1, ROW_TILE, ROW_TILE + 3):
            for start in (0, 5):
                assert torch.equal(linear(x[start : start + count]), every_row[start : start + count])
        try:
            torch.set_num_threads(1)  # the worker's thread governor drops to one thread under contention
            assert torch.equal(linear(x), every_row)
        finally:
            torch.set_num_threads(threads)


def test_token_spans_make_every_prefill_token_a_decode_row():
    spans = [RequestSpan(0, 3, 7, [4, 5]), RequestSpan(3, 1, 9, [6, 7, 8])]
    rows = token_spans(spans)
    assert [(r.query_start, r.query_len, r.context_len) for r in rows] == [(0, 1, 5), (1, 1, 6), (2, 1, 7), (3, 1, 9)]
    plan = plan_batch_invariant_attention(spans, BLOCK_SIZE, in_place=True)
    assert plan.prefills == [] and len(plan.decode_groups) == 1 and len(plan.slot_mapping) == 4
    gathered = plan_batch_invariant_attention(spans, BLOCK_SIZE)
    assert [[r.context_len for r in group] for group in gathered.decode_groups] == [[5], [6], [7], [9]]


def test_the_mode_is_refused_only_for_the_torch_backend_on_cuda():
    """The Triton backend has the mode too (tests/worker/paths/test_triton_batch_invariant.py); cuBLAS does not."""
    assert resolve_execution(WorkerOptions(deterministic=True), "cpu").deterministic
    with pytest.raises(ValueError, match="--deterministic on CUDA runs on the Triton kernel backend"):
        resolve_execution(WorkerOptions(deterministic=True, kernel_backend="torch"), "cuda")


def test_serve_passes_the_flag_to_the_worker_which_parses_it():
    import argparse

    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs


    worker = next(spec for spec in cluster_specs(ClusterConfig(worker=WorkerOptions(deterministic=True))) if spec.name == "worker")
    assert "--deterministic" in worker.argv
    assert "--deterministic" not in next(spec for spec in cluster_specs(ClusterConfig()) if spec.name == "worker").argv
    parser = argparse.ArgumentParser()
    WorkerOptions.add_arguments(parser)
    assert WorkerOptions.from_args(parser.parse_args(["--batch-invariant"])).deterministic


def test_the_in_process_engine_takes_the_mode_from_its_config(tiny):
    """EngineConfig(worker=...deterministic=True) builds its runner in the mode: batched equals alone, to the bit."""
    def config_engine() -> LLM:
        return LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(tiny), dtype="bfloat16", block_size=BLOCK_SIZE,
                                               deterministic=True),
                                scheduler=SchedulerOptions(max_num_batched_tokens=256, max_num_seqs=16)), progress=False)
    llm = config_engine()
    batch = prompts(llm.model_config.vocab_size)
    alone = [outputs(llm, [prompt])[0] for prompt in batch]
    assert outputs(config_engine(), batch) == alone
