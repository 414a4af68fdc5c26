"""The wire format: msgpack of pydantic models; malformed input is a WireError, never a crash."""

import msgpack
import pytest

from tensorhub.core.data_types import Endpoint, Envelope, Register, StatusRequest
from tensorhub.core.wire import (
    Packed,
    WireError,
    decode_envelope,
    encode,
)


def test_a_request_round_trips_with_its_bytes_intact():
    req = Register(name="w", role="replica",
                   endpoint=Endpoint(transport="nixl", agent_name="a", agent_metadata=b"\0\1\2"))
    back = decode_envelope(encode(Envelope(token="t", request=req)))
    assert back.request == req and back.token == "t"


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1garbage", "not a msgpack"),
    (msgpack.packb([1, 2, 3]), "invalid request"),
    (msgpack.packb({"request": {"type": "no_such_type"}}), "invalid request"),
    (msgpack.packb({"request": {"type": "status", "extra": 1}}), "extra"),
    (msgpack.packb({"request": {"type": "heartbeat", "worker_id": 7}}), "worker_id"),
])
def test_malformed_messages_are_refused_with_a_reason(payload, reason):
    with pytest.raises(WireError, match=reason):
        decode_envelope(payload)


def test_status_request_is_valid_without_a_token():
    assert decode_envelope(encode(Envelope(request=StatusRequest()))).token is None


def _messages():
    """One of every shape on the wire: nested models, lists of them, bytes, dicts, None."""
    from tensorhub.core.data_types import (
        Ack,
        ErrorReply,
        Manifest,
        MemoryDesc,
        Publish,
        ReadPlan,
        ReadRange,
        SharedRegion,
        Source,
        StatusReply,
        TensorSpec,
        TransferRecord,
    )

    endpoint = Endpoint(transport="nixl", agent_name="a", agent_metadata=b"\0\1\xff",
                        pid=7, host="h", shared=[SharedRegion(fd=3, inode=9, addr=4096,
                                                              nbytes=8192)])
    manifest = Manifest(tensors=[TensorSpec(name="w", dtype="bfloat16", shape=[2, 3],
                                            nbytes=12)], compact_threshold=1 << 20)
    memory = [MemoryDesc(addr=2**63, nbytes=12, device=3, mem="VRAM")]
    return [
        Ack(),
        ErrorReply(code="busy", message="wait", retry_after=0.05),
        Envelope(token="t", request=Register(name="w", role="replica", endpoint=endpoint,
                                             labels={"dc": "a"})),
        Envelope(request=Publish(worker_id="t", model="m", version=3, manifest=manifest,
                                 checksums=["c"], memory=memory)),
        ReadPlan(model="m", version=3, layout_id="l", manifest=manifest, checksums=["c"],
                 lease_id="x", lease_ttl=120.0,
                 sources=[Source(worker_id="s", name="n", role="trainer", endpoint=endpoint,
                                 memory=memory)],
                 ranges=[ReadRange(item=0, offset=4, nbytes=8, source="s")],
                 complete=False, chunk_bytes=64),
        StatusReply(workers=[{"worker_id": "w", "seen_ago": 0.5}], models=[],
                    reads_in_flight=0, transfers=[TransferRecord(
                        reader="r", source="s", model="m", version=1, nbytes=5, seconds=0.1,
                        ok=False, error="boom")]),
    ]


@pytest.mark.parametrize("model", _messages(), ids=lambda m: type(m).__name__)
def test_encoding_packs_a_models_fields_as_its_dump_would(model):
    """`encode` packs models' fields directly: the bytes are those of the model's dump."""
    assert encode(model) == msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)


def test_a_copy_with_a_key_that_is_no_field_encodes_as_its_dump_would():
    """`model_copy(update=...)` does not validate: a stray key must not reach the wire,
    where the peer's strict model refuses it (as a dump drops it, so does `encode`)."""
    copied = StatusRequest().model_copy(update={"worker_id": "w-1"})
    assert encode(copied) == msgpack.packb({"type": "status"}, use_bin_type=True)
    assert decode_envelope(encode(Envelope(request=copied))).request == StatusRequest()


def test_every_protocol_model_is_packed_from_its_fields():
    """The fast path applies to all of them (a serializer added to one would fall back)."""
    import inspect

    from pydantic import BaseModel

    from tensorhub.core import data_types
    from tensorhub.core.wire import _plain

    models = [m for _, m in inspect.getmembers(data_types, inspect.isclass)
              if issubclass(m, BaseModel) and m.__module__ == data_types.__name__]
    assert len(models) > 30 and all(_plain(m) for m in models)


def test_a_model_whose_dump_is_not_its_fields_is_encoded_as_its_dump():
    from typing import Annotated

    from pydantic import BaseModel, Field, PlainSerializer, computed_field

    class Serialized(BaseModel):
        x: Annotated[int, PlainSerializer(lambda v: str(v))]

    class Computed(BaseModel):
        x: int

        @computed_field
        @property
        def y(self) -> int:
            return self.x + 1

    class Excluded(BaseModel):
        x: int
        secret: str = Field(default="s", exclude=True)

    class Outer(BaseModel):
        inner: list[Serialized | Computed | Excluded]

    for model in (Serialized(x=1), Computed(x=1), Excluded(x=1),
                  Outer(inner=[Serialized(x=1), Computed(x=2), Excluded(x=3)])):
        assert encode(model) == msgpack.packb(model.model_dump(mode="python"),
                                              use_bin_type=True)


def test_only_models_are_encoded():
    with pytest.raises(TypeError, match="cannot encode a object"):
        encode(object())


def test_a_model_with_values_encoded_beforehand_is_the_model_encoded():
    from tensorhub.core.data_types import Manifest, ManifestReply, MemoryDesc, Source, TensorSpec

    manifest = Manifest(tensors=[TensorSpec(name="t", dtype="uint8", shape=[4], nbytes=4)],
                        compact_threshold=1)
    model = ManifestReply(model="m", version=1, layout_id="l", manifest=manifest)
    assert encode(model, packed={("manifest",): Packed(encode(manifest))}) == encode(model)
    for n in (1, 15, 16, 2**16):  # each size of array header
        memory = [MemoryDesc(addr=k, nbytes=1) for k in range(n)]
        source = Source(worker_id="w", name="w", role="replica", memory=memory,
                        endpoint=Endpoint(transport="zmq", address="tcp://127.0.0.1:1"))
        bare = source.model_copy(update={"memory": []})
        packed = Packed(msgpack.packb([m.model_dump() for m in memory]))
        assert encode(bare, packed={("memory",): packed}) == encode(source)
        spliced = encode(Envelope(request=StatusRequest()), packed={})
        assert spliced == encode(Envelope(request=StatusRequest()))

