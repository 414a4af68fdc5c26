"""Membership: workers register, heartbeat and leave; silent ones expire and are forgotten
with everything that names them."""

from __future__ import annotations

import secrets
import uuid

from tensorhub import settings
from tensorhub.coordinator import status
from tensorhub.coordinator.state import ACK, CoordinatorState, Reject, log
from tensorhub.coordinator.table import ModelRec, WorkerRec
from tensorhub.core.data_types import (
    Ack,
    Dropped,
    Heartbeat,
    HeartbeatReply,
    Register,
    Registered,
    Unregister,
)


def register(state: CoordinatorState, req: Register) -> Registered:
    """A new worker: an id, the secret its requests must show, and the timings it keeps."""
    peer = state.peer()
    if peer and state.peer_workers[peer] >= settings.MAX_WORKERS_PER_PEER:
        raise Reject("bad_request", f"{state.peer_workers[peer]} workers are registered from "
                     f"{peer} already (at most {settings.MAX_WORKERS_PER_PEER} from one "
                     f"address)")
    worker_id = f"{req.name}-{uuid.uuid4().hex[:8]}"
    secret = secrets.token_hex(16)
    worker = WorkerRec(
        worker_id, req.name, req.role, req.endpoint, dict(req.labels), state.clock(),
        progress=req.progress, secret=secret, grant_key=req.grant_key, peer=peer)
    state.account_metadata(worker, req.endpoint)
    state.table.workers[worker_id] = worker
    state.table.named[worker.name] += 1
    if peer:
        state.peer_workers[peer] += 1
    if req.role == "replica":
        state.workers_in_dc[req.labels.get("dc", "")] += 1
    log.info("worker %s registered (%s, %s)", worker_id, req.role, req.endpoint.transport)
    if req.role == "trainer":
        for model, newest in req.published.items():
            claimed(state, worker_id, model, newest, req.owners.get(model))
        for model, credential in req.owners.items():
            if model not in req.published:  # (a resumed job: its credential, no word)
                state.owners.claim(model, credential, worker_id)
    return Registered(worker_id=worker_id, secret=secret,
                      heartbeat_interval=state.config.heartbeat_interval,
                      worker_ttl=state.config.worker_ttl,
                      announce_address=state.announce_address,
                      lease_ttl=state.config.lease_ttl)


def claimed(state: CoordinatorState, worker_id: str, model: str, newest: int,
            credential: str | None) -> None:
    """A registering trainer states its newest published version of `model`. Only its
    owner's word counts (`owners.py`): a claim that shows the model's credential binds it
    (again) and is taken. Without one, a claim is taken only where nobody could show one
    (a coordinator with no persistent key that restarted: the model is unbound) and
    holders brought versions back; a claim for a model with no versions creates nothing,
    and blocks nobody."""
    owners = state.owners
    if owners.claim(model, credential, worker_id):
        trainer_newest(state, model, newest, owner=True)
        return
    if owners.persistent or owners.is_bound(model):
        log.warning("%s says it published %s up to v%d without the model's credential: "
                    "not taken", worker_id, model, newest)
        return
    mrec = state.table.models.get(model)
    if mrec is not None and mrec.versions:
        trainer_newest(state, model, newest)
    elif len(state.claims) < settings.MAX_CLAIMS or model in state.claims:
        # No version to judge it by: holders may not bring back versions past it, and
        # nothing else (a publish is numbered as if it had not been said).
        state.claims[model] = min(newest, state.claims.get(model, newest))


def trainer_newest(state: CoordinatorState, model: str, newest: int,
                   owner: bool = False) -> None:
    """A trainer registering again (we restarted) says the newest version it published:
    versions past it that holders brought back since are another run's (a replica left
    over from an earlier job): dropped, so they are never served and never block its
    next publish. From here on versions come from publishes only."""
    mrec = state.table.models.setdefault(model, ModelRec())
    if mrec.published and not owner:
        return
    # (its owner's word is taken again: versions past it that a token holder published
    # before it came back after a restart are not its own)
    mrec.published = True
    stale = sorted(v for v in mrec.versions if v > newest)
    for v in stale:
        holders = {state.table.workers[h].name if h in state.table.workers else h
                   for layout in mrec.versions.pop(v).layouts.values()
                   for h in layout.holders}
        log.warning("%s v%d, brought back by %s, is past the newest version its trainer "
                    "published (v%d): another run's, dropped", model, v,
                    ", ".join(sorted(holders)) or "nobody", newest)
    for lease_id in [k for k, x in state.table.leases.items()
                     if x.model == model and x.version in stale]:
        del state.table.leases[lease_id]
    announced = state.announcements.get(model)
    if stale and announced is not None and announced[0].version > newest:
        del state.announcements[model]
    mrec.latest = max([newest, *mrec.versions])
    state.claims.pop(model, None)


