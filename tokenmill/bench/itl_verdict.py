"""The latency-target acceptance figure (issue 19 item 4): with --target-itl-ms and --budgets in one
`tokenmill bench` run, each closed-loop level is judged as the issue words it:

    inter-token P99 within the target at every level where the fixed default budget misses it, with
    throughput within 10 % of the best fixed budget found by the sweep of fixed budgets in the same run.

"Best fixed budget" is read as the fixed budget with the most output tokens/s among those whose ITL P99
meets the target at that level (the budget someone tuning by hand for the target would keep); when no
fixed budget meets it, the best of them all. Both are reported, so the other reading can be checked.
Runs are told apart by the settings each run records (run_cluster's "settings"), not by their names.

With `--interleave --repeats N` every level ran N times on every config, back to back: each config's
figures are then its medians over the repeats (which budget is best, who meets the target), and the
throughput ratio is the median of the N paired ratios (the target's tok/s over the best budget's in the
same repeat, minutes apart), so that one slow minute on a drifting machine decides nothing.
"""
from __future__ import annotations

import statistics

THROUGHPUT_TOLERANCE = 0.10


def _is_fixed(settings: dict) -> bool:
    return (settings.get("kv_policy") == "paged" and settings.get("target_itl_ms") is None
            and not settings.get("swap_space_gb"))


def _closed_levels(run: dict) -> dict[int, list[dict]]:
    """concurrency -> that level's runs, one per repeat, in order."""
    levels: dict[int, list[dict]] = {}
    for level in run["levels"]:
        if level.get("request_rate") is None:
            levels.setdefault(level["concurrency"], []).append(level)
    return levels


def _figures(name: str, run: dict, levels: list[dict]) -> dict:
    """Medians over the repeats (with one, that level's own figures); tok_s_repeats: each repeat's."""
    p99s = [level["itl_p99_s"] * 1e3 for level in levels if level["itl_p99_s"] is not None]
    tok_s = [level["output_tokens_per_s"] for level in levels]
    return {"run": name, "budget": run["settings"].get("max_num_batched_tokens"),
            "itl_p99_ms": statistics.median(p99s) if p99s else None, "tok_s": statistics.median(tok_s),
            "tok_s_repeats": tok_s,
            "itl_p99_ms_repeats": [None if level["itl_p99_s"] is None else level["itl_p99_s"] * 1e3 for level in levels],
            "tuning_repeats": [_tuning(level) for level in levels]}


def _tuning(level: dict) -> str | None:
    """What a latency target chose in one level (from the scheduler's GetLoad), or None without it."""
    if level.get("itl_target_headroom_min") is None or level.get("token_budget_p50") is None:
        return None
    return (f"budget P50 {level['token_budget_p50']:.0f}, headroom min {level['itl_target_headroom_min']:.2f} "
            f"P50 {level['itl_target_headroom_p50']:.2f}, {level.get('itl_target_misses') or 0} steps missed")


