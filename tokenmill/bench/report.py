"""Benchmark metrics and the four report forms: terminal table, JSON, Markdown, PNG plots.

A result is a dict: {"title", "notes": [str], "command", "runs": {name: sweep dict}} where a sweep dict
is {"target", "warmup": summary, "levels": [summary + {"concurrency", "kv_utilization_mean",
"preemptions"}]}. Latencies are in seconds in the data, milliseconds in the tables.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "e2e")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is out of range: must be in 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


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


def first_trouble(levels: list[dict]) -> int | None:
    """The lowest concurrency at which the run preempted or any request failed; None if none did."""
    for level in levels:
        if (level.get("preemptions") or 0) > 0 or level["num_errors"] > 0:
            return level["concurrency"]
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _optional(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = ["run", "conc", "QPS", "out tok/s", "TTFT P50/P90/P99 ms", "ITL P50/P90/P99 ms",
          "E2E P50/P90/P99 ms", "err %", "KV util", "preempt"]


def rows(result: dict) -> list[list[str]]:
    table = []
    for name, run in result["runs"].items():
        for level in run["levels"]:
            table.append([name, str(level["concurrency"]), f"{level['qps']:.2f}", f"{level['output_tokens_per_s']:.1f}",
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
                     f"(not timed); first preemption or error at concurrency "
                     f"{trouble if trouble is not None else 'none (in the sweep)'}; "
                     f"at concurrency {top['concurrency']}: E2E P99 {_ms(top['e2e_p99_s'])} ms, "
                     f"{top['output_tokens_per_s']:.1f} tok/s")
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


def write_plots(result: dict, directory: Path, prefix: str = "bench") -> list[Path]:
    """Three PNGs: throughput vs concurrency, latency percentiles vs concurrency, E2E latency CDF."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    paths = [directory / f"{prefix}_{kind}.png" for kind in ("throughput", "latency", "cdf")]

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)
    for name, run in runs.items():
        ax.plot([lv["concurrency"] for lv in run["levels"]], [lv["output_tokens_per_s"] for lv in run["levels"]],
                marker="o", label=name)
    ax.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0])
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5), dpi=80)
    for ax, metric in zip(axes, LATENCIES):
        for index, (name, run) in enumerate(runs.items()):
            for q, style in zip(PERCENTILES, ("-", "--", ":")):
                points = [(lv["concurrency"], lv[f"{metric}_p{q}_s"] * 1e3) for lv in run["levels"]
                          if lv[f"{metric}_p{q}_s"] is not None]
                ax.plot(*zip(*points) if points else ([], []), style, color=f"C{index}", marker=".",
                        label=f"{name} P{q}")
        ax.set(xlabel="concurrency", ylabel="ms", title=metric.upper())
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)
    for name, run in runs.items():
        top = run["levels"][-1]
        values = [v * 1e3 for v in top["e2e_samples"]]
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                label=f"{name} (c={top['concurrency']})")
    ax.set(xlabel="end-to-end latency, ms", ylabel="fraction of requests", title="Latency CDF, highest concurrency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[2])
    plt.close(fig)
    return paths
