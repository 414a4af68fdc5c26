"""The coordinator as the simulator sees it: one server, one queue, real handlers.

Every request reaches the coordinator half a round trip after it is sent, waits its turn,
and is served by the real `Coordinator` handler (msgpack in, msgpack out, as the socket
loop does) for as long as that call took on this machine, plus the socket's own cost per
message (`socket_cost`, measured by `measure_socket_cost`); its reply arrives half a round
trip after it is served. So a fleet that asks too much of the coordinator waits on it in
the figures, as it would in a run. Busy time and messages by type are counted.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable

from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core.data_types import Envelope, Heartbeat, Register
from tensorhub.core.wire import decode_reply, encode
from tensorhub.sim.links import EventLoop

Reply = Callable[[object], None]


class CoordinatorQueue:
    def __init__(self, loop: EventLoop, coordinator: Coordinator, rpc: float,
                 socket_cost: float):
        self.loop, self.coordinator, self.rpc, self.socket_cost = (
            loop, coordinator, rpc, socket_cost)
        self._queue: deque[tuple[object, Reply | None, float]] = deque()
        self._serving = False
        self.busy = 0.0  # simulated seconds spent serving
        self.messages: Counter[str] = Counter()
        self.longest_wait = 0.0

    def send(self, request, on_reply: Reply | None = None) -> None:
        """`request` leaves now; `on_reply(reply)` runs when the reply is back (None: a
        message whose reply nobody waits for)."""
        sent = self.loop.now
        self.loop.at(sent + self.rpc / 2, lambda: self._arrive(request, on_reply, sent))

    def backlog(self) -> int:
        """Messages waiting or being served."""
        return len(self._queue) + self._serving

    def call_now(self, request):
        """Serve `request` at once, outside the queue (set-up before the clock starts)."""
        return self._handle(request)[0]

    def _arrive(self, request, on_reply: Reply | None, sent: float) -> None:
        self._queue.append((request, on_reply, sent))
        if not self._serving:
            self._serve()

    def _serve(self) -> None:
        if not self._queue:
            self._serving = False
            return
        self._serving = True
        request, on_reply, sent = self._queue.popleft()
        self.longest_wait = max(self.longest_wait, self.loop.now - sent - self.rpc / 2)
        reply, seconds = self._handle(request)
        cost = seconds + self.socket_cost
        self.busy += cost
        self.messages[request.type] += 1
        done = self.loop.now + cost
        if on_reply is not None:
            self.loop.at(done + self.rpc / 2, lambda: on_reply(reply))
        self.loop.at(done, self._serve)

    def _handle(self, request) -> tuple[object, float]:
        if isinstance(request, Expiry):
            started = time.perf_counter()
            self.coordinator._expire()
            return None, time.perf_counter() - started
        payload = encode(Envelope(request=request))
        started = time.perf_counter()
        wire = self.coordinator.answer(payload)  # as the socket loop does
        seconds = time.perf_counter() - started
        return decode_reply(wire), seconds


class Expiry:
    """The coordinator's periodic sweep for silent workers and stale leases, served in the
    queue like a message (it takes the same thread)."""

    type = "expiry"


def measure_socket_cost(samples: int = 2000) -> float:
    """A coordinator's CPU per message on its socket, beyond the handler: half of a
    heartbeat's round trip over loopback TCP (both ends pay about the same) less the
    handler's own time. Measured on this machine, once per run."""
    from tensorhub.core.client import CoordinatorClient
    from tensorhub.core.data_types import Endpoint

    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0",
                                                announce="tcp://127.0.0.1:0")).start()
    client = CoordinatorClient(coordinator.address)
    try:
        worker = client.call(Register(name="probe", role="replica",
                                      endpoint=Endpoint(transport="zmq",
                                                        address="tcp://probe:1"))).worker_id
        beat = Heartbeat(worker_id=worker)
        payload = encode(Envelope(request=beat))
        trips, handled = [], []
        for _ in range(samples):
            started = time.perf_counter()
            client.call(beat)
            trips.append(time.perf_counter() - started)
        for _ in range(samples):
            started = time.perf_counter()
            encode(coordinator.handle(payload))
            handled.append(time.perf_counter() - started)
        return max(0.0, statistics.median(trips) / 2 - statistics.median(handled))
    finally:
        client.close()
        coordinator.stop()
