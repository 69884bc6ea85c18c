"""tokenmill bench: the metrics math, the report writers, and one real run against a started cluster."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.report import (first_trouble, format_table, percentile, summarize, write_json,
                                    write_markdown, write_plots)
from tokenmill.bench.targets import RequestRecord, _arrived


def test_percentile_matches_numpy_linear_interpolation():
    rng = random.Random(1)
    for size in (1, 2, 7, 100):
        values = [rng.random() for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_a_delta_with_several_tokens_splits_its_gap_and_the_first_token_is_ttft():
    record = RequestRecord(sent=10.0)
    last = _arrived(record, 10.5, None, 2)  # first delta: 2 tokens
    last = _arrived(record, 10.9, last, 1)
    _arrived(record, 11.5, last, 3)
    assert record.ttft == pytest.approx(0.5)
    assert record.itls == pytest.approx([0.0, 0.4, 0.2, 0.2, 0.2])  # one gap per token after the first


def test_summary_counts_only_successful_requests_in_throughput_and_latency():
    records = [RequestRecord(0.0, ttft=0.1 * i, e2e=1.0 * i, itls=[0.01 * i], output_tokens=10) for i in range(1, 5)]
    records.append(RequestRecord(0.0, e2e=0.2, error="RESOURCE_EXHAUSTED: queue full"))
    summary = summarize(records, elapsed_s=2.0)
    assert (summary["num_requests"], summary["num_errors"], summary["error_rate"]) == (5, 1, 0.2)
    assert summary["qps"] == 2.0 and summary["output_tokens_per_s"] == 20.0
    assert summary["ttft_p50_s"] == pytest.approx(0.25) and summary["e2e_p99_s"] == pytest.approx(3.97)
    assert summary["itl_p90_s"] == pytest.approx(float(np.percentile([0.01, 0.02, 0.03, 0.04], 90)))
    assert summary["errors"] == ["RESOURCE_EXHAUSTED: queue full"]


def fabricated_result() -> dict:
    def level(concurrency: int, preemptions: int | None, errors: int = 0) -> dict:
        records = [RequestRecord(0.0, ttft=0.05 * concurrency, e2e=0.5 * concurrency + 0.01 * i,
                                 itls=[0.02] * 7, output_tokens=8) for i in range(8 - errors)]
        records += [RequestRecord(0.0, e2e=0.1, error="boom")] * errors
        extra = {} if preemptions is None else {"kv_utilization_mean": 0.5, "preemptions": preemptions}
        return {"concurrency": concurrency, **summarize(records, 2.0), **extra}

    warmup = summarize([RequestRecord(0.0, ttft=0.3, e2e=0.9, output_tokens=4)], 0.9)
    return {"title": "fabricated", "command": "tokenmill bench --x", "notes": ["CPU figures"], "runs": {
        "tokenmill paged": {"target": "tokenmill", "warmup": warmup, "levels": [level(1, 0), level(4, 0), level(8, 3)]},
        "tokenmill static": {"target": "tokenmill", "warmup": warmup, "levels": [level(1, 0), level(4, 0, errors=2), level(8, 0)]},
        "transformers static batches": {"target": "transformers", "warmup": warmup,
                                        "levels": [level(1, None), level(4, None), level(8, None)]}}}


def test_first_trouble_is_the_lowest_concurrency_that_preempted_or_failed():
    runs = fabricated_result()["runs"]
    assert first_trouble(runs["tokenmill paged"]["levels"]) == "concurrency 8"
    assert first_trouble(runs["tokenmill static"]["levels"]) == "concurrency 4"
    assert first_trouble(runs["transformers static batches"]["levels"]) is None


def test_report_writers_produce_valid_json_markdown_and_png(tmp_path):
    result = fabricated_result()
    write_json(result, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["runs"]["tokenmill paged"]["levels"][2]["preemptions"] == 3

    plots = write_plots(result, tmp_path / "plots")
    assert [p.name for p in plots] == ["bench_throughput.png", "bench_latency.png", "bench_cdf.png"]
    import matplotlib.image

    for path in plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = matplotlib.image.imread(path).shape[:2]
        assert height > 100 and width > 100

    write_markdown(result, tmp_path / "r.md", [p.name for p in plots])
    lines = (tmp_path / "r.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 9  # header, separator, 3 runs x 3 levels
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| tokenmill static | 4 | 3.00 | 24.0 |" in "\n".join(table)  # 6 ok of 8 over 2 s; 2 failed
    assert "![bench_cdf](bench_cdf.png)" in lines and "tokenmill bench --x" in lines
    text = format_table(result)
    assert "first preemption or error at concurrency 8" in text and "CPU figures" in text


# -- one real run ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_against_a_started_cluster_reports_sane_numbers(tmp_path):
    from tokenmill.bench.cli import main
    from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    config = resolve_ports(with_settings(ClusterConfig(), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
                                         http_port=0, kv_cache_mb=64, max_num_batched_tokens=256))
    # outputs long enough that a level outlasts a few of the 0.2 s GetLoad polls (at 4-8 tokens a level took
    # ~0.1 s on a faster CPU and no poll saw the cache in use)
    workload = ["--num-requests", "4", "--prompt-len", "8", "--min-output", "24", "--max-output", "32", "--no-plots"]
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        assert main(["--address", config.gateway_address, "--scheduler-address", config.scheduler_address,
                     "--concurrency", "1,2", "--warmup", "1", "--out", str(tmp_path), *workload]) == 0
        # the same client over the OpenAI-compatible HTTP API (SSE), sync mode only
        assert main(["--openai-url", f"http://{config.http_address}/v1", "--concurrency", "1", "--warmup", "0",
                     "--out", str(tmp_path / "http"), *workload]) == 0
    http = json.loads((tmp_path / "http" / "bench.json").read_text())["runs"]["openai-http"]
    # every SSE stream of the gateway ends with a finish_reason (the client counts a stream without one as failed)
    assert [(level["num_requests"], level["num_errors"]) for level in http["levels"]] == [(4, 0)]
    result = json.loads((tmp_path / "bench.json").read_text())
    run = result["runs"]["tokenmill"]
    assert run["warmup"]["num_requests"] == 1 and run["warmup"]["num_errors"] == 0
    assert [level["concurrency"] for level in run["levels"]] == [1, 2]
    from gateway.text.tokenizer import load_tokenizer
    from tokenmill.bench.workload import build_workload

    expected_tokens = build_workload(load_tokenizer(None), 4, 8, 24, 32).num_output_tokens
    for level in run["levels"]:
        assert (level["num_requests"], level["num_errors"]) == (4, 0)
        assert level["output_tokens"] == expected_tokens  # EOS ignored: every request ran to its length
        assert level["output_tokens_per_s"] == pytest.approx(expected_tokens / level["elapsed_s"])
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] <= level["e2e_p99_s"] < level["elapsed_s"]
        assert 0 < level["itl_p50_s"] < level["e2e_p50_s"]
        assert 0 < level["kv_utilization_mean"] <= 1 and level["preemptions"] == 0
        # no latency target: every step had the fixed budget, and no step was judged against a target
        assert level["token_budget_p50"] == 256 and level["itl_target_misses"] == 0
    assert "| tokenmill | 2 |" in (tmp_path / "bench.md").read_text()
    http = json.loads((tmp_path / "http" / "bench.json").read_text())["runs"]["openai-http"]["levels"][0]
    assert (http["num_errors"], http["output_tokens"]) == (0, expected_tokens)
    assert 0 < http["ttft_p50_s"] < http["e2e_p50_s"] and 0 < http["itl_p50_s"]


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc), children of children included."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_mid_run_stops_the_cluster_bench_started(tmp_path):
    """`kill` of a running `tokenmill bench` (a CI job's timeout, a shell script's trap) stops the gateway,
    scheduler, worker and Redis it started; Python's default SIGTERM left them running."""
    log = tmp_path / "bench.log"
    with open(log, "w") as stderr:
        bench = subprocess.Popen([sys.executable, "-m", "tokenmill.bench.cli", "--concurrency", "1",
                                  "--num-requests", "1000", "--prompt-len", "8", "--min-output", "4", "--max-output",
                                  "8", "--warmup", "0", "--num-blocks", "256", "--no-plots", "--out", str(tmp_path)],
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    cluster: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while "c=1" not in log.read_text():  # the timed loop has begun: the cluster serves
            assert bench.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        cluster = _descendants(bench.pid)
        assert len(cluster) >= 4, cluster  # redis, scheduler, worker, gateway
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 130
        assert "the clusters it started are stopped" in log.read_text()
        assert not [pid for pid in cluster if _running(pid)]
    finally:  # whatever a failure left behind (the bug this tests re-parents them away from bench)
        for pid in (cluster | _descendants(bench.pid)):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        bench.kill()
        bench.wait()


def test_the_rewrite_workload_asks_for_a_passage_of_exactly_its_length_and_outputs_that_long():
    """--workload rewrite (issue 35's input-grounded case): chat prompts as text that tokenize back to the chat's
    ids, each holding a passage of exactly --prompt-len tokens, distinct per prompt; every output that long."""
    from gateway.prepare.chat_encoding import encode_chat
    from gateway.text.tokenizer import load_tokenizer
    from tokenmill.bench.workload import REWRITE_INSTRUCTION, build_workload

    tokenizer = load_tokenizer(None)
    workload = build_workload(tokenizer, 3, 120, 1, 1, seed=5, num_prompts=4, rewrite=True)
    assert workload.output_lens == [120] * 3 and len(set(workload.prompts)) == 4
    for prompt, ids in zip(workload.prompts, workload.prompt_ids):
        passage = prompt.split(REWRITE_INSTRUCTION, 1)[1].split("<|im_end|>", 1)[0]
        assert len(tokenizer.encode(passage, add_special_tokens=False)) == 120
        assert ids == encode_chat(tokenizer, [{"role": "user", "content": REWRITE_INSTRUCTION + passage}])
