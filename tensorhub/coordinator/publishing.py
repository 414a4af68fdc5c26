"""Publishing: a trainer's new version (whole, or part by part for a sharded one, `parts.py`)
becomes the model's newest and is announced."""

from __future__ import annotations

from tensorhub import settings
from tensorhub.coordinator.owners import companion_of
from tensorhub.coordinator.parts import PendingPart, PendingVersion, check_parts_fit
from tensorhub.coordinator.state import CoordinatorState, Reject, log, source_of
from tensorhub.coordinator.table import LayoutRec, ModelRec, VersionRec, WorkerRec
from tensorhub.core.data_types import (
    Announcement,
    MemoryDesc,
    Publish,
    Published,
    PublishStatus,
    PublishStatusReply,
)
from tensorhub.core.memory import regions_digest
from tensorhub.core.transport.grants import ANY_READER
from tensorhub.core.wire import encode


def publish(state: CoordinatorState, req: Publish) -> Published:
    """A trainer's new version, or a part of a sharded one; a repeat is answered as the
    first was. The first publish of a model (of each part) binds it to its trainer: the
    reply carries the credential later publishes must show (`owners.py`)."""
    worker = state.worker(req.worker_id)
    if worker.role != "trainer":
        raise Reject("bad_request", "only a worker registered as trainer may publish")
    owners = state.owners
    latest = state.table.models[req.model].latest if req.model in state.table.models else 0
    if req.version == latest and already_published(state, req):
        # A retry whose first try was answered but the answer lost (a pause, a
        # reconnect): answered as the first was, so a trainer may always retry.
        vrec = state.table.models[req.model].versions[latest]
        return Published(model=req.model, version=latest,
                         layout_id=vrec.part_ids[req.part],
                         owner=owners.bound.get((req.model, req.part)))
    base = companion_of(req.model)
    if base is not None and not owners.held_by(base, worker.worker_id):
        raise Reject("unauthorized",
                     f"{req.model!r} goes with {base!r}: only the trainer that publishes "
                     f"{base!r} publishes it (publish {base!r} first, from the same worker)")
    binds = not owners.is_bound(req.model, req.part)
    if not binds and not owners.owns(req.model, req.part, req.owner):
        raise Reject("unauthorized",
                     f"model {req.model!r} belongs to the trainer that first published it "
                     f"(part {req.part}): only a publish with its credential "
                     f"(`Published.owner`) is taken")
    if binds and owners.valid(req.model, req.part, req.owner):
        owners.claim(req.model, req.owner, worker.worker_id)  # (from before a restart)
        binds = False
    elif not binds:
        owners.shown_by(req.model, req.part, worker.worker_id)
    reply = publish_part(state, req, worker, latest) if req.parts > 1 \
        else _publish_whole(state, req, worker, latest)
    if binds:
        reply = reply.model_copy(update={"owner": owners.issue(req.model, req.part,
                                                               worker.worker_id)})
        log.info("%s bound %s (part %d): only its trainer publishes it from now on",
                 worker.worker_id, req.model, req.part)
    return reply


def _publish_whole(state: CoordinatorState, req: Publish, worker: WorkerRec,
                   latest: int) -> Published:
    if req.version <= latest:
        raise Reject("stale_version",
                     f"model {req.model!r} is at version {latest}; a new version "
                     f"must be greater (got {req.version})")
    lid, layout = state.held_layout(req, worker)
    make_version(state, req.model, VersionRec(req.version, lid, {lid: layout}))
    log.info("%s published %s v%d (%d items, %.1f MiB)", worker.worker_id, req.model,
             req.version, len(layout.items), layout.nbytes / 2**20)
    announce(state, req.model, req.version, lid, layout, worker.worker_id, req.memory)
    return Published(model=req.model, version=req.version, layout_id=lid,
                     pull_rate=slowest_pull_rate(state, req.model))


