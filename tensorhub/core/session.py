"""A worker's membership: registration, heartbeats, and the references it holds.

Publisher and Replica both stand on this. It re-registers by itself when the coordinator has
forgotten it (restart, or a missed heartbeat window) and replays every reference it holds,
so the coordinator's soft state comes back without any worker restarting.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import torch

from tensorhub import settings
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    Dropped,
    Heartbeat,
    HeartbeatReply,
    Hold,
    Part,
    Publish,
    Published,
    PullProgress,
    Register,
    Unregister,
    Withdraw,
)
from tensorhub.core.errors import CoordinatorError, CoordinatorUnavailable, TensorHubError
from tensorhub.core.layout import BoundLayout
from tensorhub.core.memory import describe
from tensorhub.core.net import check_coordinator_address, local_address_towards, reachable_announce
from tensorhub.core.stripes import POLL_WINDOW, PROGRESS_BYTES
from tensorhub.core.topology import worker_labels
from tensorhub.core.transport import Transport, make_transport

T = TypeVar("T")
log = logging.getLogger("tensorhub.session")
POLL_SLOTS = 64  # poll buffers: one per stripe a pull reads (stripes are at most 64)

_named = itertools.count()


def default_name(role: str) -> str:
    """A worker name nobody else has by default: the role, this host and process, and a
    number for each further one in the process (`replica-gpu3-4182`, `replica-gpu3-4182-2`),
    so that status and logs tell workers given no name apart."""
    n = next(_named)
    return f"{role}-{socket.gethostname()}-{os.getpid()}" + (f"-{n + 1}" if n else "")


class WorkerSession:
    def __init__(
        self,
        coordinator: str,
        name: str,
        role: str,
        transport: str | Transport | None = None,
        labels: dict[str, str] | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        register_wait: float = 0.0,
        owners: dict[str, str] | None = None,
    ):
        """`register_wait`: how long to keep trying to register while the coordinator does
        not answer (not up yet, restarting: a lost request is sent again); 0: one try.
        `owners`: a trainer's model credentials, shown from its first registration on."""
        check_coordinator_address(coordinator)  # (before a transport is made for it)
        self.name = name
        self.role = role
        self.labels = worker_labels(labels)
        self.transport = (
            transport if isinstance(transport, Transport)
            else make_transport(transport, worker_name=f"{name}-{uuid.uuid4().hex[:8]}",
                                host=local_address_towards(coordinator))
        )
        # Progress bytes (what striped readers of our pulls poll one-sided), then one poll
        # buffer per stripe for our own polls of others: registered once, for good.
        self._progress = torch.zeros(PROGRESS_BYTES + POLL_SLOTS * POLL_WINDOW,
                                     dtype=torch.uint8)
        self.progress = self._progress[:PROGRESS_BYTES]
        self.transport.register([self._progress])
        self.client = CoordinatorClient(coordinator, token=token, timeout=timeout)
        # Heartbeats have a connection of their own: behind a slow plan or withdrawal on
        # `client` they could miss the coordinator's TTL and get a healthy worker evicted.
        self._beat_client = CoordinatorClient(coordinator, token=token, timeout=timeout,
                                              credentials=self.client.credentials)
        self._holds: dict[tuple[str, int], tuple[BoundLayout, Hold]] = {}
        self._unannounced: set[tuple[str, int]] = set()  # held, coordinator was unreachable
        # held versions the coordinator stopped planning reads on (`_dropped`): offered
        # again no sooner than this (monotonic)
        self._offer_after: dict[tuple[str, int], float] = {}
        self._withdrawing: set[tuple[str, int]] = set()  # never offered again meanwhile
        self._checking: set[tuple[str, int]] = set()  # held versions being checked again
        self._lock = threading.RLock()
        self.worker_id = ""
        self.registrations = 0  # times registered: a new coordinator knows nothing of ours
        self.heartbeat_interval = 1.0
        self.lease_ttl = 120.0  # (the coordinator says, at registration)
        self.announce_address = ""
        # The pull in flight, if any (`Replica.pull` sets it): heartbeats carry it to the
        # coordinator's status (the live view), and a long one is logged every 10 s.
        self.pulling: Callable[[], PullProgress] | None = None
        # A trainer's newest published version per model, told at each registration
        # (`Publisher` sets it): a restarted coordinator drops versions of another run.
        self.published: Callable[[], dict[str, int]] | None = None
        # model -> the credential its first publish returned (`Publisher` keeps them):
        # shown again at each registration, so a restarted coordinator knows its owner.
        self.owners: dict[str, str] = dict(owners or {})
        # Checks a held version's bytes again (`Replica` sets it): run when readers report
        # bad bytes of it, before it is offered again (it withdraws if they are bad).
        self.check_held: Callable[[str, int], None] | None = None
        self._progress_logged = 0.0
        try:
            self._register_patiently(register_wait)
        except BaseException:
            self.transport.close()
            self.client.close()
            self._beat_client.close()
            raise
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                      name=f"tensorhub-heartbeat-{name}")
        self._beat.start()

    def poll_buffer(self, stripe: int) -> torch.Tensor:
        """Registered scratch for polls of stripe `stripe`'s parent (one poll at a time)."""
        start = PROGRESS_BYTES + stripe * POLL_WINDOW
        return self._progress[start:start + POLL_WINDOW]

    # ------------------------------------------------------------------ membership
    def _register(self) -> None:
        reply = self.client.call(
            Register(name=self.name, role=self.role, endpoint=self.transport.endpoint(),
                     labels=self.labels, progress=describe(self.progress),
                     grant_key=self.transport.grant_key,
                     published=self.published() if self.published else {},
                     owners=dict(self.owners))
        )
        self.registrations += 1
        self.worker_id = reply.worker_id
        self.heartbeat_interval = reply.heartbeat_interval
        self.lease_ttl = reply.lease_ttl
        self.announce_address = reachable_announce(reply.announce_address,
                                                   self.client.address)

    def _register_patiently(self, wait: float) -> None:
        self._patiently(lambda timeout: self._register(), wait)

    def _patiently(self, attempt: Callable[[float], T], wait: float) -> T:
        """`attempt(timeout)` tried again while the coordinator does not answer, for up to
        `wait` seconds in all; then `CoordinatorUnavailable`."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return attempt(min(self.client.timeout,
                                   max(0.1, deadline - time.monotonic())))
            except CoordinatorUnavailable:
                if time.monotonic() >= deadline:
                    raise
                # (one short line a try: the error itself, with its hints, comes at the end)
                log.warning("%s: no answer from the coordinator at %s; trying again for up "
                            "to %.0f s more", self.name, self.client.address,
                            deadline - time.monotonic())

    def _recover(self) -> None:
        """The coordinator forgot us: register again and re-announce what we hold."""
        with self._lock:
            log.warning("%s: coordinator does not know us; registering again", self.name)
            self._register()
            self._unannounced.clear()
            self._offer_after.clear()  # (a new coordinator keeps no probation)
            for (model, version), (layout, hold) in list(self._holds.items()):
                hold = hold.model_copy(update={"worker_id": self.worker_id,
                                               "endpoint": self.transport.endpoint()})
                try:
                    self.client.call(hold)
                    self._holds[(model, version)] = (layout, hold)
                except CoordinatorError as exc:
                    log.warning("%s: could not re-announce %s v%d: %s", self.name, model,
                                version, exc)
                    if exc.code != "busy":
                        self._holds.pop((model, version), None)

    def _as_me(self, request):
        """`request` sent as this worker (requests that name no worker go as they are),
        with the `Progress` and `ReadDone` it carries too: after the coordinator restarted
        and we registered again, a pull in flight still carries ones made under our old id
        (its leases are gone with the old coordinator; its progress is worth keeping)."""
        if "worker_id" not in type(request).model_fields:
            return request
        update: dict = {"worker_id": self.worker_id}
        if type(request) is Publish and request.model in self.owners:
            update["owner"] = self.owners[request.model]
        for key in ("progress", "done"):
            carried = getattr(request, key, None)
            if carried is not None and carried.worker_id != self.worker_id:
                update[key] = carried.model_copy(update={"worker_id": self.worker_id})
        return request.model_copy(update=update)

    def call(self, request, timeout: float | None = None):
        """Call the coordinator as this worker; recover once if it has forgotten us. A
        `Publish` shows the model's credential, and a `Published` that binds a model
        gives it (`owners`)."""
        try:
            reply = self.client.call(self._as_me(request), timeout)
        except CoordinatorError as exc:
            if exc.code != "unknown_worker":
                raise
            self._recover()
            reply = self.client.call(self._as_me(request), timeout)
        if type(reply) is Published and reply.owner is not None:
            self.owners[reply.model] = reply.owner
        return reply

    def call_patiently(self, request, wait: float):
        """`call`, tried again while the coordinator does not answer (restarting, paused,
        unreachable for a moment), for up to `wait` seconds in all; then
        `CoordinatorUnavailable`. Only for requests that are safe to repeat."""
        return self._patiently(lambda timeout: self.call(request, timeout), wait)

    def _pull_progress(self) -> PullProgress | None:
        """The pull in flight, logged when it has run long (a join of a big model, a slow
        link): an operator sees it move without watching the coordinator."""
        pulling = self.pulling
        if pulling is None:
            return None
        try:
            pull = pulling()
        except Exception as exc:  # never at the cost of the heartbeat itself
            log.debug("%s: the pull's progress: %s", self.name, exc)
            return None
        if pull.seconds >= settings.PROGRESS_LOG_SECONDS \
                and time.monotonic() - self._progress_logged >= settings.PROGRESS_LOG_SECONDS:
            self._progress_logged = time.monotonic()
            log.info("%s: pulling %s v%d: %.0f%% (%.1f of %.1f MiB) in %.0f s, %.2f GB/s",
                     self.name, pull.model, pull.version,
                     100 * pull.done / max(pull.total, 1), pull.done / 2**20,
                     pull.total / 2**20, pull.seconds, pull.done / max(pull.seconds, 1e-9) / 1e9)
        return pull

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                try:
                    reply = self._beat_client.call(
                        Heartbeat(worker_id=self.worker_id, pull=self._pull_progress()),
                        timeout=max(2.0, 2 * self.heartbeat_interval))
                    if isinstance(reply, HeartbeatReply):
                        self._dropped(reply.dropped)
                except CoordinatorError as exc:
                    if exc.code != "unknown_worker":
                        raise
                    self._recover()
                if self._unannounced:
                    self._announce_pending()
            except (CoordinatorUnavailable, CoordinatorError) as exc:
                log.debug("%s: heartbeat failed: %s", self.name, exc)
            except Exception:  # never let the thread die silently
                log.exception("%s: heartbeat loop error", self.name)

    # ------------------------------------------------------------------ references
    def hold(self, model: str, version: int, layout: BoundLayout, checksums: list[str],
             part: Part | None = None) -> None:
        """Tell the coordinator we hold `version` (its `part`, of a sharded one) completely
        and serve reads of it."""
        self.offer(Hold(worker_id=self.worker_id, model=model, version=version,
                        layout_id=layout.layout_id, memory=layout.memory(),
                        endpoint=self.transport.endpoint(), manifest=layout.manifest,
                        checksums=checksums, part=part.part if part else 0,
                        parts=part.parts if part else 1), layout)

    def offer(self, hold: Hold, layout: BoundLayout, planned: bool = False) -> None:
        """`hold` (of the bytes of `layout`) told to the coordinator, and kept: offered
        again after a re-registration, or later when it is unreachable now. `planned`:
        the coordinator planned the pull of this layout, so it is named by id alone
        (`Hold.by_reference`), and told in full only if the coordinator no longer has it
        (restarted since)."""
        model, version = hold.model, hold.version
        with self._lock:
            self._holds[(model, version)] = (layout, hold)
            try:
                self._tell(hold, planned)
            except CoordinatorUnavailable:
                # The bytes are complete and verified: keep serving them, and announce them
                # as soon as the coordinator answers again (the heartbeat loop retries).
                log.warning("%s: coordinator unreachable; will announce %s v%d when it is "
                            "back", self.name, model, version)
                self._unannounced.add((model, version))
            except CoordinatorError as exc:
                if exc.code != "probation":
                    self._holds.pop((model, version), None)
                    raise
                # (we held it before and readers failed on us: offered again, later)
                log.warning("%s: %s", self.name, exc)
                self._offer_later((model, version), exc.retry_after or 0)
            except BaseException:
                self._holds.pop((model, version), None)
                raise

    def _dropped(self, dropped: list[Dropped]) -> None:
        """The coordinator stopped planning reads from us on versions readers on several
        nodes failed to read: we still hold them, so they are offered again (`Hold`, from
        the heartbeat loop) once the coordinator's probation is over."""
        with self._lock:
            for d in dropped:
                key = (d.model, d.version)
                if key not in self._holds or key in self._withdrawing:
                    continue
                if key not in self._unannounced:
                    log.warning("%s: readers on several nodes could not read %s v%d from us, "
                                "so the coordinator stopped planning reads from us; offering "
                                "it again in %.0f s", self.name, d.model, d.version,
                                d.retry_after)
                # (the coordinator's clock decides: each reply says how long is left)
                self._offer_later(key, d.retry_after)
                if d.bad_bytes and self.check_held is not None \
                        and key not in self._checking:
                    self._checking.add(key)
                    threading.Thread(target=self._check_held, args=key, daemon=True,
                                     name=f"tensorhub-check-{self.name}").start()

    def _check_held(self, model: str, version: int) -> None:
        """Readers found bad bytes of a version we hold: check our copy (`check_held`
        withdraws it if it is damaged) before it is offered again."""
        try:
            self.check_held(model, version)
        except Exception as exc:  # (it logged and withdrew what it found damaged)
            log.warning("%s: checking %s v%d: %s", self.name, model, version, exc)
        finally:
            with self._lock:
                self._checking.discard((model, version))

    def _offer_later(self, key: tuple[str, int], seconds: float) -> None:
        """Offer a held version again (`_announce_pending`) no sooner than `seconds` from
        now (the caller holds the lock)."""
        self._offer_after[key] = time.monotonic() + seconds
        self._unannounced.add(key)

    def _announce_pending(self) -> None:
        with self._lock:
            for key in list(self._unannounced):
                if key in self._withdrawing or self._offer_after.get(key, 0) > time.monotonic():
                    continue
                entry = self._holds.get(key)
                if entry is not None:
                    try:
                        self.call(entry[1].model_copy(update={
                            "endpoint": self.transport.endpoint()}))
                    except CoordinatorError as exc:
                        if exc.code == "probation":
                            self._offer_later(key, exc.retry_after or 0)
                        if exc.code in ("busy", "probation"):
                            continue  # asked again at a later heartbeat
                        log.warning("%s: could not announce %s v%d: %s", self.name, *key, exc)
                        self._holds.pop(key, None)
                self._unannounced.discard(key)
                self._offer_after.pop(key, None)

    def _tell(self, hold: Hold, planned: bool) -> None:
        if planned:
            try:
                self.call(hold.by_reference())
                return
            except CoordinatorError as exc:
                if exc.code not in ("layout_mismatch", "unknown_version"):
                    raise
        self.call(hold)

    def remember(self, model: str, version: int, layout: BoundLayout, hold: Hold) -> None:
        with self._lock:
            self._holds[(model, version)] = (layout, hold)

    def withdraw(self, model: str, version: int, timeout: float, force: bool = False,
                 damaged: bool = False) -> None:
        """Stop serving `version` and wait until reads of it in flight have ended.

        Only then may the caller overwrite the bytes (the mutability contract). Raises
        `TensorHubError` ("busy") if reads are still in flight after `timeout` seconds, or
        ("last_holder") if we still are the only holder of the model's newest version then
        (the coordinator will not let it be lost; `force` overrides that).
        """
        key = (model, version)
        with self._lock:  # no heartbeat offers it again once the coordinator let it go
            self._withdrawing.add(key)
        try:
            self._withdraw(key, timeout, force, damaged)
        finally:
            with self._lock:
                self._withdrawing.discard(key)

    def _withdraw(self, key: tuple[str, int], timeout: float, force: bool,
                  damaged: bool = False) -> None:
        (model, version), deadline = key, time.monotonic() + timeout
        while True:
            try:
                reply = self.call(Withdraw(worker_id=self.worker_id, model=model,
                                           version=version, force=force, damaged=damaged))
            except CoordinatorError as exc:
                if exc.code != "last_holder":
                    raise
                if time.monotonic() > deadline:
                    raise TensorHubError(f"{exc} (waited {timeout:.1f}s)",
                                         code="last_holder") from None
                time.sleep(exc.retry_after or 0.2)
                continue
            with self._lock:
                self._holds.pop(key, None)
                self._unannounced.discard(key)
                self._offer_after.pop(key, None)
            if reply.active_reads == 0:
                return
            if time.monotonic() > deadline:
                raise TensorHubError(
                    f"{reply.active_reads} read(s) of {model} v{version} still in flight after "
                    f"{timeout:.1f}s; not overwriting it", code="busy")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._beat.join(timeout=5)
        try:
            self.client.call(Unregister(worker_id=self.worker_id), timeout=2.0)
        except TensorHubError:
            pass
        self.transport.close()
        self.client.close()
        self._beat_client.close()
