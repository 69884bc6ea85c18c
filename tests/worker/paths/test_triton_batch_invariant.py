"""Deterministic mode on the Triton path (worker.paths.triton.batch_invariant), under the Triton interpreter: greedy
tokens and their logprobs, to the bit, are the same for a request run alone, in one batch with others, and
through chunked prefill and preemption by recompute; without the mode the logprobs move. Tiny random models:
float linears (llama, GQA ratio 3) in float32, q/k norms (qwen3) in bfloat16, group-quantized int4 and int8
linears. The same on CUDA: tests/gpu/test_cuda_deterministic.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core.sampling import SamplingParams
from scheduler.options import SchedulerOptions
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.worker.paths.test_batch_invariant import BLOCK_SIZE, outputs, prompts
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
from worker.linears.group_quant import quantize_linears
from worker.linears.int8 import quantize_linears_int8
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths.base import resolve_execution
from worker.paths.batch_invariant import RowTileLinear
from worker.paths.triton.batch_invariant import (FixedTileGroupQuantLinear, FixedTileInt8Linear, FixedTileLinear,
                                                 token_host_metadata)
from worker.paths.triton.forward import host_metadata
from worker.step_batch import RequestSpan

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
QUANTIZE = {None: lambda model: None, "int4": lambda model: quantize_linears(model, 4),
            "int8": lambda model: quantize_linears_int8(model, use_kernel=True)}


def engine(model, config, dtype, deterministic: bool, num_blocks: int, token_budget: int) -> LLM:
    options = WorkerOptions(kernel_backend="triton", deterministic=deterministic)
    runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, options=options)
    return LLM(EngineConfig(worker=replace(ENGINE_WORKER, block_size=BLOCK_SIZE),
                            scheduler=SchedulerOptions(max_num_batched_tokens=token_budget, max_num_seqs=16)),
               runner=runner, progress=False)


def three_ways(model, config, dtype, deterministic: bool):
    """(alone, batched, squeezed) as in test_batch_invariant: the squeezed engine's 10 pages and 10-token budget
    chunk the prefills and preempt requests, which then recompute prompt + generated tokens as a prefill."""
    batch = prompts(config.vocab_size, count=3, seed=2)
    llm = engine(model, config, dtype, deterministic, 256, 256)
    alone = [outputs(llm, [prompt], PARAMS)[0] for prompt in batch]
    batched = outputs(engine(model, config, dtype, deterministic, 256, 256), batch, PARAMS)
    squeezed_llm = engine(model, config, dtype, deterministic, 10, 10)
    squeezed = outputs(squeezed_llm, batch, PARAMS)
    assert squeezed_llm.engine.scheduler.num_preemptions > 0, "the small cache preempted someone"
    return alone, batched, squeezed


CASES = {  # flavour, dtype, linears' weights, the deterministic linear they run
    "llama-f32": ("llama_gqa", torch.float32, None, FixedTileLinear),
    "qwen3-qk-norms-bf16": ("qwen3", torch.bfloat16, None, FixedTileLinear),
    "llama-int4-bf16": ("llama", torch.bfloat16, "int4", FixedTileGroupQuantLinear),  # hidden 64: groups of 32
    "llama-int8-f32": ("llama_gqa", torch.float32, "int8", FixedTileInt8Linear),
}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    # one layer: every kernel of a layer still runs (the interpreter's cost is per layer: 2 layers took ~150 s of
    # the suite's CPU); what a second layer would add is the same kernels again
    one_layer = {"llama_gqa": {}, "llama": {}, "qwen3": {"layer_types": ["full_attention"]}}
    return {flavour: make_tiny_hf_model(tmp_path_factory.mktemp(flavour), flavour, num_hidden_layers=1, **more)[0]
            for flavour, more in one_layer.items()}


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_is_identical_alone_batched_and_recomputed(tiny_folders, case):
    flavour, dtype, weights, linear_kind = CASES[case]
    model, config = load_model(tiny_folders[flavour], dtype=dtype, progress=False)
    QUANTIZE[weights](model)
    alone, batched, squeezed = three_ways(model, config, dtype, True)
    assert type(model.layers[0].attn.wqkv) is linear_kind and type(model.lm_head) is linear_kind
    assert batched == alone, "tokens and logprobs (exact floats) of each request, batched vs alone"
    assert squeezed == alone, "chunked, preempted and recomputed vs alone"


def test_without_the_mode_batch_composition_changes_the_bits(tiny_folders):
    model, config = load_model(tiny_folders["llama_gqa"], dtype=torch.float32, progress=False)
    alone, batched, squeezed = three_ways(model, config, torch.float32, False)
    assert any(a[1] != b[1] for a, b in zip(alone, batched)) or any(a[1] != s[1] for a, s in zip(alone, squeezed))


def test_each_path_puts_the_other_modes_linears_right(tiny_folders):
    """One model, runners built one after another (as tests and the in-process engine do): each path's build
    undoes what the last one wrapped (the torch path's float32 linears not packed for oneDNN: a PackedLinear
    keeps no plain weight for the fixed-tile kernel, and the Triton path refuses it by name)."""
    model, config = load_model(tiny_folders["llama_gqa"], dtype=torch.float32, progress=False)

    def build(**options) -> type:
        ModelRunner(model, config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32,
                    options=WorkerOptions(deterministic=True, **options))
        return type(model.layers[0].mlp.w_down)

    assert build(kernel_backend="triton") is FixedTileLinear
    assert build(kernel_backend="torch", packed_linears=False) is RowTileLinear
    assert build(kernel_backend="triton") is FixedTileLinear
    ModelRunner(model, config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32,
                options=WorkerOptions(kernel_backend="triton"))
    assert type(model.layers[0].mlp.w_down) is torch.nn.Linear


def test_token_host_metadata_makes_every_query_token_a_decode_row():
    spans = [RequestSpan(0, 3, 7, [4, 5]), RequestSpan(3, 1, 9, [6, 7, 8])]
    tokens = token_host_metadata(spans, BLOCK_SIZE)
    assert tokens.decode_only and tokens.query_start_loc == [0, 1, 2, 3, 4]
    assert tokens.context_lens == [5, 6, 7, 9]
    assert tokens.block_tables == [[4, 5, 0], [4, 5, 0], [4, 5, 0], [6, 7, 8]]
    assert tokens.slot_mapping == host_metadata(spans, BLOCK_SIZE).slot_mapping  # the same K/V writes


def test_the_mode_runs_on_the_triton_backend_with_graphs_off_and_refuses_cublas():
    resolved = resolve_execution(WorkerOptions(deterministic=True, kernel_backend="triton"), "cpu")
    assert resolved.deterministic and resolved.kernel_backend == "triton"
    on_cuda = resolve_execution(WorkerOptions(deterministic=True), "cuda")  # auto: triton on CUDA
    assert on_cuda.kernel_backend == "triton" and not on_cuda.cuda_graphs
    assert resolve_execution(WorkerOptions(), "cuda").cuda_graphs
    with pytest.raises(ValueError, match="not on kernel backend torch: its linears are cuBLAS calls"):
        resolve_execution(WorkerOptions(deterministic=True, kernel_backend="torch"), "cuda")
