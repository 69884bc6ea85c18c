"""tests/gpu/served_cluster.py's steps on the CPU (its --cpu-dry-run: a tiny model, c = 1, 4, 8), so the
device script's served-cluster phase cannot rot where there is no GPU: the random model folder, the cluster
in no-Redis mode (what the device runs without a redis-server), `tokenmill bench --address` per level and
the ModelRunner-only figures beside them. On the device its own phase runs the real thing instead."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device runs tests.gpu.served_cluster itself (run.sh)")
def test_served_cluster_dry_run_serves_every_level_without_redis(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tests.gpu.served_cluster", "--cpu-dry-run", "--no-redis",
                           "--output-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    result = json.loads((tmp_path / "served_cluster.json").read_text())
    assert result["redis"] is False and (result["device"], result["dtype"]) == ("cpu", "float32")
    assert [level["concurrency"] for level in result["levels"]] == [1, 4, 8]
    for level in result["levels"]:
        assert level["num_errors"] == 0 and level["output_tokens"] == level["num_requests"] * 8
        assert level["output_tokens_per_s"] > 0 and level["itl_p50_s"] > 0 and level["ttft_p50_s"] > 0
    assert result["runner_only"]["1"]["sync"] > 0 and result["runner_only"]["1"]["async"] > 0
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| c | served tok/s | TTFT P50 ms") and len(rows) == 2 + 3
    assert "no-Redis mode" in done.stdout
