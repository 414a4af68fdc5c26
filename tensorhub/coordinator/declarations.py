"""Ahead of a model's first version: a trainer declares the manifest it will have, and
readers stand by in the forest of that version (`standby.py`)."""

from __future__ import annotations

from tensorhub.coordinator.owners import companion_of
from tensorhub.coordinator.state import ACK, CoordinatorState, Reject, source_of
from tensorhub.coordinator.table import load_memory, store_memory
from tensorhub.core.data_types import (
    PUBLISHER,
    Ack,
    Declare,
    Declared,
    GetDeclared,
    Placement,
    StandBy,
)


def stand_by(state: CoordinatorState, req: StandBy) -> Placement:
    """Place a reader ahead in the forest of the model's first version in its layout
    (`standby.py`)."""
    reader = state.worker(req.worker_id)
    if reader.role != "replica":
        raise Reject("bad_request", "only a replica stands by for a version")
    mrec = state.table.models.get(req.model)
    if mrec is not None and mrec.versions:
        raise Reject("stale_version", f"{req.model!r} v{mrec.latest} is out already: "
                                      f"pull it (standing by is for a first version)")
    if any(m.nbytes <= 0 for m in req.memory):
        raise Reject("bad_request", "a region of zero bytes")
    sizes = tuple(m.nbytes for m in req.memory)
    state.update_endpoint(reader, req.endpoint)
    dc = reader.labels.get("dc", "")

    def publisher_dc() -> str:  # (a trainer's, else this reader's)
        trainer = next((w for w in state.table.workers.values() if w.role == "trainer"),
                       reader)
        return trainer.labels.get("dc", "")

    try:
        parents = state.standby.place(
            req.model, req.layout_id, req.worker_id, dc, sizes, store_memory(req.memory),
            state.workers_in_dc[dc], state.clock(), publisher_dc)
    except ValueError as exc:
        raise Reject("layout_mismatch", str(exc)) from None
    standing = state.standby.get(req.model, req.layout_id)
    workers = state.table.workers
    sources = [source_of(workers[p], load_memory(standing.memory[p]), workers[p].progress,
                         req.worker_id)
               for p in dict.fromkeys(parents) if p is not None and p != PUBLISHER]
    return Placement(model=req.model, layout_id=req.layout_id,
                     chunk_bytes=state.config.planner.chunk_bytes_for(sum(sizes)),
                     stripes=parents, sources=sources,
                     # (a leaf's stripe waits for the grace, after which any slot is
                     # its: there is no hurry before the version exists)
                     retry_after=state.config.pending_grace if None in parents else None)


def declare(state: CoordinatorState, req: Declare) -> Ack:
    """Keep the manifest a trainer says its model's first version will have (`Declare`)."""
    if state.worker(req.worker_id).role != "trainer":
        raise Reject("bad_request", "only a worker registered as trainer declares")
    mrec = state.table.models.get(req.model)
    if mrec is not None and mrec.versions:
        raise Reject("stale_version", f"{req.model!r} v{mrec.latest} is out already: "
                                      f"readers allocate from its manifest")
    base = companion_of(req.model)
    if base is not None and not (state.owners.held_by(base, req.worker_id)
                                 or state.standby.declared_by(base) == req.worker_id):
        raise Reject("unauthorized", f"{req.model!r} goes with {base!r}: only the trainer "
                                     f"that declares or publishes {base!r} declares it")
    state.check_manifest(req.manifest)  # (one that could be published)
    state.standby.declare(req.model, req.manifest, req.worker_id)
    return ACK


def get_declared(state: CoordinatorState, req: GetDeclared) -> Declared:
    declared = state.standby.declared(req.model)
    mrec = state.table.models.get(req.model)
    if declared is None or (mrec is not None and mrec.versions):
        raise Reject("unknown_model", f"no manifest declared for {req.model!r} (its "
                                      f"trainer has not declared one, or a version "
                                      f"is out: read its manifest)")
    manifest, lid = declared
    return Declared(model=req.model, layout_id=lid, manifest=manifest)
