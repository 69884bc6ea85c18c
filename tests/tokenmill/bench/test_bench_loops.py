"""tokenmill bench's client against a real HTTP server written here: connection handling (a server that
closes each keep-alive connection after its response, as llama.cpp's llama-server does), the open loop
(Poisson arrivals that never wait for a response) beside the closed loop, and the defaults of a run
with no flags (a normal KV cache, 100 requests per level)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tokenmill.bench.cli import SMALL_CACHE_BLOCKS, build_parser, resolve_defaults
from tokenmill.bench.report import (
    format_table,
    p99_weight_of_maximum,
    percentile_note,
    write_markdown,
    write_plots,
)
from tokenmill.bench.runner import interleaved_order, interleaved_sweeps, poisson_arrivals, sweep
from tokenmill.bench.targets import OpenAITarget
from tokenmill.bench.workload import BenchWorkload


class _CompletionsHandler(BaseHTTPRequestHandler):
    """POST /v1/completions streamed as server-sent events in chunked transfer encoding, one chunk per
    token, then the connection is closed without a `Connection: close` header: HTTP/1.1 says the
    connection stays open, and the server closes it anyway, as llama-server does."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.arrivals.append(time.perf_counter())
            server.temperatures.append(body["temperature"])
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            tokens = min(body["max_tokens"], server.cut_after if server.cut_after is not None else body["max_tokens"])
            for index in range(tokens):
                time.sleep(server.token_delay_s)
                finish = "length" if index == body["max_tokens"] - 1 else None  # as real servers mark the last
                self._event({"choices": [{"index": 0, "text": "a", "finish_reason": finish}]})
            if server.error_event:
                self._event({"error": {"message": "engine died", "code": 500}})
            if server.cut_after is None:
                self._event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self._chunk(b"data: [DONE]\n\n")
        finally:
            with server.lock:  # before the last chunk, so the client cannot have seen the end yet
                server.in_flight -= 1
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, payload: dict) -> None:
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def closing_sse_server(token_delay_s: float = 0.0, cut_after: int | None = None, error_event: bool = False):
    """cut_after: end every stream cleanly ([DONE], no finish_reason) after that many tokens, as a server whose
    engine died does; error_event: send an error event after the tokens."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CompletionsHandler)
    server.daemon_threads = True
    server.lock = threading.Lock()
    server.arrivals, server.temperatures, server.in_flight, server.peak_in_flight = [], [], 0, 0
    server.token_delay_s, server.cut_after, server.error_event = token_delay_s, cut_after, error_event
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def text_workload(output_lens: list[int]) -> BenchWorkload:
    return BenchWorkload(["hello"] * len(output_lens), [[1]] * len(output_lens), output_lens, 1, 0)


async def _sweep_openai(url: str, workload: BenchWorkload, levels: list[int], rates: list[float] = (),
                        seed: int = 0) -> dict:
    target = OpenAITarget(url)
    try:
        return await sweep(target, workload, levels, len(workload.prompts), 0, rates=rates, seed=seed)
    finally:
        await target.close()


def test_sync_mode_survives_a_server_that_closes_every_connection_after_its_response():
    """Each next request goes out the moment the last one ended, before the client has read the
    server's close: a pooled connection would be reused and fail half the requests."""
    workload = text_workload([3] * 24)
    with closing_sse_server() as (server, url):
        result = asyncio.run(_sweep_openai(url, workload, [1, 4]))
    for level in result["levels"]:
        assert (level["num_requests"], level["num_errors"], level["errors"]) == (24, 0, [])
        assert level["output_tokens"] == 3 * 24
    assert len(server.arrivals) == 48


@pytest.mark.parametrize("cut_after, error_event, reason", [
    (2, False, "the stream ended without a finish_reason after 2 of 5 tokens"),
    (0, False, "the stream ended without a finish_reason after 0 of 5 tokens"),
    (None, True, 'error event: {"message": "engine died", "code": 500}'),
])
def test_a_stream_the_server_ends_without_a_finish_reason_or_with_an_error_is_a_failed_request(cut_after, error_event,
                                                                                                reason):
    workload = text_workload([5] * 4)
    with closing_sse_server(cut_after=cut_after, error_event=error_event) as (server, url):
        result = asyncio.run(_sweep_openai(url, workload, [2]))
    level = result["levels"][0]
    assert level["num_errors"] == 4 and reason in str(level["errors"]), level["errors"]


