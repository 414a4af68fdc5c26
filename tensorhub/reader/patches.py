"""A reader that holds a version takes a newer one as patches (`core/patch.py`) when a short
chain of them leads there, moves fewer bytes than the version itself, and is expected to
land sooner than the whole on the reader's own measured rates (`core/patch_budget.py`).

Each patch is a version of the companion patch model, pulled striped like any version (from
the trainer or from peers that hold it, one crossing per datacenter), verified by its own
checksums, then held and served. Applying the chain and checking the new version's
checksums is the replica's (`Replica.pull`), which owns the buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tensorhub import settings
from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.data_types import (
    Announcement,
    GetManifest,
    LatestRequest,
    Manifest,
    ReadDone,
    ReadPlan,
    StripedRequest,
)
from tensorhub.core.errors import CoordinatorError, TensorHubError
from tensorhub.core.held_patches import HeldPatches
from tensorhub.core.layout import BoundLayout
from tensorhub.core.memory import describe
from tensorhub.core.patch import PatchError, apply_patch, base_of, patch_model
from tensorhub.core.puller import check_item, read_verified
from tensorhub.core.session import WorkerSession
from tensorhub.reader.session import PullSession, Reader, failure_text
from tensorhub.reader.striped import StripedReader

log = logging.getLogger("tensorhub.patches")


@dataclass(frozen=True)
class Link:
    """One patch of a chain: it makes `version` from `base`."""

    version: int
    base: int
    manifest: Manifest

    @property
    def nbytes(self) -> int:
        return self.manifest.tensors[0].nbytes


def choose_chain(held: int, target: int, links: dict[int, Link], whole_nbytes: int,
                 keep: int = settings.PATCH_KEEP,
                 max_ratio: float = settings.PATCH_MAX_RATIO) -> list[Link] | None:
    """The patches that lead from `held` to `target`, oldest first, if every one is known
    (`links`, by version), there are at most `keep` of them and together they are at most
    `max_ratio` of the version's bytes; else None (pull the version whole)."""
    chain: list[Link] = []
    at = target
    while at != held:
        link = links.get(at)
        if link is None or link.base < held or len(chain) >= keep:
            return None
        chain.append(link)
        at = link.base
    if not chain or sum(link.nbytes for link in chain) > max_ratio * whole_nbytes:
        return None
    return chain[::-1]


@dataclass(frozen=True)
class Applied:
    """What applying a chain took: seconds to apply it, and to check the `checked_bytes`
    of the items it touched (a reader's rates, `core/patch_budget.py`)."""

    apply_s: float
    checked_bytes: int
    check_s: float


def apply_chain(chain: list[Link], patches: list[BoundLayout], dest: list[torch.Tensor],
                layout_id: str, held_checksums: list[str], target: Announcement) -> Applied:
    """Apply the chain's patches (oldest first) to `dest`, which holds the chain's base,
    and prove the result is `target`: every item a patch touched has the target's checksum,
    every other had it already. `PatchError` / `IntegrityError` otherwise (`dest` is then
    no version at all)."""
    started = time.perf_counter()
    touched: set[int] = set()
    for link, layout in zip(chain, patches, strict=True):
        touched.update(apply_patch(memoryview(layout.tensors[0].numpy()), dest,
                                   base=link.base, layout_id=layout_id, version=link.version))
    expected = ReadPlan.model_construct(model=target.model, version=target.version,
                                        checksums=target.checksums)
    for k in range(len(dest)):
        if k not in touched and held_checksums[k] != target.checksums[k]:
            raise PatchError(f"item {k} differs in v{target.version}, and no patch of the "
                             f"chain changes it")
    checking = time.perf_counter()
    # (checksums run without the GIL: the whole version is hashed again, on every core
    # same-host copies may use)
    with ThreadPoolExecutor(settings.copy_threads(), "tensorhub-patch-check") as pool:
        for done in [pool.submit(check_item, expected, k, dest[k]) for k in sorted(touched)]:
            done.result()
    return Applied(checking - started, sum(dest[k].numel() for k in touched),
                   time.perf_counter() - checking)


