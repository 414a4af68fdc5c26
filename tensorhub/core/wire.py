"""Encoding of protocol messages: pydantic models as msgpack, size-checked, never pickled.

Decoding validates against the models in `data_types`, so a malformed or hostile message
becomes a `WireError` with a readable reason, never an exception deep inside a handler.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import BaseModel, RootModel, TypeAdapter, ValidationError

from tensorhub.core.data_types import (
    Announcement,
    Envelope,
    MemoryDesc,
    Reply,
    TensorSpec,
)
from tensorhub.core.schema import MAX_TENSORS, PROTOCOL

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a larger frame is refused before it is decoded
# No list or map in any message may be longer than this; msgpack refuses longer ones before
# building them (a list of a million small maps would otherwise hold the coordinator's single
# thread for seconds, only to be refused by the schema).
MAX_CONTAINER_LEN = MAX_TENSORS

_envelope = TypeAdapter(Envelope)
_reply = TypeAdapter(Reply)
_announcement = TypeAdapter(Announcement)


class WireError(ValueError):
    """A message that cannot be decoded into the expected model."""


def _plain(cls: type[BaseModel]) -> bool:
    """Whether a model's dump is its fields as they are (`__dict__`): no serializer, no
    computed, excluded or extra fields, not a root model. The protocol's models all are."""
    return (not issubclass(cls, RootModel) and cls.model_config.get("extra") != "allow"
            and not cls.model_computed_fields
            and not any(f.exclude for f in cls.model_fields.values())
            and "'serialization'" not in repr(cls.__pydantic_core_schema__))


# model class -> its field names if plain, else None (isinstance on models is slow)
_model_types: dict[type, tuple[str, ...] | None] = {}


