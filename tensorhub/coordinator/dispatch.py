"""One table from request type to handler, and the one way every request is answered:
decoded, authenticated, handled, and its reply encoded (any failure becomes an
`ErrorReply` saying why; the coordinator goes on serving)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

from tensorhub.coordinator import (
    declarations,
    forgetting,
    holdings,
    membership,
    planning,
    publishing,
)
from tensorhub.coordinator import status as fleet_status
from tensorhub.coordinator.planning import PlanReply
from tensorhub.coordinator.prepare import Prepared
from tensorhub.coordinator.state import ACK, CoordinatorState, Reject, Spliced, log
from tensorhub.core.data_types import (
    Announcement,
    ConfirmParents,
    Declare,
    Envelope,
    ErrorReply,
    Forget,
    GetDeclared,
    GetManifest,
    Heartbeat,
    Hold,
    HoldingsRequest,
    LatestRequest,
    PlanRequest,
    Publish,
    PublishStatus,
    ReadDone,
    Register,
    ReplanStripes,
    RetentionRequest,
    StandBy,
    StatusRequest,
    StripedPlanRequest,
    Unregister,
    Withdraw,
)
from tensorhub.core.wire import WireError, decode_envelope, encode, foreign

Handler = Callable[[CoordinatorState, Any], Any]

HANDLERS: dict[type, Handler] = {
    Register: membership.register, Heartbeat: membership.heartbeat,
    Unregister: membership.unregister,
    Publish: publishing.publish, PublishStatus: publishing.publish_status,
    Hold: holdings.hold, Withdraw: holdings.withdraw, LatestRequest: holdings.latest,
    GetManifest: holdings.manifest, HoldingsRequest: holdings.holdings,
    RetentionRequest: holdings.retention,
    PlanRequest: planning.plan, StripedPlanRequest: planning.plan,
    ReplanStripes: planning.plan, ConfirmParents: planning.plan,
    ReadDone: planning.read_done,
    StandBy: declarations.stand_by, Declare: declarations.declare,
    GetDeclared: declarations.get_declared,
    StatusRequest: fleet_status.status, Forget: forgetting.forget,
}  # fmt: skip
PLANS = (PlanRequest, StripedPlanRequest, ReplanStripes, ConfirmParents)
_ACK_BYTES = encode(ACK)  # heartbeats alone are thousands a second


def handle(state: CoordinatorState, payload: bytes):
    """Decode, authenticate and answer one request: the reply model."""
    return _answer(state, payload, as_model)


def answer(state: CoordinatorState, payload: bytes) -> bytes:
    """`handle`, as the bytes the socket sends."""
    return _answer(state, payload, lambda reply: encode_reply(state, reply))


def as_model(reply):
    """A handler's reply as a model (a plan's sources with their memory regions)."""
    return reply.model() if type(reply) in (PlanReply, Spliced) else reply


def encode_reply(state: CoordinatorState, reply) -> bytes:
    """A handler's reply as bytes. The replies sent most are encoded once: the Ack, a
    model's newest announcement (every idle watcher's fallback), and what a plan carries
    from the table (its manifest, its sources' memory regions: `PlanReply`)."""
    if reply is ACK:
        return _ACK_BYTES
    kind = type(reply)
    if kind is PlanReply:
        return encode(reply.bare, reply.packed())
    if kind is Spliced:
        return encode(reply.reply, reply.packed)
    if kind is Announcement:
        made = state.announcements.get(reply.model)
        if made is not None and made[0] is reply:
            return made[1]
    return encode(reply)


def answer_prepared(state: CoordinatorState, envelope: Envelope | ErrorReply,
                    prepared: Prepared | None) -> bytes:
    """`answer` for a request decoded (and its manifest's work done) beside the loop
    (`prepare.py`)."""
    finish = lambda reply: encode_reply(state, reply)  # noqa: E731
    if type(envelope) is ErrorReply:
        return finish(envelope)
    state.prepared = prepared
    try:
        return _respond(state, envelope, finish)
    finally:
        state.prepared = None


def _answer(state: CoordinatorState, payload: bytes, finish: Callable[[Any], Any]):
    try:
        envelope = decode_envelope(payload)
    except WireError as exc:
        return finish(ErrorReply(code="bad_request",
                                 message=foreign(payload, "this worker", "request") or str(exc)))
    return _respond(state, envelope, finish)


def _respond(state: CoordinatorState, envelope: Envelope, finish: Callable[[Any], Any]):
    token = state.config.token
    if token is not None and not hmac.compare_digest((envelope.token or "").encode(),
                                                     token.encode()):
        return finish(ErrorReply(code="unauthorized",
                                 message="wrong or missing token (set TENSORHUB_TOKEN)"))
    request = envelope.request
    impostor = _impostor(state, request, envelope.secret)
    if impostor is not None:
        return finish(impostor)
    try:
        started = time.perf_counter()
        reply = finish(HANDLERS[type(request)](state, request))
        if type(request) in PLANS:
            state.metrics.plan_latency.observe(time.perf_counter() - started)
            state.metrics.plans.labels(request.model).inc()
        return reply
    except Reject as rej:
        return finish(rej.reply)
    except Exception as exc:  # a bug must not take the coordinator down
        log.exception("internal error handling %s", request.type)
        return finish(ErrorReply(code="internal", message=f"internal error: {exc}"))


def _impostor(state: CoordinatorState, request, secret: str | None) -> ErrorReply | None:
    """A refusal if `request` is made as a registered worker without that worker's secret
    (what it carries as another worker, a plan's `done`, is refused by its handler)."""
    worker_id = getattr(request, "worker_id", None)
    if worker_id is None:
        return None
    worker = state.table.workers.get(worker_id)
    if worker is None or hmac.compare_digest((secret or "").encode(),
                                             worker.secret.encode()):
        return None  # (an unknown worker is refused by the handler: register again)
    return ErrorReply(code="unauthorized",
                      message=f"{request.type} as worker {worker_id} without its secret: a "
                              f"worker acts only for itself (the secret comes with "
                              f"`Registered`; `CoordinatorClient` shows it)")
