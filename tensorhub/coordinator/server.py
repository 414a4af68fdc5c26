"""The coordinator's socket loop: a ZeroMQ ROUTER answering typed requests, a PUB announcing
versions, driving the I/O-free `CoordinatorState` (`state.py`, handlers in the modules
beside it, routed by `dispatch.py`).

One thread owns the state, so handlers need no locks; it wakes at least every 100 ms to
expire silent workers and stale leases. Every request gets a typed reply: a malformed,
oversized, unauthorised or simply wrong request gets an `ErrorReply` saying why, and the
coordinator goes on serving.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import zmq

from tensorhub import settings
from tensorhub.coordinator import dispatch, membership
from tensorhub.coordinator.connections import BudgetWatch, budget_for
from tensorhub.coordinator.metrics import CoordinatorMetrics
from tensorhub.coordinator.parts import Pending
from tensorhub.coordinator.prepare import prepare
from tensorhub.coordinator.standby import StandingForests
from tensorhub.coordinator.state import CoordinatorConfig, CoordinatorState, log
from tensorhub.coordinator.table import Table
from tensorhub.coordinator.trust import Trust
from tensorhub.core import curve
from tensorhub.core.data_types import ErrorReply
from tensorhub.core.errors import AddressError
from tensorhub.core.net import split_tcp
from tensorhub.core.wire import MAX_MESSAGE_BYTES, encode

_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK


def _sockets_closed(router: zmq.Socket, pub: zmq.Socket, ctx: zmq.Context,
                    gates: list) -> None:
    """A coordinator's sockets closed, its gate stopped, its context ended (once)."""
    router.close(0)
    pub.close(0)
    for gate in gates:
        gate.stop()
    ctx.term()


def _prepare_loop(jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """The thread beside the loop: each large request decoded and made ready (`prepare`)."""
    while (job := jobs.get()) is not None:
        ident, req_id, payload, peer = job
        # No collection while it runs: its hundreds of thousands of new objects would make
        # each young collection (run by whichever thread allocates, the loop's too) walk
        # them all, for a tenth of a second at a time. What it made to keep (a manifest) is
        # frozen once made, as `settle_gc` froze what the process started with; the
        # temporaries went by reference counting.
        gc.disable()
        try:
            result = prepare(payload)
            gc.freeze()
        except Exception as exc:  # a bug must not take the coordinator down
            log.exception("internal error preparing a request")
            result = (ErrorReply(code="internal", message=f"internal error: {exc}"), None)
        finally:
            gc.enable()
        done.put((ident, req_id, peer, result))


def raise_open_files(most: int | None = None) -> tuple[int, int]:
    """Raise this process's soft open-file limit to its hard one (at most
    `settings.OPEN_FILES`): every connection holds a descriptor, and many hosts still
    default to 1024. Returns the (soft, hard) limits now."""
    try:
        import resource
    except ImportError:  # (not on this platform)
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(settings.OPEN_FILES if most is None else most,
               hard if hard != resource.RLIM_INFINITY else settings.OPEN_FILES)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("open-file limit raised from %d to %d", soft, want)
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d (%s): a thousand idle "
                        "connections may starve the coordinator of descriptors", soft, exc)
    return soft, hard


def _peer_address(frame: zmq.Frame) -> str:
    """The address a message's connection came from ("" where the transport has none)."""
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""


def announce_address_for(bind: str) -> str:
    head, _, port = bind.rpartition(":")
    return f"{head}:{int(port) + 1}"


def settle_gc(young: int = 20_000) -> None:
    """Garbage collection for a coordinator process, called once everything it imports is
    loaded. What is alive then (modules, pydantic schemas) lives as long as the process:
    frozen, out of the collector's sight. The table it builds is mostly untracked tuples,
    while one request may allocate and drop thousands of objects (a first striped plan
    carries a memory region per item): the young generation is sized so that one
    request's temporaries do not promote into collections of the whole heap, which every
    request in flight would wait for."""
    gc.freeze()
    gc.set_threshold(young, 10, 10)


