"""A tiny mixture of experts (Qwen3-MoE: renormalised top-2 of 8 experts, one dense layer) served by a whole
cluster started as `tokenmill serve` starts one (its flags through cli.serve_security_options, then ClusterConfig +
Supervisor), every execution flag at its default but --dtype float32 (auto is bfloat16 on CPUs with native
bfloat16, and greedy identity with transformers' float32 needs float32): greedy tokens through gateway,
scheduler and worker equal transformers `generate`, for concurrent requests that share steps."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill import cli
from tokenmill.client import Client
from tokenmill.cluster.config import ClusterConfig, resolve_ports
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow
PROMPTS = ("Mixture of experts", "tokens grouped by expert", "zz")
NEW_TOKENS = 24
PORTS = ("gateway", "scheduler", "worker", "redis", "http")


@pytest.fixture(scope="module")
def moe_cluster(tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    args = cli.build_parser().parse_args(["serve", "--model", str(folder), "--dtype", "float32", "--kv-cache-mb", "4",
                                          "--no-metrics", *(f"--{name}-port=0" for name in PORTS)])
    config = resolve_ports(ClusterConfig.from_args(args, **cli.serve_security_options(args)))  # as `serve` does
    assert (config.worker.kernel_backend, config.worker.cpu_fused_ops, config.worker.quantization) == ("auto", True, "auto")
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config, hf_model


def test_greedy_through_the_cluster_equals_transformers(moe_cluster):
    config, hf_model = moe_cluster
    with Client(config.gateway_address, timeout=120) as client:
        prompt_ids = [client.tokenize(prompt) for prompt in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: their decode steps share batches
            results = list(pool.map(lambda p: client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                              ignore_eos=True), PROMPTS))
    for prompt, ids, result in zip(PROMPTS, prompt_ids, results):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert list(result.token_ids) == expected, prompt
