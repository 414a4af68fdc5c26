"""`pull(version=N, announce_wait=s)` for a version not published yet waits for its
announcement (bounded) instead of failing at once, so a reader need not loop."""

import threading

import pytest
import torch

from tensorhub import CoordinatorError, Publisher, Replica
from tensorhub.core.data_types import Ack, Announcement, LatestRequest
from tensorhub.core.wire import encode


def test_a_pull_of_the_next_version_returns_once_it_is_published(coordinator):
    with Publisher(coordinator.address, "lm", transport="zmq") as pub, \
            Replica(coordinator.address, "lm", transport="zmq") as rep:
        pub.publish({"w": torch.ones(8)})
        pulled: list[int] = []
        waiter = threading.Thread(target=lambda: pulled.append(
            rep.pull(version=2, timeout=30, announce_wait=60)))
        waiter.start()
        pub.publish({"w": torch.full((8,), 2.0)})
        waiter.join(90)
        assert pulled == [2]
        assert torch.equal(rep.tensors["w"], torch.full((8,), 2.0))


def test_a_version_never_announced_fails_after_the_wait_saying_the_latest(coordinator):
    with Publisher(coordinator.address, "lm", transport="zmq") as pub, \
            Replica(coordinator.address, "lm", transport="zmq") as rep:
        pub.publish({"w": torch.ones(8)})
        with pytest.raises(CoordinatorError) as caught:
            rep.pull(version=5, timeout=10, announce_wait=0.3)
        pub.release(force=True)
    assert caught.value.code == "unknown_version"
    assert str(caught.value) == ("'lm' v5 was not announced within 0.3 s (latest: v1); is "
                                 "the trainer publishing?")


def test_a_waiting_readers_question_is_answered_in_a_few_bytes_until_a_version_is_newer(
        coordinator):
    with Publisher(coordinator.address, "lm", transport="zmq") as pub, \
            Replica(coordinator.address, "lm", transport="zmq") as rep:
        pub.publish({"w": torch.ones(1000)})
        newest = rep.session.client.call(LatestRequest(model="lm"))
        unchanged = rep.session.client.call(LatestRequest(model="lm", newer_than=1))
        assert isinstance(newest, Announcement) and newest.version == 1
        assert isinstance(unchanged, Ack)
        assert len(encode(unchanged)) < 16 < 200 < len(encode(newest))
        pub.publish({"w": torch.full((1000,), 2.0)})
        newer = rep.session.client.call(LatestRequest(model="lm", newer_than=1))
        assert isinstance(newer, Announcement) and newer.version == 2
