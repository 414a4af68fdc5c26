"""Attacks on a fleet that runs with a token, each by an attacker holding exactly what a real
one would: no token (a stranger on the network), or the token but not another worker's
secret (a token holder acting for someone else). Each must leave nothing leaked and the
fleet serving bit-exact. Real coordinator sockets, real workers, the zmq fallback's real
server."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import zmq

from tensorhub import CoordinatorError, Publisher, Replica
from tensorhub.coordinator.prepare import prepare
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    Heartbeat,
    Hold,
    MemoryDesc,
    Register,
    StatusRequest,
    Unregister,
    Withdraw,
)
from tensorhub.core.errors import TransferError
from tensorhub.core.transport import Peer, ReadOp, grants
from tensorhub.core.transport.zmq import ZmqTransport

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)

TOKEN = "attack-test-token"
STATE = {"w": torch.arange(65536, dtype=torch.float32).reshape(256, 256),
         "b": torch.linspace(-1, 1, 7)}
FLOOD_SECONDS = 10


@pytest.fixture
def guarded(monkeypatch):
    """A coordinator with a token; this process's workers hold it (the environment)."""
    monkeypatch.setenv("TENSORHUB_TOKEN", TOKEN)
    for var in ("TENSORHUB_TOKEN_FILE", "TENSORHUB_CURVE_SERVER_KEY",
                "TENSORHUB_CURVE_SERVER_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token=TOKEN,
                                      heartbeat_interval=0.2, worker_ttl=1.0)).start()
    yield c
    c.stop()


def _stranger_sub(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    return sock


def test_a_listener_without_the_token_hears_no_announcement(guarded):
    stranger = _stranger_sub(guarded.announce_address)
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
        watcher = VersionWatcher(rep.session, "policy")
        heard = None
        try:
            for version in range(1, 31):  # long past both SUBs' connection
                pub.publish(STATE, version=version)
                if heard is None and watcher._sub.poll(100):
                    heard = version
            assert heard is not None, "the token holder heard no announcement"
            assert stranger.poll(1000) == 0, "a stranger heard an announcement"
        finally:
            watcher.close()
            stranger.close(0)


def test_a_stranger_gets_no_reply_to_any_request_and_is_told_it_was_refused(guarded):
    """Never past the handshake, so nothing answers; what the stranger's own socket saw (a
    refused handshake) is said, not a timeout, and said however the refusal races the
    send (the refused connection may vanish between a poll and the send)."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        for _ in range(20):
            stranger = CoordinatorClient(guarded.address, token="", timeout=5.0)
            try:
                with pytest.raises(CoordinatorError, match="refused our handshake") as err:
                    stranger.call(StatusRequest())
                assert err.value.code == "unauthorized"
            finally:
                stranger.close()


def _trainer_region(pub: Publisher) -> tuple[Peer, MemoryDesc]:
    """What a leak could tell a stranger: how to reach the trainer and where its weights lie
    (what a plan would carry), with no grant."""
    buf = pub._layout.item_bytes[0]
    return (Peer(pub.session.worker_id, pub.session.transport.endpoint()),
            MemoryDesc(addr=buf.data_ptr(), nbytes=buf.numel()))


def test_the_zmq_fallback_serves_nobody_without_a_grant(guarded):
    thief = ZmqTransport()
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
        pub.publish(STATE)
        holder, region = _trainer_region(pub)
        dest = torch.zeros(region.nbytes, dtype=torch.uint8)
        thief.register([dest])
        forged = [None, "", "*.0", f"*.{'0' * 32}", grants.issue(thief.grant_key, "*")]
        try:
            for grant in forged:
                with pytest.raises(TransferError, match="no grant from the coordinator"):
                    thief.read(Peer(holder.worker_id, holder.endpoint, grant),
                               [ReadOp(dest, region)], timeout=5)
            assert not dest.any(), "bytes of the trainer's reached the thief"
            assert pub.session.transport.refused == len(forged)
            # ... while the token holder pulls, bit-exact, through a plan's grants
            assert rep.pull(timeout=20) == 1
            for name, t in STATE.items():
                assert torch.equal(rep.tensors[name], t)
        finally:
            thief.close()


FLOOD = """
import socket, sys, threading, time
import zmq
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
big = b"\\x00" * (64 << 20)
stop = time.monotonic() + seconds
sent = [0, 0]  # zmq messages queued, raw bytes written

def zmq_client():
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 100)
    s.connect(f"tcp://{host}:{port}")
    while time.monotonic() < stop:
        try:
            s.send_multipart([b"id", big])
            sent[0] += 1
        except zmq.Again:
            time.sleep(0.01)
    s.close(0)
    ctx.term()

