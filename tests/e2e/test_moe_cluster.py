"""Tiny mixtures of experts (Qwen3-MoE: renormalised top-2 of 8 experts, one dense layer; gpt-oss: attention sinks,
a sliding window of 8 on every other layer, top-2 of 4 biased experts) each served by a whole cluster started as `tokenmill serve` starts one (its flags through cli.serve_security_options, then ClusterConfig +
Supervisor), every execution flag at its default but --dtype float32 (auto is bfloat16 on CPUs with native
bfloat16, and greedy identity with transformers' float32 needs float32): greedy tokens through gateway,
scheduler and worker equal transformers `generate`, for concurrent requests that share steps."""
from __future__ import annotations

import pytest

from tests.helpers.cluster_greedy import cluster_greedy, transformers_greedy
from tests.helpers.tiny_models import GPT_OSS, make_tiny_hf_model
from tokenmill import cli
from tokenmill.cluster.config import ClusterConfig, resolve_ports
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow
PROMPTS = ("Mixture of experts", "tokens grouped by expert", "zz")
NEW_TOKENS = 24
PORTS = ("gateway", "scheduler", "worker", "redis", "http")


@pytest.fixture(scope="module", params=["qwen3_moe", GPT_OSS])
def moe_cluster(request, tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("moe"), request.param)
    args = cli.build_parser().parse_args(["serve", "--model", str(folder), "--dtype", "float32", "--kv-cache-mb", "4",
                                          "--no-metrics", *(f"--{name}-port=0" for name in PORTS)])
    config = resolve_ports(ClusterConfig.from_args(args, **cli.serve_security_options(args)))  # as `serve` does
    assert (config.worker.kernel_backend, config.worker.cpu_fused_ops, config.worker.quantization) == ("auto", True, "auto")
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config, hf_model


def test_greedy_through_the_cluster_equals_transformers(moe_cluster):
    config, hf_model = moe_cluster
    prompt_ids, outputs = cluster_greedy(config.gateway_address, PROMPTS, NEW_TOKENS)
    for prompt, ids, tokens in zip(PROMPTS, prompt_ids, outputs):
        assert tokens == transformers_greedy(hf_model, ids, NEW_TOKENS), prompt