def test_poisson_arrivals_are_seeded_exponential_gaps():
    times = poisson_arrivals(4000, rate=5.0, seed=3)
    gaps = np.diff([0.0, *times])
    assert times == poisson_arrivals(4000, rate=5.0, seed=3) and times != poisson_arrivals(4000, 5.0, seed=4)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    # exponential: P(gap < mean) = 1 - 1/e, and the spread equals the mean (a fixed-interval sender fails both)
    assert (gaps < 1 / 5.0).mean() == pytest.approx(1 - np.exp(-1), abs=0.03)
    assert gaps.std() == pytest.approx(1 / 5.0, rel=0.08)
    assert poisson_arrivals(3, rate=10.0, seed=0) == pytest.approx([t / 2 for t in poisson_arrivals(3, 5.0, seed=0)])
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="request rate"):
            poisson_arrivals(3, bad, 0)


def test_open_loop_sends_on_schedule_without_waiting_for_responses():
    """Each request takes ~0.3 s at the server; arrivals every ~0.05 s (20 req/s) must overlap there,
    and each must reach the server at its scheduled time, while the closed loop at concurrency 1 never
    has two at once."""
    workload = text_workload([6] * 12)
    rate, seed = 20.0, 7
    with closing_sse_server(token_delay_s=0.05) as (server, url):
        result = asyncio.run(_sweep_openai(url, workload, [], rates=[rate], seed=seed))
        open_peak, open_arrivals = server.peak_in_flight, list(server.arrivals)
        server.peak_in_flight, server.arrivals = 0, []
        closed = asyncio.run(_sweep_openai(url, text_workload([6] * 3), [1]))
        assert server.peak_in_flight == 1 and closed["levels"][0]["num_errors"] == 0
    (level,) = result["levels"]
    assert (level["request_rate"], level["seed"], level["num_errors"]) == (rate, seed, 0)
    assert "concurrency" not in level
    schedule = poisson_arrivals(12, rate, seed)
    assert open_peak >= 3 and level["peak_in_flight"] >= 3
    # arrival times at the server, relative to the first, follow the schedule (the server's clock is ours)
    observed = [t - open_arrivals[0] for t in sorted(open_arrivals)]
    assert observed == pytest.approx([t - schedule[0] for t in schedule], abs=0.1)
    assert level["achieved_rate"] == pytest.approx(12 / schedule[-1], rel=0.1)
    assert level["elapsed_s"] >= schedule[-1] + 6 * 0.05


