"""A fluid model of the network: each worker's NIC sends and receives at its bandwidth, split
evenly among the transfers using it, and a transfer runs at the slower of its two ends (and
at most at the wide-area rate between datacenters).

Only the transfers sharing an endpoint with one that starts or ends change rate, so each
event costs O(transfers at two NICs), not O(fleet): thousands of workers simulate in seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Nic:
    up: float  # bytes/s
    down: float
    dc: str = ""
    node: str = ""
    alive: bool = True
    # insertion-ordered (dicts, not sets of objects hashed by address): events scheduled
    # while walking them tie-break in a fixed order, so a run repeats exactly
    sending: dict[Transfer, None] = field(default_factory=dict)
    receiving: dict[Transfer, None] = field(default_factory=dict)


@dataclass(eq=False)
class Transfer:
    src: str
    dst: str
    remaining: float
    on_done: Callable[[Transfer], None]
    on_fail: Callable[[Transfer], None]
    tag: object = None
    nbytes: float = 0.0
    rate: float = 0.0
    since: float = 0.0
    generation: int = 0
    active: bool = True


class EventLoop:
    """Simulated time: callbacks in time order (ties in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn))

    def run(self, until: float = float("inf")) -> None:
        while self._heap and self._heap[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()

    def __len__(self) -> int:
        return len(self._heap)


class Network:
    def __init__(self, loop: EventLoop, wan_rate: float):
        self.loop = loop
        self.wan_rate = wan_rate
        self.nics: dict[str, Nic] = {}
        self.sent: dict[str, float] = {}  # bytes each worker sent, in transfers that ended
        self.received: dict[str, float] = {}  # and received

    def add(self, name: str, nic: Nic) -> None:
        self.nics[name] = nic

    def start(self, src: str, dst: str, nbytes: float, on_done, on_fail, tag=None) -> None:
        """Begin moving `nbytes` from `src` to `dst` now; a dead source fails it at once."""
        t = Transfer(src, dst, float(nbytes), on_done, on_fail, tag, since=self.loop.now,
                     nbytes=float(nbytes))
        if not self.nics[src].alive or not self.nics[dst].alive:
            self.loop.at(self.loop.now, lambda: on_fail(t))
            return
        self.nics[src].sending[t] = None
        self.nics[dst].receiving[t] = None
        self._retime(src, dst)

    def kill(self, name: str) -> None:
        """The worker dies, with its NIC and every worker on it (a node's part readers
        share one): every transfer from or to that NIC stops; its readers see theirs
        fail."""
        nic = self.nics[name]
        nic.alive = False
        stopped = list(nic.sending) + list(nic.receiving)
        for t in stopped:
            self._remove(t)
        self._retime(*dict.fromkeys(t.dst if self.nics[t.src] is nic else t.src
                                    for t in stopped))
        for t in stopped:
            if self.nics[t.src] is nic:
                t.on_fail(t)

    def _rate(self, t: Transfer) -> float:
        s, d = self.nics[t.src], self.nics[t.dst]
        rate = min(s.up / len(s.sending), d.down / len(d.receiving))
        return min(rate, self.wan_rate) if s.dc != d.dc else rate

    def _retime(self, *names: str) -> None:
        now = self.loop.now
        touched: dict[Transfer, None] = {}
        for n in names:
            touched.update(self.nics[n].sending)
            touched.update(self.nics[n].receiving)
        for t in touched:
            t.remaining -= t.rate * (now - t.since)
            t.since = now
            t.rate = self._rate(t)
            t.generation += 1
            gen = t.generation
            self.loop.at(now + max(t.remaining, 0.0) / t.rate,
                         lambda t=t, gen=gen: self._finish(t, gen))

    def _finish(self, t: Transfer, gen: int) -> None:
        if not t.active or gen != t.generation:
            return
        self._remove(t)
        self._retime(t.src, t.dst)
        self.sent[t.src] = self.sent.get(t.src, 0.0) + t.nbytes
        self.received[t.dst] = self.received.get(t.dst, 0.0) + t.nbytes
        t.on_done(t)

    def _remove(self, t: Transfer) -> None:
        t.active = False
        self.nics[t.src].sending.pop(t, None)
        self.nics[t.dst].receiving.pop(t, None)