class PatchPuller:
    """Finds and pulls the patches of one model for a replica that shares its session."""

    PlanCall = Callable[[PullSession, StripedRequest], None]

    def __init__(self, session: WorkerSession, model: str, plan: PlanCall,
                 end: Callable[[list[ReadDone]], None]):
        self.session = session
        self.main_model = model
        self.model = patch_model(model)
        self.held = HeldPatches(session, model)
        self._plan = plan
        self._end = end

    def target(self, version: int | str, held: int, layout_id: str,
               watcher: VersionWatcher | None) -> Announcement | None:
        """The announcement of the version a pull of `version` wants, if patches could make
        it from `held`: newer, whole, in our layout, its checksums known. The newest is
        asked for (an announcement heard may already be superseded)."""
        a = watcher.announcement(version) \
            if watcher is not None and version != "latest" else None
        if a is None:
            try:
                a = self.session.call(LatestRequest(model=self.main_model, newer_than=held))
            except TensorHubError:
                return None
            if not isinstance(a, Announcement):  # (nothing newer than what we hold)
                return None
            if version != "latest" and a.version != version:
                return None
        usable = a.checksums is not None and a.parts == 1 and a.layout_id == layout_id \
            and a.version > held
        return a if usable else None

    def chain(self, held: int, target: int, whole_nbytes: int,
              watcher: VersionWatcher | None = None) -> list[Link] | None:
        """The chain to take from `held` to `target` (None: no such chain worth taking),
        each patch's manifest from its announcement where `watcher` heard it, else from
        the coordinator."""
        links: dict[int, Link] = {}
        at = target
        while at > held and len(links) < settings.PATCH_KEEP:
            known, heard = watcher.patch(at) if watcher is not None else (False, None)
            if known and (heard is None or heard.manifest is None):
                return None
            manifest = heard.manifest if heard is not None else self._manifest(at)
            base = base_of(manifest) if manifest is not None else None
            if base is None or base >= at:
                return None
            links[at] = Link(at, base, manifest)
            at = base
        return choose_chain(held, target, links, whole_nbytes)

    def _manifest(self, version: int) -> Manifest | None:
        try:
            reply = self.session.call(GetManifest(model=self.model, version=version))
        except CoordinatorError as exc:
            if exc.code in ("unknown_model", "unknown_version"):
                return None
            raise
        return reply.manifest if reply.version == version else None

    def pull(self, link: Link, deadline: float) -> BoundLayout:
        """Pull one patch into buffers of its own (or take it from those we hold), verify it
        by its checksums, and hold and serve it."""
        if link.version in self.held:
            return self.held.layout(link.version)
        layout = BoundLayout.allocate(link.manifest, "cpu")
        self.session.transport.register(layout.item_bytes)
        dest = layout.item_bytes
        reader = Reader(self.model, layout.layout_id, [describe(b) for b in dest],
                        self.session.transport.endpoint(), relay=True)
        pull = PullSession(reader, self.session.worker_id, link.version,
                           now=time.monotonic(), deadline=deadline,
                           stall=settings.BEHIND_AFTER, poll_max=settings.POLL_MAX)
        self.session.progress.zero_()
        try:
            self._plan(pull, pull.first_request())
            read_verified(pull.plan, dest, lambda verifier: StripedReader(
                self.session, pull, dest, verifier, self.session.call,
                lambda done: self._end([done]), self.session.registrations).run())
            self.held.hold(link.version, layout, pull.plan.checksums)
        except BaseException as exc:
            self.session.progress.zero_()  # our children stop reading from us
            # (every lease it was given ends, saying why: none stays open until it expires)
            self._end(pull.end(ok=False, error=failure_text(exc)))
            self.held.drop(link.version, layout)
            raise
        self._end(pull.end(ok=True))
        return layout