def test_report_shows_open_loop_levels_by_rate(tmp_path):
    with closing_sse_server() as (_, url):
        run = asyncio.run(_sweep_openai(url, text_workload([2] * 6), [1, 2], rates=[50.0, 100.0]))
    result = {"title": "t", "notes": [percentile_note(6)], "runs": {"peer": run}}
    text = format_table(result)
    assert "50/s (sent " in text and "100/s (sent " in text
    assert "peer open loop at 100 req/s (seed 0): arrivals" in text and "at most " in text
    assert "WARNING: with 6 requests per level" in text
    write_markdown(result, tmp_path / "r.md")
    table = [line for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| peer |")]
    assert [row.split(" | ")[1].split(" ")[0] for row in table] == ["1", "2", "50/s", "100/s"]
    plots = write_plots(result, tmp_path)
    assert [p.name for p in plots] == ["bench_throughput.png", "bench_latency.png", "bench_cdf.png",
                                       "bench_rate_throughput.png", "bench_rate_latency.png"]


def test_p99_weight_of_the_maximum_and_the_warning_below_100_requests():
    for n in (2, 16, 99, 100, 101, 150):
        only_max = [0.0] * (n - 1) + [1.0]  # P99 of this is exactly the weight the maximum gets
        assert p99_weight_of_maximum(n) == pytest.approx(float(np.percentile(only_max, 99)), abs=1e-9)
    assert p99_weight_of_maximum(16) == pytest.approx(0.85)
    assert "WARNING: with 16 requests per level, TTFT/E2E P99 is weighted 85% on the slowest" in percentile_note(16)
    assert "WARNING" not in percentile_note(100) and "linear interpolation" in percentile_note(100)


def test_no_flags_means_a_normal_cache_and_100_requests_per_level():
    from tokenmill.bench.cli import cluster_config
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs

    def parse(*argv: str):
        return resolve_defaults(build_parser().parse_args(list(argv)))

    def worker_argv(args) -> list[str]:
        specs = cluster_specs(cluster_config(args, args.kv_policies.split(",")[0]))
        return list(next(spec.argv for spec in specs if spec.name == "worker"))

    default = parse()
    assert (default.num_requests, default.kv_policies, default.num_blocks, default.baseline) == (100, "paged", None, True)
    assert default.concurrency == [1, 4, 8, 16] and default.request_rate == []
    # the worker sizes its KV cache exactly as one of `tokenmill serve` (ClusterConfig's defaults) would
    serve_worker = next(spec.argv for spec in cluster_specs(ClusterConfig()) if spec.name == "worker")
    assert not {"--num-blocks", "--kv-cache-mb", "--kv-cache-memory-fraction"} & set(worker_argv(default))
    assert not {"--num-blocks", "--kv-cache-mb", "--kv-cache-memory-fraction"} & set(serve_worker)

    layouts = parse("--compare-kv-layouts")
    assert (layouts.kv_policies, layouts.num_blocks, layouts.baseline) == ("paged,static", SMALL_CACHE_BLOCKS, False)
    assert worker_argv(layouts)[worker_argv(layouts).index("--num-blocks") + 1] == str(SMALL_CACHE_BLOCKS)
    old_default = parse("--compare-kv-layouts", "--baseline", "--num-requests", "16")
    assert (old_default.baseline, old_default.num_requests) == (True, 16)

    open_loop = parse("--request-rate", "2,0.5", "--seed", "3")
    assert (open_loop.request_rate, open_loop.concurrency, open_loop.seed) == ([0.5, 2.0], [], 3)
    both = parse("--request-rate", "1", "--concurrency", "1,8")
    assert (both.request_rate, both.concurrency) == ([1.0], [1, 8])
    for bad in ("0", "-1", "fast", "inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--request-rate", bad])


def test_cli_open_loop_against_an_openai_url(tmp_path, capsys):
    from tokenmill.bench.cli import main

    with closing_sse_server() as (server, url):
        assert main(["--openai-url", url, "--request-rate", "40", "--num-requests", "10", "--warmup", "1",
                     "--prompt-len", "8", "--min-output", "2", "--max-output", "4", "--no-plots",
                     "--out", str(tmp_path)]) == 0
    assert len(server.arrivals) == 11  # one warm-up, then the level
    result = json.loads((tmp_path / "bench.json").read_text())
    (level,) = result["runs"]["openai-http"]["levels"]
    assert (level["request_rate"], level["num_requests"], level["num_errors"]) == (40.0, 10, 0)
    assert any("open loop at 40 req/s (Poisson arrivals" in note for note in result["notes"])
    captured = capsys.readouterr()
    assert "warning: with 10 requests per level" in captured.err
    assert "linear interpolation between closest ranks" in captured.out


@pytest.mark.parametrize("temperature", [None, 0.8])
def test_requests_are_greedy_unless_a_temperature_is_given(tmp_path, temperature):
    from tokenmill.bench.cli import main

    flag = [] if temperature is None else ["--temperature", str(temperature)]
    with closing_sse_server() as (server, url):
        assert main(["--openai-url", url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                     "--prompt-len", "8", "--min-output", "2", "--max-output", "2", "--no-plots",
                     "--out", str(tmp_path), *flag]) == 0
    assert server.temperatures == [temperature or 0.0] * 4
    workload_note = json.loads((tmp_path / "bench.json").read_text())["notes"][0]
    assert ("sampled at temperature 0.8," if temperature else "greedy,") in workload_note


