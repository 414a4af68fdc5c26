"""Hostile input at the coordinator: thousands of malformed messages, each a typed reply.

A peer that can reach the coordinator may send anything: random bytes, msgpack of the wrong
shape, well-formed requests with absurd values, other workers' ids and leases, requests in
any order, the wrong token. Whatever arrives, the coordinator must answer with one of the
reply models (never an exception, never the catch-all `internal` error that marks a bug),
a refused request must leave its state exactly as it was, and it must go on serving.

Most messages go through `Coordinator.handle` in-process for volume; a few hundred go
through the real ROUTER socket, with wrong frame counts too. Hypothesis runs derandomized
(the same examples on every run) so CI is stable.
"""

from __future__ import annotations

import math
from typing import Any, get_args

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core import curve
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import ErrorReply, Reply, Request, StatusRequest
from tensorhub.core.errors import CoordinatorError
from tensorhub.core.schema import DTYPES
from tensorhub.core.wire import decode_reply, encode

pytestmark = pytest.mark.slow  # (hundreds of generated requests per test: not in the fast loop)

TOKEN = "fuzz-token"
REPLY_TYPES = get_args(get_args(Reply)[0])
REQUEST_TYPES = get_args(get_args(Request)[0])
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --------------------------------------------------------------------------- strategies
EXTREME_INTS = [0, 1, -1, 2**31, 2**32 - 1, 2**40, 2**44, 2**62 - 1, 2**62, 2**63 - 1,
                -(2**63), 2**64 - 1]
NASTY_TEXT = ["", "\x00", "latest", "../../etc/passwd", "x" * 600, "💥" * 300,
              "\u202etxet", "%s%n{}", "policy\x00evil"]

hostile_scalar = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME_INTS),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(NASTY_TEXT),
    st.text(max_size=30), st.binary(max_size=30),
)
msgpack_value = st.recursive(
    hostile_scalar,
    lambda kids: st.lists(kids, max_size=5)
    | st.dictionaries(st.text(max_size=12) | st.sampled_from(["type", "request", "token"]),
                      kids, max_size=5),
    max_leaves=25,
)
# "@name" strings are placeholders the world swaps for live ids: other workers' ids, a
# lease someone else holds, the right layout id, checksums and memory of the version.
worker_ref = st.sampled_from(["@trainer", "@reader", "@other", "@ghost"])
size = st.sampled_from(EXTREME_INTS) | st.integers(min_value=-4, max_value=4096)


@st.composite
def consistent_tensor(draw) -> dict:
    """A tensor spec whose nbytes follows from dtype and shape (so publishes can succeed)."""
    dtype = draw(st.sampled_from(["float32", "float16", "int8", "int64", "bool"]))
    shape = draw(st.lists(st.integers(min_value=0, max_value=6), max_size=3))
    itemsize = {"float32": 4, "float16": 2, "int8": 1, "int64": 8, "bool": 1}[dtype]
    return {"name": draw(st.text(min_size=1, max_size=8)), "dtype": dtype, "shape": shape,
            "nbytes": math.prod(shape) * itemsize}


hostile_tensor = st.fixed_dictionaries({
    "name": st.text(max_size=8) | st.sampled_from(NASTY_TEXT),
    "dtype": st.sampled_from([*DTYPES, "float31", "torch.float32", "<f4", "object", ""]),
    "shape": st.lists(size, max_size=10),
    "nbytes": size,
})  # fmt: skip
manifest = st.fixed_dictionaries({
    "tensors": st.lists(consistent_tensor(), max_size=5) | st.lists(hostile_tensor, max_size=5),
    "compact_threshold": st.sampled_from([0, 64, 1 << 20, 2**40 - 1]) | size,
})  # fmt: skip
memory_desc = st.fixed_dictionaries(
    {"addr": size, "nbytes": size},
    optional={"device": size, "mem": st.sampled_from(["DRAM", "VRAM", "HBM"])})
endpoint = st.fixed_dictionaries(
    {"transport": st.sampled_from(["zmq", "nixl", "rdma"])},
    optional={"address": st.sampled_from(["tcp://127.0.0.1:1", "x" * 300]),
              "agent_name": st.text(max_size=8), "agent_metadata": st.binary(max_size=64)})