def heartbeat(state: CoordinatorState, req: Heartbeat) -> Ack | HeartbeatReply:
    """A worker is alive (with its pull in flight); a holder on probation is told when it
    may offer each dropped version again."""
    state.worker(req.worker_id).pull = req.pull
    dropped = state.probation.get(req.worker_id)
    if not dropped:
        return ACK
    now = state.clock()
    return HeartbeatReply(dropped=[
        Dropped(model=m, version=v, retry_after=max(0.0, until - now),
                bad_bytes=(req.worker_id, m, v) in state.bad_bytes)
        for (m, v), until in dropped.items()])


def unregister(state: CoordinatorState, req: Unregister) -> Ack:
    forget_worker(state, req.worker_id, "unregistered", "unregistered")
    return ACK


def forget_worker(state: CoordinatorState, worker_id: str, why: str, reason: str) -> None:
    """`why` for the log, `reason` for the evictions metric."""
    worker = state.table.workers.pop(worker_id, None)
    if worker is None:
        return
    state.table.named[worker.name] -= 1
    if not state.table.named[worker.name]:
        del state.table.named[worker.name]
    state.release_metadata(worker)
    state.owners.worker_gone(worker_id)
    state.metrics.evictions.labels(reason).inc()
    if worker.role == "replica":
        state.workers_in_dc[worker.labels.get("dc", "")] -= 1
    log.info("worker %s %s: dropping its references and reads", worker_id, why)
    for key in state.pending.published_by(worker_id):
        state.abort(key, f"{worker.name}, which published a part, {why}")
    state.trust.forget(worker_id)
    state.standby.forget(worker_id)
    for model, version in state.probation.pop(worker_id, {}):
        state.bad_bytes.discard((worker_id, model, version))
    if state.table.last_pull.get(worker.name, ("",))[0] == worker_id:
        del state.table.last_pull[worker.name]
    for lease_id in [k for k, v in state.table.leases.items() if v.reader == worker_id]:
        lease = state.table.leases.pop(lease_id)
        state.finish_withdrawals(lease.sources, lease.model, lease.version)
    state.table.drop_holder(worker_id, gone=True)


def expire(state: CoordinatorState) -> None:
    """Give up sharded versions whose parts are late, forget workers that stopped
    heartbeating, end probations long over and leases expired; measure the fleet for the
    metrics when due. Called every `settings.EXPIRY_PERIOD` by whoever drives the state."""
    now, ttl = state.clock(), state.config.worker_ttl
    for key, pv in list(state.pending.versions.items()):
        if now - pv.started > state.config.part_wait:
            state.abort(key, f"part(s) {pv.missing()} of {pv.parts} not in within "
                             f"{state.config.part_wait:.0f} s")
    for w in [w for w in state.table.workers.values() if now - w.last_seen > ttl]:
        forget_worker(state, w.worker_id, "stopped heartbeating", "heartbeat")
    for worker_id, dropped in list(state.probation.items()):
        for model, version in [k for k, until in dropped.items() if until < now - ttl]:
            state.end_probation(worker_id, model, version)  # told long since, or gone
    for lease in [x for x in state.table.leases.values() if x.expires < now]:
        log.warning("read lease of %s on %s v%d expired", lease.reader, lease.model,
                    lease.version)
        del state.table.leases[lease.lease_id]
        state.finish_withdrawals(lease.sources, lease.model, lease.version)
    measured_at = state.fleet_measured_at
    if measured_at is not None and now - measured_at >= settings.FLEET_PERIOD:
        state.fleet_measured_at = now
        status.measure_fleet(state)


def forgive_pause(state: CoordinatorState, seconds: float) -> None:
    """The coordinator did not read its queue for `seconds` (this process or its
    machine was paused, or one request took that long): heartbeats and lease reports
    sent meanwhile are still queued, so the gap counts against no worker and no lease.
    Without this, the first expiry walk after a pause drops every worker at once, and
    all of them register again."""
    log.warning("the coordinator did not read its queue for %.1f s (paused, or busy); "
                "not counting that against heartbeats or read leases", seconds)
    for worker in state.table.workers.values():
        worker.last_seen += seconds
    for lease in state.table.leases.values():
        lease.expires += seconds
    for pending in state.pending.versions.values():
        pending.started += seconds
