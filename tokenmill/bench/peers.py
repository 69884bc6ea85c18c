"""The peer comparison's helpers for scripts/peers/compare.sh: wait for a server, then one side-by-side table.

    python -m tokenmill.bench.peers wait http://127.0.0.1:8000/v1 --pid 1234 [--timeout 900]
        polls GET /v1/models until it answers 200 (prints the first model id), fails early if the
        server process is gone
    python -m tokenmill.bench.peers table --doc docs/benchmarks.md \\
        --side "tokenmill serve" "bfloat16 (serve --dtype), GGUF Q4_1 file" out/tokenmill/bench.json ...
        one row per side (each a `tokenmill bench --openai-url` result), a column group per load level,
        the CPU (lscpu: model, cores, SIMD flags) and the workload, written between the markers below
        in the doc (appended with a heading when the markers are absent)
    python -m tokenmill.bench.peers table --section shape-qwen2.5-1.5b --rss "tokenmill serve" 6800 ...
        a real-shape model's table (compare.sh --model): its own markers, the issue-34 columns (output
        tok/s, TTFT P50, ITL P50 / P99 per level) and each side's RSS in MiB
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path

from tokenmill.bench.report import is_open_loop

BEGIN = "<!-- peers-table:begin (written by scripts/peers/compare.sh) -->"
END = "<!-- peers-table:end -->"
HEADING = "## Peers: tokenmill vs vLLM's CPU backend vs llama.cpp's llama-server (issue 15)"
# each table compare.sh writes has its own markers, so a --near-free run never replaces the default model's
SECTIONS = {
    "peers": (BEGIN, END, HEADING),
    "near-free": ("<!-- peers-near-free:begin (written by scripts/peers/compare.sh --near-free) -->",
                  "<!-- peers-near-free:end -->",
                  "## Peers on the near-free model: the serving stack's ceiling (issue 33)"),
}
SHAPE_PREFIX = "shape-"  # a real-shape model's section (compare.sh --model NAME): shape-NAME
# the columns of a level: (header, the level's key, seconds shown as ms)
LEVEL_COLUMNS = (("out tok/s", "output_tokens_per_s", False), ("TTFT P50 ms", "ttft_p50_s", True),
                 ("ITL P50 ms", "itl_p50_s", True), ("E2E P99 ms", "e2e_p99_s", True))
SHAPE_LEVEL_COLUMNS = (("out tok/s", "output_tokens_per_s", False), ("TTFT P50 ms", "ttft_p50_s", True),
                       ("ITL P50 ms", "itl_p50_s", True), ("ITL P99 ms", "itl_p99_s", True))
# the lscpu flags that decide which kernels a CPU server can run (avx512_bf16, avx512_vnni, amx_* included)
SIMD_FLAG_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx")


def markers(name: str) -> tuple[str, str, str]:
    """(begin marker, end marker, heading) of one of the doc's tables: SECTIONS, or shape-MODEL."""
    if name in SECTIONS:
        return SECTIONS[name]
    if name.startswith(SHAPE_PREFIX) and len(name) > len(SHAPE_PREFIX):
        model = name.removeprefix(SHAPE_PREFIX)
        return (f"<!-- peers-{name}:begin (written by scripts/peers/compare.sh --model {model}) -->",
                f"<!-- peers-{name}:end -->",
                f"## Peers on the {model} shape: random weights, llama.cpp's Q4_K_M mix (issue 34)")
    raise ValueError(f"--section {name!r}: must be one of {', '.join(SECTIONS)} or {SHAPE_PREFIX}MODEL")


