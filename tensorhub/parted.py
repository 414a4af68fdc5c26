"""A reader of sharded versions: one `Replica` per part, one version for all of them.

A version published by K trainer ranks (`Publisher(part=r, parts=K)`) is K ordinary
layouts. `PartedReplica` pulls each part with a replica of its own (its own place in that
part's relay forest, so each part fans out as any version does) and calls the version
its own only once every part is pulled and verified: a reader never serves or exposes a
mix of two versions' parts. Slices of one tensor, spread over parts, are joined.

A reader given a `share` pulls only some of a version's parts: a node of a
tensor-parallel engine pulls the tiles its ranks load (`tensorhub/tiles.py`), a pipeline
stage the layer blocks it runs (`tensorhub/stages.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tensorhub import settings
from tensorhub.core.data_types import GetDeclared, GetManifest, Manifest, Part, TensorSpec
from tensorhub.core.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    LayoutError,
    TransferError,
)
from tensorhub.core.layer_blocks import part_of
from tensorhub.core.layout import BoundLayout
from tensorhub.core.session import default_name
from tensorhub.replica import Replica

if TYPE_CHECKING:
    from tensorhub.tiles import Share

log = logging.getLogger("tensorhub.parted")


class PartedReplica:
    def __init__(self, coordinator: str, model: str, *, name: str | None = None,
                 transport: str | None = None, token: str | None = None,
                 timeout: float = 10.0, labels: dict[str, str] | None = None,
                 whole_items: bool = False,
                 share: Share | None = None):
        """Pulls any version of `model`, sharded (K parts) or not (one part). Each part
        has a worker of its own, named `<name>.part<r>`. `share`: given a version's part
        count and part 0's manifest (its tiles or layer blocks), the parts to pull (None:
        all). Until its
        first pull it runs part 0's worker; then one per part it pulls (the first of them
        hears the model's announcements)."""
        self.coordinator, self.model = coordinator, model
        self.name = name or default_name("replica")
        self.share = share
        self._kw = {"transport": transport, "token": token, "timeout": timeout,
                    "labels": labels, "whole_items": whole_items}
        self._parts: dict[int, Replica] = {0: self._replica(0)}  # by part number
        self._count = 1  # the part count they were made for
        self._tiling: str | None = None  # of the version pulled (`Manifest.tiling`)
        self._blocks: list[int] | None = None  # its layer blocks' edges (`Manifest.blocks`)
        self._joined: tuple[tuple, dict[str, torch.Tensor]] | None = None  # (`tensors`)
        self.version: int | None = None
        self._declared_at = 0.0  # when to look for a declared layout (again)
        self._lock = threading.Lock()  # a pull, or buffers allocated from a declaration

    def _replica(self, part: int) -> Replica:
        return Replica(self.coordinator, self.model, name=Part.worker_name(self.name, part),
                       part=part, **self._kw)

    @property
    def replicas(self) -> list[Replica]:
        """One replica per part this reader pulls, in part order."""
        return [self._parts[k] for k in sorted(self._parts)]

    @property
    def partial(self) -> bool:
        """Whether this reader pulls only some of its version's parts (a `share`)."""
        return len(self._parts) < self._count

    def holds(self, name: str) -> bool:
        """Whether a tensor of this name is in the parts it pulls of its version in layer
        blocks (True for any other version: its share, if any, covers every tensor)."""
        if self._blocks is None or not self.partial:
            return True
        return part_of(name, self._blocks) in self._parts

    @property
    def share_layout(self) -> str | None:
        """How the version it pulls a share of is tiled (`Manifest.tiling`), else None."""
        return self._tiling if self.partial else None

    def wanted(self, parts: int, manifest: Manifest) -> set[int]:
        """The parts of a version of `parts` parts (part 0's `manifest`) this reader
        pulls."""
        if self.share is None:
            return set(range(parts))
        wanted = set(self.share(parts, manifest))
        if not wanted or not wanted <= set(range(parts)):
            raise ValueError(f"{self.name}: a share of {sorted(wanted)} is not a set of the "
                             f"parts 0..{parts - 1}")
        return wanted

    @property
    def session(self):
        """The session of the first part it pulls (part 0's, unless its share leaves part
        0 out): the reader's coordinator connection."""
        return self.replicas[0].session

    @property
    def nbytes(self) -> int:
        return sum(r.layout.nbytes for r in self.replicas if r.layout is not None)

    def sources(self) -> list[str]:
        """Who the last pull of each part read from."""
        return sorted({s for r in self.replicas if r.last_pull for s in r.last_pull.sources})

    def wait_for_newer(self, timeout: float, than: int | str | None = "ours") -> int | None:
        """Block until the coordinator knows a version newer than the one we hold whole (or
        than `than`); None at the timeout. Before the first version, a declared layout
        gives part 0 buffers, so it stands by (`_allocate_declared`)."""
        self._allocate_declared()
        return self.replicas[0].wait_for_newer(timeout,
                                               than=self.version if than == "ours" else than)

    def _allocate_declared(self) -> None:
        """With no version yet: allocate part 0's buffers from the manifest the trainer
        declared for the first version (`Publisher.declare`), so that part 0 stands by
        and pulls that version with no plan request, as a reader with buffers of its own
        does. Asked every `settings.STANDBY_RETRY` seconds until there is a declaration (or a
        version). Never while a pull runs (`_lock`): it allocates by itself. A first
        version unlike the declaration is pulled into new buffers (`pull`)."""
        first = self.replicas[0]
        if self.version is not None or first.layout is not None or self._count > 1 \
                or time.monotonic() < self._declared_at or not self._lock.acquire(False):
            return
        try:
            if self.version is not None or first.layout is not None:
                return  # (a pull ran meanwhile)
            self._declared_at = time.monotonic() + settings.STANDBY_RETRY
            if first.announcement() is not None:
                self._declared_at = float("inf")  # a version is out: pulls allocate from it
                return
            declared = self.session.call(GetDeclared(model=self.model))
            first.allocate(declared.manifest)
        except CoordinatorError as exc:
            if exc.code != "unknown_model":
                log.warning("%s: could not read %s's declared layout: %s", self.name,
                            self.model, exc)
            return
        except CoordinatorUnavailable:
            return  # (restarting: asked again later)
        except (LayoutError, TransferError, MemoryError, RuntimeError) as exc:
            # (buffers that could not be allocated or registered: the first pull will)
            self._declared_at = float("inf")
            log.warning("%s: no buffers from %s's declared layout (%s); its first pull "
                        "allocates them", self.name, self.model, exc)
            return
        finally:
            self._lock.release()
        log.info("%s: allocated %s's declared layout %s (%.1f MiB); standing by for its "
                 "first version", self.name, self.model, declared.layout_id,
                 first.layout.nbytes / 2**20)

    def withdraw(self, timeout: float) -> None:
        """Stop serving what every part holds, and wait (bounded) for reads of it to end."""
        held = [r for r in self.replicas if r.version is not None]
        self.version = None
        for r in held:
            version, r.version = r.version, None
            r.session.withdraw(self.model, version, timeout)

    def pull(self, version: int | str = "latest", timeout: float = 60.0) -> int:
        """Pull every part of `version` (or the latest) at once; return the version. If a
        part fails, the error is raised and `version` is None: no complete version.

        A version split otherwise than the last (another part count, a part of another
        layout: the trainer's sharding changed) is pulled into new buffers."""
        with self._lock:
            return self._pull(version, timeout)

    def _pull(self, version: int | str, timeout: float) -> int:
        target, parts, layout_id, manifest = self._describe(version)
        first = self._parts[0].layout if 0 in self._parts else None
        wanted = self.wanted(parts, manifest)
        if self._count != parts or set(self._parts) != wanted \
                or (first is not None and first.layout_id != layout_id):
            self._rebuild(parts, wanted)
        self._tiling, self._blocks = manifest.tiling, manifest.blocks
        for r, replica in self._parts.items():  # (what their `Hold`s tell a restart)
            replica.part = Part(part=r, parts=parts)
        if self.version == target:
            return target
        self.version, self._joined = None, None
        if wanted == {0}:
            self._pull_part(0, target, timeout)
        else:
            with ThreadPoolExecutor(len(wanted)) as pool:
                futures = [pool.submit(self._pull_part, r, target, timeout)
                           for r in sorted(wanted)]
                failed = [e for e in (f.exception() for f in futures) if e is not None]
            if failed:
                raise failed[0]
        self.version = target
        return target

    def _describe(self, version: int | str) -> tuple[int, int, str, Manifest]:
        """`version` (or the latest): its number, its part count, part 0's layout and its
        manifest. For a version by number, from its announcement when we heard it (a fleet
        pulling a version then sends the coordinator only what a single replica sends),
        else asked (and "latest" is always asked: what we heard may be older already)."""
        a = self.replicas[0].announcement(version) if isinstance(version, int) else None
        if a is not None and a.manifest is not None:
            return a.version, a.parts, a.layout_id, a.manifest
        reply = self.session.call(GetManifest(model=self.model, version=version))
        return reply.version, reply.parts, reply.layout_id, reply.manifest

    def _rebuild(self, parts: int, wanted: set[int]) -> None:
        # The new workers register before the old ones leave: a trainer deciding whether
        # anyone could keep its version must never see this reader gone for a moment.
        old = self.replicas
        self.version, self._joined = None, None  # (its buffers go with the old workers)
        fresh: dict[int, Replica] = {}
        try:
            for r in sorted(wanted):
                fresh[r] = self._replica(r)
        except BaseException:
            for replica in fresh.values():
                replica.close()
            raise
        self._parts, self._count = fresh, parts
        for replica in old:
            replica.close()

    def _pull_part(self, part: int, version: int, timeout: float) -> int:
        try:
            return self._parts[part].pull(version, timeout)
        except (CoordinatorError, LayoutError) as exc:
            if isinstance(exc, CoordinatorError) and exc.code != "layout_mismatch":
                raise
        # This part's layout changed (its rank publishes other tensors now): new buffers.
        replaced = self._parts[part]
        self._parts[part] = fresh = self._replica(part)
        fresh.part = replaced.part
        replaced.close()
        return fresh.pull(version, timeout)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())

    def reverify(self, always: bool = False) -> None:
        """Each part verified again if a late read may have landed in it, or `always`
        (`Replica.reverify`); a part that fails stops the whole version being ours."""
        try:
            for r in self.replicas:
                r.reverify(always)
        except Exception:
            self.version = None
            raise

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, whole: a tensor published as slices by several
        ranks is joined here (a copy, made once per version pulled: an engine's check
        before the pause makes it, its install inside the pause reuses it); the others are
        views of the pulled buffers. With a `share`, only the tensors and slices its parts
        hold: a sliced tensor comes whole in shape, its other rows or columns NaN."""
        key = (self.version, tuple(id(r.layout) for r in self.replicas))
        if self._joined is not None and self._joined[0] == key and self.version is not None:
            return self._joined[1]
        joined = whole_tensors([r.layout for r in self.replicas if r.layout is not None],
                               partial=self.partial)
        self._joined = (key, joined) if self.version is not None else None
        return joined

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> PartedReplica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def whole_tensors(layouts: list[BoundLayout], partial: bool = False
                  ) -> dict[str, torch.Tensor]:
    """The tensors of a version's parts, by name; slices of one tensor (rows, or a tile's
    columns) joined (a copy), the others as they are (views of the parts' buffers). A
    tensor whose slices do not cover it raises `LayoutError`, unless `partial`: then it
    comes whole in shape with its slices written and the rest NaN (0 for integers), so that
    an engine that loads rows outside its share serves garbage loudly, not stale memory."""
    whole: dict[str, torch.Tensor] = {}
    slices: dict[str, list[tuple[int, TensorSpec, torch.Tensor]]] = {}
    for layout in layouts:
        for spec, tensor in zip(layout.manifest.tensors, layout.tensors, strict=True):
            if spec.piece is None:
                whole[spec.name] = tensor
            else:
                slices.setdefault(spec.name, []).append((spec.piece[1], spec, tensor))
    for name, pieces in slices.items():
        pieces.sort(key=lambda p: p[0])
        dim, _, _, total = pieces[0][1].piece
        if sum(t.shape[dim] for _, _, t in pieces) == total:
            whole[name] = torch.cat([t for _, _, t in pieces], dim=dim)
        elif partial:
            first = pieces[0][2]
            out = torch.full(pieces[0][1].whole_shape,
                             float("nan") if first.dtype.is_floating_point else 0,
                             dtype=first.dtype, device=first.device)
            for start, _, t in pieces:
                out.narrow(dim, start, t.shape[dim]).copy_(t)
            whole[name] = out
        else:
            raise LayoutError(f"tensor {name!r}: its parts hold only some of its "
                              f"{('rows', 'columns')[dim]}")
    return whole
