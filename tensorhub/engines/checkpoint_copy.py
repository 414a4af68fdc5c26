"""The worker-side half of an engine plugin: a checkpoint-layout copy that pulls and serves.

On CPU, engines repack their weights after loading, so an engine cannot serve reads from
its live parameters; it keeps the version it holds in checkpoint layout (HF names, as the
trainer publishes them) in registered memory. That copy is a `Replica`: it pulls a new
version while the engine keeps generating with the old one, serves it to other engines at
once, and is what the engine applies with its own `load_weights`.

In follow mode a thread pulls each announced version, but only once the engine has applied
what it holds, or turned it down, so the copy is never overwritten while the front end may
still apply it. Nothing times out: a version the ranks of one engine cannot all apply (one
rank holds a newer one) is let go by vLLM's front end (`release`, `versions_to_release`;
SGLang's pulls the version it applies, so its ranks never wait on each other).

An engine of several ranks (tensor or pipeline parallel) has a copy per rank, or the ranks
of each node and stage share their lowest rank's (`shared_copy.py`), and applies a version
on all of them or on none: `tensors_of` takes a vote (`agree`, `votes.RankVote`) among the
ranks before any of them touches its weights, and another after they loaded it
(`TornLoad`, `restore`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from tensorhub import settings
from tensorhub.core.errors import TensorHubError
from tensorhub.engines.background_priority import yield_to_engine
from tensorhub.engines.fleet import FleetView
from tensorhub.engines.outcome import InstallFailed
from tensorhub.engines.weights_check import LoadableWeights, from_manifests, from_tensors
from tensorhub.parted import PartedReplica
from tensorhub.tiles import Share

log = logging.getLogger("tensorhub.engines")


class TornLoad(TensorHubError):
    """A load that failed half-way, on this rank (`cause`) or another: the model holds
    parts of two versions until a whole one is loaded again (`restore_after`)."""

    def __init__(self, version: int, cause: BaseException | None = None):
        where = f": {cause}" if cause is not None else " on another rank of this engine"
        super().__init__(f"loading v{version} failed half-way{where}", code="torn")
        self.version = version


def alone(ok: bool) -> bool:
    """The vote of an engine with one rank."""
    return ok


def versions_to_release(holdings: dict[str, list[int]], serving: int | None) -> set[int]:
    """Versions that ranks of one engine hold (worker name -> versions held) and that the
    engine will never apply: another rank already holds a newer one, and a rank's copy
    keeps one version. Their ranks should let them go (`CheckpointCopy.release`) and
    pull the newest. None while a rank holds nothing (it is pulling)."""
    newest = [max(held) for held in holdings.values() if held]
    if len(newest) < len(holdings) or not newest:
        return set()
    top = max(newest)
    return {v for v in newest if v < top and (serving is None or v > serving)}


class CheckpointCopy:
    def __init__(self, coordinator: str, model: str, name: str, *,
                 transport: str | None = None, follow: bool = True,
                 pull_timeout: float = 120.0, share: Share | None = None):
        """`share`: the parts of each version the copy pulls (`PartedReplica`): a node's
        copy pulls its ranks' tiles of a version in tiles (`tiles.node_share`)."""
        self.replica = PartedReplica(coordinator, model, name=name, transport=transport,
                                     share=share)
        self.pull_timeout = pull_timeout
        self.applied: int | None = None
        self.refused: int | None = None  # the last version the engine's ranks turned down
        self.last_error: str | None = None
        # What the engine's model loads (set by the plugin; then the last version applied):
        # a version unlike it is refused before the model is touched (`tensors_of`).
        self.loadable: LoadableWeights | None = None
        self.unloadable: dict | None = None  # the last version refused so: {version, reason}
        self._lock = threading.Lock()
        self._pulls = 0  # bumped by every pull into the copy
        self._prepared: tuple[int, int] | None = None  # (version, pulls) checked in `prepare`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if follow:
            self._thread = threading.Thread(target=self._follow, daemon=True,
                                            name=f"tensorhub-follow-{name}")
            self._thread.start()

    @property
    def version(self) -> int | None:
        return self.replica.version

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def nbytes(self) -> int:
        """Bytes of the checkpoint copy (every part of a sharded version)."""
        return self.replica.nbytes

    def sources(self) -> list[str]:
        return self.replica.sources()

    def pull_whole_versions(self, why: str) -> None:
        """Pull every part of each version from now on, not this node's share (a load
        from the share failed: `share_check`; the engine, which may make new copies,
        keeps that decision too)."""
        if self.replica.share is not None:
            self.replica.share = None
            log.warning("TensorHub: %s pulls every part of each version from now on: %s",
                        self.name, why)

    def withdraw(self) -> None:
        """Stop serving the copy; reads of it in flight end first (bounded)."""
        self.replica.withdraw(self.pull_timeout)

    def pull(self, version: int | str = "latest") -> int:
        """Pull now (blocking) into the checkpoint copy; the engine keeps serving meanwhile."""
        with self._lock:
            self._pulls += 1
            got = self.replica.pull(version, timeout=self.pull_timeout)
            self.last_error = None
            return got

    def prefetch(self, version: int | str = "latest") -> None:
        """Pull in the background; returns at once (errors land in `last_error`)."""
        def run() -> None:
            yield_to_engine()
            try:
                self.pull(version)
            except TensorHubError as exc:
                self.last_error = str(exc)
                log.warning("prefetch of %s failed: %s", version, exc)
        threading.Thread(target=run, daemon=True, name="tensorhub-prefetch").start()

    def release(self, version: int) -> None:
        """The engine gives up `version` (another of its ranks holds a newer one): if this
        copy holds it unapplied, it may move on. Never waits: a swap or a pull may hold the
        copy's lock, and `refused` matters only while the copy holds that version."""
        if self.replica.version == version and self.applied != version:
            self.refused = version
            log.info("%s: letting v%d go (another rank holds a newer version)", self.name,
                     version)

    def _may_replace(self) -> bool:
        held = self.replica.version
        return held is None or held in (self.applied, self.refused)

    def _follow(self) -> None:
        yield_to_engine()
        backoff = 0.5
        lost, lost_until = None, 0.0  # a version no copy was left of: wait for a newer one
        while not self._stop.is_set():
            newer = None
            try:
                held = self.replica.version
                if lost is not None and (time.monotonic() > lost_until or (held or 0) >= lost):
                    lost = None  # try it again: holders may have come back (a restart)
                newer = self.replica.wait_for_newer(timeout=1.0,
                                                    than=held if lost is None else lost)
                if newer is None or not self._may_replace():
                    if newer is not None:
                        self._stop.wait(0.05)
                    continue
                self.pull(newer)
                backoff = 0.5
            except TensorHubError as exc:
                self.last_error = str(exc)
                if exc.code == "no_holder" and newer is not None:
                    lost, lost_until, backoff = newer, time.monotonic() + settings.LOST_RETRY, 0.5
                    log.warning("%s: %s; waiting for a newer version (or trying it again "
                                "in %.0f s)", self.name, exc, settings.LOST_RETRY)
                    continue
                log.warning("%s: pulling a new version failed (%s); retrying in %.1fs",
                            self.name, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:  # never let the thread die: the engine relies on it
                log.exception("follow loop error")
                self._stop.wait(1.0)

    @contextmanager
    def tensors_of(self, version: int, agree: Callable[[bool], bool] = alone, *,
                   loaded: Callable[[bool], bool] | None = None, fetch: bool = False,
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The checkpoint tensors of `version`, locked against replacement while the engine
        applies them. Raises before yielding if we do not hold exactly that version, or if
        another rank of the engine does not (`agree`: every rank's readiness in, whether
        all are ready out; every rank reaches it, whatever happened here). `fetch`: pull
        `version` from peers first if the copy holds another (a restore).

        After the engine's load, the ranks vote again (`loaded`, default `agree`) on
        whether each loaded it: if one did not, `TornLoad` is raised on every rank, and the
        version is not recorded as applied."""
        # (a restore waits out a pull in progress: it may take the whole pull timeout)
        locked = self._lock.acquire(timeout=self.pull_timeout if fetch else 10.0)
        try:
            named: list[tuple[str, torch.Tensor]] = []
            try:  # whatever fails here, every rank must still reach the vote
                problem = self._not_ready(version, locked, fetch)
                if problem is None:
                    named = self.replica.named_tensors()
            except Exception as exc:
                problem = exc
            if not agree(problem is None):
                self.refused = version  # nobody applies it: the copy may move on
                raise problem or TensorHubError(
                    f"another rank of this engine cannot apply v{version}, so no rank "
                    f"applies it; the engine keeps its current weights", code="refused")
            failure: Exception | None = None
            try:
                yield named
            except Exception as exc:
                failure = exc
            except BaseException:
                self.refused = version  # the engine could not load it: the copy moves on
                (loaded or agree)(False)  # the other ranks must not wait for this one
                raise
            if not (loaded or agree)(failure is None):
                self.refused = version  # the engine could not load it: the copy moves on
                raise TornLoad(version, failure) from failure
            self.applied = version
            self.loadable = from_tensors(named, f"v{version}, the last version it applied",
                                         self.loadable.optional if self.loadable else None,
                                         keep=self.loadable if self.replica.partial else None)
        finally:
            if locked:
                self._lock.release()

    def _not_ready(self, version: int, locked: bool, fetch: bool) -> Exception | None:
        """Why the copy cannot give `version` to the engine now (None: it can). `fetch`:
        pull it from peers first if the copy holds another (the caller holds the lock)."""
        if not locked:
            return TensorHubError("the checkpoint copy is busy (a pull is running)",
                                  code="busy")
        if fetch and self.replica.version != version:
            self._pulls += 1
            self.replica.pull(version, timeout=self.pull_timeout)
        if self.replica.version != version:
            held = self.replica.version
            return TensorHubError(
                f"asked to apply v{version} but this worker holds "
                f"{'nothing' if held is None else f'v{held}'}", code="unknown_version")
        if self._prepared == (version, self._pulls):
            # checked whole by `prepare` before the pause: again only where a late read
            # has landed since
            return self._unloadable(version) or self._reverified(always=False)
        return self._unloadable(version) or self._reverified()

    def prepare(self, version: int, then: Callable[[list[tuple[str, torch.Tensor]]], object]
                | None = None, busy_after: float | None = None) -> object:
        """Before the engine pauses: the checks `tensors_of` makes (loadable, every byte
        verified again), so that inside the pause only a late read that landed since is
        checked; then `then(tensors)` while the copy cannot change (an engine's own
        preparation, e.g. what a sparse install will write). Raises the refusal; returns
        what `then` returned. Waits for a pull in progress (the copy's lock), or, with
        `busy_after`, that long at most, then raises `busy` (the checks are then left to
        `tensors_of`, as `check` leaves them)."""
        if not self._lock.acquire(timeout=-1 if busy_after is None else busy_after):
            raise TensorHubError(f"the copy is busy (a pull): v{version} is checked as it "
                                 f"is installed", code="busy")
        try:
            if self.replica.version != version:
                self._prepared = None
                raise TensorHubError(f"the copy holds v{self.replica.version}, not "
                                     f"v{version}", code="unknown_version")
            self._ready_before_pause(version)
            return then(self.replica.named_tensors()) if then is not None else None
        finally:
            self._lock.release()

    def _ready_before_pause(self, version: int) -> None:
        """Check that the engine can load `version` and verify every byte of the copy
        again; raise the refusal (the copy may then move on)."""
        self._prepared = None
        problem = self._unloadable(version) or self._reverified()
        if problem is not None:
            self.refused = version  # nobody applies it: the copy may move on
            raise problem
        self._prepared = (version, self._pulls)

    def prepared(self, version: int) -> bool:
        """Whether `prepare(version)` ran on the bytes the copy holds now."""
        return self._prepared == (version, self._pulls) and self.replica.version == version

    def loadable_as(self, version: int, optional: set[str]) -> LoadableWeights | None:
        """What the engine loads, as the published tensors of `version`, a version it
        applied another way (SGLang's native path); None if the coordinator no longer has
        it."""
        try:
            manifests = FleetView(self.replica.session, self.replica.model).manifests(version)
        except TensorHubError as exc:
            log.info("%s: no manifest of v%d to check versions against (%s)", self.name,
                     version, exc)
            return None
        return from_manifests(manifests, f"v{version}, the last version it applied", optional)

    def check(self, version: int) -> None:
        """`prepare` as the front end asks it before generation pauses, without waiting
        on a pull in progress (it holds the lock: the checks are then left to
        `tensors_of`), and only if the copy holds `version`."""
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            if self.replica.version == version:
                self._ready_before_pause(version)
        finally:
            self._lock.release()

    def _reverified(self, always: bool = True) -> TensorHubError | None:
        """What is applied is what was verified: every byte checked again before the
        engine reads the copy (a late read, or a peer's one-sided write, may have landed in
        it since it was pulled; ~1 s per 13 GB, beside a pull of the same bytes); not
        `always`: only if a read given up earlier has landed since."""
        try:
            self.replica.reverify(always=always)
        except TensorHubError as exc:
            return exc
        return None

    def _unloadable(self, version: int) -> TensorHubError | None:
        """A refusal when the copy's tensors are unlike what the engine loads."""
        if self.loadable is None:
            return None
        reason = self.loadable.only(self.replica.holds).refusal(
            version, self.replica.named_tensors())
        if reason is None:
            return None
        if (self.unloadable or {}).get("version") != version:
            log.error("%s: refusing %s; still serving the version it has", self.name, reason)
        self.unloadable = {"version": version, "reason": reason}
        return InstallFailed.of("unloadable", version, reason)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.replica.close()
