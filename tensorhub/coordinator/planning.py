"""Planning: whole-item plans (`planner.py`), striped plans (a parent per stripe,
`forest.py`), and what readers report back: their progress, the end of a lease, and the
holders they failed to read."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tensorhub import settings
from tensorhub.coordinator.forest import Forest
from tensorhub.coordinator.planner import NoSource, distance, plan_ranges
from tensorhub.coordinator.state import ACK, CoordinatorState, Reject, log, source_of
from tensorhub.coordinator.table import (
    HolderRec,
    LayoutRec,
    PartialRec,
    WorkerRec,
    load_memory,
    store_memory,
)
from tensorhub.core.data_types import (
    Ack,
    ConfirmParents,
    PlanRequest,
    ReadDone,
    ReadPlan,
    ReadRange,
    ReplanStripes,
    StripedRequest,
    TransferRecord,
)
from tensorhub.core.stripes import PROGRESS_BYTES, warm_lease_id
from tensorhub.core.wire import Packed


def plan(state: CoordinatorState, req: PlanRequest | StripedRequest) -> PlanReply:
    """A plan of either kind: whole items from one holder, or a parent per stripe."""
    state.worker(req.worker_id)
    if type(req) is PlanRequest and req.done is not None:
        apply_done(state, req)
    _, vrec = state.resolve(req.model, req.version)
    lid = req.layout_id or state.part_layout(vrec, 0, req.model)[0]
    layout = vrec.layouts.get(lid)
    if layout is None:
        raise Reject("layout_mismatch",
                     f"nobody holds {req.model!r} v{vrec.version} in layout {lid}; "
                     f"known layouts: {', '.join(vrec.layouts)}")
    # A layout the coordinator knows but plans no reads from ("layout_unserved": not a
    # difference of tensors; the reader takes the publisher's layout instead).
    if layout.untrusted:
        raise Reject("layout_unserved",
                     f"holders of {req.model!r} v{vrec.version} in layout {lid} disagree on "
                     f"its bytes: it is untrusted; read the publisher's layout "
                     f"({vrec.origin_layout})")
    if not state.vouched(vrec, lid, layout):
        raise Reject("layout_unserved",
                     f"{req.model!r} v{vrec.version} in layout {lid} is vouched for by "
                     f"{len(layout.vouchers)} address(es) only (its checksums come from its "
                     f"holders, not the publisher): read the publisher's layout "
                     f"({vrec.origin_layout}); it is served once holders on "
                     f"{state.config.layout_vouchers} addresses, or on the publisher's, made "
                     f"the same bytes")
    if lid not in vrec.part_ids:  # what it reads here, it relays: its hold vouches nothing
        layout.relays.add(req.worker_id)
    if type(req) is not PlanRequest:
        return plan_striped(state, req, vrec.version, lid, layout)
    avoid = state.trust.avoided(req.worker_id)
    try:
        ranges = _plan_around(state, req, layout, avoid)
    except ValueError as exc:
        raise Reject("bad_request", str(exc)) from None
    except NoSource as exc:
        raise no_source(state, exc, req.worker_id, req.model, vrec.version, layout, avoid,
                        "every holder is serving its maximum of readers",
                        striped=False) from None
    source_ids = {r.source for r in ranges}
    lease = state.table.new_lease(req.worker_id, req.model, vrec.version, lid, source_ids,
                                  state.config.lease_ttl)
    workers = state.table.workers
    sources = [(workers[sid], layout.holders[sid]) for sid in source_ids]
    return read_plan(state, req, vrec.version, lid, layout, lease.lease_id, sources, ranges)


def _plan_around(state: CoordinatorState, req: PlanRequest, layout: LayoutRec,
                 avoid) -> list[ReadRange]:
    """Whole-item ranges from a holder neither the coordinator nor the reader avoids
    (`PlanRequest.avoid`: the sources of its bytes that failed their checksums); when only
    those hold the version, from a publisher among them (trusted last)."""
    planner = state.config.planner
    if not req.avoid:
        return plan_ranges(state.table, layout, req.worker_id, planner, req.missing, avoid)
    own = set(req.avoid)
    try:
        return plan_ranges(state.table, layout, req.worker_id, planner, req.missing,
                           own | set(avoid))
    except NoSource:
        workers = state.table.workers
        publishers = {h for h in own if h in workers and workers[h].role == "trainer"}
        if not publishers:
            raise
        return plan_ranges(state.table, layout, req.worker_id, planner, req.missing,
                           (own - publishers) | set(avoid))


def read_plan(state: CoordinatorState, req: PlanRequest | StripedRequest, version: int,
              lid: str, layout: LayoutRec, lease_id: str,
              sources: list[tuple[WorkerRec, HolderRec | PartialRec]],
              ranges: list[ReadRange], **striped) -> PlanReply:
    """The reply: with the manifest and checksums unless the reader has them."""
    manifest = not (req.known_manifest and req.version != "latest")
    return PlanReply(ReadPlan(
        model=req.model, version=version, layout_id=lid,
        manifest=layout.manifest if manifest else None,
        checksums=layout.checksums if manifest else None,
        lease_id=lease_id, lease_ttl=float(state.config.lease_ttl),
        sources=[source_of(w, [], w.progress if "stripes" in striped else None,
                           req.worker_id) for w, _ in sources],
        ranges=ranges, **striped), [rec for _, rec in sources], layout)


@dataclass(frozen=True, slots=True)
class PlanReply:
    """A plan as made: the `ReadPlan` with its sources' memory regions left out, and the
    records that hold them (`memory`, one per source, encoded once there). As a model
    (`model`) the regions are filled in; on the socket they are spliced into the reply's
    bytes as encoded (`packed`), never built as models (a source of a 2049-item version
    has 2049 regions), and so are the manifest and checksums."""

    bare: ReadPlan
    memory: list[HolderRec | PartialRec]
    layout: LayoutRec

    def model(self) -> ReadPlan:
        return self.bare.model_copy(update={"sources": [
            source.model_copy(update={"memory": load_memory(rec.memory)})
            for source, rec in zip(self.bare.sources, self.memory, strict=True)]})

    def packed(self) -> dict[tuple, Packed]:
        packed = {("sources", k, "memory"): Packed(rec.packed_memory())
                  for k, rec in enumerate(self.memory)}
        if self.bare.manifest is not None:
            packed[("manifest",)], packed[("checksums",)] = self.layout.packed_manifest()
        return packed


def apply_done(state: CoordinatorState, req: PlanRequest) -> None:
    """The end of the reader's previous lease, carried by its next request (one round
    trip instead of two). It is the reader's own: another worker's id is refused."""
    if req.done.worker_id != req.worker_id:
        raise Reject("bad_request", f"a plan request of {req.worker_id} carries a "
                                    f"{req.done.type} of {req.done.worker_id}")
    read_done(state, req.done)


def no_source(state: CoordinatorState, exc: NoSource, reader: str, model: str, version: int,
              layout: LayoutRec, avoid, busy: str, striped: bool = True) -> Reject:
    """`unreachable` when this reader failed on every holder there is (its own fault,
    most likely: the others read them); `busy` (retry soon) when holders exist but are
    all serving; else `no_holder`."""
    serving = [h for h in (layout.serving() if striped else
                           [h.worker_id for h in layout.holders.values() if not h.withdrawn])
               if h != reader]
    if avoid and serving and all(h in avoid for h in serving):
        names = ", ".join(sorted(state.table.workers[h].name for h in serving
                                 if h in state.table.workers)[:8])
        return Reject(
            "unreachable",
            f"{state.table.workers[reader].name} could not read {model!r} v{version} "
            f"from any holder ({names}) while they still heartbeat, so this worker's "
            f"transport is the likely fault: check that it reaches other hosts "
            f"(UCX_NET_DEVICES, UCX_TLS, TENSORHUB_TRANSPORT, firewalls). They are "
            f"offered to it again after {state.config.trust.window:.0f} s")
    if exc.busy:
        state.metrics.busy.labels(model).inc()
        return Reject("busy", busy, retry_after=busy_retry(state, layout))
    return Reject("no_holder", f"no live holder of {model!r} v{version} is left; the "
                  f"trainer must publish it again", retry_after=1.0)


def busy_retry(state: CoordinatorState, layout: LayoutRec) -> float:
    """How long a busy reader waits: a quarter of a chunk's time at the rate reads have
    had lately (a holder frees once a chunk is read; waiting longer idles it), at least
    `settings.BUSY_RETRY_MIN`, at most the configured `busy_retry`."""
    if state.stream_rate is None:
        return state.config.busy_retry
    chunk_time = state.config.planner.chunk_bytes_for(layout.nbytes) / state.stream_rate
    return min(state.config.busy_retry, max(settings.BUSY_RETRY_MIN, chunk_time / 4))


def plan_striped(state: CoordinatorState, req: StripedRequest, version: int, lid: str,
                 layout: LayoutRec) -> PlanReply:
    """A parent per stripe for the whole version (see `forest.py`): at a reader's first
    request, at its confirmation of the parents it reads by already, or for the `stripes`
    it names again (no parent yet, or a parent that failed or fell behind)."""
    forest = state.forest(layout)
    chunk_bytes = state.config.planner.chunk_bytes_for(layout.nbytes)
    nchunks = len(layout.chunks(chunk_bytes))
    if nchunks > PROGRESS_BYTES:
        raise Reject("bad_request", f"{nchunks} chunks of {chunk_bytes} bytes: a striped "
                                    f"pull takes at most {PROGRESS_BYTES} (--chunk-mib)")
    if not any(not h.withdrawn and h.worker_id != req.worker_id
               for h in layout.holders.values()):
        # Nobody has every chunk: readers of it could never complete.
        raise Reject("no_holder", f"no live holder of {req.model!r} v{version} is left; "
                                  f"the trainer must publish it again", retry_after=1.0)
    member = forest.members.get(req.worker_id)
    parents, kept = _parents(state, req, version, layout, forest)
    # A reader that reads by its last parents confirms: its lease is opened under the
    # name it already uses.
    lease_name = warm_lease_id(req.worker_id, req.model, version) \
        if type(req) is ConfirmParents else None
    sources = {p for p in parents if p is not None}
    lease_id = layout.striped_leases.get(req.worker_id)
    lease = state.table.leases.get(lease_id) if lease_id else None
    if lease is None:
        lease = state.table.new_lease(req.worker_id, req.model, version, lid, sources,
                                      state.config.lease_ttl, lease_id=lease_name)
        layout.striped_leases[req.worker_id] = lease.lease_id
    elif lease.sources != sources:
        dropped = lease.sources - sources
        state.table.leases[lease.lease_id] = replace(lease, sources=sources)
        state.finish_withdrawals(dropped, req.model, version)
    workers = state.table.workers
    chosen, holding = [], []
    for sid in sorted(sources):
        m = forest.members[sid]
        rec = layout.holders.get(sid) if m.root else layout.partial.get(sid)
        if rec is None or sid not in workers:
            continue
        chosen.append((workers[sid], rec))
        if m.root:
            holding.append(sid)
    # A parent taken in before it confirmed has no regions here yet: not named, unless
    # it is one the reader had (it knows its regions).
    named = {w.worker_id for w, _ in chosen}
    parents = [p if p in named or (kept and p == kept[s]) else None
               for s, p in enumerate(parents)]
    pending = any(p is None for p in parents) and not (member is not None and member.root)
    return read_plan(state, req, version, lid, layout, lease.lease_id, chosen, [],
                     complete=not pending, chunk_bytes=chunk_bytes, stripes=parents,
                     retry_after=state.config.pending_retry if pending else None,
                     holding=holding)


def _parents(state: CoordinatorState, req: StripedRequest, version: int, layout: LayoutRec,
             forest: Forest) -> tuple[list[str | None], list[str | None] | None]:
    """The reader's parent per stripe, and the parents it had for the last version if it
    was taken in with them (None otherwise)."""
    reader = state.table.workers[req.worker_id]
    dc, now = reader.labels.get("dc", ""), state.clock()
    member = forest.members.get(req.worker_id)
    if member is not None and member.root:
        # It holds the version already (a second pull of it): nothing to read.
        return [None] * forest.stripes, None
    if type(req) is ConfirmParents and layout.previous_forest is not None and (
            kept := forest.adopt(req.worker_id, layout.previous_forest)) is not None:
        # It pulls by the parents it had for the last version (no plan waited for):
        # taken in with them (a stripe whose old parent left gets a new one).
        take_memory(state, req, reader, layout)
        return forest.fill(req.worker_id, now, state.workers_in_dc[dc]), kept
    if member is None:
        if req.relay and req.memory is None:
            raise Reject("bad_request", "the first striped plan request of a reader that "
                                        "serves what it pulls must carry its memory")
        take_memory(state, req, reader, layout)
        return forest.join(req.worker_id, dc, state.workers_in_dc[dc], now,
                           relay=req.relay), None
    stripes, failed_ids, behind = (req.stripes, req.failed, req.behind) \
        if type(req) is ReplanStripes else ([], [], [])
    # On record once, and only a parent it had: a reader asking again after a busy
    # reply names the same failed parent again, already replaced.
    parents_now = {member.parents[s] for s in stripes if s < forest.stripes}
    for failed in parents_now & set(failed_ids):
        source = state.table.workers.get(failed)
        state.table.record(TransferRecord(
            reader=reader.name, source=source.name if source else failed,
            model=req.model, version=version, nbytes=0, seconds=0.0, ok=False,
            error="a striped read failed; the stripe is planned elsewhere"))
    for failed in failed_ids:  # (only a parent it had is its to report; any, to avoid)
        if failed in parents_now:
            report_failed(state, reader, failed, req.model, version,
                          "a striped read failed", protected_sources=None)
        else:
            state.trust.steer(req.worker_id, failed)
    gone = set(failed_ids) | set(behind)
    avoid = gone | set(state.trust.avoided(req.worker_id))
    for s in stripes:
        if s < forest.stripes and member.parents[s] in gone:
            forest.replace(req.worker_id, s, avoid, now)
    parents = forest.fill(req.worker_id, now, state.workers_in_dc[dc], avoid)
    if None in parents:
        avoid = state.trust.avoided(req.worker_id)
        serving = [h for h in layout.serving() if h != req.worker_id]
        if avoid and serving and all(h in avoid for h in serving):
            raise no_source(state, NoSource(busy=True), req.worker_id, req.model,
                            version, layout, avoid, "")
    return parents, None


def take_memory(state: CoordinatorState, req: StripedRequest, reader: WorkerRec,
                layout: LayoutRec) -> None:
    """A striped reader's destination regions: it serves its chunks from them."""
    if req.memory is not None:
        state.check_memory(layout, req.memory)
        state.update_endpoint(reader, req.endpoint)
        layout.partial.add(req.worker_id, store_memory(req.memory))


