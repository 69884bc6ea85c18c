"""`tokenmill serve --speculative ngram --num-speculative-tokens N` reaches the scheduler's config, and a count
outside 1..16 or an unknown method is refused with a clear error (issue 35)."""
from __future__ import annotations

import pytest

from scheduler.options import SchedulerOptions
from tests.tokenmill.test_tuning_flags import processes
from tokenmill.cli import build_parser


def test_speculative_flags_reach_the_scheduler_config():
    _, scheduler = processes(["--speculative", "ngram", "--num-speculative-tokens", "7"])
    config = scheduler.scheduler_config(num_blocks=64, block_size=16, model_max_len=2048)
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 7)
    _, plain = processes([])
    assert plain.scheduler_config(num_blocks=64, block_size=16, model_max_len=2048).speculative is None


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "0"], "0 is out of range: must be in 1..16"),
    (["--num-speculative-tokens", "17"], "17 is out of range: must be in 1..16"),
    (["--speculative", "eagle"], "invalid choice: 'eagle'"),
])
def test_bad_speculative_flags_are_refused_at_start(capsys, argv, message):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_a_config_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be in 1..16"):
        SchedulerOptions(speculative="ngram", num_speculative_tokens=0).scheduler_config(
            num_blocks=8, block_size=16, model_max_len=128)


def test_draft_flags_reach_the_worker_and_the_scheduler():
    worker, scheduler = processes(["--speculative", "draft", "--draft-model", "small.gguf", "--num-speculative-tokens",
                                   "5"])
    assert worker.draft_model == "small.gguf"
    config = scheduler.scheduler_config(num_blocks=64, block_size=16, model_max_len=2048)
    assert (config.speculative, config.num_speculative_tokens) == ("draft", 5)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "draft"], "--speculative draft needs a draft model: start the worker with --draft-model PATH"),
    (["--draft-model", "small.gguf"], "--draft-model small.gguf is only used with --speculative draft"),
])
def test_serve_refuses_a_draft_model_without_speculative_draft_and_the_reverse(capsys, argv, message):
    from tokenmill.cli import main
    assert main(["serve", "--redis-url", "redis://x:1", *argv]) == 2
    assert message in capsys.readouterr().err
