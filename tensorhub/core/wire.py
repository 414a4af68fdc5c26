"""Encoding of protocol messages: pydantic models as msgpack, size-checked, never pickled.

Decoding validates against the models in `data_types`, so a malformed or hostile message
becomes a `WireError` with a readable reason, never an exception deep inside a handler.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from tensorhub.core.data_types import MAX_TENSORS, Announcement, Envelope, Reply

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# No list or map in any message may be longer than this; msgpack refuses longer ones before
# building them (a 23 MB list of a million small maps otherwise costs the coordinator's
# single thread ~4 s to build and validate, only to be refused by the schema).
MAX_CONTAINER_LEN = MAX_TENSORS

_envelope = TypeAdapter(Envelope)
_reply = TypeAdapter(Reply)
_announcement = TypeAdapter(Announcement)


class WireError(ValueError):
    """A message that cannot be decoded into the expected model."""


def encode(model: BaseModel) -> bytes:
    return msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)


def _unpack(data: bytes) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True,
                               max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not a msgpack message: {exc}") from None


def _validate(adapter: TypeAdapter, data: bytes, what: str) -> Any:
    obj = _unpack(data)
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise WireError(f"invalid {what}: {errors}") from None


def decode_envelope(data: bytes) -> Envelope:
    return _validate(_envelope, data, "request")


def decode_reply(data: bytes) -> Any:
    return _validate(_reply, data, "reply")


def decode_announcement(data: bytes) -> Announcement:
    return _validate(_announcement, data, "announcement")
