"""The coordinator's budget of open connections per address (`coordinator/connections.py`):
the bookkeeping, and a real coordinator shutting down what one address opens past it."""

from __future__ import annotations

import select
import socket
import time

from tensorhub import settings
from tensorhub.coordinator.connections import PeerBudget, budget_for
from tensorhub.coordinator.server import Coordinator
from tensorhub.coordinator.state import CoordinatorConfig
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusReply, StatusRequest


def test_an_address_past_its_budget_is_refused_and_others_are_not():
    budget = PeerBudget(per_peer=2)
    assert [budget.opened(fd, "10.0.0.9") for fd in (5, 6, 7)] == [True, True, False]
    assert budget.opened(8, "10.0.0.1")  # another address: its own budget
    assert budget.refused == 1
    budget.closed(7)
    budget.closed(5)
    assert budget.opened(9, "10.0.0.9")  # room again once one of its connections closed
    assert dict(budget.by_peer) == {"10.0.0.9": 2, "10.0.0.1": 1}


def test_a_reused_descriptor_is_counted_once():
    """A descriptor whose close was not seen before it was reused (events in order, one
    missed): its old connection is let go, not counted twice."""
    budget = PeerBudget(per_peer=1)
    assert budget.opened(5, "10.0.0.9")
    assert budget.opened(5, "10.0.0.9")
    assert dict(budget.by_peer) == {"10.0.0.9": 1}


def test_the_budget_is_a_quarter_of_the_open_file_limit_at_most():
    assert budget_for(1024, 4096) == 256
    assert budget_for(1 << 20, 4096) == 4096
    assert budget_for(16, 4096) == 8  # (never fewer than a few)


def _ended(conns: list[socket.socket], deadline: float) -> int:
    """How many of `conns` the far end has closed, reading what comes (zmq's greeting) until
    no more are closed for a while or `deadline` passes."""
    open_ = {c.fileno(): c for c in conns}
    poller = select.poll()
    for c in conns:
        c.setblocking(False)
        poller.register(c, select.POLLIN)
    while time.monotonic() < deadline and (events := poller.poll(500)):
        for fd, _ in events:
            try:
                while open_[fd].recv(4096):
                    pass
            except BlockingIOError:
                continue
            except OSError:
                pass
            poller.unregister(fd)
            del open_[fd]
    return len(conns) - len(open_)


def test_a_coordinator_closes_what_one_address_opens_past_its_budget(monkeypatch):
    """40 idle connections from one address against a budget of 16: 24 are closed as they
    are accepted, 16 stay (no handshake window to close them here); a client from another
    address is answered meanwhile."""
    monkeypatch.setattr(settings, "HANDSHAKE_MS", 600_000)
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0",
                                                connections_per_peer=16)).start()
    host, port = coordinator.address.removeprefix("tcp://").rsplit(":", 1)
    conns = [socket.create_connection((host, int(port)), source_address=("127.0.0.2", 0))
             for _ in range(40)]
    try:
        client = CoordinatorClient(coordinator.address, timeout=10)
        try:
            assert isinstance(client.call(StatusRequest()), StatusReply)
        finally:
            client.close()
        deadline = time.monotonic() + 30
        while coordinator.connections.shut < 24 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _ended(conns, deadline) == 24
        assert coordinator.connections.budget.by_peer["127.0.0.2"] == 16
    finally:
        for c in conns:
            c.close()
        coordinator.stop()
