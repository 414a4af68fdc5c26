"""Waits that are bounded and said: a `Publisher` at an address where nothing answers fails
after one try, as a `Replica` does, and a retry says one short line; `close()` says at
once what it waits for and how to skip it."""

import logging
import socket

import pytest
import torch

from tensorhub import CoordinatorUnavailable, Publisher, Replica


@pytest.fixture
def dead_address():
    with socket.socket() as s:  # a port that was free a moment ago, and nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def _retry_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]


def test_a_publisher_at_a_dead_address_gives_up_after_one_try(dead_address, caplog):
    with pytest.raises(CoordinatorUnavailable) as caught:
        Publisher(dead_address, "lm", transport="zmq", timeout=0.3)
    assert f"no reply from the coordinator at {dead_address} within 0.3s" in str(caught.value)
    assert _retry_lines(caplog) == []


def test_each_retry_is_one_short_line_naming_the_address(dead_address, caplog):
    caplog.set_level(logging.WARNING, logger="tensorhub.session")
    with pytest.raises(CoordinatorUnavailable):
        Publisher(dead_address, "lm", name="trainer", transport="zmq", timeout=0.2,
                  register_wait=0.5)
    lines = _retry_lines(caplog)
    assert lines
    for line in lines:
        assert line.startswith(f"trainer: no answer from the coordinator at {dead_address}; "
                               f"trying again for up to ")
        assert line.endswith(" s more")
        assert len(line) < 120


def test_close_says_at_once_what_it_waits_for_and_how_to_skip_it(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="tensorhub.publisher")
    pub = Publisher(coordinator.address, "lm", transport="zmq", retain_timeout=0.3)
    with Replica(coordinator.address, "lm", transport="zmq"):  # registered, never pulls
        pub.publish({"w": torch.zeros(4)})
        pub.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tensorhub.publisher"]
    assert said[0] == ("lm v1: close() waits up to 0.3 s until 1 replica(s) hold it (0 do, 0 "
                       "read(s) in flight), so that the trainer's copy is not its last; "
                       "close(retain=False) skips the wait")
    assert said[1].startswith("closing anyway: lm v1: 0 of 1 replica(s) hold it")


def test_close_without_retaining_says_nothing_of_a_wait(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="tensorhub.publisher")
    pub = Publisher(coordinator.address, "lm", transport="zmq", retain_timeout=0.3)
    with Replica(coordinator.address, "lm", transport="zmq"):
        pub.publish({"w": torch.zeros(4)})
        pub.close(retain=False)
    assert [r.getMessage() for r in caplog.records if r.name == "tensorhub.publisher"] == []
