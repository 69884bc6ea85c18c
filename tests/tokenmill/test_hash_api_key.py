"""`tokenmill hash-api-key`: its line is what the gateway's keys file takes, and the key works with it."""
from __future__ import annotations

import json
import subprocess
import sys

from gateway.access.api_keys import ApiKeyStore, api_key_from_entry


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "hash-api-key", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_given_key_hashes_to_a_keys_file_line():
    done = run("s3cret-key", "--name", "alice", "--requests-per-s", "2.5", "--burst", "5")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["name"] == "alice" and line["requests_per_s"] == 2.5 and line["burst"] == 5
    assert "s3cret-key" not in done.stdout
    assert ApiKeyStore([api_key_from_entry(line, "stdout")]).authenticate("Bearer s3cret-key").name == "alice"


def test_latency_target_flags_make_the_keys_class_of_service():
    done = run("chat-key", "--name", "chat", "--target-itl-ms", "25", "--target-ttft-ms", "400")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert (line["target_itl_ms"], line["target_ttft_ms"]) == (25.0, 400.0)
    key = ApiKeyStore([api_key_from_entry(line, "stdout")]).authenticate("Bearer chat-key")
    assert (key.target_itl_ms, key.target_ttft_ms) == (25.0, 400.0)
    assert "target_itl_ms" not in json.loads(run("other-key").stdout)  # none unless asked
    refused = run("k", "--target-itl-ms", "0")
    assert refused.returncode == 2 and "--target-itl-ms" in refused.stderr and "> 0" in refused.stderr


def test_without_a_key_a_random_one_is_made_and_shown_once():
    done = run("--name", "bob")
    key = done.stderr.split("API key (shown only now): ")[1].strip()
    assert len(key) > 32 and key not in done.stdout
    assert ApiKeyStore([api_key_from_entry(json.loads(done.stdout), "stdout")]).authenticate(f"Bearer {key}").name == "bob"


def test_key_from_stdin_and_a_bad_key():
    assert json.loads(run("-", stdin="from-stdin\n").stdout)["name"] == "default"
    done = run("two words")
    assert done.returncode == 2 and "without spaces" in done.stderr
