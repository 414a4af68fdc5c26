"""A reader's word does not evict a holder: one faulty reader cannot take a version away."""

from __future__ import annotations

import pytest

from tensorhub import CoordinatorError, Publisher, Replica
from tensorhub.coordinator.status import status
from tensorhub.coordinator.trust import Trust, TrustConfig
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import StatusRequest
from tensorhub.core.errors import TransferError
from tensorhub.tools.synthetic_weights import synthetic_state_dict


def from_address(coordinator: str, source: str) -> str:
    """`coordinator`'s address, connected to from `source` (a loopback address: another
    host, as the coordinator sees it)."""
    return f"tcp://{source}:0;{coordinator.removeprefix('tcp://')}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_report_only_steers_the_reader_that_made_it():
    trust = Trust(TrustConfig(quorum=2, window=30.0), Clock())
    assert trust.report("r1", "h", protected=False) is False
    assert set(trust.avoided("r1")) == {"h"}
    assert set(trust.avoided("r2")) == set()


def test_two_credible_readers_agree_and_the_holder_is_dropped():
    trust = Trust(TrustConfig(quorum=2), Clock())
    trust.report("r1", "h", protected=False)
    assert trust.report("r2", "h", protected=False) is True


def test_readers_on_one_node_are_one_witness():
    trust = Trust(TrustConfig(quorum=2), Clock())
    trust.report("engine-tp0", "h", protected=False, witness="10.0.0.1")
    assert trust.report("engine-tp1", "h", protected=False, witness="10.0.0.1") is False
    assert trust.report("other", "h", protected=False, witness="10.0.0.2") is True


def test_a_contradicted_witness_loses_its_weight_and_good_reads_do_not_restore_it():
    """Liars on two hosts report a holder that others read fine: each contradiction is a
    strike against the witness; two strikes and its reports steer only itself, whatever
    good reads it reports meanwhile, until they age out."""
    clock = Clock()
    trust = Trust(TrustConfig(quorum=2, window=30.0, liar_after=2, strike_window=600.0), clock)
    for round_ in range(2):
        clock.now += 1
        trust.report(f"liar-a{round_}", "h", protected=False, witness="10.0.0.1")
        clock.now += 1
        trust.read_ok("honest", {"h": False}, witness="10.0.0.9", since=clock.now)
        trust.read_ok(f"liar-a{round_}", {"other": True}, witness="10.0.0.1",
                      since=clock.now)  # its own good reads
    assert trust.strikes("10.0.0.1") == 2
    clock.now += 1
    trust.report("liar-a2", "h", protected=False, witness="10.0.0.1")
    assert trust.report("liar-b", "h", protected=False, witness="10.0.0.2") is False
    clock.now += 601
    assert trust.strikes("10.0.0.1") == 0


def test_a_report_of_bad_bytes_is_contradicted_only_by_a_read_of_the_whole_version():
    trust = Trust(TrustConfig(quorum=2), Clock())
    trust.report("r1", "h", protected=False, witness="a", bad_bytes=True)
    trust.read_ok("r2", {"h": False}, witness="b", since=1.0)  # a stripe of it: no word
    assert trust.strikes("a") == 0
    assert trust.report("r3", "h", protected=False, witness="c", bad_bytes=True) is True


def test_a_departed_holder_no_longer_counts_against_its_readers():
    trust = Trust(TrustConfig(broken_after=2), Clock())
    trust.report("r", "dead1", protected=False)
    trust.report("r", "dead2", protected=False)
    assert trust.suspects() == ["r"]
    trust.forget("dead1")
    assert trust.suspects() == []


def test_a_publisher_is_never_dropped_on_reports():
    trust = Trust(TrustConfig(quorum=2), Clock())
    assert [trust.report(r, "trainer", protected=True) for r in ("r1", "r2", "r3")] == \
           [False, False, False]


def test_a_reader_failing_on_every_holder_is_the_suspect_and_its_reports_stop_counting():
    trust = Trust(TrustConfig(quorum=2, broken_after=2), Clock())
    trust.report("broken", "h1", protected=False)
    trust.report("broken", "h2", protected=False)
    assert trust.suspects() == ["broken"]
    # one healthy reader's report of h1 is not a quorum with a suspect's
    assert trust.report("healthy", "h1", protected=False) is False


def test_a_good_read_clears_a_reader_and_reports_expire():
    clock = Clock()
    trust = Trust(TrustConfig(quorum=2, window=30.0, broken_after=2), clock)
    trust.report("r1", "h1", protected=False)
    trust.report("r1", "h2", protected=False)
    trust.read_ok("r1")
    assert trust.suspects() == []
    clock.now = 31.0
    assert set(trust.avoided("r1")) == set()
    assert trust.report("r2", "h1", protected=False) is False  # r1's report has expired