def raw_client():
    while time.monotonic() < stop:
        try:
            with socket.create_connection((host, port), timeout=1) as c:
                while time.monotonic() < stop:
                    sent[1] += c.send(big[: 1 << 20])
        except OSError:
            time.sleep(0.01)

threads = [threading.Thread(target=f) for f in [zmq_client] * 10 + [raw_client] * 10]
for t in threads: t.start()
for t in threads: t.join()
print(sent[0], sent[1])
"""


def test_twenty_strangers_flooding_the_coordinator_cost_no_worker_its_registration(guarded):
    """10 ZeroMQ clients queueing maximum-size requests and 10 raw TCP clients writing as
    fast as they can, for FLOOD_SECONDS (10 worker TTLs): none completes a handshake, so
    nothing is decoded, and a worker heartbeating meanwhile keeps its registration."""
    host, port = guarded.address.removeprefix("tcp://").rsplit(":", 1)
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
        pub.publish(STATE)
        assert rep.pull(timeout=20) == 1
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, host, port, str(FLOOD_SECONDS)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            answered = 0
            while flood.poll() is None:
                status = pub.session.client.call(StatusRequest(), timeout=5.0)
                assert {w["worker_id"] for w in status.workers} == {
                    pub.session.worker_id, rep.session.worker_id}
                answered += 1
                time.sleep(0.5)
            _queued, written = map(int, flood.stdout.read().split())
        finally:
            flood.kill()
            flood.wait()
        assert written > 0 and answered > 0  # the flood ran; every status call answered
        assert rep.session.registrations == 1 and pub.session.registrations == 1
        pub.publish({k: t + 1 for k, t in STATE.items()})
        assert rep.pull(timeout=20) == 2
        assert torch.equal(rep.tensors["w"], STATE["w"] + 1)


def test_a_token_holder_cannot_act_as_another_worker(guarded):
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="victim") as victim:
        pub.publish(STATE)
        assert victim.pull(timeout=20) == 1
        mallory = CoordinatorClient(guarded.address, timeout=5.0)
        try:
            own = mallory.call(Register(name="mallory", role="replica",
                                        endpoint=victim.session.transport.endpoint()))
            status = mallory.call(StatusRequest())
            vid = next(w["worker_id"] for w in status.workers if w["name"] == "victim")
            layout = victim.layout
            attacks = [
                Unregister(worker_id=vid),
                Heartbeat(worker_id=vid),
                Withdraw(worker_id=vid, model="policy", version=1, force=True),
                Hold(worker_id=vid, model="policy", version=99, layout_id=layout.layout_id,
                     memory=[MemoryDesc(addr=b.data_ptr(), nbytes=b.numel())
                             for b in layout.item_bytes]),
            ]
            for secret in (None, own.secret):  # none, or mallory's own
                if secret is not None:
                    mallory.credentials.remember(vid, secret)
                for attack in attacks:
                    with pytest.raises(CoordinatorError, match="acts only for itself") as err:
                        mallory.call(attack)
                    assert err.value.code == "unauthorized"
            holders = guarded.table.models["policy"].versions[1].layouts[layout.layout_id]
            assert vid in guarded.table.workers and vid in holders.holders
            assert guarded.table.models["policy"].latest == 1
        finally:
            mallory.close()
        with Replica(guarded.address, "policy", transport="zmq", name="late") as late:
            assert late.pull(timeout=20) == 1
            assert torch.equal(late.tensors["w"], STATE["w"])


def test_a_hold_beyond_the_trainers_versions_cannot_take_over_the_numbering(guarded):
    """A token holder holds a version far past the trainer's (its own bytes, its own
    checksums): refused, so the trainer keeps numbering and engines keep following it."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep, \
            Replica(guarded.address, "policy", transport="zmq", name="mallory") as mallory:
        pub.publish(STATE)
        assert mallory.pull(timeout=20) == 1 and rep.pull(timeout=20) == 1
        layout = mallory.layout
        forged = Hold(worker_id=mallory.session.worker_id, model="policy", version=10**12,
                      layout_id=layout.layout_id,
                      memory=[MemoryDesc(addr=b.data_ptr(), nbytes=b.numel())
                              for b in layout.item_bytes],
                      manifest=layout.manifest, checksums=["0" * 16] * len(layout.item_bytes))
        with pytest.raises(CoordinatorError, match="cannot bring one it never published"):
            mallory.session.call(forged)
        assert guarded.table.models["policy"].latest == 1
        assert pub.publish({k: t * 2 for k, t in STATE.items()}, version=2) == 2
        assert rep.pull(timeout=20) == 2
        assert torch.equal(rep.tensors["w"], STATE["w"] * 2)