def _paired_ratios(ours: dict, best: dict) -> list[float]:
    """ours / best in each repeat."""
    return [mine / theirs if theirs > 0 else 0.0 for mine, theirs in zip(ours["tok_s_repeats"], best["tok_s_repeats"])]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def itl_verdicts(result: dict, target_itl_ms: float, default_budget: int) -> list[dict]:
    """One verdict per closed-loop concurrency level the target run and the default-budget run share."""
    runs = {name: run for name, run in result["runs"].items() if "settings" in run}
    fixed = {name: run for name, run in runs.items() if _is_fixed(run["settings"])}
    targeted = [name for name, run in runs.items() if run["settings"].get("target_itl_ms") == target_itl_ms]
    default = [name for name, run in fixed.items() if run["settings"].get("max_num_batched_tokens") == default_budget]
    if not targeted or not default:
        return []
    target_levels = _closed_levels(runs[targeted[0]])
    default_levels = _closed_levels(runs[default[0]])
    verdicts = []
    for concurrency in sorted(set(target_levels) & set(default_levels)):
        sweep = [_figures(name, run, _closed_levels(run)[concurrency]) for name, run in fixed.items()
                 if concurrency in _closed_levels(run)]
        ours = _figures(targeted[0], runs[targeted[0]], target_levels[concurrency])
        base = _figures(default[0], runs[default[0]], default_levels[concurrency])
        meeting = [f for f in sweep if f["itl_p99_ms"] is not None and f["itl_p99_ms"] <= target_itl_ms]
        best = max(meeting or sweep, key=lambda f: f["tok_s"])
        best_any = max(sweep, key=lambda f: f["tok_s"])
        default_misses = base["itl_p99_ms"] is None or base["itl_p99_ms"] > target_itl_ms
        target_meets = ours["itl_p99_ms"] is not None and ours["itl_p99_ms"] <= target_itl_ms
        ratios = _paired_ratios(ours, best)
        ratio = _median(ratios)
        itl_ok = target_meets or not default_misses
        verdicts.append({
            "concurrency": concurrency, "target_itl_ms": target_itl_ms, "sweep": sweep, "target": ours,
            "default_misses": default_misses, "target_meets": target_meets,
            "best_fixed": best, "best_fixed_meets": bool(meeting), "best_fixed_any": best_any,
            "repeats": len(ours["tok_s_repeats"]),
            "throughput_ratios": ratios, "throughput_ratio": ratio,
            "throughput_ratio_any": _median(_paired_ratios(ours, best_any)),
            "passed": itl_ok and ratio >= 1 - THROUGHPUT_TOLERANCE,
        })
    return verdicts


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_verdicts(verdicts: list[dict]) -> str:
    """The per-level ITL P99 / tok/s of every config, and the verdict, as plain text."""
    if not verdicts:
        return "ITL target verdict: needs a paged run with the default budget and the --target-itl-ms run"
    target_ms = verdicts[0]["target_itl_ms"]
    repeats = verdicts[0].get("repeats", 1)
    lines = [f"ITL target verdict (target {target_ms:g} ms; ITL P99 ms / out tok/s per config"
             + (f", medians of {repeats} repeats; throughput: the median of the paired per-repeat ratios)"
                if repeats > 1 else ")")]
    for verdict in verdicts:
        cells = [f"{f['run'].removeprefix('tokenmill ')} {_ms(f['itl_p99_ms'])}/{f['tok_s']:.1f}"
                 for f in [*verdict["sweep"], verdict["target"]]]
        lines.append(f"  c={verdict['concurrency']}: " + " | ".join(cells))
        best = verdict["best_fixed"]
        itl = ("target met" if verdict["target_meets"] else "target MISSED") + (
            " where the default budget misses it" if verdict["default_misses"]
            else " (the default budget meets it too: not required)")
        lines.append(f"    {'PASS' if verdict['passed'] else 'FAIL'}: {itl}; throughput "
                     f"{verdict['throughput_ratio']:.2f}x the best fixed budget "
                     f"{'meeting the target' if verdict['best_fixed_meets'] else '(none meets the target)'} "
                     f"(budget {best['budget']}, {best['tok_s']:.1f} tok/s); "
                     f"{verdict['throughput_ratio_any']:.2f}x the best of all fixed "
                     f"(budget {verdict['best_fixed_any']['budget']})")
        if repeats > 1:
            lines.append("    per repeat: " + " / ".join(f"{r:.2f}x" for r in verdict["throughput_ratios"])
                         + "; target's ITL P99 " + " / ".join(_ms(level) for level in verdict["target"]["itl_p99_ms_repeats"]))
        tunings = verdict["target"].get("tuning_repeats", [])
        if any(tunings):
            lines.append("    the target chose: " + " | ".join(tuning or "-" for tuning in tunings))
    return "\n".join(lines)