@contextlib.contextmanager
def _in_use_said(bind: str, announce: str | None, which: str) -> Iterator[None]:
    """A bind whose address is taken fails naming both of the coordinator's addresses
    (the announcement one is the request port + 1 unless given), and the way out."""
    try:
        yield
    except zmq.ZMQError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        taken = bind if which == "requests" else announce
        raise AddressError(
            f"cannot bind {taken} ({which}): the address is in use (another coordinator?). A "
            f"coordinator binds {bind} for requests and {announce or 'a free port'} for "
            f"announcements (the request port + 1 unless --announce is given): pick "
            f"--bind with a port whose next one is free too, or stop the other process",
            code="address_in_use") from None


class Coordinator:
    def __init__(self, config: CoordinatorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`clock`: the time source for liveness and leases (the simulator drives its own)."""
        self.config = config = config or CoordinatorConfig()
        # A context of its own: its ZAP handler (`TokenGate`) must not judge the sockets of
        # workers or other coordinators living in the same process. Closed by `stop`, or
        # by `_sockets_closed` when a coordinator never stopped is collected.
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pub = self._ctx.socket(zmq.PUB)
        self.gate: curve.TokenGate | None = None
        self._gates: list[curve.TokenGate] = []  # (seen by the finalizer once started)
        self._close = weakref.finalize(self, _sockets_closed, self._router, self._pub,
                                       self._ctx, self._gates)
        try:
            self._bind(config)
        except BaseException:
            self._close()
            raise
        self.state = CoordinatorState(config, clock, self.announce_address)
        self.connections = BudgetWatch(
            [self._router, self._pub],
            budget_for(self._open_files, config.connections_per_peer
                       or settings.CONNECTIONS_PER_PEER),
            self.state.metrics.connections_refused).start()
        self._gates.append(self.connections)  # (stopped with the sockets)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _bind(self, config: CoordinatorConfig) -> None:
        """Make both sockets CURVE servers (with a token, or an explicit keypair), start the
        token's gate before any connection can arrive, and bind."""
        self._router.setsockopt(zmq.LINGER, 0)
        # Larger messages are dropped by libzmq, which also drops the sender's connection.
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._pub.setsockopt(zmq.LINGER, 0)
        for sock in (self._router, self._pub):  # (a stranger's idle connection: closed soon)
            sock.setsockopt(zmq.HANDSHAKE_IVL, settings.HANDSHAKE_MS)
        self._open_files, _ = raise_open_files()
        self.curve_public_key = None  # an explicit keypair's, which clients must be given
        secret = config.curve_secret or (
            curve.token_server_secret(config.token) if config.token else None)
        if secret is not None:
            for sock in (self._router, self._pub):
                curve.secure_server(sock, secret)
            if config.curve_secret is not None:
                self.curve_public_key = curve.public_key_of(config.curve_secret)
        if config.token:
            self.gate = curve.TokenGate(self._ctx, config.token)
            self._gates.append(self.gate)
        said = config.announce or (announce_address_for(config.bind)
                                   if split_tcp(config.bind) is not None else None)
        with _in_use_said(config.bind, said, "requests"):
            self._router.bind(config.bind)
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        # A requested port 0 means "any free port": the announcement port is then random
        # too (bound port + 1 may be taken by anyone).
        announce = config.announce or (
            announce_address_for(self.address) if not config.bind.endswith(":0") else None
        )
        if announce and not announce.endswith(":0"):
            with _in_use_said(config.bind, announce, "announcements"):
                self._pub.bind(announce)
            self.announce_address = announce
        else:
            port = self._pub.bind_to_random_port(self.address.rpartition(":")[0])
            self.announce_address = f"{self.address.rpartition(':')[0]}:{port}"

    # ------------------------------------------------------------------ the state's API
    @property
    def table(self) -> Table:
        return self.state.table

    @property
    def trust(self) -> Trust:
        return self.state.trust

    @property
    def metrics(self) -> CoordinatorMetrics:
        return self.state.metrics

    @property
    def pending(self) -> Pending:
        return self.state.pending

    @property
    def standby(self) -> StandingForests:
        return self.state.standby

    def start_over(self) -> None:
        """Forget every worker, version and reference, as a restart does, sockets kept."""
        self.state.start_over()

    def forgive_pause(self, seconds: float) -> None:
        membership.forgive_pause(self.state, seconds)

    def handle(self, payload: bytes):
        """Decode, authenticate and answer one request (any failure becomes an ErrorReply)."""
        return dispatch.handle(self.state, payload)

    def answer(self, payload: bytes) -> bytes:
        """`handle`, as the bytes the socket sends (what a benchmark should time)."""
        return dispatch.answer(self.state, payload)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Coordinator:
        """Serve in a background thread (tests, demos, in-process use)."""
        self._thread = threading.Thread(target=self.serve_forever, name="tensorhub-coordinator",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_metrics(self, port: int, addr: str = "0.0.0.0"):
        """Prometheus `/metrics` on `port`, from a thread of its own (`metrics.py`)."""
        server = self.state.metrics.serve(port, addr)
        self.state.fleet_measured_at = float("-inf")
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return server

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close()

    def serve_forever(self) -> None:
        log.info("coordinator serving on %s, announcing on %s", self.address,
                 self.announce_address)
        # A receive waits at most this long, so the loop sees `stop` and expiry in time: no
        # poller, and no `zmq.Again` raised (~3 us) each time the queue runs dry.
        router = self._router
        router.setsockopt(zmq.RCVTIMEO, 100)
        state = self.state
        next_expiry = 0.0
        last_turn = state.clock()
        # Large requests (a manifest of many tensors) are decoded and their manifest's work
        # done on a thread beside this loop, in short calls (`prepare.py`): the loop answers
        # other requests meanwhile, and answers them once ready.
        to_prepare: queue.SimpleQueue = queue.SimpleQueue()
        prepared: queue.SimpleQueue = queue.SimpleQueue()
        preparer = threading.Thread(target=_prepare_loop, args=(to_prepare, prepared),
                                    name="tensorhub-coordinator-prepare", daemon=True)
        preparer.start()
        preparing = 0
        try:
            while not self._stop.is_set():
                try:
                    # The routing frame is kept as a frame: the address its connection came
                    # from is asked of it (a registration's witness, `trust.py`), lazily.
                    first = router.recv(copy=False)
                    frames = [first.bytes, *router.recv_multipart()] if first.more \
                        else [first.bytes]
                    state.peer = lambda first=first: _peer_address(first)
                except zmq.Again:
                    frames = None
                now = state.clock()
                if now - last_turn > settings.PAUSE_FORGIVEN:
                    self.forgive_pause(now - last_turn)
                last_turn = now
                if frames is not None:
                    if len(frames) == 3 and len(frames[2]) > settings.PREPARE_BYTES:
                        to_prepare.put((*frames, _peer_address(first)))
                        preparing += 1
                        if preparing == 1:  # (look for it often until it is answered)
                            router.setsockopt(zmq.RCVTIMEO, settings.PREPARED_POLL_MS)
                    else:
                        self._handle_frames(frames)
                while preparing and not prepared.empty():
                    ident, req_id, peer, (envelope, work) = prepared.get()
                    preparing -= 1
                    if not preparing:
                        router.setsockopt(zmq.RCVTIMEO, 100)
                    state.peer = lambda peer=peer: peer
                    self._send(ident, req_id, dispatch.answer_prepared(state, envelope, work))
                    self._publish()
                # Expiry walks every worker and lease: at most every settings.EXPIRY_PERIOD,
                # not after every request (at 4096 workers heartbeating, that walk was most
                # of the CPU).
                if time.monotonic() >= next_expiry:
                    membership.expire(state)
                    next_expiry = time.monotonic() + settings.EXPIRY_PERIOD
        finally:
            to_prepare.put(None)

    def _handle_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            if len(frames) >= 2:
                ident, req_id = frames[0], frames[1] if len(frames) > 2 else b""
                self._send(ident, req_id, encode(ErrorReply(
                    code="bad_request",
                    message="expected frames [request id, msgpack envelope]")))
            return
        ident, req_id, payload = frames
        self._send(ident, req_id, self.answer(payload))
        self._publish()

    def _send(self, ident: bytes, req_id: bytes, reply: bytes) -> None:
        router = self._router
        try:  # three sends: `send_multipart` checks and wraps frames at twice the cost
            router.send(ident, _SEND_MORE)
            router.send(req_id, _SEND_MORE)
            router.send(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _publish(self) -> None:
        """Send the announcements the state made, from the loop's thread (the PUB socket is
        its own; a subscriber too slow misses them: it asks for the latest)."""
        outbox = self.state.outbox
        while outbox:
            topic, msg = outbox.pop(0)
            try:
                self._pub.send_multipart([topic, msg], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
