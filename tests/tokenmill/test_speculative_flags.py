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
