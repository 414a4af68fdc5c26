"""The control plane's defaults and limits: loopback unless told otherwise, oversized messages
dropped before they are read, and no code path that unpickles what a peer sent."""

from __future__ import annotations

import ast
import socket
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from tensorhub.coordinator.server import CoordinatorConfig
from tensorhub.core.client import SNDHWM, CoordinatorClient
from tensorhub.core.data_types import Envelope, StatusRequest
from tensorhub.core.errors import CoordinatorUnavailable
from tensorhub.core.wire import MAX_MESSAGE_BYTES, encode
from tensorhub.tools.cli import DEFAULT_COORDINATOR, build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_the_coordinator_and_its_clients_default_to_loopback():
    assert CoordinatorConfig().bind.startswith("tcp://127.0.0.1:")
    assert DEFAULT_COORDINATOR.startswith("tcp://127.0.0.1:")
    parser = build_parser()
    assert parser.parse_args(["coordinator"]).bind.startswith("tcp://127.0.0.1:")
    for command in (["status"], ["replica"]):
        assert parser.parse_args(command).coordinator.startswith("tcp://127.0.0.1:")


def test_a_message_over_the_size_limit_is_refused_in_process(coordinator):
    reply = coordinator.handle(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert (reply.type, reply.code) == ("error", "bad_request")
    assert f"exceeds the {MAX_MESSAGE_BYTES} limit" in reply.message


def test_an_oversized_message_on_the_socket_is_dropped_unanswered_and_it_serves_on(
        coordinator):
    """libzmq (MAXMSGSIZE) drops the frame and the sender's connection before anything is
    read into Python: the sender gets no reply (its call times out), everyone else is
    served as before."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coordinator.address)
    try:
        sock.send_multipart([b"id", b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        assert sock.poll(2000) == 0, "an oversized message was answered"
        # ... while a message just under the limit is read and refused with a reason.
        fine = CoordinatorClient(coordinator.address, timeout=5)
        assert fine.call(StatusRequest()).type == "status_reply"
        fine.close()
        sock.send_multipart([b"id2", encode(Envelope(request=StatusRequest()))])
        # the dropped connection is re-established by libzmq: the same socket works again
        assert sock.poll(5000), "the sender's socket did not recover"
        assert msgpack.unpackb(sock.recv_multipart()[1])["type"] == "status_reply"
    finally:
        sock.close(0)


def test_a_client_whose_queue_is_full_is_told_so_at_once_not_blocked():
    """With no coordinator, requests queue unsent up to the high-water mark; the next
    send then waits no longer than the call's timeout."""
    client = CoordinatorClient("tcp://127.0.0.1:9", timeout=0.001)  # nobody listens
    outcomes = set()
    for _ in range(SNDHWM + 50):
        with pytest.raises(CoordinatorUnavailable) as err:
            client.call(StatusRequest())
        outcomes.add("cannot send" if "cannot send" in str(err.value) else "no reply")
    assert outcomes == {"no reply", "cannot send"}
    client.close()


def test_one_handshake_cut_short_is_a_timeout_not_a_refusal():
    """A connection dropped mid-handshake (a coordinator killed as a worker connects) looks
    like a wrong key on the wire, but once is not a refusal: the caller may wait and try
    again (`unauthorized` is never retried)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_once_then_go():
        conn, _ = listener.accept()
        conn.close()
        listener.close()

    thread = threading.Thread(target=accept_once_then_go)
    thread.start()
    client = CoordinatorClient(f"tcp://127.0.0.1:{port}", token="t", timeout=1.5)
    try:
        with pytest.raises(CoordinatorUnavailable, match="no reply"):
            client.call(StatusRequest())
    finally:
        client.close()
        thread.join(5)


@pytest.mark.parametrize("token", [None, "t"], ids=["no token", "token"])
def test_handshakes_cut_short_for_a_while_are_waited_out_not_taken_as_a_refusal(token):
    """A proxy whose coordinator restarts accepts connections and drops them, many times
    over; the call waits (within its timeout) and is answered once the coordinator is back,
    with or without a token."""
    from tensorhub.coordinator.server import Coordinator

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.settimeout(0.1)
    coordinator = []

    def drop_connections_then_start_the_coordinator():
        for _ in range(10):  # ~1 s of connections cut short (libzmq retries every 0.1 s)
            try:
                conn, _ = listener.accept()
                conn.close()
            except TimeoutError:
                pass
        listener.close()
        coordinator.append(Coordinator(CoordinatorConfig(
            bind=f"tcp://127.0.0.1:{port}", announce="tcp://127.0.0.1:0",
            token=token)).start())

    thread = threading.Thread(target=drop_connections_then_start_the_coordinator)
    thread.start()
    client = CoordinatorClient(f"tcp://127.0.0.1:{port}", token=token, timeout=10.0)
    try:
        assert client.call(StatusRequest()).type == "status_reply"
    finally:
        client.close()
        thread.join(10)
        for c in coordinator:
            c.stop()


def test_a_client_gets_a_clear_timeout_not_a_hang_when_nobody_answers():
    client = CoordinatorClient("tcp://127.0.0.1:9", timeout=0.5)  # discard port: no server
    with pytest.raises(CoordinatorUnavailable, match="no reply from the coordinator"):
        client.call(StatusRequest())
    client.close()


UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("torch", "load"), ("marshal", "loads"), ("marshal", "load"),
              ("cloudpickle", "loads"), ("dill", "loads"), ("numpy", "load")}


def _unpickling_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in UNPICKLERS | {("np", "load")}:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "marshal", "dill"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import")
        if isinstance(node, ast.Import) and any(a.name in ("dill", "cloudpickle")
                                                for a in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} import")
    return found


def test_no_code_of_ours_unpickles_anything():
    """Peer data is msgpack validated by pydantic. The only pickle use allowed is
    `pickle.dumps` in the SGLang driver (SGLang's own update API takes pickled input)."""
    files = sorted((ROOT / "tensorhub").rglob("*.py")) + sorted(
        (ROOT / "tensorhub_plugins").rglob("*.py"))
    assert len(files) > 20
    assert [hit for f in files for hit in _unpickling_calls(f)] == []
