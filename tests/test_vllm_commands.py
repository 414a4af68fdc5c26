"""vLLM's front end talks to its workers in typed commands: each round-trips through the
`init_info` dict vLLM carries, and one that is malformed or unknown is refused before a
worker acts on it."""

from __future__ import annotations

import pytest

from tensorhub_plugins.vllm.commands import Check, Init, Prefetch, Release, parse


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
