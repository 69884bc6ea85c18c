"""INT8 weight-only quantization of a whole model: every linear replaced, embeddings and norms kept, and
the logits stay close to float32 (the torch path, which is what --quantization int8 runs on CPU)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from tests.gpu.random_model import random_llama, tiny_config
from tokenmill.bench.int8_agreement import window_logits
from worker.linears.int8 import Int8Linear, quantize_linears_int8


def test_int8_model_stays_close_to_float32():
    config = tiny_config(num_layers=2)
    model = random_llama(config, torch.float32, "cpu", seed=5, std=0.2)
    quantized = copy.deepcopy(model)
    assert quantize_linears_int8(quantized, use_kernel=False) == config.num_layers * 4 + 1  # 4 per layer + lm_head
    assert not any(isinstance(module, nn.Linear) for module in quantized.modules())
    layer = quantized.layers[0].attn.wqkv
    assert isinstance(layer, Int8Linear) and layer.weight_q.dtype == torch.int8 and layer.scales.shape == (layer.out_features,)
    assert torch.equal(quantized.embed_tokens.weight, model.embed_tokens.weight)

    token_ids = [int(t) for t in torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))]
    expected = window_logits(model, config, token_ids, torch.float32, torch.device("cpu"))  # [40, vocab]
    actual = window_logits(quantized, config, token_ids, torch.float32, torch.device("cpu"))
    # per-channel int8 keeps ~1% relative error per weight; through 2 layers the logits move by a few percent
    relative = (actual - expected).norm() / expected.norm()
    assert 0 < relative < 0.05, relative
    # a random model's top two logits are often near-ties (35/40 agreed when written); a broken scale flips most
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_build_runner_quantizes_at_load(tmp_path):
    from core.step import NewRequestData, StepPlan
    from core.sampling import SamplingParams
    from tests.helpers.tiny_models import make_tiny_hf_model
    from worker.options import WorkerOptions
    from worker.build import build_runner

    from worker.linears.group_quant import GroupQuantLinear

    folder, _ = make_tiny_hf_model(tmp_path, "qwen2")  # q/k/v bias: the quantized linear keeps it
    for bits in (8, 4):  # on CPU both are group-wise (the per-channel Int8Linear is CUDA's Triton format)
        runner = build_runner(WorkerOptions(model=str(folder), dtype="float32", block_size=4, num_blocks=8, device="cpu",
                                            quantization=f"int{bits}"), progress=False)
        wqkv = runner.model.layers[0].attn.wqkv
        assert isinstance(wqkv, GroupQuantLinear) and wqkv.bits == bits and wqkv.bias is not None
        assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.modules())
        plan = StepPlan(1, [NewRequestData("r", [1, 2, 3], 3, SamplingParams(temperature=0.0), [1], 0)], num_scheduled_tokens={"r": 3})
        assert set(runner.execute(plan).sampled_token_ids) == {"r"}


def test_model_info_names_the_quantization(tmp_path):
    from tests.helpers.tiny_models import make_tiny_hf_model
    from worker.main import build_worker, parse_args

    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    common = ["--model", str(folder), "--device", "cpu", "--num-blocks", "8", "--block-size", "4"]
    _, quantized = build_worker(parse_args([*common, "--quantization", "int4"]))
    _, plain = build_worker(parse_args(common))
    assert quantized.model_config.quantization == "int4 (quantized at load)"
    assert plain.model_config.quantization == ""  # a folder's weights in --dtype: the proto's "none"
    assert plain.model_config.dtype in ("float32", "bfloat16")  # --dtype auto, as resolved
