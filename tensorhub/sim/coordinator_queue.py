"""The coordinator as the simulator sees it: one server, one queue, real handlers.

Every request reaches the coordinator half a round trip after it is sent, waits its turn,
and is served by the real coordinator handler (msgpack in, msgpack out, as the socket
loop does: `dispatch.answer` on a `CoordinatorState`, no socket bound) for as long as that
call took on this machine, plus the socket's own cost per
message (`socket_cost`, measured by `measure_socket_cost`); its reply arrives half a round
trip after it is served. So a fleet that asks too much of the coordinator waits on it in
the figures, as it would in a run. Busy time and messages by type are counted.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from tensorhub.coordinator import dispatch, membership
from tensorhub.coordinator.server import Coordinator
from tensorhub.coordinator.state import CoordinatorConfig, CoordinatorState
from tensorhub.core.client import Credentials
from tensorhub.core.data_types import Heartbeat, Register
from tensorhub.core.wire import decode_reply, encode
from tensorhub.sim.links import EventLoop

Reply = Callable[[object], None]


class CoordinatorQueue:
    def __init__(self, loop: EventLoop, coordinator: CoordinatorState, rpc: float,
                 socket_cost: float):
        self.loop, self.coordinator, self.rpc, self.socket_cost = (
            loop, coordinator, rpc, socket_cost)
        self._queue: deque[tuple[object, Reply | None, float]] = deque()
        self._serving = False
        self.busy = 0.0  # simulated seconds spent serving
        self.messages: Counter[str] = Counter()
        self.longest_wait = 0.0
        self.credentials = Credentials()  # the simulated workers' secrets

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
            with _no_collection():
                started = time.perf_counter()
                membership.expire(self.coordinator)
                return None, time.perf_counter() - started
        payload = encode(self.credentials.envelope(request))
        with _no_collection():
            started = time.perf_counter()
            wire = dispatch.answer(self.coordinator, payload)  # as the socket loop does
            seconds = time.perf_counter() - started
        # (the simulated fleet hears of a version from the simulator, not the PUB socket)
        self.coordinator.outbox.clear()
        reply = decode_reply(wire)
        self.credentials.learn(reply)
        return reply, seconds


@contextmanager
def _no_collection():
    """No garbage collection inside a handler's timing: a collection here walks the whole
    simulated fleet's heap (every worker's objects), which a real coordinator's process
    does not hold; charged to the coordinator, it made a 512-node fleet's handlers several
    times slower than the same handlers in a process of their own."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class SocketCost:
    """Seconds per message on the coordinator's socket beyond its handler (see
    `measure_socket_cost`): `saturated` is what the queue charges."""

    saturated: float
    half_round_trip: float
    handler: float


class Expiry:
    """The coordinator's periodic sweep for silent workers and stale leases, served in the
    queue like a message (it takes the same thread)."""

    type = "expiry"


FLOOD_CLIENT = """
import sys, time, zmq
address, payload, count = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(64)]  # 64 workers, 2 requests each in flight
poller = zmq.Poller()
for s in socks:
    s.connect(address)
    poller.register(s, zmq.POLLIN)
    for _ in range(2):
        s.send_multipart([b"0", payload])
sent, done, started = 128, 0, None
while done < count:
    for s, _ in poller.poll():
        while True:
            try:
                s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            done += 1
            if done == count // 4:  # from here on the coordinator's queue is never empty
                started = time.perf_counter()
            if sent < count:
                s.send_multipart([b"0", payload])
                sent += 1
print((time.perf_counter() - started) / (done - count // 4))
"""


def measure_socket_cost(samples: int = 20_000) -> SocketCost:
    """A coordinator's time per message on its socket beyond the handler, as a queue
    serves it: a client in another process keeps the real socket loop saturated with
    heartbeats (64 connections, 2 requests in flight on each), so the time between replies
    is one message's share of the loop; less the handler's own time, that is the socket's.
    Latency is not in it (the simulator adds half a round trip each way). Also measured,
    for comparison: half a heartbeat's round trip less the handler, which overstates it
    (it also holds the client's time and both ends' I/O threads')."""
    import subprocess
    import sys

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
        payload = encode(client.credentials.envelope(beat))
        trips, handled = [], []
        for _ in range(2000):
            started = time.perf_counter()
            client.call(beat)
            trips.append(time.perf_counter() - started)
        for _ in range(2000):
            started = time.perf_counter()
            coordinator.answer(payload)
            handled.append(time.perf_counter() - started)
        handler = statistics.median(handled)
        flood = subprocess.run(
            [sys.executable, "-c", FLOOD_CLIENT, coordinator.address, payload.hex(),
             str(samples)], capture_output=True, text=True, timeout=300, check=True)
        per_message = float(flood.stdout.split()[-1])
        return SocketCost(saturated=max(0.0, per_message - handler),
                          half_round_trip=max(0.0, statistics.median(trips) / 2 - handler),
                          handler=handler)
    finally:
        client.close()
        coordinator.stop()
