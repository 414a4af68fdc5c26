"""Holdings: which worker holds which version. Holders announce and withdraw what they
hold (a holder dropped on readers' reports waits out a probation first); anyone may ask
who holds what, the newest version, a manifest, or whether a version may be let go
(retention)."""

from __future__ import annotations

from collections import Counter

from tensorhub.coordinator import publishing
from tensorhub.coordinator.parts import PendingPart
from tensorhub.coordinator.state import ACK, CoordinatorState, Reject, Spliced, log
from tensorhub.coordinator.table import HolderRec, ModelRec, VersionRec, store_memory
from tensorhub.core.data_types import (
    LAYOUT_LABEL,
    Ack,
    Announcement,
    GetManifest,
    Hold,
    HoldingsReply,
    HoldingsRequest,
    LatestRequest,
    ManifestReply,
    Retention,
    RetentionRequest,
    Withdraw,
    Withdrawn,
    checksums_digest,
)
from tensorhub.core.wire import encode


def hold(state: CoordinatorState, req: Hold) -> Ack:
    worker = state.worker(req.worker_id)
    check_probation(state, req.worker_id, req.model, req.version)
    mrec = state.table.models.get(req.model)
    vrec = mrec.versions.get(req.version) if mrec else None
    pending = state.pending.versions.get((req.model, req.version))
    if vrec is None and pending is not None and req.manifest is not None \
            and req.parts == pending.parts and req.part not in pending.have:
        # A restart while the version was pending: a rank that had it complete
        # announces its part as the others send theirs again. It joins the pending
        # version (which completes when all are in), not a record of its own.
        lid, layout = state.held_layout(req, worker)
        pending.have[req.part] = PendingPart(lid, layout, worker.worker_id,
                                             list(req.memory))
        if pending.complete:
            publishing.complete(state, (req.model, req.version), pending)
        return ACK
    if vrec is None:
        vrec = _brought_back(state, req, mrec)
    new_layout = None
    layout = vrec.layouts.get(req.layout_id)
    if layout is None:
        if req.manifest is None:
            raise Reject("layout_mismatch",
                         f"version {req.version} has no layout {req.layout_id}; "
                         f"send its manifest and checksums to add one")
        lid, layout = state.new_layout(req.manifest, req.checksums)
        if lid != req.layout_id:
            raise Reject("layout_mismatch", "layout id does not match the manifest")
        new_layout = lid
    elif req.checksums is None and req.checksums_digest is not None \
            and req.checksums_digest != checksums_digest(layout.checksums):
        # by reference, but verified against other checksums than this layout's now (its
        # record made again since the plan): told in full, it is compared as below
        raise Reject("layout_mismatch",
                     f"version {req.version}'s layout {req.layout_id} has other checksums "
                     f"than those it was verified against; send them")
    elif req.checksums is not None and list(req.checksums) != layout.checksums:
        if req.layout_id not in vrec.part_ids and not layout.untrusted:
            # Nobody but its holders vouches for a layout other than the publisher's: two
            # that disagree make it untrusted (one of them holds bytes the trainer never
            # published), and readers fall back to the publisher's layout.
            layout.untrusted = True
            log.warning("%s v%d: holders disagree on the bytes of layout %s (%s, and %s "
                        "now): it is no longer served; readers take the publisher's layout",
                        req.model, req.version, req.layout_id,
                        ", ".join(sorted(_names(state, layout.holders))) or "a holder gone",
                        worker.name)
        raise Reject("layout_mismatch",
                     f"checksums differ from version {req.version}'s: not the same bytes"
                     + (" (the layout is untrusted now: holders disagree)"
                        if layout.untrusted else ""))
    state.check_memory(layout, req.memory)
    state.update_endpoint(worker, req.endpoint)
    if new_layout is not None:
        vrec.layouts[new_layout] = layout
        if vrec.parts is not None and req.parts == len(vrec.parts) \
                and vrec.parts[req.part] is None:  # a part back after a restart
            vrec.parts[req.part] = new_layout
            if req.part == 0:
                vrec.origin_layout = new_layout
    if req.version not in (mrec.versions if mrec else {}):
        mrec = state.table.models.setdefault(req.model, ModelRec())
        mrec.versions[req.version] = vrec
        mrec.latest = max(mrec.latest, req.version)
    layout.holders[worker.worker_id] = HolderRec(worker.worker_id, store_memory(req.memory))
    if worker.worker_id not in layout.relays:  # it made these bytes: its address vouches
        layout.vouchers.add(state.witness(worker))
        state.vouched(vrec, req.layout_id, layout)  # (while the publisher is here to tell)
    if layout.forest is not None:
        layout.forest.add_root(worker.worker_id, worker.labels.get("dc", ""))
    return ACK


