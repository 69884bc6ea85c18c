"""Benchmark metrics and the four report forms: terminal table, JSON, Markdown, PNG plots.

A result is a dict: {"title", "notes": [str], "command", "runs": {name: sweep dict}} where a sweep dict
is {"target", "warmup": summary, "levels": [summary + load]}: a closed-loop level has "concurrency", an
open-loop one "request_rate", "achieved_rate" and "peak_in_flight"; both may have
"kv_utilization_mean", "preemptions" and "kv_pages_total", and with a latency target "token_budget_p50",
"itl_target_headroom_min", "itl_target_headroom_p50" and "itl_target_misses" (what it chose). Latencies
are in seconds in the data, milliseconds in the tables.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.percentile import percentile

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "e2e")


def summarize(records: list, elapsed_s: float) -> dict:
    """QPS and tok/s over the timed window (successful requests only), latency percentiles, error rate."""
    ok = [r for r in records if not r.error]
    samples = {"ttft": [r.ttft for r in ok if r.ttft is not None], "e2e": [r.e2e for r in ok],
               "itl": [gap for r in ok for gap in r.itls]}
    summary = {"num_requests": len(records), "num_errors": len(records) - len(ok),
               "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
               "errors": sorted({r.error for r in records if r.error})[:3],
               "elapsed_s": elapsed_s, "qps": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
               "output_tokens": sum(r.output_tokens for r in ok),
               "output_tokens_per_s": sum(r.output_tokens for r in ok) / elapsed_s if elapsed_s > 0 else 0.0,
               "e2e_samples": sorted(samples["e2e"])}  # kept for the CDF plot
    for name in LATENCIES:
        for q in PERCENTILES:
            summary[f"{name}_p{q}_s"] = percentile(samples[name], q)
    return summary


def is_open_loop(level: dict) -> bool:
    return level.get("request_rate") is not None


def level_load(level: dict) -> str:
    """The table's load cell: the concurrency, or the request rate asked for and the one achieved; which
    repeat it was (--repeats)."""
    repeat = f" #{level['repeat'] + 1}" if "repeat" in level else ""
    if not is_open_loop(level):
        return str(level["concurrency"]) + repeat
    achieved = level.get("achieved_rate")
    return f"{level['request_rate']:g}/s" + ("" if achieved is None else f" (sent {achieved:.2f}/s)") + repeat


def level_name(level: dict) -> str:
    return f"rate {level['request_rate']:g} req/s" if is_open_loop(level) else f"concurrency {level['concurrency']}"


def first_trouble(levels: list[dict]) -> str | None:
    """The first level (lowest concurrency, then lowest rate) at which the run preempted or any request
    failed, by level_name; None if none did."""
    for level in levels:
        if (level.get("preemptions") or 0) > 0 or level["num_errors"] > 0:
            return level_name(level)
    return None


def p99_weight_of_maximum(num_samples: int) -> float:
    """How much of P99 (linear interpolation at rank 0.99 * (n - 1)) is the largest sample: 1 for n <= 1,
    (101 - n) / 100 up to n = 100, 0 from 101 on. Below 100 samples P99 is mostly the maximum."""
    if num_samples <= 1:
        return 1.0
    rank = 0.99 * (num_samples - 1)
    return max(0.0, rank - (num_samples - 2))


def p99_warning(num_requests: int) -> str | None:
    """Says when P99 over num_requests per-request samples is mostly the slowest request; None from 100 on."""
    if num_requests >= 100:
        return None
    return (f"with {num_requests} requests per level, TTFT/E2E P99 is weighted {p99_weight_of_maximum(num_requests):.0%} "
            f"on the slowest request (interpolated at rank 0.99 x {num_requests - 1}): use --num-requests 100 or more")


def percentile_note(num_requests: int) -> str:
    """How the percentiles were computed, with p99_warning's warning when there is one."""
    warning = p99_warning(num_requests)
    return (f"percentiles: linear interpolation between closest ranks (numpy's default) over each level's "
            f"successful requests (TTFT, E2E: {num_requests} per level) and over all their inter-token gaps (ITL)"
            + ("" if warning is None else f"; WARNING: {warning}"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _optional(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = ["run", "conc / rate", "QPS", "out tok/s", "TTFT P50/P90/P99 ms", "ITL P50/P90/P99 ms",
          "E2E P50/P90/P99 ms", "err %", "KV util", "preempt"]


def rows(result: dict) -> list[list[str]]:
    table = []
    for name, run in result["runs"].items():
        for level in run["levels"]:
            table.append([name, level_load(level), f"{level['qps']:.2f}", f"{level['output_tokens_per_s']:.1f}",
                          *("/".join(_ms(level[f"{m}_p{q}_s"]) for q in PERCENTILES) for m in LATENCIES),
                          f"{level['error_rate'] * 100:.0f}", _optional(level.get("kv_utilization_mean"), ".2f"),
                          _optional(level.get("preemptions"), "d")])
    return table


def summary_lines(result: dict) -> list[str]:
    lines = []
    for name, run in result["runs"].items():
        trouble = first_trouble(run["levels"])
        top = run["levels"][-1]
        lines.append(f"{name}: warm-up {run['warmup']['num_requests']} req, E2E P50 {_ms(run['warmup']['e2e_p50_s'])} ms "
                     f"(not timed); first preemption or error at "
                     f"{trouble if trouble is not None else 'none (in the sweep)'}; "
                     f"at {level_name(top)}: E2E P99 {_ms(top['e2e_p99_s'])} ms, "
                     f"{top['output_tokens_per_s']:.1f} tok/s")
        for level in (lv for lv in run["levels"] if is_open_loop(lv)):
            achieved = level.get("achieved_rate")
            lines.append(f"{name} open loop at {level['request_rate']:g} req/s (seed {level['seed']}): arrivals "
                         f"{'-' if achieved is None else f'{achieved:.2f}'} req/s, completed {level['qps']:.2f} req/s, "
                         f"{level['output_tokens_per_s']:.1f} tok/s, at most {level['peak_in_flight']} in flight")
    return lines


def format_table(result: dict) -> str:
    table = [HEADER, *rows(result)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in table]
    return "\n".join([result.get("title", "tokenmill bench"), *text, "", *summary_lines(result),
                      *result.get("notes", [])])


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1))


def write_markdown(result: dict, path: Path, plots: list[str] = ()) -> None:
    lines = [f"## {result.get('title', 'tokenmill bench')}", ""]
    if result.get("command"):
        lines += ["```bash", result["command"], "```", ""]
    lines += [*(f"- {note}" for note in result.get("notes", [])), ""]
    lines += ["| " + " | ".join(HEADER) + " |", "| --- " + "| ---: " * (len(HEADER) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(result)]
    lines += ["", *(f"- {line}" for line in summary_lines(result)), ""]
    lines += [f"![{Path(p).stem}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def _plot_axes(runs: dict) -> list[tuple[str, str, str, dict[str, list[dict]]]]:
    """(file name part, x label, level key, {run: its levels}) for the closed loop, then the open loop."""
    axes = []
    for part, xlabel, key, wanted in (("", "concurrency", "concurrency", False),
                                      ("rate_", "request rate, req/s", "request_rate", True)):
        levels = {name: [lv for lv in run["levels"] if is_open_loop(lv) == wanted] for name, run in runs.items()}
        if any(levels.values()):
            axes.append((part, xlabel, key, levels))
    return axes


def write_plots(result: dict, directory: Path, prefix: str = "bench") -> list[Path]:
    """PNGs: throughput and latency percentiles vs concurrency (closed loop), the E2E latency CDF at each
    run's last level, then throughput and latency vs request rate (open loop, when it ran)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    color = {name: f"C{index}" for index, name in enumerate(runs)}
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name)
        plt.close(fig)
        paths.append(directory / name)

    def throughput_and_latency(part: str, xlabel: str, key: str, by_run: dict[str, list[dict]]) -> None:
        fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)
        for name, levels in by_run.items():
            ax.plot([lv[key] for lv in levels], [lv["output_tokens_per_s"] for lv in levels], marker="o",
                    color=color[name], label=name)
        ax.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
        ax.legend(fontsize=7)
        save(fig, f"{prefix}_{part}throughput.png")

        fig, axes = plt.subplots(1, 3, figsize=(11, 3.5), dpi=80)
        for ax, metric in zip(axes, LATENCIES):
            for name, levels in by_run.items():
                for q, style in zip(PERCENTILES, ("-", "--", ":")):
                    points = [(lv[key], lv[f"{metric}_p{q}_s"] * 1e3) for lv in levels if lv[f"{metric}_p{q}_s"] is not None]
                    ax.plot(*zip(*points) if points else ([], []), style, color=color[name], marker=".",
                            label=f"{name} P{q}")
            ax.set(xlabel=xlabel, ylabel="ms", title=metric.upper())
        axes[0].legend(fontsize=6)
        save(fig, f"{prefix}_{part}latency.png")

    axes_by_loop = _plot_axes(runs)
    if axes_by_loop and axes_by_loop[0][0] == "":
        throughput_and_latency(*axes_by_loop.pop(0))

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)
    for name, run in runs.items():
        top = run["levels"][-1]
        values = [v * 1e3 for v in top["e2e_samples"]]
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=color[name],
                label=f"{name} ({level_name(top)})")
    ax.set(xlabel="end-to-end latency, ms", ylabel="fraction of requests", title="Latency CDF, last level")
    ax.legend(fontsize=7)
    save(fig, f"{prefix}_cdf.png")

    for axis in axes_by_loop:
        throughput_and_latency(*axis)
    return paths