def read_done(state: CoordinatorState, req: ReadDone) -> Ack:
    """A reader ends its lease: the transfer is recorded, its sources' reads end (a
    withdrawing holder may go), and the holders it failed on are reported."""
    reader = state.worker(req.worker_id)
    lease = state.table.leases.get(req.lease_id)
    if lease is None or lease.reader != req.worker_id:
        return ACK  # expired, released, or not this worker's: nothing to do
    del state.table.leases[req.lease_id]
    layout = state.layout(lease.model, lease.version, lease.layout_id)
    if layout is not None and layout.striped_leases.get(req.worker_id) == req.lease_id:
        del layout.striped_leases[req.worker_id]
    for sid in sorted(req.by_source or lease.sources):
        source = state.table.workers.get(sid)
        nbytes = req.by_source.get(sid, req.nbytes)
        state.table.record(TransferRecord(
            reader=reader.name, source=source.name if source else sid, model=lease.model,
            version=lease.version, nbytes=nbytes, seconds=req.seconds, ok=req.ok,
            error=req.error))
        if req.ok and source is not None:
            state.metrics.served(source.role, distance(reader, source), nbytes)
    if req.ok and req.nbytes:  # the whole pull (the records above are per source)
        state.table.last_pull[reader.name] = req.worker_id, TransferRecord(
            reader=reader.name, source=",".join(
                state.table.workers[s].name if s in state.table.workers else s
                for s in sorted(req.by_source or lease.sources)),
            model=lease.model, version=lease.version, nbytes=req.nbytes,
            seconds=req.seconds, ok=True)
    if req.ok:
        read = req.by_source or dict.fromkeys(lease.sources, req.nbytes)
        whole = layout.nbytes if layout is not None else 0
        state.trust.read_ok(req.worker_id, {
            sid: whole > 0 and n >= whole for sid, n in read.items()
            if sid in lease.sources and n > 0 and sid not in req.bad_bytes},
            witness=state.witness(reader), since=lease.started)
        if req.nbytes >= 1 << 20 and req.seconds > 0:
            rate = req.nbytes / req.seconds
            state.stream_rate = rate if state.stream_rate is None \
                else 0.9 * state.stream_rate + 0.1 * rate
    elif not req.failed_holders:
        # The reader gave up (not a source failure it will re-plan around): its partial
        # buffers may be reused, so it serves none of them any more.
        state.table.drop_partial(req.worker_id, lease.model, lease.version)
    for failed in req.failed_holders:
        report_failed(state, reader, failed, lease.model, lease.version, req.error,
                      protected_sources=lease.sources)
    for bad in req.bad_bytes:
        report_failed(state, reader, bad, lease.model, lease.version,
                      "it served bytes that failed the version's checksums (they passed "
                      "when read again from another holder)", protected_sources=lease.sources,
                      bad_bytes=True)
    state.finish_withdrawals(lease.sources, lease.model, lease.version)
    return ACK