def test_a_declaration_larger_than_memory_is_refused_before_anything_is_allocated(guarded):
    """A token holder registered as a trainer declares a first version of ~1.6 PiB: a
    copy standing by refuses it (no allocation, a clear reason), lives on and pulls the
    real first version when it comes."""
    from tensorhub.core.data_types import Declare, Manifest, TensorSpec
    from tensorhub.core.errors import LayoutError
    from tensorhub.core.layout import BoundLayout
    from tensorhub.parted import PartedReplica

    huge = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="uint8", shape=[2**20, 2**23],
                                        nbytes=2**43) for i in range(200)],
                    compact_threshold=1 << 20)
    with pytest.raises(LayoutError, match="does not fit"):
        BoundLayout.allocate(huge)
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            PartedReplica(guarded.address, "policy", transport="zmq", name="eng") as copy:
        pub.session.call(Declare(worker_id=pub.session.worker_id, model="policy",
                                 manifest=huge))
        assert copy.wait_for_newer(timeout=0.5) is None  # it read the declaration ...
        assert copy.replicas[0].layout is None  # ... and allocated nothing
        assert copy._declared_at == float("inf")  # refused it, once: never asks again
        pub.publish(STATE)
        assert copy.pull(timeout=20) == 1
        assert torch.equal(copy.tensors["w"], STATE["w"])


def test_a_token_holder_that_did_not_publish_a_model_cannot_number_its_versions(guarded):
    """A token holder registers as a trainer and publishes v10^9 of a model another trainer
    published first: refused (`unauthorized`), and the numbering is the real trainer's:
    its explicit v2 lands, its default numbering goes on at 3."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Publisher(guarded.address, "policy", transport="zmq", name="mallory") as mallory, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
        assert pub.publish(STATE) == 1
        with pytest.raises(CoordinatorError, match="belongs to the trainer") as err:
            mallory.publish({k: t * 7 for k, t in STATE.items()}, version=10**9)
        assert err.value.code == "unauthorized"
        # ... a credential of its own (for another model) does not help either
        mallory.session.owners["policy"] = pub.session.owners["policy"][:-4] + "0000"
        with pytest.raises(CoordinatorError, match="belongs to the trainer"):
            mallory.publish({k: t * 7 for k, t in STATE.items()}, version=10**9)
        assert guarded.table.models["policy"].latest == 1
        assert pub.publish({k: t * 2 for k, t in STATE.items()}, version=2) == 2
        assert pub.publish({k: t * 3 for k, t in STATE.items()}) == 3
        assert rep.pull(timeout=20) == 3
        assert torch.equal(rep.tensors["w"], STATE["w"] * 3)


def test_a_claim_of_versions_of_a_model_nobody_published_creates_nothing_and_blocks_nobody(
        guarded):
    """A token holder registers as a trainer saying it published v10^9 of a model no one has
    published: nothing is created, and the model's real trainer publishes v1."""
    from tensorhub.core.transport.zmq import ZmqTransport

    mallory = CoordinatorClient(guarded.address, timeout=5.0)
    transport = ZmqTransport()
    try:
        mallory.call(Register(name="mallory", role="trainer", endpoint=transport.endpoint(),
                              published={"policy": 10**9}, owners={"policy": "0.1.2.3"}))
        assert "policy" not in guarded.table.models
        with Publisher(guarded.address, "policy", transport="zmq") as pub, \
                Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
            assert pub.publish(STATE) == 1
            assert rep.pull(timeout=20) == 1
            assert torch.equal(rep.tensors["w"], STATE["w"])
    finally:
        mallory.close()
        transport.close()