byte_range = st.fixed_dictionaries({"item": size, "offset": size, "nbytes": size})

valid_manifest = st.fixed_dictionaries({
    "tensors": st.lists(consistent_tensor(), min_size=1, max_size=4, unique_by=lambda t: t["name"]),
    "compact_threshold": st.sampled_from([0, 64, 1 << 20]),
})  # fmt: skip
small = st.integers(min_value=0, max_value=80)
# Values of the right type (placeholders often), so that sequences reach deep into handlers.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "version": st.sampled_from([1, 2, 3, 4, 2**62 - 1, "latest"]),
    "manifest": st.sampled_from(["@manifest"]) | valid_manifest,
    "checksums": st.sampled_from(["@checksums"]) | st.lists(st.text(max_size=4), max_size=2),
    "memory": st.sampled_from(["@memory"])
    | st.lists(st.fixed_dictionaries({"addr": small, "nbytes": small}), max_size=2),
    "missing": st.none() | st.lists(st.fixed_dictionaries(
        {"item": st.integers(0, 2), "offset": small, "nbytes": small}), max_size=3),
    "nbytes": st.integers(min_value=0, max_value=2**40),
    "layout_id": st.sampled_from(["@layout", "0" * 24]),
    "chunks": st.lists(st.integers(0, 4), max_size=5),
    "endpoint": st.just({"transport": "zmq", "address": "tcp://127.0.0.1:2"}),
}
# Values of the right shape but absurd, or of the wrong type.
FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "worker_id": worker_ref, "lease_id": st.sampled_from(["@lease", "@my_lease", "nope"]),
    "name": st.sampled_from(["trainer", "eng-a", "eng-b"]) | st.text(max_size=12),
    "role": st.sampled_from(["trainer", "replica", "admin"]),
    "model": st.sampled_from(["policy", "policy", "other"]),
    "version": st.sampled_from([1, 2, 3, 0, 2**62 - 1, 2**62, "latest", "1", 1.5]) | size,
    "layout_id": st.sampled_from(["@layout", "0" * 24]) | st.none(),
    "manifest": manifest | st.sampled_from(["@manifest"]),
    "checksums": st.sampled_from(["@checksums"]) | st.lists(st.text(max_size=20), max_size=4),
    "memory": st.sampled_from(["@memory"]) | st.lists(memory_desc, max_size=4),
    "endpoint": endpoint, "missing": st.none() | st.lists(byte_range, max_size=4),
    "ok": st.booleans(), "nbytes": size, "seconds": st.floats(),
    "error": st.none() | st.text(max_size=40), "failed_holders": st.lists(worker_ref, max_size=3),
    "names": st.lists(st.sampled_from(["eng-a", "trainer"]) | st.text(max_size=6), max_size=4),
    "labels": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
    "force": st.booleans(), "relay": st.booleans(),
    "stripes": st.lists(st.integers(0, 3), min_size=1, max_size=3),
    "failed": st.lists(worker_ref, max_size=2), "behind": st.lists(worker_ref, max_size=2),
    "chunks": st.lists(st.integers(0, 4) | size, max_size=5),
}  # fmt: skip


@st.composite
def request_dict(draw) -> dict:
    """A request of a real type whose fields are plausible, hostile or missing."""
    cls = draw(st.sampled_from(REQUEST_TYPES))
    out: dict[str, Any] = {"type": cls.model_fields["type"].default}
    # Half the requests are plausible (so sequences get deep into the handlers); the others
    # lose fields or carry values of any type in them.
    mangled = draw(st.booleans())
    for fname in cls.model_fields:
        if fname == "type" or (mangled and draw(st.integers(0, 7)) == 0):
            continue  # a required field is simply missing
        if not mangled:
            known = PLAUSIBLE.get(fname, FIELD_VALUES.get(fname))
            if known is None and not cls.model_fields[fname].is_required():
                continue  # a field added since this test was written: its default is fine
            out[fname] = draw(msgpack_value if known is None else known)
        elif draw(st.integers(0, 3)) == 0:
            out[fname] = draw(msgpack_value)
        else:
            out[fname] = draw(FIELD_VALUES.get(fname, msgpack_value))
    if mangled and draw(st.integers(0, 7)) == 0:
        out[draw(st.text(max_size=8))] = draw(hostile_scalar)  # an unknown field
    return out


