"""`tokenmill bench-stack` (issue 33 item 4): the near-free model, the per-run accounting, and the command end
to end on tiny sizes (a real cluster: redis-server, worker, scheduler, gateway). Not timed: no figure is
held to a speed, only to how it is computed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenmill.bench.stack import PROCESSES, redis_round_trip_sample, usage

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_near_free_model_is_one_layer_of_hidden_64_with_the_default_tokenizer(tmp_path):
    from gateway.text.tokenizer import load_tokenizer
    from tokenmill.bench.near_free_model import write_near_free_model

    folder = write_near_free_model(tmp_path / "near-free")
    config = json.loads((folder / "config.json").read_text())
    default = load_tokenizer(None)
    assert (config["num_hidden_layers"], config["hidden_size"]) == (1, 64)
    assert config["vocab_size"] == default.vocab_size and config["tie_word_embeddings"]
    ours = load_tokenizer(folder)
    assert ours.encode("Hello, world") == default.encode("Hello, world")
    assert (ours.bos_token_id, ours.eos_token_id) == (default.bos_token_id, default.eos_token_id)


def snapshot(cpu: dict, step_sum: float, step_count: float, scheduler: dict) -> dict:
    return {"cpu_s": cpu, "scheduler": scheduler,
            "worker": {"tokenmill:worker_step_seconds_sum": step_sum, "tokenmill:worker_step_seconds_count": step_count}}


def test_usage_is_cpu_per_token_the_worker_idle_share_and_round_trips_per_step():
    before = snapshot({"gateway": 1.0, "worker": 5.0, "client": 2.0}, 10.0, 100,
                      {"tokenmill:redis_round_trips_total": 40, "tokenmill:scheduler_steps_total": 20})
    after = snapshot({"gateway": 1.5, "worker": 6.5, "client": 2.25, "redis": 9.0}, 11.5, 150,
                     {"tokenmill:redis_round_trips_total": 140, "tokenmill:scheduler_steps_total": 70})
    result = usage(before, after, elapsed_s=2.0, output_tokens=1000)
    assert result["cpu_us_per_token"] == {"gateway": 500.0, "worker": 1500.0, "client": 250.0}  # redis: no "before"
    assert result["cores"] == {"gateway": 0.25, "worker": 0.75, "client": 0.125}
    assert result["worker_steps"] == 50 and result["worker_idle_share"] == 0.25  # 1.5 s busy of 2 s
    assert result["redis_round_trips_per_step"] == 2.0  # 100 round trips over 50 scheduler steps
    no_counter = usage(snapshot({}, 0, 0, {}), snapshot({}, 1.0, 10, {}), elapsed_s=4.0, output_tokens=10)
    assert no_counter["redis_round_trips_per_step"] is None and no_counter["worker_idle_share"] == 0.75


def test_round_trip_counter_is_found_by_its_name():
    assert redis_round_trip_sample({"tokenmill:redis_round_trips_total": 3, "tokenmill:redis_round_trips_created": 1}) \
        == "tokenmill:redis_round_trips_total"
    assert redis_round_trip_sample({"tokenmill:scheduler_steps_total": 3}) is None


def test_bench_stack_runs_end_to_end_and_the_ratio_is_the_two_runs(tmp_path):
    """The command in its own process on tiny sizes: c=4, 8 output tokens; the Markdown table's columns,
    one row per level, and the ratio is cluster tok/s over in-process tok/s of the same level."""
    out = tmp_path / "stack.json"
    argv = ["bench-stack", "--concurrency", "4", "--output-len", "8", "--prompt-len", "16", "--kv-cache-mb", "16",
            "--json", str(out)]
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["c", "in-process tok/s", "cluster tok/s", "cluster / in-process", "worker idle",
                      *(f"{name} µs/tok (cores)" for name in PROCESSES), "Redis RT/step"]
    (row,) = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    (level,) = json.loads(out.read_text())["levels"]
    assert level["concurrency"] == 4 and level["output_tokens"] == 32
    assert level["in_process"]["elapsed_s"] > 0 and level["cluster"]["elapsed_s"] > 0
    assert level["in_process_tok_s"] == 32 / level["in_process"]["elapsed_s"]
    assert level["cluster_tok_s"] == 32 / level["cluster"]["elapsed_s"]
    assert level["ratio"] == level["cluster_tok_s"] / level["in_process_tok_s"]
    assert row[0] == "4" and row[3] == f"{level['ratio']:.2f}"
    cluster = level["cluster"]
    assert cluster["worker_steps"] >= 8 and 0 <= cluster["worker_idle_share"] < 1
    assert set(cluster["cpu_us_per_token"]) == set(PROCESSES)  # every process's pid was read
    assert level["identical_greedy_outputs"] == 1.0  # float32 both sides: the same greedy tokens


def test_the_report_says_whether_the_in_process_heap_is_the_workers(monkeypatch):
    from tokenmill.bench.stack import in_process_heap

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert in_process_heap() == "as the worker's (glibc thread cache off)"
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert "GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in in_process_heap()  # how to get the worker's