def test_interleaved_order_runs_each_step_on_every_run_rotating_the_order():
    assert interleaved_order(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                                                     (2, "c"), (2, "a"), (2, "b")]
    assert interleaved_order(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert interleaved_order(["a"], 2) == [(0, "a"), (1, "a")]


def test_interleaved_order_never_runs_the_same_run_last_twice():
    # issue 19's acceptance run: six clusters, three levels; forward/reverse ran "f" last at levels 0 and 2
    names, steps = list("abcdef"), 3
    order = interleaved_order(names, steps)
    lasts = [[name for step, name in order if step == level][-1] for level in range(steps)]
    firsts = [[name for step, name in order if step == level][0] for level in range(steps)]
    assert len(set(lasts)) == steps and len(set(firsts)) == steps
    assert all(sorted(name for step, name in order if step == level) == names for level in range(steps))


async def _interleaved_openai(urls: dict[str, str], workload: BenchWorkload, levels: list[int],
                              repeats: int = 1) -> dict:
    targets = {name: (OpenAITarget(url), None) for name, url in urls.items()}
    try:
        return await interleaved_sweeps(targets, workload, levels, len(workload.prompts), 1, repeats=repeats)
    finally:
        for target, _ in targets.values():
            await target.close()


def test_interleaved_sweeps_run_each_level_on_every_server_before_the_next_level():
    """Two real servers: each gets its warm-up, then level 1 goes to a then b, level 2 to b then a; each
    result holds its own levels, as sweep() would have returned them."""
    workload = text_workload([2] * 6)
    with closing_sse_server() as (server_a, url_a), closing_sse_server() as (server_b, url_b):
        results = asyncio.run(_interleaved_openai({"a": url_a, "b": url_b}, workload, [1, 2]))
    assert list(results) == ["a", "b"]
    for result in results.values():
        assert result["warmup"]["num_requests"] == 1
        assert [level["concurrency"] for level in result["levels"]] == [1, 2]
        assert all((level["num_requests"], level["num_errors"]) == (6, 0) for level in result["levels"])
    # arrivals: a's warm-up, b's warm-up, then per level: a before b at level 1, b before a at level 2
    a, b = server_a.arrivals, server_b.arrivals
    assert len(a) == len(b) == 13
    assert a[0] < b[0] < min(a[1:7]) and max(a[1:7]) < min(b[1:7])
    assert max(b[1:7]) < min(b[7:]) and max(b[7:]) < min(a[7:])


def test_repeats_run_each_level_again_on_every_server_in_rotated_order():
    workload = text_workload([2] * 3)
    with closing_sse_server() as (server_a, url_a), closing_sse_server() as (server_b, url_b):
        results = asyncio.run(_interleaved_openai({"a": url_a, "b": url_b}, workload, [1, 2], repeats=2))
    for result in results.values():
        assert [(level["concurrency"], level["repeat"]) for level in result["levels"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
        assert all((level["num_requests"], level["num_errors"]) == (3, 0) for level in result["levels"])
    # after the warm-ups: a b | b a | a b | b a, three requests each
    a, b = server_a.arrivals[1:], server_b.arrivals[1:]
    assert max(a[0:3]) < min(b[0:3]) and max(b[3:6]) < min(a[3:6]) and max(a[6:9]) < min(b[6:9])
    assert max(b[0:3]) < min(b[3:6]) and max(a[3:6]) < min(a[6:9])


def test_repeats_need_interleave():
    from tokenmill.bench.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--repeats", "3", "--no-baseline"])
    assert exited.value.code == 2


def test_progress_lines_go_to_stderr_while_stdout_carries_the_json(capsys):
    from tokenmill.bench.workload import progress_log

    progress_log(True)("round", 1)
    progress_log(False)("round", 2)
    captured = capsys.readouterr()
    assert captured.err == "round 1\n" and captured.out == "round 2\n"


def test_every_level_of_a_sweep_gets_prompts_no_earlier_level_or_warm_up_sent():
    """A prefix cache must not see a level's prompts before it (they used to be the first ones, every level):
    prompts run on after the warm-up's, output lengths stay the first ones, the pool is sized for the sweep."""
    from tokenmill.bench.workload import BenchWorkload, Levels

    needed = Levels.prompts_needed([1, 4, 8], requests_per_level=4, warmup=2, rates=[2.0], repeats=2)
    assert needed == 2 + 2 * ((4 + 4 + 8) + 4)
    workload = BenchWorkload([f"p{i}" for i in range(needed)], [[i] for i in range(needed)], [10, 20, 30, 40, 50, 60,
                             70, 80], prompt_len=1, seed=0)
    fresh = Levels(warmup=2)
    levels = [fresh.take(workload, count) for count in (4, 4, 8)]
    seen = [prompt for level in levels for prompt in level.prompts]
    assert seen == [f"p{i}" for i in range(2, 2 + 16)]  # after the warm-up's two, each once
    assert [level.output_lens for level in levels] == [[10, 20, 30, 40], [10, 20, 30, 40], [10, 20, 30, 40, 50, 60,
                                                                                              70, 80]]
