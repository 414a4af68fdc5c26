"""Waiting for new versions: the coordinator's announcements, with one fallback.

Announcements (PUB/SUB) are the way a worker learns of a version. PUB/SUB drops messages
for late joiners and slow readers, so when none has come for `poll_interval` the watcher
asks once (`LatestRequest`, answered with the newest announcement if it is newer than the
newest heard, else with a few bytes); that is the only
polling. An announcement carries what a reader needs to pull the version by the parents it
had for the previous one, without a plan request (`Replica`).
"""

from __future__ import annotations

import time

import zmq

from tensorhub.core.data_types import Announcement, LatestRequest
from tensorhub.core.errors import CoordinatorError, CoordinatorUnavailable
from tensorhub.core.patch import patch_model
from tensorhub.core.session import WorkerSession
from tensorhub.core.wire import WireError, decode_announcement

HEARD = 16  # versions and patches remembered


def _keep_newest(seen: dict[int, Announcement] | set[int], count: int) -> None:
    for old in sorted(seen)[:-count]:
        if isinstance(seen, set):
            seen.discard(old)
        else:
            del seen[old]


class VersionWatcher:
    def __init__(self, session: WorkerSession, model: str, poll_interval: float = 1.0):
        self.session = session
        self.model = model
        self.poll_interval = poll_interval
        self.newest: Announcement | None = None
        self._heard = float("-inf")  # when we last heard or asked
        # The model's patches (`core/patch.py`) are announced on a topic our subscription's
        # prefix takes in, each before its version: a version heard here with no patch
        # heard before it has none. The newest few of both, by version.
        self._patch_model = patch_model(model)
        self.patches: dict[int, Announcement] = {}
        self._heard_versions: set[int] = set()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, model.encode())
        session.client.secure(self._sub)  # as the request socket: CURVE with a token
        self._sub.connect(session.announce_address)

    def _take(self, announcement: Announcement, published: bool = False) -> None:
        """`published`: heard on the subscription (not asked for)."""
        self._heard = time.monotonic()
        if announcement.model == self._patch_model:
            self.patches[announcement.version] = announcement
            _keep_newest(self.patches, HEARD)
            return
        if published and announcement.model == self.model:
            self._heard_versions.add(announcement.version)
            _keep_newest(self._heard_versions, HEARD)
        if announcement.model == self.model and (
                self.newest is None or announcement.version >= self.newest.version):
            self.newest = announcement

    def _drain(self) -> None:
        while True:
            try:
                _, body = self._sub.recv_multipart(zmq.NOBLOCK)
                self._take(decode_announcement(body), published=True)
            except zmq.Again:
                return
            except (ValueError, WireError):
                continue

    def _ask(self) -> None:
        """The fallback: the newest version as announced, straight from the coordinator,
        if newer than the newest we heard of (else a few bytes say it is not)."""
        self._heard = time.monotonic()
        heard = self.newest.version if self.newest is not None else None
        try:
            reply = self.session.client.call(LatestRequest(model=self.model, newer_than=heard))
            if isinstance(reply, Announcement):
                self._take(reply)
        except CoordinatorUnavailable:
            pass  # restarting: the caller simply waits on
        except CoordinatorError as exc:
            if exc.code not in ("unknown_model", "unknown_version"):
                raise

    def _refresh(self) -> None:
        """Take what was announced; ask once if we have heard of no version at all."""
        self._drain()
        if self.newest is None:
            self._ask()

    def announcement(self, version: int | str = "latest") -> Announcement | None:
        """The announcement of `version` (or of the newest), if we have it."""
        self._refresh()
        a = self.newest
        return a if a is not None and version in ("latest", a.version) else None

    def patch(self, version: int) -> tuple[bool, Announcement | None]:
        """(known, announcement) of the patch that makes `version`: known is True when the
        patch was heard, or the version was heard with no patch before it (None: it has
        none); False when only the coordinator can say."""
        self._drain()
        if version in self.patches:
            return True, self.patches[version]
        return version in self._heard_versions, None

    def latest(self) -> int | None:
        a = self.announcement()
        return a.version if a is not None else None

    def wait_newer(self, than: int | None, timeout: float) -> int | None:
        """Return the newest version once it is newer than `than`, or None at the timeout."""
        deadline = time.monotonic() + timeout
        self._refresh()
        while True:
            if self.newest is not None and (than is None or self.newest.version > than):
                return self.newest.version
            now = time.monotonic()
            if now >= deadline:
                return None
            quiet_until = self._heard + self.poll_interval
            if now >= quiet_until:
                self._ask()
                continue
            if self._sub.poll(max(1, int((min(deadline, quiet_until) - now) * 1000))):
                self._drain()

    def close(self) -> None:
        self._sub.close(0)