def slowest_pull_rate(state: CoordinatorState, model: str) -> float | None:
    """Bytes/s of the slowest of `model`'s readers' last whole pulls (of at least
    `PATCH_RATE_MIN_BYTES`): what its trainer weighs a patch's cost against
    (`core/patch_budget.py`); None when no reader's last pull was one."""
    rates = [r.nbytes / r.seconds for _, r in state.table.last_pull.values()
             if r.model == model and r.nbytes >= settings.PATCH_RATE_MIN_BYTES
             and r.seconds > 0]
    return min(rates, default=None)


def make_version(state: CoordinatorState, model: str, vrec: VersionRec) -> None:
    """`vrec` becomes the model's newest version (all checks passed)."""
    mrec = state.table.models.setdefault(model, ModelRec())
    mrec.published = True
    previous = mrec.versions.get(mrec.latest)
    mrec.versions[vrec.version] = vrec
    mrec.latest = vrec.version
    state.metrics.published.labels(model).inc()
    for lid, layout in vrec.layouts.items():
        last = previous.layouts.get(lid) if previous is not None else None
        if last is not None and last.forest is not None:
            # The same layout: its readers may pull this version by their last parents
            # (`Forest.adopt`, as each confirms), so the forest starts with its publisher.
            layout.previous_forest = last.forest
            state.forest(layout)
        elif vrec.parts is None and (standing := state.standby.take(
                model, lid, tuple(i.nbytes for i in layout.items))) is not None:
            # Readers stood by for it: they pull by the parents they were placed under.
            layout.previous_forest = standing
            state.forest(layout)
    state.standby.drop_model(model)
    for key in [k for k in state.pending.versions if k[0] == model and k[1] < vrec.version]:
        state.abort(key, f"v{vrec.version} was published first")
    state.table.prune()


def already_published(state: CoordinatorState, req: Publish) -> bool:
    """`req` repeats the publish that made its version (or part): same trainer, same
    bytes."""
    vrec = state.table.models[req.model].versions.get(req.version)
    if vrec is None or req.part >= len(vrec.part_ids):
        return False
    layout = vrec.part_layouts()[req.part]
    return (layout is not None and req.worker_id in layout.holders
            and layout.checksums == list(req.checksums or []))


def publish_part(state: CoordinatorState, req: Publish, worker: WorkerRec,
                 latest: int) -> Published:
    """Part `req.part` of a sharded version: kept aside until all parts are in, then
    the version is made and announced like any other (`parts.py`)."""
    key = (req.model, req.version)
    restored = restore_part(state, req, worker)
    if restored is not None:
        return restored
    if req.version <= latest:
        raise Reject("stale_version",
                     f"model {req.model!r} is at version {latest}; a new version "
                     f"must be greater (got {req.version})")
    if key in state.pending.aborted and key not in state.pending.versions:
        raise Reject("aborted", f"{req.model!r} v{req.version} was given up "
                     f"({state.pending.aborted[key]}); publish the next version")
    pending = state.pending.versions.get(key)
    if pending is not None and pending.parts != req.parts:
        raise Reject("bad_request", f"{req.model!r} v{req.version} is being published "
                     f"in {pending.parts} parts, not {req.parts}")
    lid, layout = state.held_layout(req, worker)
    have = pending.have.get(req.part) if pending is not None else None
    if have is not None:
        if have.publisher == worker.worker_id and have.layout.checksums == layout.checksums:
            return Published(model=req.model, version=req.version, layout_id=lid,
                             complete=False)  # a repeat
        raise Reject("bad_request", f"part {req.part} of {req.model!r} v{req.version} "
                     f"is in already, from {have.publisher}")
    if pending is None:
        pending = state.pending.versions[key] = PendingVersion(req.version, req.parts,
                                                              state.clock())
        state.pending.aborted.pop(key, None)
    pending.have[req.part] = PendingPart(lid, layout, worker.worker_id, list(req.memory))
    if not pending.complete:
        log.info("%s published part %d of %s v%d (%d of %d in)", worker.worker_id,
                 req.part, req.model, req.version, len(pending.have), req.parts)
        return Published(model=req.model, version=req.version, layout_id=lid,
                         complete=False)
    complete(state, key, pending)
    return Published(model=req.model, version=req.version, layout_id=lid, complete=True)


