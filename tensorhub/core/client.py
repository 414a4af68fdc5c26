"""Request/reply with the coordinator over a ZeroMQ DEALER socket, every call with a timeout.

Each request carries an id that its reply echoes, so a reply that arrives after its caller
gave up is recognised and dropped instead of being taken as the answer to the next call.
The socket is shared by a worker's threads (pulls, heartbeats) behind one lock.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import zmq

from tensorhub.core import curve
from tensorhub.core.data_types import Envelope, ErrorReply
from tensorhub.core.errors import CoordinatorError, CoordinatorUnavailable
from tensorhub.core.wire import WireError, decode_reply, encode

DEFAULT_TIMEOUT = 10.0
# A busy reply's retry_after is scaled by 1 +- this (uniform): readers refused together
# (every reader asks at once when a version is announced) ask again out of step, so a
# holder whose slot frees is taken at once, not at the next common tick (the simulated
# fleet, worst / lower bound: 1.245 -> 1.22 at N = 1024, 1.28 -> 1.26 at N = 4096).
BUSY_RETRY_JITTER = 0.5


def busy_wait(retry_after: float, jitter: float = BUSY_RETRY_JITTER,
              rng: random.Random | None = None) -> float:
    """How long a reader refused as busy waits before asking again (the simulator passes its
    own seeded `rng` and jitter)."""
    return retry_after * (1 + jitter * (rng or random).uniform(-1.0, 1.0))


def token_from_env() -> str | None:
    """The shared control-plane token: TENSORHUB_TOKEN, or the file TENSORHUB_TOKEN_FILE."""
    token = os.environ.get("TENSORHUB_TOKEN")
    path = os.environ.get("TENSORHUB_TOKEN_FILE")
    if not token and path:
        with open(path) as f:
            token = f.read().strip()
    return token or None


class CoordinatorClient:
    def __init__(self, address: str, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, curve_server_key: str | None = None):
        """`curve_server_key`: the coordinator's CURVE public key (default: from the
        environment, see `core/curve.py`); None there too: a plain connection."""
        self.address = address
        self.token = token if token is not None else token_from_env()
        self.timeout = timeout
        self.curve_server_key = (curve_server_key if curve_server_key is not None
                                 else curve.server_key_from_env())
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock = self._new_socket()

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_server_key is not None:
            curve.secure_client(sock, self.curve_server_key)
        sock.connect(self.address)
        return sock

    def call(self, request, timeout: float | None = None):
        """Send one request; return its typed reply or raise `CoordinatorError` /
        `CoordinatorUnavailable`."""
        timeout = self.timeout if timeout is None else timeout
        req_id = uuid.uuid4().bytes
        payload = encode(Envelope(token=self.token, request=request))
        with self._lock:
            self._sock.send_multipart([req_id, payload])
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1):
                    hint = ("" if self.curve_server_key is not None else
                            f" (if it uses CURVE, set {curve.SERVER_KEY_ENV} to its public key)")
                    raise CoordinatorUnavailable(
                        f"no reply from the coordinator at {self.address} within {timeout:.1f}s "
                        f"to {request.type!r}; is `tensorhub coordinator` running there?{hint}"
                    )
                frames = self._sock.recv_multipart()
                if len(frames) == 2 and frames[0] == req_id:
                    break  # anything else is a late reply to a call that timed out
        try:
            reply = decode_reply(frames[1])
        except WireError as exc:
            raise CoordinatorError(f"unreadable reply from the coordinator: {exc}") from None
        if isinstance(reply, ErrorReply):
            raise CoordinatorError(reply.message, code=reply.code, retry_after=reply.retry_after)
        return reply

    def close(self) -> None:
        with self._lock:
            self._sock.close(0)
