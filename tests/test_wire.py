"""The wire format: msgpack of pydantic models; malformed input is a WireError, never a crash."""

import msgpack
import pytest

from tensorhub.core.data_types import Endpoint, Envelope, Register, StatusRequest
from tensorhub.core.wire import WireError, decode_envelope, encode


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
