"""A Q4_K_M file (make_shapes.py's Llama-3.2-1B and Qwen2.5-1.5B shapes, 1 layer, 2048-token vocabulary) on
its own blocks (worker.linears.ggml_blocks) against the same file converted (worker.linears.group_quant, float
activations): the fused q/k/v of Q4_K and Q6_K parts, llama's un-permuted q/k rows, the tied Q6_K embedding
and lm_head, the blocks mapped from the file rather than copied, and the logits equal up to the
activations' int8 rounding."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from worker.linears.ggml_blocks import BLOCK_TYPES, GGMLBlocksEmbedding, GGMLBlocksLinear
from worker.linears.group_quant import GroupQuantLinear, weight_formats
from worker.loader import load_model
from worker.model.attention import build_attention_metadata
from worker.model.kv_cache import allocate_kv_cache
from worker.native_ops import cpu_ops_available
from worker.step_batch import RequestSpan
from tests.helpers.make_shapes_script import load_make_shapes
from tests.helpers.mapped_files import mapped_file

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops are not built")


@pytest.fixture(scope="module", params=["llama3.2-1b", "qwen2.5-1.5b"])
def shape_file(request, tmp_path_factory) -> Path:
    module = load_make_shapes()
    model = module.shaped(request.param, 1, 2048)
    path, _ = module.make(model, tmp_path_factory.mktemp("shape"), hf=False, log=lambda line: None)
    return path


def prefill_logits(model, config, tokens: list[int]) -> torch.Tensor:
    blocks = len(tokens) // 16 + 1
    kv_cache = allocate_kv_cache(config, blocks + 1, 16, torch.float32)
    metadata = build_attention_metadata([RequestSpan(0, len(tokens), len(tokens), list(range(blocks, 0, -1)))], 16)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), kv_cache, metadata)
        return model.compute_logits(hidden).float()


def test_blocks_run_the_file_as_stored_and_match_the_conversion(shape_file):
    blocks_model, config = load_model(shape_file, dtype=torch.float32, progress=False, keep_quantized=True,
                                      block_types=BLOCK_TYPES)
    converted, _ = load_model(shape_file, dtype=torch.float32, progress=False, keep_quantized=True)
    layer = blocks_model.layers[0]
    assert isinstance(layer.attn.wqkv, GGMLBlocksLinear) and isinstance(layer.mlp.w_down, GGMLBlocksLinear)
    assert {part.type_name for part in layer.attn.wqkv.weight_blocks.parts} == {"Q4_K", "Q6_K"}
    assert isinstance(blocks_model.embed_tokens, GGMLBlocksEmbedding) and isinstance(blocks_model.lm_head, GGMLBlocksLinear)
    assert blocks_model.lm_head.weight_blocks is blocks_model.embed_tokens.weight_blocks  # tied: one set of blocks
    assert isinstance(converted.layers[0].attn.wqkv, GroupQuantLinear)
    assert weight_formats(blocks_model) == "Q4_K, Q6_K"  # what /v1/models and KServe metadata name
    # the gate/up blocks are the file's pages (q/k are re-ordered copies for llama, so not those)
    address = layer.mlp.w_gate_up.weight_blocks.parts[0].blocks.data_ptr()
    assert mapped_file(address) == str(shape_file.resolve())

    tokens = [5, 77, 1000, 3, 42, 2047, 9, 300]
    got = prefill_logits(blocks_model, config, tokens)
    want = prefill_logits(converted, config, tokens)
    assert torch.isfinite(got).all()
    error = (got - want).abs().max() / want.abs().max()
    assert error < 0.05, error  # activations rounded to int8 per 256 values; the weights are the same
    # and the same weights: rows summed in another order are off by float rounding only, far below that
    assert np.corrcoef(got.flatten().numpy(), want.flatten().numpy())[0, 1] > 0.999


def test_the_kv_sizing_sees_the_mapped_weights(shape_file):
    """Mapped weights sit in the page cache, which MemAvailable counts as free: the KV cache's sizing takes
    their bytes (every quantized tensor of the file, the tied embedding once) off what it may claim."""
    from gguf import GGUFReader

    from worker.linears.ggml_blocks import mapped_weight_bytes

    model, _ = load_model(shape_file, dtype=torch.float32, progress=False, keep_quantized=True, block_types=BLOCK_TYPES)
    quantized = [t for t in GGUFReader(str(shape_file)).tensors if t.tensor_type.name in ("Q4_K", "Q6_K")]
    assert mapped_weight_bytes(model) == sum(int(t.n_bytes) for t in quantized)
    converted, _ = load_model(shape_file, dtype=torch.float32, progress=False, keep_quantized=True)
    assert mapped_weight_bytes(converted) == 0
    from worker.build import build_sized_runner
    from worker.options import WorkerOptions

    free = 2**30
    runner, sizing = build_sized_runner(WorkerOptions(model=str(shape_file), kv_cache_memory_fraction=0.5),
                                        progress=False, free_bytes=free)
    assert isinstance(runner.model.layers[0].mlp.w_down, GGMLBlocksLinear)  # the worker's default on CPU
    assert f"({(free - mapped_weight_bytes(runner.model)) / 2**20:.0f} MiB free on cpu" in sizing.reason, sizing.reason


def resident_bytes(path: str) -> int:
    """Bytes of path's mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(path)
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_fault_in_makes_the_file_resident_before_anything_is_measured(shape_file):
    """build_sized_runner calls fault_in before its profile pass, whose peak (VmHWM) would otherwise count the
    pages the pass faults in as activations (4.1 GiB of them on the Llama-3.1-8B shape)."""
    from worker.linears.ggml_blocks import fault_in, mapped_weight_bytes

    model, _ = load_model(shape_file, dtype=torch.float32, progress=False, keep_quantized=True, block_types=BLOCK_TYPES)
    mapped, path = mapped_weight_bytes(model), str(shape_file.resolve())
    assert resident_bytes(path) < 0.5 * mapped  # a fresh mapping: nothing read through it yet
    assert fault_in(model) == mapped
    assert resident_bytes(path) >= 0.95 * mapped


