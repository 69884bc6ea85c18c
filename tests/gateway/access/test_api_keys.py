"""The keys file, the Bearer check and the per-key token buckets, without processes."""
from __future__ import annotations

import argparse
import json
import logging

import pytest

from gateway.access.control import AccessControl, build_access
from gateway.access.api_keys import ApiKey, ApiKeyStore, hash_api_key, load_api_keys
from gateway.access.rate_limit import RateLimiter
from core.errors import ResourceExhausted, Unauthenticated
from core.requests import GenerationRequest
from core.sampling import SamplingParams


def write_keys(tmp_path, *lines: str):
    path = tmp_path / "keys.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_keys_file_round_trip_and_bearer_check(tmp_path):
    path = write_keys(tmp_path, "# comment", "", json.dumps({"name": "a", "sha256": hash_api_key("alpha")}),
                      json.dumps({"name": "b", "sha256": hash_api_key("beta").upper(), "requests_per_s": 2, "burst": 4}))
    store = ApiKeyStore(load_api_keys(path))
    assert store.authenticate("Bearer alpha").name == "a"
    assert store.authenticate("bearer  beta ") == ApiKey("b", hash_api_key("beta"), 2.0, 4)
    for header, reason in ((None, "missing API key"), ("", "missing API key"), ("Bearer gamma", "unknown API key"),
                           ("alpha", "malformed authorization"), ("Token alpha", "malformed authorization")):
        with pytest.raises(Unauthenticated, match=reason) as caught:
            store.authenticate(header)
        assert "alpha" not in str(caught.value) and "gamma" not in str(caught.value)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"keys.jsonl:2: not a JSON object"),
    ('["a"]', r"keys.jsonl:2: must be a JSON object"),
    ('{"name": "x", "sha256": "abc"}', r"keys.jsonl:2: sha256 must be 64 hex digits"),
    ('{"sha256": "' + "0" * 64 + '"}', r"keys.jsonl:2: name must be a non-empty string"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "key": "plain"}', r"unknown field\(s\) \['key'\]"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "requests_per_s": 0}', r"requests_per_s=0 must be a number > 0"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "burst": 1.5}', r"burst=1.5 must be an integer >= 1"),
    ('{"name": "first", "sha256": "' + "1" * 64 + '"}', r"name 'first' is used by more than one key"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_itl_ms": 0}',
     r"keys.jsonl:2: target_itl_ms=0 must be a number of milliseconds > 0"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_ttft_ms": -5}',
     r"keys.jsonl:2: target_ttft_ms=-5 must be a number of milliseconds > 0"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_itl_ms": "20"}',
     r"keys.jsonl:2: target_itl_ms='20' must be a number of milliseconds > 0"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_ttft_ms": true}',
     r"keys.jsonl:2: target_ttft_ms=True must be a number of milliseconds > 0"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_itl_ms": NaN}', r"keys.jsonl:2: target_itl_ms=nan must be"),
    ('{"name": "x", "sha256": "' + "0" * 64 + '", "target_ttft_ms": 1e999}', r"keys.jsonl:2: target_ttft_ms=inf must be"),
])
def test_a_bad_keys_file_is_refused_naming_line_and_field(tmp_path, line, message):
    path = write_keys(tmp_path, json.dumps({"name": "first", "sha256": "f" * 64}), line)
    with pytest.raises(ValueError, match=message):
        load_api_keys(path)


def test_a_keys_latency_targets_go_on_the_requests_it_submits(tmp_path):
    path = write_keys(tmp_path, json.dumps({"name": "chat", "sha256": hash_api_key("c"), "target_itl_ms": 25,
                                            "target_ttft_ms": 400.5}),
                      json.dumps({"name": "batch", "sha256": hash_api_key("b")}))
    store = ApiKeyStore(load_api_keys(path))
    chat, batch = store.authenticate("Bearer c"), store.authenticate("Bearer b")
    assert (chat.target_itl_ms, chat.target_ttft_ms) == (25.0, 400.5)
    request = GenerationRequest("r1", [1, 2], SamplingParams(max_tokens=3), priority=2)
    assert chat.with_targets(request) == GenerationRequest("r1", [1, 2], SamplingParams(max_tokens=3), priority=2,
                                                           target_itl_ms=25.0, target_ttft_ms=400.5)
    assert batch.with_targets(request) is request  # no targets: the scheduler's flags, as before


def test_token_bucket_allows_the_burst_then_the_rate():
    limiter = RateLimiter(default_requests_per_s=2.0, default_burst=3)
    key = ApiKey("k", "0" * 64)
    for _ in range(3):
        limiter.take(key, now=100.0)
    with pytest.raises(ResourceExhausted, match=r"'k' exceeded: 2 requests/s, burst 3; retry in 0.50 s") as caught:
        limiter.take(key, now=100.0)
    assert caught.value.retry_after_s == pytest.approx(0.5)
    limiter.take(key, now=100.5)  # one token came back
    with pytest.raises(ResourceExhausted):
        limiter.take(key, now=100.6)
    own = ApiKey("own", "1" * 64, requests_per_s=1.0, burst=1)  # a key's own line wins over the default
    limiter.take(own, now=100.0)
    with pytest.raises(ResourceExhausted, match="1 requests/s, burst 1"):
        limiter.take(own, now=100.1)


def test_no_default_rate_means_unlimited():
    limiter = RateLimiter()
    for _ in range(10_000):
        limiter.take(ApiKey("k", "0" * 64), now=1.0)


def test_without_a_keys_file_auth_is_off_with_a_warning(caplog):
    args = argparse.Namespace(api_keys_file="", rate_limit_rps=0.0, rate_limit_burst=0)
    with caplog.at_level(logging.WARNING, logger="tokenmill.gateway.access"):
        access = build_access(args)
    assert "authentication is off" in caplog.text
    assert isinstance(access, AccessControl) and access.admit(None).name == "anonymous"


def test_a_broken_keys_file_stops_the_gateway_naming_it(tmp_path):
    path = write_keys(tmp_path, '{"name": "x"}')
    with pytest.raises(SystemExit, match=r"--api-keys-file: .*keys.jsonl:1: sha256 must be 64 hex digits"):
        build_access(argparse.Namespace(api_keys_file=str(path), rate_limit_rps=0.0, rate_limit_burst=0))