def wait_ready(base_url: str, pid: int | None, timeout_s: float, interval_s: float = 1.0) -> str:
    """The first model id of GET {base_url}/models once it answers 200 with one."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if pid is not None and not _alive(pid):
            raise RuntimeError(f"the server (pid {pid}) exited before {base_url}/models answered ({last})")
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=5) as response:
                models = json.loads(response.read()).get("data") or []
                if models:
                    return models[0]["id"]
                last = "200 with no model listed"
        except urllib.error.HTTPError as error:
            last = f"HTTP {error.code}"  # llama-server answers 503 while it loads
        except (OSError, ValueError) as error:
            last = f"{type(error).__name__}: {error}"
        time.sleep(interval_s)
    raise RuntimeError(f"{base_url}/models did not answer within {timeout_s:g} s ({last})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a child that exited but was not reaped yet is a zombie: gone for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def cpu_summary(lscpu_text: str) -> str:
    """Model name, CPUs / cores / threads, and the SIMD flags, from lscpu's output."""
    fields = {}
    for line in lscpu_text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = [flag for flag in fields.get("Flags", "").split() if flag.startswith(SIMD_FLAG_PREFIXES)]
    shape = ", ".join(f"{fields[key]} {label}" for key, label in
                      (("CPU(s)", "CPUs"), ("Core(s) per socket", "cores per socket"),
                       ("Thread(s) per core", "threads per core")) if key in fields)
    return (f"{fields.get('Model name', 'unknown CPU')} ({shape}); SIMD flags (lscpu): "
            + (" ".join(dict.fromkeys(flags)) or "none listed"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _load(level: dict) -> str:
    return f"{level['request_rate']:g} req/s" if is_open_loop(level) else f"c={level['concurrency']}"


def side_table(sides: list[tuple[str, str, dict]], columns=LEVEL_COLUMNS,
               rss_mib: dict[str, float] | None = None) -> list[str]:
    """Markdown rows: side, its dtype / format, then per load level (in first-seen order) the columns
    (default: output tok/s, TTFT P50, ITL P50 and E2E P99), then the failed requests over all levels, then
    each side's RSS in MiB where rss_mib is given."""
    loads: list[str] = []
    for _, _, result in sides:
        for run in result["runs"].values():
            loads += [load for load in map(_load, run["levels"]) if load not in loads]
    header = ["server", "dtype / format"]
    for load in loads:
        header += [f"{load} {label}" for label, _, _ in columns]
    header.append("failed")
    if rss_mib is not None:
        header.append("RSS MiB")
    table = ["| " + " | ".join(header) + " |", "| --- | --- " + "| ---: " * (len(header) - 2) + "|"]
    for name, form, result in sides:
        (run,) = result["runs"].values()  # one `tokenmill bench --openai-url` run per side
        by_load = {_load(level): level for level in run["levels"]}
        cells = [name, form]
        for load in loads:
            level = by_load.get(load)
            cells += (["-"] * len(columns) if level is None else
                      [_ms(level[key]) if seconds else f"{level[key]:.1f}" for _, key, seconds in columns])
        failed = sum(level["num_errors"] for level in run["levels"])
        cells.append(f"{failed}/{sum(level['num_requests'] for level in run['levels'])}")
        if rss_mib is not None:
            cells.append(f"{rss_mib[name]:.0f}" if name in rss_mib else "-")
        table.append("| " + " | ".join(cells) + " |")
    return table


def section(sides: list[tuple[str, str, dict]], lscpu_text: str, command: str, notes: list[str],
            day: str, name: str = "peers", rss_mib: dict[str, float] | None = None) -> list[str]:
    """The doc's section: how it was run, the CPU, the workload (from the first side's notes), the table."""
    workload = [note for note in sides[0][2].get("notes", []) if note.startswith(("workload:", "percentiles:"))]
    intro = (f"Run on {day}, one server after the other on this machine, each through the same client "
             "(`tokenmill bench --openai-url`, streamed `/v1/completions`):")
    outro = ("Each side's full table (P50/P90/P99 of TTFT, ITL, E2E) is in the `bench.md` beside its "
             "`bench.json` in the command's output directory.")
    begin, end, _ = markers(name)
    columns = SHAPE_LEVEL_COLUMNS if name.startswith(SHAPE_PREFIX) else LEVEL_COLUMNS
    if rss_mib is not None:
        notes = [*notes, "RSS: the server's whole process group (`ps -g`), summed after its last level"]
    return [begin, "", intro, "", "```bash", command, "```", "", f"- CPU: {cpu_summary(lscpu_text)}",
            *(f"- {note}" for note in [*workload, *notes]), "", *side_table(sides, columns, rss_mib), "", outro, "",
            end]


def write_section(doc: Path, lines: list[str], name: str = "peers") -> None:
    """Replaces the text from the section's begin marker to its end marker in doc, or appends a heading and
    the section."""
    begin, end, heading = markers(name)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = "\n".join(lines)
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    wait = commands.add_parser("wait", help="wait until an OpenAI-compatible server lists a model")
    wait.add_argument("base_url", help="…/v1")
    wait.add_argument("--pid", type=int, help="fail as soon as this process is gone")
    wait.add_argument("--timeout", type=float, default=900.0, help="seconds (default: %(default)s)")
    table = commands.add_parser("table", help="write the side-by-side table into a Markdown doc")
    table.add_argument("--doc", type=Path, required=True)
    table.add_argument("--side", nargs=3, action="append", required=True, metavar=("NAME", "FORMAT", "BENCH_JSON"))
    table.add_argument("--command", default="scripts/peers/compare.sh", help="the command shown above the table")
    table.add_argument("--note", action="append", default=[], help="a line under the CPU (versions, settings)")
    table.add_argument("--lscpu-file", type=Path, help="lscpu's output saved in a file (default: run lscpu)")
    table.add_argument("--date", default=date.today().isoformat())
    table.add_argument("--section", default="peers",
                       help="which of the doc's tables (its own markers): the default model's (peers), the near-free "
                            "model's (near-free: compare.sh --near-free) or a real-shape model's (shape-NAME: "
                            "compare.sh --model NAME) (default: %(default)s)")
    table.add_argument("--rss", nargs=2, action="append", metavar=("NAME", "MIB"),
                       help="a side's resident memory after its run (adds an RSS column)")
    args = parser.parse_args(argv)
    if hasattr(args, "section"):  # the table command (whose --command flag shares the subcommand's dest)
        try:
            markers(args.section)
        except ValueError as error:
            parser.error(str(error))
    if args.command == "wait":
        try:
            print(wait_ready(args.base_url, args.pid, args.timeout))
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 0
    sides = [(name, form, json.loads(Path(path).read_text())) for name, form, path in args.side]
    lscpu_text = (args.lscpu_file.read_text() if args.lscpu_file
                  else subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout)
    rss_mib = None if args.rss is None else {name: float(mib) for name, mib in args.rss}
    lines = section(sides, lscpu_text, args.command, args.note, args.date, args.section, rss_mib)
    write_section(args.doc, lines, args.section)
    print("\n".join(line for line in lines if line.startswith("|")))
    print(f"\nwritten into {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
