"""plumbing.options: one declaration gives the flag, the value back, and the argv that rebuilds it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from plumbing.options import POSITIVE, Options, option


@dataclass(frozen=True, slots=True)
class Example(Options):
    max_num_seqs: int = option(64, "batch size limit", type=POSITIVE)
    enable_prefix_caching: bool = option(True, "reuse prefix pages", flag="--no-prefix-caching")
    deterministic: bool = option(False, "batch-invariant kernels", flag=("--deterministic", "--batch-invariant"))
    fast_path: bool = option(True, "the compiled ops")
    target_itl_ms: float | None = option(None, "latency target", type=float)
    sizes: tuple[int, ...] = option((1, 2, 4), "graph sizes", type=int)
    kind: str = option("paged", "cache kind", choices=("paged", "static"))
    port: int = option(50052, "where it listens", type=int, cluster=False)
    redis_url: str = option("", "state store", env="EXAMPLE_REDIS_URL")
    tls: object | None = field(default=None)  # a composite: not a flag


def parse(argv: list[str], **kwargs) -> Example:
    parser = argparse.ArgumentParser()
    Example.add_arguments(parser, **kwargs)
    return Example.from_args(parser.parse_args(argv))


def test_defaults_parse_to_the_declared_defaults_and_write_no_argv():
    assert parse([]) == Example()
    assert Example().to_argv() == []


def test_every_value_round_trips_through_argv():
    changed = Example(max_num_seqs=8, enable_prefix_caching=False, deterministic=True, fast_path=False,
                      target_itl_ms=25.0, sizes=(1, 8), kind="static", port=7)
    argv = changed.to_argv()
    assert "--no-prefix-caching" in argv and "--no-fast-path" in argv and "--deterministic" in argv
    assert parse(argv) == changed


def test_aliases_and_checked_types():
    assert parse(["--batch-invariant"]).deterministic
    with pytest.raises(SystemExit):
        parse(["--max-num-seqs", "0"])
    with pytest.raises(SystemExit):
        parse(["--kind", "ring"])


def test_cluster_parser_leaves_out_what_the_cluster_sets_per_child():
    parser = argparse.ArgumentParser()
    Example.add_arguments(parser, cluster=True)
    args = parser.parse_args([])
    assert not hasattr(args, "port")
    assert Example.from_args(args, port=9).port == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1"])


def test_env_default_is_read_and_never_written_to_argv(monkeypatch):
    monkeypatch.setenv("EXAMPLE_REDIS_URL", "redis://secret@host:6379/0")
    options = parse([])
    assert options.redis_url == "redis://secret@host:6379/0"
    assert "redis://secret@host:6379/0" not in options.to_argv()


def test_help_never_shows_a_default_read_from_the_environment(monkeypatch):
    """The Redis URL's default comes from TOKENMILL_REDIS_URL, which may carry a password."""
    monkeypatch.setenv("EXAMPLE_REDIS_URL", "redis://user:hunter2@host:6379/0")
    parser = argparse.ArgumentParser()
    Example.add_arguments(parser)
    text = parser.format_help()
    assert "hunter2" not in text and "(default: 64)" in text and "(default: )" not in text


def test_a_switch_on_by_default_also_takes_its_plain_form():
    """--async-scheduling was a flag while the loop was off by default; commands that pass it still work."""
    assert parse(["--fast-path"]).fast_path is True
    assert parse(["--no-fast-path"]).fast_path is False


def test_a_services_parser_takes_its_options_then_what_only_its_process_adds():
    parser = Example.service_parser("example.main", "An example service.",
                                    lambda parser: parser.add_argument("--metrics-port", type=int, default=0))
    assert parser.prog == "python -m example.main" and parser.description == "An example service."
    args = parser.parse_args(["--max-num-seqs", "8", "--metrics-port", "9"])
    assert Example.from_args(args) == Example(max_num_seqs=8) and args.metrics_port == 9