def report_failed(state: CoordinatorState, reader: WorkerRec, failed: str, model: str,
                  version: int, error: str | None, protected_sources: set[str] | None,
                  bad_bytes: bool = False) -> None:
    """A reader could not read from `failed` (or, `bad_bytes`, its bytes failed their
    checksums): it is avoided by that reader, and dropped only when witnesses of weight
    agree (`trust.py`). A source outside
    the reader's lease (`protected_sources`) is not its to report."""
    if protected_sources is not None and failed not in protected_sources:
        return
    holder = state.table.workers.get(failed)
    protected = (holder is not None and holder.role == "trainer") \
        or state.last_complete_holder(failed, model, version)
    if state.trust.report(reader.worker_id, failed, protected,
                          witness=state.witness(reader), bad_bytes=bad_bytes):
        log.warning("%s v%d: readers agree that holder %s fails (latest: %s, %s); "
                    "dropping its reference", model, version,
                    holder.name if holder else failed, reader.name, error)
        complete = state.holds_complete(failed, model, version)
        state.table.drop_holder(failed, model, version)
        state.metrics.evictions.labels("failed_reads").inc()
        if holder is not None and complete:  # told; it may offer it again later
            state.probation.setdefault(failed, {})[(model, version)] = \
                state.clock() + state.trust.config.window
            if bad_bytes:  # (told so: it checks its copy before it offers it again)
                state.bad_bytes.add((failed, model, version))
    else:
        log.warning("%s could not read %s v%d from %s (%s); it is planned elsewhere",
                    reader.name, model, version, holder.name if holder else failed, error)
