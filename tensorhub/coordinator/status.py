"""The fleet as an operator sees it: `tensorhub status`, and the shape the metrics show."""

from __future__ import annotations

from collections import Counter

from tensorhub.coordinator.state import CoordinatorState
from tensorhub.core.data_types import (
    HolderStatus,
    ModelStatus,
    PullInFlight,
    StatusReply,
    StatusRequest,
    VersionStatus,
)


def status(state: CoordinatorState, req: StatusRequest) -> StatusReply:
    now = state.clock()
    workers = [
        {"worker_id": w.worker_id, "name": w.name, "role": w.role,
         "transport": w.endpoint.transport, "seen_ago": round(now - w.last_seen, 3),
         "labels": ",".join(f"{k}={v}" for k, v in sorted(w.labels.items()))}
        for w in state.table.workers.values()
    ]  # fmt: skip
    models = []
    for name, mrec in sorted(state.table.models.items()):
        versions = []
        for v, vrec in sorted(mrec.versions.items()):
            for lid, layout in vrec.layouts.items():
                holders = [
                    HolderStatus(
                        worker_id=h.worker_id,
                        name=state.table.workers[h.worker_id].name
                        if h.worker_id in state.table.workers else "?",
                        role=state.table.workers[h.worker_id].role
                        if h.worker_id in state.table.workers else "?",
                        active_reads=state.table.active_reads(h.worker_id, name, v),
                        withdrawn=h.withdrawn)
                    for h in layout.holders.values()
                ]
                versions.append(VersionStatus(
                    version=v, layout_id=lid,
                    part=vrec.parts.index(lid) if vrec.parts and lid in vrec.parts else None,
                    nbytes=sum(i.nbytes for i in layout.items), holders=holders))
        models.append(ModelStatus(model=name, latest=mrec.latest, versions=versions))
    suspects = [state.table.workers[r].name for r in state.trust.suspects()
                if r in state.table.workers]
    pulls = [PullInFlight(reader=w.name, **dict(w.pull))
             for w in state.table.workers.values() if w.pull is not None]
    return StatusReply(workers=workers, models=models,
                       reads_in_flight=len(state.table.leases),
                       transfers=state.table.transfers[-200:], suspect_readers=suspects,
                       pulls=pulls)


def measure_fleet(state: CoordinatorState) -> None:
    """The fleet's shape for the metrics: another walk of every worker and holder, so
    only while metrics are served, and at most every `settings.FLEET_PERIOD`."""
    holders, latest = {}, {}
    for model, mrec in state.table.models.items():
        latest[model] = mrec.latest
        for version, vrec in mrec.versions.items():
            holders[(model, version)] = state.complete_holders(vrec)
    roles = Counter(w.role for w in state.table.workers.values())
    state.metrics.fleet(holders, latest, len(state.table.leases), roles, len(state.standby))