@pytest.mark.parametrize("kept_by", ["curve_secret", "owner_key_file"])
def test_a_model_stays_its_publishers_across_a_coordinator_restart(monkeypatch, tmp_path,
                                                                    kept_by):
    """With a persistent coordinator key (from a CURVE keypair, or the owner key file the
    coordinator keeps), a model's credential outlives a restart: a token holder that
    publishes the model first after the restart binds it only until the real trainer
    registers again with its older credential; then the token holder's version is dropped,
    its publishes refused, and the trainer numbers on."""
    import socket

    from tensorhub.core import curve
    from tensorhub_testing.waits import wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var in ("TENSORHUB_TOKEN", "TENSORHUB_TOKEN_FILE", "TENSORHUB_CURVE_SERVER_KEY_FILE",
                "TENSORHUB_CURVE_SERVER_KEY"):
        monkeypatch.delenv(var, raising=False)
    if kept_by == "curve_secret":
        public, secret = curve.generate_keypair()
        monkeypatch.setenv("TENSORHUB_CURVE_SERVER_KEY", public)
        kept = {"curve_secret": secret}
    else:
        kept = {"owner_key_file": str(tmp_path / "owner.key")}
    config = CoordinatorConfig(bind=f"tcp://127.0.0.1:{port}", heartbeat_interval=0.2,
                               worker_ttl=2.0, **kept)
    first = Coordinator(config).start()
    address, later = first.address, None
    try:
        with Publisher(address, "policy", transport="zmq") as pub:
            assert pub.publish(STATE) == 1
            first.stop()
            later = Coordinator(config).start()
            with Publisher(address, "policy", transport="zmq", name="mallory") as mallory:
                try:  # before the trainer is back (taken, then dropped), or after (refused)
                    mallory.publish({k: t * 7 for k, t in STATE.items()}, version=50)
                except CoordinatorError as refused:
                    assert refused.code == "unauthorized"
                wait_for(lambda: pub.session.registrations == 2, 10,
                         "the trainer registering again")
                wait_for(lambda: 50 not in later.table.models["policy"].versions, 10,
                         "the token holder's version dropped")
                with pytest.raises(CoordinatorError, match="belongs to the trainer"):
                    mallory.publish({k: t * 7 for k, t in STATE.items()}, version=51)
            assert pub.publish({k: t * 2 for k, t in STATE.items()}) == 2
    finally:
        first.stop()
        if later is not None:
            later.stop()



def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


PIN = """
import sys, time, zmq
address, seconds = sys.argv[1], float(sys.argv[2])
big = bytes(256 << 20)  # declared and sent on each of 4 connections, again and again
ctx = zmq.Context()
socks = []
for _ in range(4):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 100)
    s.connect(address)
    socks.append(s)
stop, sent = time.monotonic() + seconds, 0
while time.monotonic() < stop:
    for s in socks:
        try:
            s.send(big, copy=False)
            sent += 1
        except zmq.Again:
            pass
    time.sleep(0.05)
print(sent)
"""


def test_a_stranger_cannot_pin_a_workers_memory_through_the_zmq_data_port(guarded):
    """No token needed to reach a worker's zmq data port: a stranger on 4 connections sends
    256 MiB messages for 5 s. A chunk request is ~100 bytes, so a frame over 2 KiB drops the
    connection before it is buffered: the worker's memory does not grow, and it serves on."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
        pub.publish(STATE)
        address = pub.session.transport.endpoint().address
        before, peak = _rss(), 0
        stranger = subprocess.Popen([sys.executable, "-c", PIN, address, "5"],
                                    stdout=subprocess.PIPE, text=True)
        try:
            while stranger.poll() is None:
                peak = max(peak, _rss() - before)
                time.sleep(0.05)
            assert int(stranger.stdout.read()) > 0  # it did send
        finally:
            stranger.kill()
            stranger.wait()
        print(f"\na stranger sending 256 MiB frames to the zmq data port: the holder's RSS "
              f"+{peak / 2**20:.1f} MiB at most")
        assert peak < 8 << 20
        assert rep.pull(timeout=20) == 1
        assert torch.equal(rep.tensors["w"], STATE["w"])


IDLE = """
import select, socket, sys, time
source, host = sys.argv[1], sys.argv[2]
port, n, keep = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
conns = []
for _ in range(n):
    try:
        conns.append(socket.create_connection((host, port), timeout=10,
                                              source_address=(source, 0)))
    except OSError:
        pass
print(len(conns), flush=True)
for s in conns:
    s.setblocking(False)
open_ = {s.fileno(): s for s in conns}
poller = select.poll()
for fd in open_:
    poller.register(fd, select.POLLIN)