def _names(state: CoordinatorState, holders) -> set[str]:
    return {w.name for h in holders if (w := state.table.workers.get(h)) is not None}


def _brought_back(state: CoordinatorState, req: Hold, mrec: ModelRec | None) -> VersionRec:
    """The record of a version a holder brings back after a coordinator restart (soft
    state), built aside: `hold` stores it once every check has passed."""
    if req.manifest is None or (mrec is not None and req.version < mrec.latest):
        raise Reject("unknown_version", f"model {req.model!r} has no version {req.version}")
    if mrec is not None and mrec.published and req.version > mrec.latest:
        raise Reject("unknown_version",
                     f"model {req.model!r} has no version {req.version}: its trainer "
                     f"publishes versions (latest {mrec.latest}), a holder cannot "
                     f"bring one it never published")
    claimed = state.claims.get(req.model)
    if claimed is not None and req.version > claimed and not (mrec and mrec.published):
        raise Reject("unknown_version",
                     f"model {req.model!r} has no version {req.version}: its trainer "
                     f"said it published up to v{claimed}")
    lid, layout = state.new_layout(req.manifest, req.checksums)
    return VersionRec(req.version, lid if req.part == 0 else "", {lid: layout},
                      parts=None if req.parts == 1 else
                      [lid if r == req.part else None for r in range(req.parts)])


def withdraw(state: CoordinatorState, req: Withdraw) -> Withdrawn:
    """A holder stops offering a version (reads in flight may finish); the last holder of
    the newest version may not, unless forced."""
    worker = state.worker(req.worker_id)
    state.end_probation(req.worker_id, req.model, req.version)  # nothing left to offer
    if req.damaged:
        log.warning("%s found its copy of %s v%d damaged (its checksums fail) and "
                    "withdraws it", worker.name, req.model, req.version)
        state.metrics.evictions.labels("damaged").inc()
    mrec = state.table.models.get(req.model)
    vrec = mrec.versions.get(req.version) if mrec else None
    if vrec is not None and req.version == mrec.latest and not req.force:
        for part, layout in enumerate(vrec.part_layouts()):
            me = layout.holders.get(req.worker_id) if layout else None
            others = [h for h in layout.holders.values()
                      if h.worker_id != req.worker_id and not h.withdrawn] if layout else []
            if me is not None and not me.withdrawn and not others:
                what = f" (part {part})" if vrec.parts else ""
                raise Reject("last_holder",
                             f"{req.worker_id} is the last holder of {req.model!r} "
                             f"v{req.version}{what}, the newest version: wait until a "
                             f"replica holds it, or publish a newer one first",
                             retry_after=0.2)
    if vrec is not None:
        # No new reads of it from us, complete or partial; reads in flight may finish.
        state.table.drop_partial(req.worker_id, req.model, req.version)
        for layout in vrec.layouts.values():
            holder = layout.holders.get(req.worker_id)
            if holder is not None:
                holder.withdrawn = True
    active = state.table.active_reads(req.worker_id, req.model, req.version)
    if active == 0:
        state.table.drop_holder(req.worker_id, req.model, req.version)
    return Withdrawn(active_reads=active)


def check_probation(state: CoordinatorState, worker_id: str, model: str, version: int) -> None:
    """A holder dropped on readers' reports offers the version again only once its
    probation (the trust window, on our clock) is over; readers' reports of it start
    afresh then."""
    until = state.probation.get(worker_id, {}).get((model, version))
    if until is None:
        return
    left = until - state.clock()
    if left > 0:
        raise Reject("probation", f"{model} v{version}: readers on several nodes failed "
                     f"to read it from this worker; it may be offered again in "
                     f"{left:.1f} s", retry_after=left)
    state.end_probation(worker_id, model, version)
    log.info("%s offers %s v%d again after its probation", worker_id, model, version)


