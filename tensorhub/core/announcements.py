"""Waiting for new versions: the coordinator's PUB stream, with polling as a safety net.

PUB/SUB drops messages for late joiners and slow readers, so a watcher also asks the
coordinator directly every `poll_interval`; an announcement only makes it notice sooner.
"""

from __future__ import annotations

import time

import zmq

from tensorhub.core import curve
from tensorhub.core.data_types import GetManifest
from tensorhub.core.errors import CoordinatorError, CoordinatorUnavailable
from tensorhub.core.session import WorkerSession
from tensorhub.core.wire import WireError, decode_announcement


class VersionWatcher:
    def __init__(self, session: WorkerSession, model: str, poll_interval: float = 1.0):
        self.session = session
        self.model = model
        self.poll_interval = poll_interval
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, model.encode())
        if session.client.curve_server_key is not None:  # same key as the request socket
            curve.secure_client(self._sub, session.client.curve_server_key)
        self._sub.connect(session.announce_address)

    def latest(self) -> int | None:
        """The model's latest version; None if it has none, or the coordinator is not
        answering now (restarting): the caller simply waits on."""
        try:
            return self.session.client.call(GetManifest(model=self.model)).version
        except CoordinatorUnavailable:
            return None
        except CoordinatorError as exc:
            if exc.code in ("unknown_model", "unknown_version"):
                return None
            raise

    def wait_newer(self, than: int | None, timeout: float) -> int | None:
        """Return the latest version once it is newer than `than`, or None at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            latest = self.latest()
            if latest is not None and (than is None or latest > than):
                return latest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._sub.poll(int(min(remaining, self.poll_interval) * 1000)):
                while True:
                    try:
                        _, body = self._sub.recv_multipart(zmq.NOBLOCK)
                        decode_announcement(body)
                    except (zmq.Again, ValueError, WireError):
                        break

    def close(self) -> None:
        self._sub.close(0)
