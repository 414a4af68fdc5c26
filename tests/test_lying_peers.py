"""Peers that lie, each against real processes' sockets: a holder whose bytes are wrong is
read around and named; readers that report a healthy holder do not get it dropped; a
token holder that is not a model's publisher cannot number its versions."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from test_trust import _FailingFrom, from_address

from tensorhub import Publisher, Replica
from tensorhub.coordinator.status import status
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import StatusRequest

ITEM_BYTES = 2 << 20


def _state(items: int = 16, seed: int = 5) -> dict[str, torch.Tensor]:
    """`items` tensors of 2 MiB (each its own item: no compact region), 4 to an 8 MiB
    chunk, so a chunk's bytes are whole items."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(ITEM_BYTES // 4096, 1024, generator=g) for i in range(items)}


@pytest.mark.parametrize("whole_items", [False, True], ids=["striped", "whole_items"])
def test_a_holder_with_bad_bytes_fails_no_reader_and_only_its_items_are_read_again(
        coordinator, whole_items):
    """One byte of 3 of 16 items flipped in a replica's buffers after it holds the version
    (a memory error, or a token holder serving other bytes under the real checksums): every
    reader's pull succeeds bit-exact, each reads again only those of the 3 items it got from
    that holder, and names it as the source of bad bytes."""
    state = _state()
    sums = {n: checksum(t) for n, t in state.items()}
    readers, reread, from_bad, named = 4, [], [], []
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="bad",
                    whole_items=whole_items) as bad:
        pub.publish(state)
        assert bad.pull(timeout=30) == 1
        items = [k for k, buf in enumerate(bad.layout.item_bytes) if buf.numel()]
        flipped = [items[0], items[5], items[11]]
        for k in flipped:
            buf = bad.layout.item_bytes[k]
            buf[buf.numel() // 2] ^= 0xFF
        for r in range(readers):
            with Replica(coordinator.address, "policy", transport="zmq", name=f"reader{r}",
                         whole_items=whole_items) as rep:
                assert rep.pull(timeout=60) == 1  # never `checksum_mismatch`
                assert {n: checksum(t) for n, t in rep.tensors.items()} == sums
                stats = rep.last_pull
                reread.append(rep.last_pull_reread)
                from_bad.append(stats.by_source.get("bad", 0))
                named.append(rep.last_pull_bad_sources)
                rep.session.withdraw("policy", 1, timeout=10)  # readers after read `bad`
    print(f"\nbad bytes, {'whole items' if whole_items else 'striped'}: {readers} readers, "
          f"0 failed; read again per reader: {[n / 2**20 for n in reread]} MiB; "
          f"from the bad holder: {[n / 2**20 for n in from_bad]} MiB")
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total in from_bad, "no reader read all from the bad holder: nothing was tried"
    for got, served, who in zip(reread, from_bad, named, strict=True):
        assert got % ITEM_BYTES == 0 and got <= min(served, len(flipped) * ITEM_BYTES)
        if served == total:  # (every flipped item came from it)
            assert got == len(flipped) * ITEM_BYTES  # exactly those, nothing more
        assert who == (["bad"] if got else [])


def _holders(coordinator, version: int = 1) -> set[str]:
    reply = status(coordinator.state, StatusRequest())
    return {h.name for m in reply.models for v in m.versions if v.version == version
            for h in v.holders if not h.withdrawn}


def test_a_good_holder_is_kept_against_two_lying_reporters(coordinator):
    """Two readers that report a healthy holder as failing: with self-chosen node labels
    from one host they are one witness; from two hosts, each report is contradicted by an
    honest reader's good read of the holder and no longer counts. The holder is never
    dropped, and readers keep reading from it."""
    state = _state(8)
    sums = {n: checksum(t) for n, t in state.items()}
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher(coordinator.address, "policy", transport="zmq"))
        good = stack.enter_context(Replica(coordinator.address, "policy", transport="zmq",
                                           name="good"))
        pub.publish(state)
        assert good.pull(timeout=30) == 1

        def liar(address: str, name: str, node: str) -> Replica:
            rep = stack.enter_context(Replica(address, "policy", transport="zmq", name=name,
                                              labels={"node": node}))
            rep.session.transport = _FailingFrom(rep.session.transport,
                                                 good.session.worker_id)
            assert rep.pull(timeout=30) == 1  # (from the trainer, having reported `good`)
            rep.session.withdraw("policy", 1, timeout=5)  # later readers read `good`
            return rep

        def honest(name: str) -> None:
            with Replica(from_address(coordinator.address, "127.0.0.9"), "policy",
                         transport="zmq", name=name) as rep:
                assert rep.pull(timeout=30) == 1
                assert {n: checksum(t) for n, t in rep.tensors.items()} == sums
                assert rep.last_pull.by_source.get("good", 0) > 0
                rep.session.withdraw("policy", 1, timeout=5)

        # one host, two self-chosen labels: one witness
        liar(coordinator.address, "liar-a", "a")
        liar(coordinator.address, "liar-b", "b")
        assert "good" in _holders(coordinator)
        reports = coordinator.trust._reports.get(good.session.worker_id, {})
        assert len(reports) == 2 and len({w for w, _, _ in reports.values()}) == 1
        honest("honest-1")  # reads `good` fine: both reports contradicted
        assert coordinator.trust.strikes("127.0.0.1") == 2
        # two hosts: each report is contradicted before the next one comes
        liar(from_address(coordinator.address, "127.0.0.2"), "liar-c", "c")
        honest("honest-2")
        liar(from_address(coordinator.address, "127.0.0.3"), "liar-d", "d")
        assert "good" in _holders(coordinator)
        assert good.session.worker_id not in coordinator.state.probation


def test_a_holder_reported_for_bad_bytes_by_two_hosts_is_dropped_checks_its_copy_and_withdraws(
        coordinator, caplog):
    """Readers on two hosts read around a holder's bad bytes and name it: the coordinator
    drops it for the version and tells it why; the holder verifies its copy, finds it
    damaged, withdraws it and says so. Later readers never meet it."""
    from tensorhub_testing.waits import wait_for

    state = _state(8)
    sums = {n: checksum(t) for n, t in state.items()}
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher(coordinator.address, "policy", transport="zmq"))
        bad = stack.enter_context(Replica(coordinator.address, "policy", transport="zmq",
                                          name="bad"))
        pub.publish(state)
        assert bad.pull(timeout=30) == 1
        buf = next(b for b in bad.layout.item_bytes if b.numel())
        buf[7] ^= 0x01
        for host in ("127.0.0.2", "127.0.0.3"):
            # (they stay registered: a witness that left takes its reports with it)
            rep = stack.enter_context(Replica(from_address(coordinator.address, host),
                                              "policy", transport="zmq",
                                              name=f"reader-{host}"))
            assert rep.pull(timeout=30) == 1
            assert rep.last_pull_bad_sources == ["bad"]
            assert {n: checksum(t) for n, t in rep.tensors.items()} == sums
            rep.session.withdraw("policy", 1, timeout=5)
        assert "bad" not in _holders(coordinator)
        wait_for(lambda: bad.version is None, what="the bad holder withdrawing its copy")
        wait_for(lambda: "found its copy of policy v1 damaged" in caplog.text,
                 what="the coordinator hearing why")
        with Replica(coordinator.address, "policy", transport="zmq", name="late") as late:
            assert late.pull(timeout=30) == 1
            assert late.last_pull_reread == 0 and "bad" not in late.last_pull.by_source
