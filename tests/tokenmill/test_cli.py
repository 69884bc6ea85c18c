"""The `tokenmill` command: argument checking for serve and generate, generate against a real gRPC
server speaking tokenmill.v1.Generation (a scripted servicer in this process), dispatch to bench-engine."""
from __future__ import annotations

import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tokenmill import cli
from tokenmill.cluster.readiness import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- argument parsing ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_the_flags(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    expected = ["--gateway-port", "--redis-url", "--kv-policy", "--startup-timeout-s"] if command == "serve" \
        else ["--address", "--max-tokens", "--top-p", "--chat", "--system", "--no-stream"]
    assert all(flag in out for flag in expected)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--gateway-port", "70000"], "argument --gateway-port: 70000 is out of range: must be a port in 0..65535"),
    (["serve", "--worker-port", "http"], "argument --worker-port: 'http' is not an integer"),
    (["serve", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["serve", "--kv-policy", "lru"], "argument --kv-policy: invalid choice: 'lru'"),
    (["serve", "--block-size", "24"], "argument --block-size: 24 is not a power of two"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: 0 is out of range: must be >= 1"),
    (["serve", "--redis-url", "redis://x:1/0", "--redis-port", "7000"],
     "argument --redis-port: not allowed with argument --redis-url"),
    (["generate", "hi", "--top-p", "1.5"], "argument --top-p: 1.5 is out of range: must be in (0, 1]"),
    (["generate", "hi", "--top-p", "0"], "argument --top-p: 0.0 is out of range: must be in (0, 1]"),
    (["generate", "hi", "--temperature", "-0.5"], "argument --temperature: -0.5 is out of range: must be >= 0"),
    (["generate", "hi", "--max-tokens", "lots"], "argument --max-tokens: 'lots' is not an integer"),
    (["generate", "hi", "--seed", "-1"], "argument --seed: -1 is out of range: must be in 0..2^64-1"),
    (["generate"], "the following arguments are required: prompt"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_values_are_rejected_naming_the_flag_and_the_limit(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err


def test_serve_reports_a_taken_port_with_the_flag_to_change_it(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run(capsys, "serve", "--gateway-port", str(port), "--scheduler-port", "0",
                           "--worker-port", "0", "--redis-port", "0")
    assert code == 1
    assert f"port {port} for gateway is already in use on 127.0.0.1; change it with --gateway-port" in err
    assert "[tokenmill] started" not in err  # failed before starting anything


def test_serve_rejects_a_missing_model_before_starting_anything(capsys, tmp_path):
    code, _, err = run(capsys, "serve", "--model", str(tmp_path / "nope.gguf"))
    assert code == 2
    assert f"--model {tmp_path / 'nope.gguf'}: no such file or directory" in err


def test_cli_modules_do_not_import_torch():
    # serve and generate must start fast; torch is only for the worker process and bench-engine
    code = ("import sys, tokenmill.cli, tokenmill.cluster.supervisor, tokenmill.cluster.specs, tokenmill.client_cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_bench_engine_gets_every_remaining_argument(monkeypatch):
    seen = []
    monkeypatch.setitem(cli.DELEGATED, "bench-engine", (__name__, ""))
    monkeypatch.setattr(sys.modules[__name__], "main", lambda argv: seen.append(argv) or 5, raising=False)
    assert cli.main(["bench-engine", "--json", "--help"]) == 5
    assert seen == [["--json", "--help"]]


def test_bench_engine_runs_through_the_command_on_a_tiny_model(tmp_path):
    """`tokenmill bench-engine` for real, in its own process (it loads torch): the command's dispatch,
    the module's main, both tokenmill KV layouts and the transformers baseline on a tiny random model
    (~5 s). float32 on both sides, so every greedy request must match transformers token for token."""
    import json

    from tests.helpers.tiny_models import make_tiny_hf_model

    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    argv = ["bench-engine", "--model", str(folder), "--num-requests", "4", "--prompt-len", "8", "--min-output", "2",
            "--max-output", "6", "--kv-cache-mb", "1", "--baseline-batch-size", "2", "--dtype", "float32", "--json"]
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["workload"]["num_requests"] == 4 and result["workload"]["dtype"] == "float32"
    assert 4 * 2 <= result["workload"]["num_output_tokens"] <= 4 * 6
    for side in ("tokenmill_paged", "tokenmill_static", "transformers_static_batches"):
        assert result[side]["output_tokens_per_s"] > 0 and result[side]["elapsed_s"] > 0, side
    assert result["tokenmill_paged"]["preemptions"] == 0
    assert result["speedup_vs_transformers"] > 0
    assert result["greedy_requests_identical_to_transformers"] == 1.0


# -- generate against a scripted Generation server -------------------------------------------------

class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def GenerateStream(self, request, context):
        self.requests.append(request)
        if request.parameters.max_tokens == 999:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid max_tokens=999: prompt + max_tokens > 8192")
        for text, ids in (("Hel", [1]), ("lo", [2]), ("!", [3])):
            yield generation_pb2.GenerateStreamResponse(request_id="r-1", text=text, token_ids=ids)
        yield generation_pb2.GenerateStreamResponse(
            request_id="r-1", finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=3))

    def Generate(self, request, context):
        self.requests.append(request)
        return generation_pb2.GenerateResponse(request_id="r-2", text="Hello!", token_ids=[1, 2, 3],
                                               finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                               usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=3))


@pytest.fixture
def gateway():
    servicer = ScriptedGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_generate_streams_text_and_summarizes_on_stderr(capsys, gateway):
    address, servicer = gateway
    code, out, err = run(capsys, "generate", "Say hello", "--address", address, "--temperature", "0",
                         "--max-tokens", "8", "--stop", "\n\n", "END", "--seed", "7")
    assert code == 0
    assert out == "Hello!\n"
    assert "3 tokens" in err and "4 prompt tokens" in err and "finish: stop" in err and "request r-1" in err
    request = servicer.requests[0]
    assert request.WhichOneof("input") == "prompt" and request.prompt == "Say hello"
    params = request.parameters
    assert params.HasField("temperature") and params.temperature == 0.0  # greedy, not "unset"
    assert (params.max_tokens, params.seed, list(params.stop)) == (8, 7, ["\n\n", "END"])
    assert not params.HasField("top_p") and not params.HasField("top_k")


def test_generate_chat_sends_system_and_user_turns(capsys, gateway):
    address, servicer = gateway
    code, _, _ = run(capsys, "generate", "What is 2+2?", "--address", address, "--system", "Be brief.")
    assert code == 0
    request = servicer.requests[0]
    assert request.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [
        ("system", "Be brief."), ("user", "What is 2+2?")]


def test_generate_without_stream_uses_one_call(capsys, gateway):
    address, servicer = gateway
    code, out, err = run(capsys, "generate", "hi", "--address", address, "--no-stream", "--chat")
    assert (code, out) == (0, "Hello!\n")
    assert "finish: length" in err
    assert [(m.role, m.content) for m in servicer.requests[0].messages.messages] == [("user", "hi")]


def test_generate_prints_the_servers_status_and_exits_1(capsys, gateway):
    address, _ = gateway
    code, _, err = run(capsys, "generate", "hi", "--address", address, "--max-tokens", "999")
    assert code == 1
    assert "INVALID_ARGUMENT: invalid max_tokens=999: prompt + max_tokens > 8192" in err


def test_generate_without_a_gateway_says_so(capsys):
    address = f"127.0.0.1:{free_port()}"
    code, _, err = run(capsys, "generate", "hi", "--address", address, "--connect-timeout-s", "0.5")
    assert code == 1
    assert f"UNAVAILABLE: no tokenmill gateway at {address}" in err


def test_serve_reports_a_taken_metrics_port_with_the_flag_to_change_it(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run(capsys, "serve", "--gateway-port", "0", "--scheduler-port", "0", "--worker-port", "0",
                           "--redis-port", "0", "--no-http", "--scheduler-metrics-port", str(port))
    assert code == 1
    assert f"port {port} for scheduler metrics is already in use" in err
    assert "--scheduler-metrics-port (or --no-metrics)" in err


def test_serve_passes_the_tool_call_parser_to_the_gateway(capsys, monkeypatch):
    import tokenmill.cluster.supervisor as supervisor

    class Captured(supervisor.Supervisor):  # takes the command lines; stops serve before anything starts
        def check_ports(self):
            raise supervisor.SupervisorError("captured")

    captured = {}
    monkeypatch.setattr(supervisor, "Supervisor", lambda specs, **options: captured.update(
        {spec.name: spec.argv for spec in specs}) or Captured(specs, **options))
    code, _, _ = run(capsys, "serve", "--tool-call-parser", "llama3_json", "--gateway-port", "0",
                     "--scheduler-port", "0", "--worker-port", "0", "--redis-port", "0")
    assert code == 1
    gateway_argv = " ".join(captured["gateway"])
    assert "-m gateway.main" in gateway_argv and "--tool-call-parser llama3_json" in gateway_argv
