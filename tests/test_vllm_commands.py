"""vLLM's front end talks to its workers in typed commands: each round-trips through the
`init_info` dict vLLM carries, and one that is malformed or unknown is refused before a
worker acts on it."""

from __future__ import annotations

import pytest

from tensorhub.engines import LoadOutcome
from tensorhub_plugins.vllm.commands import (
    Check,
    Init,
    InstalledAnswer,
    Prefetch,
    Release,
    failed_as,
    parse,
)


@pytest.mark.parametrize("command", [
    Init(coordinator="tcp://127.0.0.1:5555", model="m", name="vllm-x", follow=False),
    Prefetch(), Prefetch(version=3), Release(version=2), Check(version=4, asker="a1b2", attempt=1)])
def test_each_command_round_trips_through_init_info(command):
    assert parse(command.info()) == command


@pytest.mark.parametrize("info", [
    {"op": "reboot"}, {"op": "release"},
    {"op": "check", "version": 0, "asker": "a1b2", "attempt": 1},
    {"op": "check", "version": 2, "attempt": 1},
    {"op": "check", "version": 2, "asker": "", "attempt": 1},
    {"op": "init"}, {"op": "prefetch", "version": 1, "extra": True}, {}])
def test_a_malformed_command_is_refused_as_vllm_expects(info):
    with pytest.raises(ValueError):
        parse(info)


def test_a_failed_install_reaches_the_front_end_as_the_worst_outcome_a_rank_answered():
    restored = LoadOutcome(kind="restored", version=5, reason="rank 0 loaded v4 again")
    torn = LoadOutcome(kind="torn", version=5, reason="rank 1 could not load v4 again")
    answers = [InstalledAnswer(version=4, install="whole", failed=restored).model_dump(),
               InstalledAnswer(version=None, failed=torn).model_dump()]
    assert failed_as(answers, 5) == torn
    assert failed_as(answers[:1], 5) == restored


def test_no_outcome_is_made_up_where_the_ranks_said_none_for_that_version():
    stale = InstalledAnswer(version=4, install="whole",
                            failed=LoadOutcome(kind="restored", version=3)).model_dump()
    assert failed_as([stale], 5) is None
    assert failed_as([InstalledAnswer(version=4).model_dump()], 5) is None
    assert failed_as([{"version": 4, "failed": "torn"}], 5) is None  # (malformed)
    assert failed_as(RuntimeError("the engine core died"), 5) is None