class _BrokenTransport:
    """Wraps a real transport; every read fails as a misconfigured network would."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def read(self, peer, ops, timeout):
        raise TransferError(f"no route to {peer.worker_id} (test: broken transport)",
                            peer.worker_id)


def test_a_reader_with_a_broken_transport_cannot_make_a_version_unavailable(coordinator):
    state = synthetic_state_dict(8, n_tiny=20, seed=3)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        with Replica(coordinator.address, "policy", transport="zmq", name="broken") as bad:
            bad.session.transport = _BrokenTransport(bad.session.transport)
            with pytest.raises(CoordinatorError, match="transport is the likely fault") as err:
                bad.pull(timeout=30)
            assert err.value.code == "unreachable"
        # the trainer still holds v1, and a healthy reader gets it bit-exact
        reply = status(coordinator.state, StatusRequest())
        holders = {h.name for v in reply.models[0].versions for h in v.holders}
        assert "trainer" in holders
        with Replica(coordinator.address, "policy", transport="zmq", name="healthy") as good:
            assert good.pull(timeout=30) == 1
            assert {n: checksum(t) for n, t in good.tensors.items()} == \
                   {n: checksum(t) for n, t in state.items()}


class _FailingFrom(_BrokenTransport):
    """Reads from one holder fail (a network fault between it and this reader's node)."""

    def __init__(self, real, holder: str):
        super().__init__(real)
        self._holder = holder

    def read(self, peer, ops, timeout):
        if peer.worker_id == self._holder:
            return super().read(peer, ops, timeout)
        return self._real.read(peer, ops, timeout)


def test_a_holder_dropped_on_reports_is_told_and_offers_the_version_again_after_probation(
        caplog):
    """Readers on two hosts fail to read from a holder: the coordinator stops planning reads
    from it and tells it so. An early offer is refused (`probation`, kept on the
    coordinator's clock); once the probation is over it offers the version again itself,
    and serves it bit-exact."""
    import time
    from contextlib import ExitStack

    from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
    from tensorhub.core.client import CoordinatorClient
    from tensorhub.core.data_types import Hold, StatusRequest
    from tensorhub_testing.waits import wait_for

    skew = [0.0]
    coordinator = Coordinator(
        CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.2, worker_ttl=600.0,
                          trust=TrustConfig(window=60.0)),
        clock=lambda: time.monotonic() + skew[0]).start()
    state = synthetic_state_dict(8, n_tiny=20, seed=3)
    sums = {n: checksum(t) for n, t in state.items()}
    status = CoordinatorClient(coordinator.address)

    def holders() -> set[str]:
        return {h.name for m in status.call(StatusRequest()).models for v in m.versions
                for h in v.holders if v.version == 1 and not h.withdrawn}

    try:
        with ExitStack() as stack:
            pub = stack.enter_context(Publisher(coordinator.address, "policy", transport="zmq"))
            suspect = stack.enter_context(Replica(coordinator.address, "policy",
                                                  transport="zmq", name="suspect",
                                                  labels={"node": "s"}))
            pub.publish(state)
            suspect.pull(timeout=30)
            for host, node in (("127.0.0.2", "a"), ("127.0.0.3", "b")):
                # two hosts, as the coordinator sees them: connections from two addresses
                reader = stack.enter_context(Replica(from_address(coordinator.address, host),
                                                     "policy", transport="zmq",
                                                     name=f"reader-{node}",
                                                     labels={"node": node}))
                reader.session.transport = _FailingFrom(reader.session.transport,
                                                        suspect.session.worker_id)
                assert reader.pull(timeout=30) == 1  # from another holder, then
                assert {n: checksum(t) for n, t in reader.tensors.items()} == sums
                # it stays registered (its report counts) but serves nothing: the next
                # reader is planned onto the suspect too
                reader.session.withdraw("policy", 1, timeout=5)
            assert "suspect" not in holders()
            wait_for(lambda: "could not read policy v1 from us" in caplog.text,
                     what="the holder being told")
            layout = suspect.layout
            with pytest.raises(CoordinatorError) as early:
                suspect.session.call(Hold(
                    worker_id=suspect.session.worker_id, model="policy", version=1,
                    layout_id=layout.layout_id, memory=layout.memory(),
                    endpoint=suspect.session.transport.endpoint(), manifest=layout.manifest,
                    checksums=layout.checksums()))
            assert early.value.code == "probation" and early.value.retry_after > 50
            assert "suspect" not in holders()
            skew[0] += 61.0  # the probation is over
            wait_for(lambda: "suspect" in holders(), what="the holder offering v1 again")
            pub.release(force=True)  # the trainer leaves: the suspect is the one holder
            late = stack.enter_context(Replica(coordinator.address, "policy",
                                               transport="zmq", name="late"))
            assert late.pull(timeout=30) == 1
            assert {n: checksum(t) for n, t in late.tensors.items()} == sums
            assert late.last_pull.sources == ["suspect"]
    finally:
        status.close()
        coordinator.stop()
