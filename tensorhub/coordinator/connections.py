"""A budget of open connections per address: one peer cannot take the coordinator's file
descriptors.

Every TCP connection holds a descriptor from the moment it is accepted, before any
handshake, so a stranger's idle connections could exhaust the open-file limit (the
handshake window closes them, but only after `HANDSHAKE_MS`). ZeroMQ has no hook before
the handshake; its socket monitor reports each accepted connection's descriptor. The
coordinator counts them by the address they came from and shuts down, at once, a
connection that takes its address past the budget: zmq sees it closed and frees it, and the
peer's other connections are untouched. A legitimate host needs two connections per worker
(requests and announcements): the budget is far above that for any fleet the per-address
registration cap (`MAX_WORKERS_PER_PEER`) allows, and bounded by a share of the open-file
limit.

`PeerBudget` is the bookkeeping (no I/O); `BudgetWatch` reads the monitors on a thread of its
own and acts on its answers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("tensorhub.coordinator")

_OPENED, _CLOSED = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def budget_for(open_files: int, most: int) -> int:
    """Connections one address may hold: `most`, at most a quarter of the open-file limit
    (so four hosts' worth of strangers still leave room for everyone else)."""
    return max(8, min(most, open_files // 4)) if open_files > 0 else most


@dataclass
class PeerBudget:
    """Open connections by descriptor and by address (events come in the order the
    connections opened and closed, so a reused descriptor is counted right)."""

    per_peer: int
    by_fd: dict[int, str] = field(default_factory=dict)
    by_peer: Counter[str] = field(default_factory=Counter)
    refused: int = 0  # connections shut down past the budget

    def opened(self, fd: int, peer: str) -> bool:
        """A connection from `peer` on `fd`: whether it stays (False: shut it down)."""
        self.closed(fd)  # (its earlier connection's close was not seen: same descriptor)
        if not peer:  # (not TCP, or gone before it was looked at)
            return True
        self.by_fd[fd] = peer
        self.by_peer[peer] += 1
        if self.by_peer[peer] > self.per_peer:
            self.refused += 1
            return False
        return True

    def closed(self, fd: int) -> None:
        peer = self.by_fd.pop(fd, None)
        if peer is not None:
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]


def _peer_of(fd: int) -> tuple[str, socket.socket | None]:
    """The address connected to descriptor `fd`, and a duplicate of it to shut down with
    (its peer is "" where it is not a TCP connection or is already gone)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return "", None
    try:
        return (dup.getpeername()[0] if dup.family in (socket.AF_INET, socket.AF_INET6)
                else ""), dup
    except OSError:
        dup.close()
        return "", None


class BudgetWatch:
    """Watches `sockets` (listening ones) and shuts down connections past the budget."""

    def __init__(self, sockets: list[zmq.Socket], per_peer: int, refused=None):
        """`refused`: a counter (`.inc()`) of the connections shut down."""
        self.budget = PeerBudget(per_peer)
        self._refused = refused
        self.shut = 0  # connections shut down (after the budget counted them refused)
        self._monitors = [s.get_monitor_socket(_OPENED | _CLOSED) for s in sockets]
        self._sockets = sockets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorhub-connections",
                                        daemon=True)

    def start(self) -> BudgetWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            for monitor, _ in poller.poll(100):
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                self._on(event["event"], event["value"])

    def _on(self, event: int, fd: int) -> None:
        if event != _OPENED:
            self.budget.closed(fd)
            return
        peer, dup = _peer_of(fd)
        if dup is None:
            return
        with dup:
            if not self.budget.opened(fd, peer):
                if self._refused is not None:
                    self._refused.inc()
                if self.budget.refused == 1 or self.budget.refused % 1000 == 0:
                    log.warning("%s holds %d connections, past its budget of %d: closing "
                                "the next ones at once (%d so far)", peer,
                                self.budget.by_peer[peer], self.budget.per_peer,
                                self.budget.refused)
                try:
                    dup.shutdown(socket.SHUT_RDWR)  # (zmq sees it closed and frees it)
                except OSError:
                    pass
                self.shut += 1

    def stop(self) -> None:
        """Stop watching (before the sockets close)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sock, monitor in zip(self._sockets, self._monitors, strict=True):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