def _fields(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: a model becomes its fields."""
    cls = type(obj)
    try:
        names = _model_types[cls]
    except KeyError:
        if not isinstance(obj, BaseModel):
            raise TypeError(f"cannot encode a {cls.__name__} on the wire") from None
        names = _model_types[cls] = tuple(cls.model_fields) if _plain(cls) else None
    if names is None:
        return obj.model_dump(mode="python")
    values = obj.__dict__
    if len(values) == len(names):
        return values
    # `model_copy(update=...)` can leave a key that is no field in `__dict__`: a dump drops
    # it, and so does this (the peer's strict model would refuse it)
    return {k: values[k] for k in names}


def encode(model: BaseModel, packed: dict[tuple, Packed] | None = None) -> bytes:
    """The model as a msgpack map, nested models as maps: the bytes of
    `packb(model.model_dump(mode="python"))` (`tests/test_wire.py` pins it).

    A plain model's fields go to msgpack as they are (its `__dict__`, validated values):
    dumping them to dicts first only built a second tree of the same values (for a read plan
    of 129 items, ~260 dicts: half the cost of encoding it, and garbage to collect).

    `packed`: values the caller encoded before, by their path in the model (field names
    and list indices: `("sources", 0, "memory")`), written as they are in place of what the
    model holds there. A read plan's manifest and its sources' memory regions are the same
    in every plan that carries them: encoded once, by the table that keeps them, they are
    neither encoded again nor built as models (a source of a 2049-item version has 2049
    regions).
    """
    if packed:
        return _spliced(model, packed, ())
    return msgpack.packb(model, use_bin_type=True, default=_fields)



def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, default=_fields)


def _shallow(value: Any) -> Any:
    """A list of plain models (a plan's ranges) as their fields: msgpack then packs them
    without calling back into Python for each."""
    if type(value) is list and value and _model_types.get(type(value[0])):
        return [_fields(v) for v in value]
    return value


class Packed:
    """A value msgpack-encoded beforehand, which `encode` splices in as it is."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


def _spliced(value: Any, packed: dict[tuple, Packed], path: tuple) -> bytes:
    hit = packed.get(path)
    if hit is not None:
        return hit.data
    depth = len(path)
    if not any(len(p) > depth and p[:depth] == path for p in packed):
        return _pack(value)
    if isinstance(value, list):
        return _array_header(len(value)) + b"".join(
            _spliced(v, packed, (*path, k)) for k, v in enumerate(value))
    fields = _fields(value)
    out, run = [_map_header(len(fields))], {}
    for key, field in fields.items():
        inner = (*path, key)
        if any(p[:depth + 1] == inner for p in packed):
            if run:  # the fields before it, packed at once, less their map header
                out.append(_pack(run)[len(_map_header(len(run))):])
                run = {}
            out.append(_pack(key))
            out.append(_spliced(field, packed, inner))
        else:
            run[key] = _shallow(field)
    if run:
        out.append(_pack(run)[len(_map_header(len(run))):])
    return b"".join(out)


def _array_header(n: int) -> bytes:
    return bytes((0x90 | n,)) if n < 16 else (
        b"\xdc" + n.to_bytes(2, "big") if n < 2**16 else b"\xdd" + n.to_bytes(4, "big"))


def _map_header(n: int) -> bytes:
    return bytes((0x80 | n,)) if n < 16 else (
        b"\xde" + n.to_bytes(2, "big") if n < 2**16 else b"\xdf" + n.to_bytes(4, "big"))


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


def foreign(data: bytes, who: str, marker: str) -> str | None:
    """Why a message from `who` that failed to decode cannot be read, if it is one of ours
    (a map with a `marker` key: "request" for an envelope, "worker_id" for `Registered`)
    made by a release that speaks another protocol (its `protocol`; none: an older one)."""
    try:
        obj = msgpack.unpackb(data, raw=False, max_array_len=MAX_CONTAINER_LEN,
                              max_map_len=MAX_CONTAINER_LEN)
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(obj, dict) or marker not in obj or obj.get("protocol") == PROTOCOL:
        return None
    theirs = obj.get("protocol")
    said = f"protocol {theirs}" if isinstance(theirs, int) else "an older protocol"
    return (f"{who} speaks {said}, this process protocol {PROTOCOL}: run the same tensorhub "
            f"release on the coordinator and every worker")


# ------------------------------------------------------------------ large messages, sliced
SLICE = 512  # list elements validated (or unpacked) per call into C or Rust


def _sliced_value(u: msgpack.Unpacker) -> Any:
    """The next value on `u`: maps descended, arrays' elements unpacked one call each (a
    call into msgpack's C decoder holds the GIL for as long as it runs)."""
    try:
        n = u.read_map_header()
    except ValueError:
        pass
    else:
        out = {}
        for _ in range(n):
            key = u.unpack()
            if not isinstance(key, str):
                raise WireError("a map key that is not a string")
            out[key] = _sliced_value(u)
        return out
    try:
        n = u.read_array_header()
    except ValueError:
        return u.unpack()
    return [u.unpack() for _ in range(n)]


def unpack_sliced(data: bytes) -> Any:
    """As `_unpack`, in many short calls into C: another thread (the coordinator's loop)
    runs between them."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    u = msgpack.Unpacker(raw=False, strict_map_key=True, max_array_len=MAX_CONTAINER_LEN,
                         max_map_len=MAX_CONTAINER_LEN, max_buffer_size=len(data) + 1)
    try:
        u.feed(data)
        value = _sliced_value(u)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not a msgpack message: {exc}") from None
    if u.tell() != len(data):
        raise WireError("not a msgpack message: extra data after it")
    return value


_SLICED_LISTS = {("request", "manifest", "tensors"): TypeAdapter(list[TensorSpec]),
                 ("request", "memory"): TypeAdapter(list[MemoryDesc])}


def decode_envelope_sliced(data: bytes) -> Envelope:
    """`decode_envelope` for a large request, in short calls (`unpack_sliced`; a manifest's
    tensors and a memory list validated `SLICE` at a time): for a thread beside the loop."""
    obj = unpack_sliced(data)
    lists: dict[tuple[str, ...], list] = {}
    for path, adapter in _SLICED_LISTS.items():
        parent = obj
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        values = parent.get(path[-1]) if isinstance(parent, dict) else None
        if not isinstance(values, list) or len(values) <= SLICE:
            continue
        try:
            lists[path] = [v for k in range(0, len(values), SLICE)
                           for v in adapter.validate_python(values[k:k + SLICE])]
        except ValidationError as exc:
            e = exc.errors()[0]
            raise WireError(f"invalid request: {'.'.join(path)}: {e['msg']}") from None
        # The rest is validated with one element in its place (checking a model instance
        # per element is another long call), and the whole list put back after. The raw
        # elements are let go a slice at a time: freeing them at once is a long call too.
        parent[path[-1]] = lists[path][:1]
        while values:
            del values[-SLICE:]
    try:
        envelope = _envelope.validate_python(obj)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise WireError(f"invalid request: {errors}") from None
    for path, values in lists.items():
        owner = envelope
        for key in path[:-1]:
            owner = getattr(owner, key)
        owner.__dict__[path[-1]] = values  # (validated above; the models are frozen)
    return envelope