def latest(state: CoordinatorState, req: LatestRequest) -> Announcement | Ack:
    """The model's newest version as it was announced (the watchers' one fallback); `Ack`
    when it is not newer than the asker's `newer_than`."""
    mrec = state.model(req.model)
    if req.newer_than is not None and mrec.latest <= req.newer_than:
        return ACK
    announced = state.announcements.get(req.model)
    if announced is None or announced[0].version != mrec.latest:
        # (a version brought back by holders after a restart: no publish was seen)
        _, vrec = state.resolve(req.model, "latest")
        lid, layout = state.part_layout(vrec, 0, req.model)
        announcement = Announcement(model=req.model, version=mrec.latest, layout_id=lid,
                                    parts=len(vrec.part_ids), manifest=layout.manifest)
        announced = state.announcements[req.model] = (announcement, encode(
            announcement, {("manifest",): layout.packed_manifest()[0]}))
    return announced[0]


def manifest(state: CoordinatorState, req: GetManifest) -> Spliced:
    _, vrec = state.resolve(req.model, req.version)
    lid, layout = state.part_layout(vrec, req.part, req.model)
    # (the manifest as encoded once for plans: one of 150,000 tensors takes ~0.1 s to encode)
    return Spliced(ManifestReply(model=req.model, version=vrec.version, layout_id=lid,
                                 manifest=layout.manifest, parts=len(vrec.part_ids)),
                   {("manifest",): layout.packed_manifest()[0]})


def holdings(state: CoordinatorState, req: HoldingsRequest) -> HoldingsReply:
    """The versions each named worker holds completely, and its last whole pull. Names are
    the workers' own choice: where several live workers share one (a token holder may
    register under an engine's), a version counts as held under it only if every one of
    them holds it, so no one can make an engine believe its workers hold a version."""
    mrec = state.table.models.get(req.model)
    wanted = set(req.names)
    holdings: dict[str, list[int]] = {n: [] for n in req.names}
    for v, vrec in sorted(mrec.versions.items()) if mrec else []:
        if vrec.parts is not None:
            for name in wanted:
                if state.holds_every_part(name, vrec):
                    holdings[name].append(v)
            continue
        holding = {h.worker_id for layout in vrec.layouts.values()
                   for h in layout.holders.values() if not h.withdrawn}
        held = Counter(w.name for wid in holding
                       if (w := state.table.workers.get(wid)) is not None and w.name in wanted)
        for name, n in held.items():
            if n == state.table.named[name]:
                holdings[name].append(v)
    pulls = {n: state.table.last_pull[n][1] for n in req.names if n in state.table.last_pull}
    return HoldingsReply(latest=mrec.latest if mrec else 0, holdings=holdings, pulls=pulls,
                         in_layout=_in_layout(state, mrec, req.layout_id),
                         announce_address=state.announce_address)


def _in_layout(state: CoordinatorState, mrec, layout_id: str | None) -> dict[str, list[int]]:
    """Who holds which versions in `layout_id`, and [] for a worker registered as serving
    that layout (its `layout` label) that holds none now: an engine's live parameters being
    written still count as a same-layout peer to wait for."""
    if layout_id is None:
        return {}
    held: dict[str, list[int]] = {w.name: [] for w in state.table.workers.values()
                                  if w.labels.get(LAYOUT_LABEL) == layout_id}
    for v, vrec in sorted(mrec.versions.items()) if mrec else []:
        layout = vrec.layouts.get(layout_id)
        if layout is not None and (layout.untrusted or not state.vouched(vrec, layout_id,
                                                                          layout)):
            continue  # (nobody to read it from)
        for h in layout.holders.values() if layout else []:
            w = state.table.workers.get(h.worker_id)
            if w is not None and not h.withdrawn:
                held.setdefault(w.name, []).append(v)
    return held


def retention(state: CoordinatorState, req: RetentionRequest) -> Retention:
    """Whether a version may be let go: replicas holding it, reads of it in flight."""
    mrec = state.table.models.get(req.model)
    vrec = mrec.versions.get(req.version) if mrec else None
    replicas = {w.worker_id for w in state.table.workers.values() if w.role == "replica"}
    held = 0
    if vrec is not None and vrec.parts is not None:  # the least-held part counts
        held = min(len({h.worker_id for h in layout.holders.values() if not h.withdrawn}
                       & replicas) if layout else 0
                   for layout in vrec.part_layouts())
    elif vrec is not None:
        holders = {h.worker_id for lid, layout in vrec.layouts.items()
                   if req.layout_id in (None, lid)
                   for h in layout.holders.values() if not h.withdrawn}
        held = len(holders & replicas)
    active = sum(1 for lease in state.table.leases.values()
                 if lease.model == req.model and lease.version == req.version)
    return Retention(replica_holders=held, active_reads=active, replicas=len(replicas))
