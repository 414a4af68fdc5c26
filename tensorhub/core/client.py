"""Request/reply with the coordinator over a ZeroMQ DEALER socket, every call with a timeout.

Each request carries an id that its reply echoes, so a reply that arrives after its caller
gave up is recognised and dropped instead of being taken as the answer to the next call.
The socket is shared by a worker's threads (pulls, heartbeats) behind one lock.
"""

from __future__ import annotations

import threading
import time
import uuid

import zmq
from zmq.utils.monitor import recv_monitor_message

from tensorhub import settings
from tensorhub.core import curve
from tensorhub.core.data_types import Envelope, ErrorReply, Registered
from tensorhub.core.errors import CoordinatorError, CoordinatorUnavailable
from tensorhub.core.net import check_coordinator_address
from tensorhub.core.wire import WireError, decode_reply, encode, foreign

# Handshakes failed in a row that mean "refused": one may be a coordinator killed mid-way.
REFUSALS = 3
SNDHWM = 1000  # requests a client queues while the coordinator is unreachable (libzmq's)


def token_from_env() -> str | None:
    """The shared control-plane token: TENSORHUB_TOKEN, or the file TENSORHUB_TOKEN_FILE."""
    token = settings.TOKEN.get()
    path = settings.TOKEN_FILE.get()
    if not token and path:
        token = path.read_text().strip()
    return token or None


class Credentials:
    """What a client shows the coordinator: the token, and for a request made as a worker,
    the secret that worker was given when it registered (learned from `Registered`). One
    object may serve several clients of one worker (its heartbeat connection)."""

    def __init__(self, token: str | None = None):
        self.token = token
        self._secrets: dict[str, str] = {}  # worker id -> its secret

    def envelope(self, request) -> Envelope:
        worker_id = getattr(request, "worker_id", None)
        return Envelope(token=self.token, request=request,
                        secret=self._secrets.get(worker_id) if worker_id else None)

    def learn(self, reply) -> None:
        if type(reply) is Registered:
            self.remember(reply.worker_id, reply.secret)

    def remember(self, worker_id: str, secret: str) -> None:
        self._secrets[worker_id] = secret


