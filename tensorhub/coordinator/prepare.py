"""A large request made ready beside the coordinator's loop: decoded, validated, and its
manifest checked, cut into items, hashed and encoded, in short calls (a thread of the socket
loop runs this; `server.py`). What the loop's handler then does with it takes
milliseconds: a publish of 150,000 tiny tensors holds no other request for the seconds its
manifest takes.

No I/O and no state: the handlers find the work done by the manifest object
(`CoordinatorState.prepared`), and do it themselves for a request that did not come this
way (the simulator, small requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from tensorhub.core.data_types import Envelope, ErrorReply, Manifest
from tensorhub.core.errors import LayoutError
from tensorhub.core.layout import Item, check_manifest, layout_id_sliced, plan_items
from tensorhub.core.wire import Packed, WireError, decode_envelope_sliced, encode, foreign


@dataclass(frozen=True)
class Prepared:
    """A manifest's layout work, done: its id, items and encoding (as plans carry it)."""

    manifest: Manifest
    layout_id: str
    items: list[Item]
    packed: tuple[Packed, Packed] | None  # manifest and checksums, msgpack-encoded


def prepare(payload: bytes) -> tuple[Envelope | ErrorReply, Prepared | None]:
    """The request in `payload`, or the error to answer it with; and its manifest's work
    (None: it has none, or the manifest is bad: the handler says why)."""
    try:
        envelope = decode_envelope_sliced(payload)
    except WireError as exc:
        return ErrorReply(code="bad_request",
                          message=foreign(payload, "this worker", "request") or str(exc)), None
    request = envelope.request
    manifest = getattr(request, "manifest", None)
    if not isinstance(manifest, Manifest):
        return envelope, None
    try:
        check_manifest(manifest)
    except LayoutError:
        return envelope, None
    checksums = getattr(request, "checksums", None)
    packed = (Packed(encode(manifest)),
              Packed(msgpack.packb(list(checksums), use_bin_type=True))) \
        if checksums is not None else None
    return envelope, Prepared(manifest, layout_id_sliced(manifest), plan_items(manifest), packed)