deadline = time.monotonic() + 30  # (the coordinator shuts the excess down as it accepts)
while len(open_) > keep and time.monotonic() < deadline:
    for fd, _ in poller.poll(100):  # (zmq's greeting, then the end)
        s = open_[fd]
        try:
            while s.recv(4096):
                pass
        except BlockingIOError:
            continue
        except OSError:
            pass
        poller.unregister(fd)
        del open_[fd]
        s.close()
print(len(conns) - len(open_), flush=True)
sys.stdin.read()  # (holds the rest until told)
"""


def test_a_stranger_keeps_no_more_connections_than_its_budget(monkeypatch, tmp_path):
    """A coordinator whose open-file limit is 1024 and cannot be raised (hard limit): a
    stranger on another address opens 1,200 idle connections (no handshake). The
    coordinator keeps 256 of them (a quarter of its limit) and shuts the rest down as it
    accepts them, and says so; new workers' registrations from elsewhere meanwhile all
    succeed (their median time is printed beside a quiet one's)."""
    import statistics

    from tensorhub.core.net import free_port
    from tensorhub.core.transport.zmq import ZmqTransport
    from tensorhub.tools.child_process import ChildProcess

    for var in ("TENSORHUB_TOKEN_FILE", "TENSORHUB_CURVE_SERVER_KEY",
                "TENSORHUB_CURVE_SERVER_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = ChildProcess(["prlimit", "--nofile=1024:1024", sys.executable, "-m",
                         "tensorhub.tools.cli", "--log-level", "WARNING", "coordinator",
                         "--bind", address, "--announce", f"tcp://127.0.0.1:{free_port()}"],
                        env={"TENSORHUB_TOKEN": TOKEN}, name="coordinator",
                        log_path=str(tmp_path / "coordinator.log"))
    transport = ZmqTransport()
    idle = None
    try:
        proc.next_line(timeout=60)

        def registration() -> float:
            """A new worker's: a connection of its own, then `Register`."""
            started = time.perf_counter()
            fresh = CoordinatorClient(address, token=TOKEN, timeout=10.0)
            try:
                fresh.call(Register(name="w", role="replica", endpoint=transport.endpoint()))
            finally:
                fresh.close()
            return time.perf_counter() - started

        quiet = statistics.median(registration() for _ in range(20))
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        idle = subprocess.Popen([sys.executable, "-c", IDLE, "127.0.0.2", host, port,
                                 "1200", "256"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        opened = int(idle.stdout.readline())
        assert opened > 256  # (idle, no handshake; a connect the kernel gave up on is not)
        assert int(idle.stdout.readline()) >= opened - 256  # the rest were shut down
        assert "127.0.0.2 holds 257 connections, past its budget of 256" in (
            tmp_path / "coordinator.log").read_text()  # (not the handshake window)
        times = [registration() for _ in range(20)]  # (each one succeeds)
        print(f"\nregistration, median of 20: {1e3 * statistics.median(times):.2f} ms "
              f"(max {1e3 * max(times):.1f} ms) while a stranger holds 256 idle "
              f"connections of the {opened} it opened, against {1e3 * quiet:.2f} ms quiet "
              f"(fd limit 1024, hard)")
    finally:
        if idle is not None:
            idle.kill()
            idle.wait()
        transport.close()
        proc.stop()


BIG_PUBLISH = """
import sys, time, torch
from tensorhub import Publisher
address, n, versions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {f"layers.{i}.norm": torch.zeros(4) for i in range(n)}
with Publisher(address, "big", transport="zmq", timeout=300.0, patches=False) as pub:
    print("ready", flush=True)
    for v in range(versions):
        started = time.monotonic()
        pub.publish(state)
        print(f"published {time.monotonic() - started:.2f}", flush=True)
    pub.release(force=True)
"""


def test_a_large_request_being_made_ready_does_not_hold_the_loop(monkeypatch):
    """A large request (a manifest of many tensors) is decoded and checked beside the
    coordinator's loop: while its preparation is held up, a status request is answered, and
    the large request is answered once its preparation ends."""
    import threading

    import tensorhub.coordinator.server as server

    held, release = threading.Event(), threading.Event()

    def slow_prepare(payload: bytes):
        held.set()
        release.wait(60)
        return prepare(payload)

    monkeypatch.setattr(server, "prepare", slow_prepare)
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    try:
        with Publisher(coordinator.address, "big", transport="zmq", patches=False) as pub:
            state = {f"layers.{i}.norm": torch.zeros(4) for i in range(20_000)}
            publishing = threading.Thread(target=lambda: published.append(pub.publish(state)))
            published: list[int] = []
            publishing.start()
            assert held.wait(60)  # (the publish is in preparation, beside the loop)
            client = CoordinatorClient(coordinator.address, timeout=30.0)
            try:
                status = client.call(StatusRequest())
            finally:
                client.close()
            assert {w["worker_id"] for w in status.workers} == {pub.session.worker_id}
            assert published == []  # answered while the publish was still being prepared
            release.set()
            publishing.join(60)
            assert published == [1]
    finally:
        release.set()
        coordinator.stop()


def test_a_status_request_is_answered_in_milliseconds_while_a_150000_tensor_publish_is_handled():
    """A token holder may publish a manifest of 150,000 tiny tensors (within every limit):
    its decoding, checks, hashing and encoding run beside the coordinator's loop, which
    answers status requests meanwhile. The latencies are printed (the figure); the
    behaviour is pinned without a clock above."""
    import statistics

    from tensorhub.tools.child_process import ChildProcess
    from tensorhub_testing.local_fleet import CoordinatorProcess

    coordinator = CoordinatorProcess().start()
    client = CoordinatorClient(coordinator.address, token="", timeout=60.0)
    trainer = None

    def status_latency() -> float:
        started = time.perf_counter()
        client.call(StatusRequest())
        return time.perf_counter() - started

    try:
        quiet = [status_latency() for _ in range(50)]
        trainer = ChildProcess([sys.executable, "-c", BIG_PUBLISH, coordinator.address,
                                "150000", "2"], name="trainer")
        assert trainer.next_line(timeout=120) == "ready"
        during, published = [], []
        while len(published) < 2:
            during.append(status_latency())
            time.sleep(0.005)
            while not trainer.lines.empty():
                published.append(float(trainer.lines.get().split()[1]))
        assert trainer.wait(timeout=120) == 0
        during.sort()
        print(f"\nstatus latency: quiet median {1e3 * statistics.median(quiet):.1f} ms, "
              f"max {1e3 * max(quiet):.1f} ms; during two 150,000-tensor publishes "
              f"({', '.join(f'{p:.1f}' for p in published)} s each, {len(during)} requests): "
              f"median {1e3 * statistics.median(during):.1f} ms, "
              f"p99 {1e3 * during[int(0.99 * len(during))]:.1f} ms, "
              f"max {1e3 * max(during):.1f} ms")
        assert len(published) == 2 and during  # (the figure is printed above)
    finally:
        if trainer is not None:
            trainer.stop()
        client.close()
        coordinator.stop()


def test_a_large_request_made_ready_beside_the_loop_is_the_request_decoded_whole():
    """What `prepare` makes of a large publish (sliced decoding, layout id, items, the
    manifest's encoding) equals what the loop's own path makes of it; a bad one is refused
    the same way."""
    from tensorhub.core.data_types import Envelope, ErrorReply, Manifest, Publish, TensorSpec
    from tensorhub.core.layout import layout_id, plan_items
    from tensorhub.core.wire import decode_envelope, encode

    tensors = [TensorSpec(name=f"t{i}", dtype="bfloat16", shape=[2, 3], nbytes=12)
               for i in range(3000)]
    tensors += [TensorSpec(name="rows", dtype="float32", shape=[2, 4], nbytes=32,
                           rows=(2, 4, 8))]
    manifest = Manifest(tensors=tensors, compact_threshold=1 << 20)
    items = plan_items(manifest)
    request = Publish(worker_id="w", model="m", version=3, manifest=manifest,
                      checksums=["0" * 16] * len(items),
                      memory=[MemoryDesc(addr=4096 * (k + 1), nbytes=i.nbytes)
                              for k, i in enumerate(items)])
    payload = encode(Envelope(request=request, secret="s"))
    envelope, work = prepare(payload)
    assert envelope == decode_envelope(payload)
    assert work.layout_id == layout_id(manifest) and work.items == items
    assert work.packed[0].data == encode(manifest)
    bad = payload.replace(b"bfloat16", b"bfloat17", 1)
    refused, work = prepare(bad)
    assert isinstance(refused, ErrorReply) and refused.code == "bad_request" and work is None


def test_a_token_holder_that_holds_a_native_layout_first_cannot_make_an_engine_load_its_bytes(
        guarded):
    """A token holder holds v1 in an engine-style layout (other names, other order) first,
    with bytes and checksums of its own (every weight 7.0); the real engine's hold of the
    same layout disagrees. The layout is untrusted from then on: no plan reads from it, the
    engines' fleet view shows nobody to read it from, and a joining engine takes the
    publisher's layout: the trainer's bytes."""
    from tensorhub.engines.fleet import FleetView

    native = {"b.native": STATE["b"], "w.native": STATE["w"]}  # (an engine's own names)
    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", {k: t.clone() for k, t in native.items()},
                    transport="zmq", name="mallory") as mallory, \
            Replica(guarded.address, "policy", {k: t.clone() for k, t in native.items()},
                    transport="zmq", name="engine") as engine:
        pub.publish(STATE)
        assert mallory.layout.layout_id != pub.layout_id
        for t in mallory.tensors.values():
            t.fill_(7.0)
        mallory.layout.pack()
        mallory.session.hold("policy", 1, mallory.layout, mallory.layout.checksums())
        engine.layout.pack()
        with pytest.raises(CoordinatorError, match="untrusted"):
            engine.session.hold("policy", 1, engine.layout, engine.layout.checksums())
        lid = engine.layout.layout_id
        assert not FleetView(engine.session, "policy").in_layout(lid).held_by_others(1, [])
        with Replica(guarded.address, "policy", {k: torch.zeros_like(t)
                                                 for k, t in native.items()},
                     transport="zmq", name="joining-native") as joining:
            with pytest.raises(CoordinatorError, match="untrusted") as err:
                joining.pull(1, timeout=20)
            assert err.value.code == "layout_unserved"
            assert not any(t.eq(7.0).any() for t in joining.tensors.values())
        with Replica(guarded.address, "policy", transport="zmq", name="joining") as joining:
            assert joining.pull(1, timeout=20) == 1  # the publisher's layout
            assert torch.equal(joining.tensors["w"], STATE["w"])


def _from(host: str, coordinator) -> str:
    """The coordinator's address, connected to from `host` (another loopback address: to
    the coordinator, another machine)."""
    return f"tcp://{host}:0;{coordinator.address[len('tcp://'):]}"


def _native_holder(address: str, name: str, fill: float | None = None) -> Replica:
    """A replica holding v1 in an engine-style layout it made itself: the trainer's bytes,
    or every weight `fill`."""
    tensors = {"b.native": STATE["b"].clone(), "w.native": STATE["w"].clone()}
    if fill is not None:
        for t in tensors.values():
            t.fill_(fill)
    rep = Replica(address, "policy", tensors, transport="zmq", name=name)
    rep.layout.pack()
    rep.session.hold("policy", 1, rep.layout, rep.layout.checksums())
    return rep


def test_the_only_holder_of_a_native_layout_on_another_host_is_not_believed(guarded):
    """A token holder on a host of its own is the first and only holder of v1 in an
    engine-style layout, with bytes of its own: nobody vouches for them, so no plan reads
    them; a joining engine of that layout is told to read the publisher's layout (and
    does: the trainer's bytes). A real engine on another host then makes the layout with
    the trainer's bytes: the holders disagree and the layout stays unread."""
    from tensorhub.engines.fleet import FleetView

    with Publisher(guarded.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        with _native_holder(_from("127.0.0.2", guarded), "mallory", fill=7.0) as mallory:
            lid = mallory.layout.layout_id
            assert not FleetView(mallory.session, "policy").in_layout(lid).held_by_others(
                1, [])
            with Replica(guarded.address, "policy",
                         {"b.native": torch.zeros(7), "w.native": torch.zeros(256, 256)},
                         transport="zmq", name="joining-native") as joining:
                with pytest.raises(CoordinatorError,
                                   match="vouched for by 1 address") as err:
                    joining.pull(1, timeout=20)
                assert err.value.code == "layout_unserved"
                assert not any(t.eq(7.0).any() for t in joining.tensors.values())
            with Replica(guarded.address, "policy", transport="zmq") as joining:
                assert joining.pull(1, timeout=20) == 1
                assert torch.equal(joining.tensors["w"], STATE["w"])
            with pytest.raises(CoordinatorError, match="untrusted"):
                _native_holder(_from("127.0.0.3", guarded), "engine").close()


def test_a_native_layout_made_alike_on_two_hosts_is_served(guarded):
    """Two engines on two hosts (not the trainer's) that each made v1's native layout
    with the same bytes vouch for it: a joining engine of that layout reads it natively,
    and gets the trainer's bytes."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        with _native_holder(_from("127.0.0.2", guarded), "engine-a"), \
                _native_holder(_from("127.0.0.3", guarded), "engine-b"), \
                Replica(guarded.address, "policy",
                        {"b.native": torch.zeros(7), "w.native": torch.zeros(256, 256)},
                        transport="zmq", name="joining-native") as joining:
            assert joining.pull(1, timeout=20) == 1
            assert torch.equal(joining.tensors["w.native"], STATE["w"])


def test_a_native_layout_made_on_the_trainers_host_is_served_at_once(guarded):
    """An engine on the trainer's own address is as trusted as the trainer's host: its
    native layout is served as soon as it holds it (one host, one engine is enough)."""
    with Publisher(guarded.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        with _native_holder(guarded.address, "engine"), \
                Replica(_from("127.0.0.2", guarded), "policy",
                        {"b.native": torch.zeros(7), "w.native": torch.zeros(256, 256)},
                        transport="zmq", name="joining-native") as joining:
            assert joining.pull(1, timeout=20) == 1
            assert torch.equal(joining.tensors["b.native"], STATE["b"])


def test_a_resumed_trainer_shows_the_credential_its_first_run_saved(guarded):
    """While a model's trainer is registered, another trainer's publish of it is refused.
    Once it left, the next publish binds the model anew; the first trainer's job, resumed
    with the credentials it saved, wins the model back (the older credential)."""
    with Publisher(guarded.address, "policy", transport="zmq") as first:
        assert first.publish(STATE) == 1
        saved = first.owners
        with Publisher(guarded.address, "policy", transport="zmq", name="other") as other, \
                pytest.raises(CoordinatorError, match="belongs to the trainer"):
            other.publish(STATE, version=2)
    assert set(saved) == {"policy"}
    with Publisher(guarded.address, "policy", transport="zmq", name="next") as later:
        assert later.publish({k: t * 3 for k, t in STATE.items()}, version=2) == 2
        with Publisher(guarded.address, "policy", transport="zmq", owners=saved) as resumed, \
                Replica(guarded.address, "policy", transport="zmq", name="eng") as rep:
            with pytest.raises(CoordinatorError, match="belongs to the trainer"):
                later.publish(STATE, version=3)
            assert resumed.publish({k: t * 2 for k, t in STATE.items()}, version=3) == 3
            assert rep.pull(timeout=20) == 3
            assert torch.equal(rep.tensors["w"], STATE["w"] * 2)


def test_the_owner_key_file_is_made_once_private_and_kept(tmp_path):
    from tensorhub.coordinator.owner_key import load_owner_key

    path = tmp_path / "state" / "owner.key"
    key = load_owner_key(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_owner_key(path) == key
    path.write_text("not a key\n")
    with pytest.raises(ValueError, match=r"does not hold an owner key .* remove it"):
        load_owner_key(path)


def test_a_worker_named_like_an_engines_cannot_make_it_believe_a_version_is_held(guarded):
    """Names are the workers' own choice: a token holder that registers under an engine
    worker's name and holds v2 does not make v2 held under that name (the engine would
    swap to a version its worker does not have); every worker of the name must hold it."""
    from tensorhub.engines.fleet import FleetView

    with Publisher(guarded.address, "policy", transport="zmq") as pub, \
            Replica(guarded.address, "policy", transport="zmq", name="engine-tp0") as rank:
        pub.publish(STATE)
        assert rank.pull(1, timeout=20) == 1
        view = FleetView(rank.session, "policy")
        assert view.holdings(["engine-tp0"]).held == {"engine-tp0": [1]}
        pub.publish({k: t * 2 for k, t in STATE.items()})
        with Replica(guarded.address, "policy", transport="zmq",
                     name="engine-tp0") as impostor:
            assert impostor.pull(2, timeout=20) == 2
            assert 2 not in view.holdings(["engine-tp0"]).held["engine-tp0"]
        assert rank.pull(2, timeout=20) == 2  # (it lets v1 go)
        assert view.holdings(["engine-tp0"]).held == {"engine-tp0": [2]}


def test_an_engine_route_takes_the_bearer_scheme_in_any_case(monkeypatch):
    from tensorhub.engines.auth import authorized

    monkeypatch.setenv("TENSORHUB_TOKEN", TOKEN)
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert authorized(f"{scheme} {TOKEN}", "10.0.0.5")
    assert not authorized(f"Basic {TOKEN}", "10.0.0.5")
    assert not authorized(TOKEN, "10.0.0.5")