def test_a_truncated_file_is_a_load_error_not_a_kernel_crash(shape_file, tmp_path):
    from worker.loader.errors import ModelLoadError

    cut = tmp_path / "cut.gguf"
    data = shape_file.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF file"):
        load_model(cut, dtype=torch.float32, progress=False, keep_quantized=True, block_types=BLOCK_TYPES)


def small_random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a 32-value type whose f16 d (and Q4_1 / Q5_1's m) is 0.01: every other byte any code."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    per, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    scales = 4 if type_name in ("Q4_1", "Q5_1") else 2
    raw[..., :scales] = np.full((rows, cols // per, scales // 2), 0.01, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_a_block_part_group_quant_cannot_hold_beside_a_converted_one_makes_the_fusion_float():
    """auto keeps IQ4_NL on blocks but converts Q5_1, and group_quant has no layout for IQ4_NL: q/k in
    IQ4_NL beside a Q5_1 v (llama.cpp's choice for rows that are not a multiple of 256) fuse as the exact
    floats, as they did before IQ4_NL had a kernel (the build casts them to --dtype)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from worker.linears.ggml_blocks import GGMLBlocksWeight
    from worker.loader.gguf_quants import group_quant_from_blocks
    from worker.loader.weights import cat_rows

    cols = 96
    qk, v = small_random_blocks("IQ4_NL", 8, cols, 0), small_random_blocks("Q5_1", 4, cols, 1)
    fused = cat_rows([GGMLBlocksWeight.from_blocks("IQ4_NL", qk, 8, cols), group_quant_from_blocks("Q5_1", v, 4, cols)])
    expected = np.concatenate([dequantize(qk, GGMLQuantizationType.IQ4_NL).reshape(8, cols),
                               dequantize(v, GGMLQuantizationType.Q5_1).reshape(4, cols)])
    assert isinstance(fused, torch.Tensor) and fused.dtype == torch.float32
    assert np.array_equal(fused.numpy(), expected)
    # a Q4_0 block part still converts beside it: one group_quant weight, as before
    q40 = small_random_blocks("Q4_0", 8, cols, 2)
    mixed = cat_rows([GGMLBlocksWeight.from_blocks("Q4_0", q40, 8, cols), group_quant_from_blocks("Q5_1", v, 4, cols)])
    assert not isinstance(mixed, torch.Tensor) and mixed.out_features == 12


def test_the_loader_routes_each_type_by_the_mode():
    """ggml_blocks_from_gguf: a tensor in a type the mode names, with a kernel at its row length, is the file's
    blocks; the rest get None, for the caller to convert (group_quant) or dequantize at load."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    from worker.linears.ggml_blocks import block_types
    from worker.loader.gguf_quants import ggml_blocks_from_gguf, group_quant_from_gguf

    def tensor(type_name: str, cols: int, rows: int = 2):
        per, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        return SimpleNamespace(tensor_type=GGMLQuantizationType[type_name], shape=np.array([cols, rows]),
                               data=np.zeros((rows, cols // per * nbytes), np.uint8))

    auto, every = block_types("auto"), block_types("all")
    for type_name in ("Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL"):
        assert ggml_blocks_from_gguf(tensor(type_name, 512), auto).parts[0].type_name == type_name
        assert group_quant_from_gguf(tensor(type_name, 512)) is None  # no conversion: blocks, or floats
    assert ggml_blocks_from_gguf(tensor("Q3_K", 256 + 256, 3), auto).rows(torch.tensor([2, 0])).out_features == 2
    for type_name in ("Q4_1", "Q5_1"):
        assert ggml_blocks_from_gguf(tensor(type_name, 96), auto) is None
        assert group_quant_from_gguf(tensor(type_name, 96)) is not None  # converted under auto, as before
        assert ggml_blocks_from_gguf(tensor(type_name, 96), every).parts[0].type_name == type_name
    assert ggml_blocks_from_gguf(tensor("IQ2_XXS", 512), every) is None  # no kernel: dequantized at load


# A file of the types auto now runs on blocks beside the K-quants, in a mix no llama.cpp preset writes but
# that every fusion path meets: q/k/v in three types, gate/up in two, a tied Q3_K embedding.
LOW_BIT_TYPES = {"attn_q": "Q3_K", "attn_k": "IQ4_XS", "attn_v": "Q2_K", "attn_output": "IQ4_XS", "ffn_gate": "Q2_K",
                 "ffn_up": "Q3_K", "ffn_down": "IQ4_XS", "token_embd": "Q3_K", "output": "Q2_K"}
# where each type's f16 scales sit, and their size relative to make_shapes' Q4_K d (weights of a similar spread)
LOW_BIT_SCALES = {"IQ4_XS": ((0, 0.1),), "Q2_K": ((80, 2.0), (82, 3.0)), "Q3_K": ((108, 0.5),)}


def test_a_q2_k_q3_k_iq4_xs_file_runs_on_its_blocks_and_matches_its_dequantized_floats(tmp_path, monkeypatch):
    """Before their kernels these types were dequantized to --dtype at load; now auto maps them: the fused
    q/k/v of three types, llama's un-permuted q/k rows, the tied embedding's lookups and lm_head, all on the
    file's blocks, against the same file dequantized (block_types empty), up to the int8 rounding of x."""
    from gguf import GGMLQuantizationType

    from worker.linears.ggml_blocks import block_types

    module = load_make_shapes()
    make_blocks = module.random_blocks

    def random_blocks(rng, qtype, rows, cols):
        if qtype.name not in LOW_BIT_SCALES:
            return make_blocks(rng, qtype, rows, cols)
        per, nbytes = module.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * cols // per, nbytes), dtype=np.uint8)
        for offset, multiple in LOW_BIT_SCALES[qtype.name]:
            blocks[:, offset:offset + 2] = module._f16_scales(rng, len(blocks), multiple)
        return blocks.reshape(rows, -1)

    def tensor_type(name, shape, layer, num_layers, tied):
        return GGMLQuantizationType[LOW_BIT_TYPES[name.split(".")[-2]]] if len(shape) == 2 else GGMLQuantizationType.F32

    monkeypatch.setattr(module, "random_blocks", random_blocks)
    monkeypatch.setattr(module, "q4_k_m_type", tensor_type)
    path, _ = module.make(module.shaped("llama3.2-1b", 1, 2048), tmp_path, hf=False, log=lambda line: None)
    blocks_model, config = load_model(path, dtype=torch.float32, progress=False, keep_quantized=True,
                                      block_types=block_types("auto"))
    floats, _ = load_model(path, dtype=torch.float32, progress=False, keep_quantized=True)
    layer = blocks_model.layers[0]
    assert [part.type_name for part in layer.attn.wqkv.weight_blocks.parts] == ["Q3_K", "IQ4_XS", "Q2_K"]
    assert [part.type_name for part in layer.mlp.w_gate_up.weight_blocks.parts] == ["Q2_K", "Q3_K"]
    assert isinstance(blocks_model.embed_tokens, GGMLBlocksEmbedding) and isinstance(blocks_model.lm_head, GGMLBlocksLinear)
    assert isinstance(floats.layers[0].attn.wqkv, torch.nn.Linear)  # no kernel there: the dequantized floats

    tokens = [5, 77, 1000, 3, 42, 2047, 9, 300]
    got = prefill_logits(blocks_model, config, tokens)
    want = prefill_logits(floats, config, tokens)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() / want.abs().max() < 0.05  # x's int8 rounding; the weights are the same
    assert np.corrcoef(got.flatten().numpy(), want.flatten().numpy())[0, 1] > 0.999