class CoordinatorClient:
    def __init__(self, address: str, token: str | None = None,
                 timeout: float = settings.REQUEST_TIMEOUT, curve_server_key: str | None = None,
                 credentials: Credentials | None = None):
        """`curve_server_key`: the coordinator's CURVE public key, when it was given one
        (`tensorhub keygen`; default: from the environment, see `core/curve.py`). With a
        token the connection is CURVE in any case (the key then derived from the token)."""
        self.address = check_coordinator_address(address)
        self.token = token if token is not None else token_from_env()
        self.credentials = credentials or Credentials(self.token)
        self.timeout = timeout
        explicit = (curve_server_key if curve_server_key is not None
                    else curve.server_key_from_env())
        self.curve_server_key = explicit or (
            curve.token_server_key(self.token) if self.token else None)
        self._keypair = curve.token_client_keypair(self.token) if self.token else None
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock, self._monitor = self._new_socket()
        # (without CURVE a connection cut short says nothing of keys: only a refusal in so
        # many words, a CURVE coordinator's mechanism mismatch, counts)
        self._handshake = _Handshake(cut_short_counts=self.curve_server_key is not None)

    def secure(self, sock: zmq.Socket) -> None:
        """Make a (not yet connected) socket of ours speak to the coordinator as this
        client does (the announcement socket: `VersionWatcher`)."""
        if self.curve_server_key is not None:
            curve.secure_client(sock, self.curve_server_key, self._keypair)

    def _new_socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.secure(sock)
        # Watched with or without CURVE: a client without the token fails the handshake
        # of a coordinator that has one (a mechanism mismatch), and is told so.
        monitor = sock.get_monitor_socket(  # (a fresh address: an fd-named one may be taken)
            _HANDSHAKE_EVENTS, addr=f"inproc://tensorhub-monitor-{uuid.uuid4().hex}")
        sock.connect(self.address)
        return sock, monitor

    def _refused(self, request, outright: bool = False) -> CoordinatorError | None:
        """Why the coordinator's handshakes fail, if they did since the last success
        (`outright`: only if the last one was refused in so many words)."""
        self._handshake.take(self._monitor)
        if self._handshake.failed < REFUSALS or (outright and not self._handshake.outright):
            return None
        return CoordinatorError(
            f"the coordinator at {self.address} refused our handshake for {request.type!r} "
            f"({self._handshake.failed} times): wrong or missing token (a coordinator "
            f"started without one refuses a client that has one); set "
            f"TENSORHUB_TOKEN (or TENSORHUB_TOKEN_FILE) as the coordinator has it, and, if "
            f"it was given a keypair by `tensorhub keygen`, "
            f"{settings.CURVE_SERVER_KEY.name} to its public key",
            code="unauthorized")

    def _send(self, request, frames: list[bytes], deadline: float, timeout: float) -> None:
        """Queue a request, waiting no later than `deadline` for a connection to take it.
        Bounded like the reply: with the coordinator gone, requests queue up to the
        socket's high-water mark, and a blocking send would then wait for ever. A
        connection writable when polled may be dropped before the send (a handshake the
        coordinator refused): the wait then goes on for the next one."""
        while True:
            self._wait(request, zmq.POLLOUT, deadline, timeout, unsent=True)
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                continue

    def _wait(self, request, event: int, deadline: float, timeout: float,
              unsent: bool = False) -> None:
        """Return once the socket is ready for `event`; raise at `deadline`, or as soon as
        a handshake is refused in so many words (no use waiting out the timeout then;
        handshakes cut short may be a coordinator restarting behind a proxy, and count
        only at the deadline)."""
        poller = zmq.Poller()
        poller.register(self._sock, event)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._sock.poll(0, event):
            refused = self._refused(request, outright=True)
            if refused is not None:
                raise refused
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(int(remaining * 1000) + 1):
                raise self._unanswered(request, timeout, unsent)

    def _unanswered(self, request, timeout: float,
                    unsent: bool = False) -> CoordinatorError | CoordinatorUnavailable:
        """Why a call got no reply in time: a refused handshake, or no coordinator."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        hint = ("" if self.curve_server_key is not None else
                " (if it uses a token, set TENSORHUB_TOKEN as it has it; if it "
                f"uses a CURVE key, set {settings.CURVE_SERVER_KEY.name} to its "
                f"public key)")
        if unsent:
            return CoordinatorUnavailable(
                f"cannot send {request.type!r} to the coordinator at {self.address} within "
                f"{timeout:.1f}s: no connection to it takes requests ({SNDHWM} wait unsent "
                f"once it has been unreachable for a while); is `tensorhub coordinator` "
                f"running there?{hint}")
        return CoordinatorUnavailable(
            f"no reply from the coordinator at {self.address} within {timeout:.1f}s "
            f"to {request.type!r}; is `tensorhub coordinator` running there?{hint}")

    def call(self, request, timeout: float | None = None):
        """Send one request; return its typed reply or raise `CoordinatorError` /
        `CoordinatorUnavailable`."""
        timeout = self.timeout if timeout is None else timeout
        req_id = uuid.uuid4().bytes
        payload = encode(self.credentials.envelope(request))
        with self._lock:
            self._handshake.take(self._monitor)  # (read every call: its queue is bounded)
            deadline = time.monotonic() + timeout
            self._send(request, [req_id, payload], deadline, timeout)
            while True:
                self._wait(request, zmq.POLLIN, deadline, timeout)
                frames = self._sock.recv_multipart()
                if len(frames) == 2 and frames[0] == req_id:
                    break  # anything else is a late reply to a call that timed out
        try:
            reply = decode_reply(frames[1])
        except WireError as exc:
            why = foreign(frames[1], "the coordinator", "worker_id")
            raise CoordinatorError(why or f"unreadable reply from the coordinator: {exc}",
                                   code="bad_request") from None
        if isinstance(reply, ErrorReply):
            raise CoordinatorError(reply.message, code=reply.code, retry_after=reply.retry_after)
        self.credentials.learn(reply)
        return reply

    def close(self) -> None:
        with self._lock:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)


_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)


class _Handshake:
    """What a client socket's monitor said of its handshakes: `failed` scores those
    that failed since the last that succeeded. A handshake refused in so many words (ZAP,
    a mechanism mismatch) scores `REFUSALS` at once and is `outright`; one cut short scores
    1 (a coordinator with another key drops it silently, but so does one killed mid-way,
    or a proxy whose coordinator restarts), and nothing where the client has no CURVE key
    (a CURVE coordinator refuses such a client outright)."""

    def __init__(self, cut_short_counts: bool = True) -> None:
        self.failed = 0
        self.outright = False  # the last failure was a refusal in so many words
        self._cut_short_counts = cut_short_counts
        self._up = False
        self._counted = False  # this connection's failure is scored already

    def take(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failed, self._up, self._counted = 0, True, False
                self.outright = False
            elif event == zmq.EVENT_DISCONNECTED:
                cut_short = not (self._up or self._counted) and self._cut_short_counts
                self.failed += cut_short
                self.outright = self.outright and not cut_short
                self._up = self._counted = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.failed += self._cut_short_counts
                self.outright = self.outright and not self._cut_short_counts
                self._counted = True
            else:  # refused: wrong credentials, or no CURVE at all on one side
                self.failed += REFUSALS
                self.outright = self._counted = True