envelope_dict = st.fixed_dictionaries({
    "token": st.sampled_from(["@token"] * 6 + [None, "", "wrong", TOKEN + "x"]),
    # "@secret": the secret of the worker the request names (if it is one of the world's)
    "secret": st.sampled_from(["@secret"] * 6 + [None, "", "wrong"]),
    "request": request_dict(),
})  # fmt: skip


# --------------------------------------------------------------------------- the world
class World:
    """A coordinator (not serving: driven through `handle`) seeded with a trainer that has
    published v1, a reader holding a lease on it and a third worker, all via real requests."""

    def __init__(self) -> None:
        self.coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token=TOKEN))
        self.refs: dict[str, Any] = {}
        self.secrets: dict[str, str] = {}  # worker id -> its secret, from its registration

    def close(self) -> None:
        self.coordinator.stop()

    def call(self, request: dict, token: Any = TOKEN) -> Any:
        secret = self.secrets.get(request.get("worker_id"))
        payload = msgpack.packb({"token": token, "secret": secret, "request": request},
                                use_bin_type=True)
        return self.coordinator.handle(payload)

    def reset(self) -> None:
        self.coordinator.start_over()
        ep = {"transport": "zmq", "address": "tcp://127.0.0.1:1"}
        for ref, role in (("trainer", "trainer"), ("reader", "replica"), ("other", "replica")):
            reply = self.call({"type": "register", "name": ref, "role": role, "endpoint": ep})
            self.refs["@" + ref] = reply.worker_id
            self.secrets[reply.worker_id] = reply.secret
        manifest = {"tensors": [{"name": "w", "dtype": "float32", "shape": [4, 4],
                                 "nbytes": 64}], "compact_threshold": 1 << 20}
        checksums, memory = ["c0"], [{"addr": 4096, "nbytes": 64}]
        published = self.call({"type": "publish", "worker_id": self.refs["@trainer"],
                               "model": "policy", "version": 1, "manifest": manifest,
                               "checksums": checksums, "memory": memory})
        plan = self.call({"type": "plan", "worker_id": self.refs["@reader"], "model": "policy"})
        assert plan.type == "read_plan", plan
        self.refs.update({"@layout": published.layout_id, "@manifest": manifest,
                          "@owner": published.owner,
                          "@checksums": checksums, "@memory": memory,
                          "@lease": plan.lease_id, "@my_lease": plan.lease_id,
                          "@ghost": "ghost-00000000", "@token": TOKEN})

    def resolve(self, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") == "publish" and "owner" not in value:
            value = {**value, "owner": "@owner"}  # (the trainer shows its credential)
        if isinstance(value, str) and value.startswith("@"):
            return self.refs.get(value, value)
        if isinstance(value, list):  # (huge lists hold no placeholders: leave them be)
            return [self.resolve(v) for v in value] if len(value) <= 64 else value
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        return value

    def snapshot(self) -> tuple:
        """Everything a request may change (not heartbeat times): refused requests must not."""
        t = self.coordinator.table
        workers = sorted((w.worker_id, w.role, w.endpoint.model_dump_json())
                         for w in t.workers.values())
        models = sorted(
            (name, m.latest, v, lid, sorted((h.worker_id, h.withdrawn, len(h.memory))
                                            for h in lay.holders.values()))
            for name, m in t.models.items() for v, vr in m.versions.items()
            for lid, lay in vr.layouts.items())
        return (workers, sorted(t.models), models, sorted(t.leases), len(t.transfers))

    def check_consistent(self) -> None:
        t = self.coordinator.table
        for name, m in t.models.items():
            assert all(v <= m.latest for v in m.versions), (name, m.latest, list(m.versions))
            for vrec in m.versions.values():
                assert vrec.origin_layout in vrec.layouts
                for layout in vrec.layouts.values():
                    assert set(layout.holders) <= set(t.workers), "a forgotten worker holds"
        assert all(lease.reader in t.workers for lease in t.leases.values())


def assert_typed(reply: Any) -> None:
    """A reply model that survives the wire; `internal` would mean a handler raised."""
    assert isinstance(reply, REPLY_TYPES), repr(reply)
    assert type(decode_reply(encode(reply))) is type(reply)
    if isinstance(reply, ErrorReply):
        assert reply.code != "internal", reply.message
        assert reply.message


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


# --------------------------------------------------------------------------- in-process
@settings(FUZZ, max_examples=1000)
@given(payload=st.binary(max_size=256))
def test_random_bytes_get_a_typed_refusal(world, payload):
    reply = world.coordinator.handle(payload)
    assert_typed(reply)
    assert reply.type == "error" and reply.code == "bad_request"


@settings(FUZZ, max_examples=400)
@given(value=msgpack_value)
def test_msgpack_of_any_shape_gets_a_typed_refusal(world, value):
    reply = world.coordinator.handle(msgpack.packb(value, use_bin_type=True))
    assert_typed(reply)
    assert reply.code == "bad_request"


@settings(FUZZ, max_examples=500)
@given(envelopes=st.lists(envelope_dict, min_size=1, max_size=8))
def test_hostile_requests_in_any_order_get_typed_replies_and_refusals_change_nothing(
        world, envelopes):
    """Sequences of requests with hostile fields, other workers' ids and leases, wrong or
    missing tokens: every reply typed; a refused one leaves the state as it was; the table
    stays consistent (no holder or reader the coordinator has forgotten)."""
    world.reset()
    for env in envelopes:
        env = world.resolve(env)
        before = world.snapshot()
        sender = env["request"].get("worker_id") if isinstance(env["request"], dict) else None
        if env["secret"] == "@secret":
            env["secret"] = world.secrets.get(sender) if isinstance(sender, str) else None
        registered = isinstance(sender, str) and sender in world.coordinator.table.workers
        others_leases = {k for k, lease in world.coordinator.table.leases.items()
                         if lease.reader != sender}
        reply = world.coordinator.handle(msgpack.packb(env, use_bin_type=True))
        assert_typed(reply)
        if env["token"] != TOKEN and reply.code != "bad_request":
            assert reply.code == "unauthorized", reply
        if registered and env["secret"] != world.secrets.get(sender) \
                and reply.code != "bad_request":
            assert reply.code == "unauthorized", reply  # no one acts for another worker
        if isinstance(reply, ErrorReply):
            assert world.snapshot() == before, (env, reply)
        # No worker can end another's read: its lease outlives whatever this one sends.
        assert others_leases <= set(world.coordinator.table.leases), (env, reply)
        world.check_consistent()


def test_the_right_token_is_accepted_and_any_other_refused(world):
    world.reset()
    ok = world.call({"type": "status"})
    assert ok.type == "status_reply" and len(ok.workers) == 3
    for token in (None, "", "wrong", TOKEN + " ", TOKEN.upper(), "💥" * 10):
        reply = world.call({"type": "status"}, token=token)
        assert (reply.type, reply.code) == ("error", "unauthorized")
        assert "TENSORHUB_TOKEN" in reply.message


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("what, request_", [
    ("a million tensors", {"type": "publish", "worker_id": "@trainer", "model": "policy",
                           "version": 2, "manifest": {"tensors": [{}] * 1_000_000,
                                                      "compact_threshold": 0},
                           "checksums": [], "memory": []}),
    ("a million missing ranges", {"type": "plan", "worker_id": "@reader", "model": "policy",
                                  "missing": [{"item": 0, "offset": 0, "nbytes": 1}] * 1_000_000}),
    ("nbytes not matching the shape", {
        "type": "publish", "worker_id": "@trainer", "model": "policy", "version": 2,
        "manifest": {"tensors": [{"name": "w", "dtype": "float32", "shape": [2**39, 2**39],
                                  "nbytes": 4}], "compact_threshold": 0},
        "checksums": ["c"], "memory": [{"addr": 0, "nbytes": 4}]}),
    ("a dtype that is not a dtype", {
        "type": "publish", "worker_id": "@trainer", "model": "policy", "version": 2,
        "manifest": {"tensors": [{"name": "w", "dtype": "__import__('os')", "shape": [1],
                                  "nbytes": 4}], "compact_threshold": 0},
        "checksums": ["c"], "memory": [{"addr": 0, "nbytes": 4}]}),
    ("deep nesting", {"type": "status", "x": _nested(400)}),
    ("a new model's publish with a bad manifest", {
        "type": "publish", "worker_id": "@trainer", "model": "other", "version": 1,
        "manifest": "@manifest", "checksums": [], "memory": []}),
    ("a future version's hold with memory that does not fit", {
        "type": "hold", "worker_id": "@other", "model": "policy", "version": 2**62 - 1,
        "layout_id": "@layout", "manifest": "@manifest", "checksums": "@checksums",
        "memory": []}),
    ("a range past the item", {"type": "plan", "worker_id": "@reader", "model": "policy",
                               "missing": [{"item": 0, "offset": 2**63 - 1, "nbytes": 2**63}]}),
    ("a lease of another reader", {"type": "read_done", "worker_id": "@other",
                                   "lease_id": "@lease", "ok": False,
                                   "failed_holders": ["@trainer"]}),
])  # fmt: skip
def test_absurd_requests_are_refused_and_change_nothing(world, what, request_):
    world.reset()
    before = world.snapshot()
    reply = world.call(world.resolve(request_))
    assert_typed(reply)
    if what == "a lease of another reader":
        assert reply.type == "ack"  # nothing to do: the lease is not theirs ...
        assert world.refs["@lease"] in world.coordinator.table.leases  # ... so it stays
        holders = world.coordinator.table.models["policy"].versions[1].layouts
        assert world.refs["@trainer"] in holders[world.refs["@layout"]].holders
    else:  # (a version past the trainer's is no holder's to bring: `unknown_version`)
        assert reply.type == "error" and reply.code in ("bad_request", "layout_mismatch",
                                                        "unknown_version")
    assert world.snapshot() == before


def test_msgpack_nested_beyond_its_stack_limit_is_refused(world):
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    reply = world.coordinator.handle(deep)
    assert (reply.type, reply.code) == ("error", "bad_request")


# --------------------------------------------------------------------------- on the socket
frames_strategy = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=5),  # any frame count
    st.tuples(st.binary(min_size=1, max_size=16),
              envelope_dict.map(lambda e: msgpack.packb(e, use_bin_type=True))).map(list),
    st.tuples(st.binary(min_size=1, max_size=16), msgpack_value.map(
        lambda v: msgpack.packb(v, use_bin_type=True))).map(list),
)