def complete(state: CoordinatorState, key: tuple[str, int], pending: PendingVersion) -> None:
    """Every part of a pending version is in: check they fit, then make and announce
    the version (or abort it, `bad_request` to the caller)."""
    model, version = key
    parts = [pending.have[r] for r in range(pending.parts)]
    try:
        check_parts_fit([p.layout.manifest for p in parts])
    except ValueError as exc:
        state.abort(key, str(exc))
        raise Reject("bad_request", f"{model!r} v{version}: {exc}") from None
    del state.pending.versions[key]
    make_version(state, model, VersionRec(version, parts[0].layout_id,
                                         {p.layout_id: p.layout for p in parts},
                                         parts=[p.layout_id for p in parts]))
    log.info("%s v%d published in %d parts (%.1f MiB)", model, version, len(parts),
             sum(p.layout.nbytes for p in parts) / 2**20)
    announce(state, model, version, parts[0].layout_id, parts[0].layout,
                   parts[0].publisher, parts[0].memory, parts=len(parts))


def restore_part(state: CoordinatorState, req: Publish, worker: WorkerRec) -> Published | None:
    """After a restart a sharded version can come back from its holders before one of
    its ranks sends its part again (that rank was still waiting for the others): the
    part fills the restored record's empty slot."""
    mrec = state.table.models.get(req.model)
    vrec = mrec.versions.get(req.version) if mrec else None
    if vrec is None or vrec.parts is None or len(vrec.parts) != req.parts \
            or vrec.parts[req.part] is not None:
        return None
    lid, layout = state.held_layout(req, worker)
    vrec.layouts[lid] = layout
    vrec.parts[req.part] = lid
    if req.part == 0:
        vrec.origin_layout = lid
    return Published(model=req.model, version=req.version, layout_id=lid,
                     complete=None not in vrec.parts)


def publish_status(state: CoordinatorState, req: PublishStatus) -> PublishStatusReply:
    key = (req.model, req.version)
    pending = state.pending.versions.get(key)
    if pending is not None:
        return PublishStatusReply(state="pending", parts=pending.parts,
                                  parts_in=sorted(pending.have))
    if key in state.pending.aborted:
        return PublishStatusReply(state="aborted", reason=state.pending.aborted[key])
    mrec = state.table.models.get(req.model)
    vrec = mrec.versions.get(req.version) if mrec else None
    if vrec is not None:
        layouts = vrec.part_layouts()
        back = [r for r, layout in enumerate(layouts) if layout is not None]
        return PublishStatusReply(state="complete" if len(back) == len(layouts)
                                  else "pending", parts=len(layouts), parts_in=back)
    return PublishStatusReply(state="unknown")


def announce(state: CoordinatorState, model: str, version: int, lid: str, layout: LayoutRec,
              publisher: str, memory: list[MemoryDesc], parts: int = 1) -> None:
    """Tell subscribers (and later `LatestRequest`s) of a new version, with what a
    reader needs to pull it by the parents it had for the previous one (for a sharded
    version: its part 0's)."""
    announcement = Announcement(
        model=model, version=version, layout_id=lid, checksums=layout.checksums,
        chunk_bytes=state.config.planner.chunk_bytes_for(layout.nbytes),
        publisher=publisher, memory_digest=regions_digest(memory), parts=parts,
        manifest=layout.manifest,
        source=source_of(state.table.workers[publisher], memory,
                         state.table.workers[publisher].progress, ANY_READER)
        if parts == 1 else None)
    manifest, checksums = layout.packed_manifest()  # (encoded once: plans carry them too)
    msg = encode(announcement, {("manifest",): manifest, ("checksums",): checksums})
    state.announcements[model] = (announcement, msg)
    state.outbox.append((model.encode(), msg))
