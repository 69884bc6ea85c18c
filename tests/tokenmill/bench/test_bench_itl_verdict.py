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


def repeated(budget: int, concurrency: int, figures: list[tuple[float, float]], target_itl_ms: float | None = None) -> dict:
    """One run whose level ran once per (ITL P99 ms, tok/s) pair, as --interleave --repeats lists them."""
    result = run(budget, {}, target_itl_ms)
    result["levels"] = [{"concurrency": concurrency, "itl_p99_s": itl / 1e3, "output_tokens_per_s": tok_s,
                         "repeat": index} for index, (itl, tok_s) in enumerate(figures)]
    return result


def test_repeats_are_judged_by_medians_and_the_median_paired_ratio():
    # repeat 1 ran in a slow minute for the target run only: its ratio 0.60 alone would fail the level
    result = {"runs": {
        "tokenmill paged": repeated(512, 32, [(500, 140.0), (520, 130.0), (510, 150.0)]),
        "tokenmill paged budget=32": repeated(32, 32, [(120, 100.0), (115, 100.0), (118, 110.0)]),
        "tokenmill paged budget=128": repeated(128, 32, [(300, 125.0), (160, 120.0), (310, 126.0)]),
        "tokenmill paged itl<=150ms": repeated(512, 32, [(140, 95.0), (170, 60.0), (145, 104.0)], target_itl_ms=150),
    }}
    (verdict,) = itl_verdicts(result, 150.0, default_budget=512)
    assert verdict["repeats"] == 3 and verdict["target"]["itl_p99_ms"] == 145  # the median P99 meets 150
    assert verdict["best_fixed"]["budget"] == 32  # budget 128's median P99 (300) misses the target
    assert [round(r, 3) for r in verdict["throughput_ratios"]] == [0.95, 0.6, 0.945]
    assert abs(verdict["throughput_ratio"] - 104 / 110) < 1e-9 and verdict["passed"]
    text = format_verdicts([verdict])
    assert "medians of 3 repeats" in text and "per repeat: 0.95x / 0.60x / 0.95x" in text and "140 / 170 / 145" in text
    # slow minutes on different configs in different repeats: medians of each side would compare 58 with
    # 100 tok/s (0.58x); paired, two repeats of three say 0.95x and 0.97x
    result["runs"]["tokenmill paged budget=32"] = repeated(32, 32, [(120, 100.0), (115, 60.0), (118, 110.0)])
    result["runs"]["tokenmill paged itl<=150ms"] = repeated(512, 32, [(140, 57.0), (145, 58.0), (145, 104.0)],
                                                            target_itl_ms=150)
    (verdict,) = itl_verdicts(result, 150.0, default_budget=512)
    assert abs(verdict["throughput_ratio"] - 104 / 110) < 1e-9 and verdict["passed"]
    # and a target run slower in every repeat fails
    result["runs"]["tokenmill paged itl<=150ms"] = repeated(512, 32, [(140, 85.0), (145, 50.0), (145, 95.0)],
                                                            target_itl_ms=150)
    (verdict,) = itl_verdicts(result, 150.0, default_budget=512)
    assert abs(verdict["throughput_ratio"] - 0.85) < 1e-9 and not verdict["passed"]


def test_the_verdict_shows_what_the_target_chose_in_each_repeat():
    result = {"runs": {
        "tokenmill paged": repeated(512, 8, [(100, 150.0), (104, 155.0)]),
        "tokenmill paged itl<=150ms": repeated(512, 8, [(120, 130.0), (110, 150.0)], target_itl_ms=150),
    }}
    tunings = [(96, 0.31, 0.62, 14), (160, 0.8, 0.9, 1)]
    for level, (budget, low, middle, misses) in zip(result["runs"]["tokenmill paged itl<=150ms"]["levels"], tunings):
        level.update(token_budget_p50=budget, itl_target_headroom_min=low, itl_target_headroom_p50=middle,
                     itl_target_misses=misses)
    text = format_verdicts(itl_verdicts(result, 150.0, default_budget=512))
    assert ("the target chose: budget P50 96, headroom min 0.31 P50 0.62, 14 steps missed | "
            "budget P50 160, headroom min 0.80 P50 0.90, 1 steps missed") in text
    # runs from before GetLoad reported it: no such line
    for level in result["runs"]["tokenmill paged itl<=150ms"]["levels"]:
        del level["token_budget_p50"], level["itl_target_headroom_min"]
    assert "the target chose" not in format_verdicts(itl_verdicts(result, 150.0, default_budget=512))