def test_hostile_frames_on_the_router_socket_get_typed_replies_and_it_serves_on():
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token=TOKEN)).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a token holder's socket (one without the token never gets past the handshake)
    curve.secure_client(sock, curve.token_server_key(TOKEN), curve.token_client_keypair(TOKEN))
    sock.connect(coordinator.address)
    sent = []

    @settings(FUZZ, max_examples=300)
    @given(frames=frames_strategy)
    def fire(frames: list[bytes]) -> None:
        sent.append(len(frames))
        sock.send_multipart(frames)
        assert sock.poll(5000), f"no reply to {len(frames)} frame(s)"
        reply_frames = sock.recv_multipart()
        assert len(reply_frames) == 2
        if len(frames) == 2:
            assert reply_frames[0] == frames[0]  # the request id comes back
        reply = decode_reply(reply_frames[1])
        assert_typed(reply)
        if len(frames) != 2:
            assert reply.code == "bad_request" and "frames" in reply.message

    try:
        fire()
        assert len(sent) >= 200 and {1, 2, 3} <= set(sent)
        assert coordinator._thread is not None and coordinator._thread.is_alive()
        client = CoordinatorClient(coordinator.address, token=TOKEN, timeout=5)
        assert client.call(StatusRequest()).workers == []
        intruder = CoordinatorClient(coordinator.address, token="wrong", timeout=5)
        with pytest.raises(CoordinatorError) as err:
            intruder.call(StatusRequest())
        assert err.value.code == "unauthorized"
        client.close()
        intruder.close()
    finally:
        sock.close(0)
        coordinator.stop()
