"""The ITL acceptance verdict of `tokenmill bench --budgets ... --target-itl-ms ...`, on fabricated runs."""
from __future__ import annotations

from tokenmill.bench.itl_verdict import format_verdicts, itl_verdicts


def run(budget: int, levels: dict[int, tuple[float, float]], target_itl_ms: float | None = None) -> dict:
    """levels: concurrency -> (ITL P99 ms, output tok/s)."""
    return {"settings": {"kv_policy": "paged", "max_num_batched_tokens": budget, "target_itl_ms": target_itl_ms,
                         "swap_space_gb": None},
            "levels": [{"concurrency": c, "itl_p99_s": itl / 1e3, "output_tokens_per_s": tok_s}
                       for c, (itl, tok_s) in levels.items()]}


def test_each_level_is_judged_against_the_default_and_the_best_fixed_budget_meeting_the_target():
    result = {"runs": {
        "tokenmill paged": run(512, {1: (90, 12.0), 8: (400, 40.0), 32: (900, 60.0)}),
        "tokenmill paged budget=32": run(32, {1: (95, 11.5), 8: (180, 30.0), 32: (250, 50.0)}),
        "tokenmill paged budget=128": run(128, {1: (92, 12.0), 8: (260, 38.0), 32: (500, 58.0)}),
        "tokenmill paged itl<=200ms": run(512, {1: (91, 11.9), 8: (190, 28.0), 32: (260, 49.0)}, target_itl_ms=200),
        "tokenmill paged swap 1GB": {**run(512, {8: (100, 99.0)}), "settings": {
            "kv_policy": "paged", "max_num_batched_tokens": 512, "target_itl_ms": None, "swap_space_gb": 1.0}},
    }}
    verdicts = {v["concurrency"]: v for v in itl_verdicts(result, 200.0, default_budget=512)}

    # c=1: the default meets 200 ms, so only throughput counts: 11.9 / 12.0 of the best (default or 128)
    assert not verdicts[1]["default_misses"] and verdicts[1]["passed"]
    # c=8: the default misses; the target meets it with 28 / 30 tok/s of budget 32, the only fixed that meets it
    assert verdicts[8]["default_misses"] and verdicts[8]["target_meets"]
    assert verdicts[8]["best_fixed"]["budget"] == 32 and abs(verdicts[8]["throughput_ratio"] - 28 / 30) < 1e-9
    assert verdicts[8]["best_fixed_any"]["budget"] == 512  # the swap run is not a fixed budget
    assert verdicts[8]["passed"]
    # c=32: the target run misses 200 ms where the default misses it: FAIL whatever its throughput
    assert verdicts[32]["default_misses"] and not verdicts[32]["target_meets"] and not verdicts[32]["passed"]
    # no fixed budget meets it at c=32: the best of all of them is the reference
    assert not verdicts[32]["best_fixed_meets"] and verdicts[32]["best_fixed"]["budget"] == 512

    text = format_verdicts(list(verdicts.values()))
    assert "c=8: paged 400/40.0 | paged budget=32 180/30.0" in text
    assert text.count("PASS") == 2 and text.count("FAIL") == 1


def test_throughput_more_than_ten_percent_below_the_best_fixed_budget_fails():
    result = {"runs": {
        "tokenmill paged": run(512, {8: (400, 40.0)}),
        "tokenmill paged budget=64": run(64, {8: (150, 40.0)}),
        "tokenmill paged itl<=200ms": run(512, {8: (150, 35.0)}, target_itl_ms=200),
    }}
    (verdict,) = itl_verdicts(result, 200.0, default_budget=512)
    assert verdict["target_meets"] and verdict["throughput_ratio"] == 35 / 40 and not verdict["passed"]


def test_without_a_default_budget_run_there_is_no_verdict():
    result = {"runs": {"tokenmill paged itl<=200ms": run(512, {8: (150, 35.0)}, target_itl_ms=200)}}
    assert itl_verdicts(result, 200.0, default_budget=512) == []
    assert "needs a paged run" in format_verdicts([])
