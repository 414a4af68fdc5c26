"""Ctrl-C in a pull before any byte of the replica's buffers changed leaves it on the
version it held, and the coordinator records the pull as "interrupted"."""

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest


@pytest.fixture
def interrupted(coordinator):
    """A replica on v1 whose pull of v2 was interrupted while reads of v1 ended (before it
    read anything), and its publisher."""
    with Publisher(coordinator.address, "lm", transport="zmq") as pub, \
            Replica(coordinator.address, "lm", {"w": torch.zeros(64)}, name="reader",
                    transport="zmq", whole_items=True) as rep:  # (a plan and a lease a pull)
        pub.publish({"w": torch.ones(64)})
        assert rep.pull(timeout=10) == 1
        pub.publish({"w": torch.full((64,), 2.0)})
        withdraw = rep.session.withdraw

        def ctrl_c(*args, **kwargs):
            withdraw(*args, **kwargs)
            raise KeyboardInterrupt

        rep.session.withdraw = ctrl_c
        with pytest.raises(KeyboardInterrupt):
            rep.pull(timeout=10)
        rep.session.withdraw = withdraw
        yield rep


def test_the_replica_stays_on_the_version_it_held(interrupted):
    assert interrupted.version == 1
    assert torch.equal(interrupted.tensors["w"], torch.ones(64))
    assert interrupted.pull(timeout=10) == 2


def test_the_status_says_interrupted(interrupted, coordinator):
    client = CoordinatorClient(coordinator.address)
    try:
        transfers = client.call(StatusRequest()).transfers
    finally:
        client.close()
    assert [t.error for t in transfers if t.reader == "reader" and not t.ok] == ["interrupted"]
