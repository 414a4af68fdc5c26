"""Forgetting a model: an operator's way to drop a model nobody uses any more (and its
companions: its patches, `<model>.patch`, and quantized layouts, `<model>@<recipe>`) from
the coordinator's records, so that `tensorhub status` lists only the models in use.

The rule: a model is forgotten only when no registered worker holds any version of it
(whole or in part), publishes it (a sharded version waiting for parts, or a trainer bound
to it as its owner) or reads it. Forgetting so never takes a version from a worker that
serves it, and never unbinds a live trainer's model (which would let another token holder
publish it); a model in use is refused with the names of the workers that use it.
"""

from __future__ import annotations

from tensorhub.coordinator.owners import companion_of
from tensorhub.coordinator.state import CoordinatorState, Reject
from tensorhub.core.data_types import Forget, Forgotten


def _users(state: CoordinatorState, model: str) -> set[str]:
    """Ids of the registered workers that hold, publish, own or read `model`."""
    workers = state.table.workers
    users: set[str] = set()
    mrec = state.table.models.get(model)
    for vrec in (mrec.versions.values() if mrec is not None else ()):
        for layout in vrec.layouts.values():
            users.update(layout.holders)
            users.update(layout.partial)
    users.update(pp.publisher for (m, _), pv in state.pending.versions.items() if m == model
                 for pp in pv.have.values())
    users.update(w for (m, _), w in state.owners.by.items() if m == model)
    users.update(lease.reader for lease in state.table.leases.values() if lease.model == model)
    return {w for w in users if w in workers}


def _goes_with(model: str, base: str) -> bool:
    """Whether `model` is a companion of `base`, or of one of its companions (the patches
    of a quantized layout)."""
    while (model := companion_of(model)) is not None:
        if model == base:
            return True
    return False


def forget(state: CoordinatorState, req: Forget) -> Forgotten:
    names = sorted(m for m in {*state.table.models, *state.standby.declared_models()}
                   if m == req.model or _goes_with(m, req.model))
    if not names:
        known = ", ".join(sorted(state.table.models)) or "none"
        raise Reject("unknown_model", f"model {req.model!r} is not known (known: {known})")
    users = set().union(*(_users(state, m) for m in names))
    if users:
        shown = ", ".join(sorted(state.table.workers[w].name for w in users))
        raise Reject("in_use", f"model {req.model!r} is in use by {shown}: a model is "
                               f"forgotten only once no worker holds, publishes or reads "
                               f"it; close them (or let them leave) and ask again")
    versions = {}
    for m in names:
        mrec = state.table.models.pop(m, None)
        versions[m] = sorted(mrec.versions) if mrec is not None else []
        state.announcements.pop(m, None)
        state.claims.pop(m, None)
        state.standby.drop_model(m)
        for key in [k for k in state.pending.versions if k[0] == m]:
            del state.pending.versions[key]
        for key in [k for k in state.owners.bound if k[0] == m]:
            del state.owners.bound[key]
    return Forgotten(model=req.model, versions=versions)
