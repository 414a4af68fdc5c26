"""Sharded versions: K trainer ranks publish one version, each its part; readers see it
only whole, and a rank that dies or a part that does not fit takes no version away."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time

import pytest
import torch

from tensorhub import PartedReplica, Publisher, TensorHubError
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    GetManifest,
    HoldingsRequest,
    PublishStatus,
    StatusRequest,
)
from tensorhub.core.errors import CoordinatorError
from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.local_fleet import CoordinatorProcess
from tensorhub_testing.waits import wait_for

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


def rank_state(rank: int, version: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s own tensors at `version`: one large (its own item), two tiny."""
    g = torch.Generator().manual_seed(1000 * version + rank)
    return {f"layers.{rank}.w": torch.randn(512, 640, generator=g),
            f"layers.{rank}.b": torch.randn(640, generator=g),
            f"layers.{rank}.norm": torch.randn(16, generator=g)}


def status(address: str, version: int):
    client = CoordinatorClient(address, timeout=5.0)
    try:
        return client.call(PublishStatus(model="policy", version=version))
    finally:
        client.close()


def in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_version_in_two_parts_appears_only_once_both_are_in(coordinator, transport):
    with Publisher(coordinator.address, "policy", transport=transport, name="rank0",
                   part=0, parts=2) as rank0, \
            Publisher(coordinator.address, "policy", transport=transport, name="rank1",
                      part=1, parts=2) as rank1:
        thread, published = in_background(lambda: rank0.publish(rank_state(0, 1), version=1))
        wait_for(lambda: status(coordinator.address, 1).parts_in == [0], 10, "part 0 is in")
        client = CoordinatorClient(coordinator.address)
        with pytest.raises(CoordinatorError) as err:  # half a version is no version
            client.call(GetManifest(model="policy"))
        assert err.value.code == "unknown_model"
        assert rank1.publish(rank_state(1, 1), version=1) == 1
        thread.join(10)
        assert published == [1]
        assert status(coordinator.address, 1).state == "complete"
        with PartedReplica(coordinator.address, "policy", transport=transport,
                           name="reader") as reader:
            assert reader.pull(timeout=60) == 1
            got = reader.tensors
            want = {**rank_state(0, 1), **rank_state(1, 1)}
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[n], want[n]) for n in want)
            # An engine's front end asks by the reader's name: it holds v1 only whole.
            held = client.call(HoldingsRequest(model="policy", names=["reader"]))
            assert held.holdings == {"reader": [1]}
        client.close()


def test_row_slices_of_one_tensor_are_joined_by_the_reader(coordinator):
    full = torch.arange(10 * 300, dtype=torch.float32).reshape(10, 300)
    with Publisher(coordinator.address, "policy", transport="zmq", name="rank0",
                   part=0, parts=2) as rank0, \
            Publisher(coordinator.address, "policy", transport="zmq", name="rank1",
                      part=1, parts=2) as rank1:
        thread, _ = in_background(lambda: rank0.publish(
            {"embed": full[:4], "a": torch.ones(3)}, version=7, rows={"embed": (0, 10)}))
        rank1.publish({"embed": full[4:], "b": torch.zeros(2)}, version=7,
                      rows={"embed": (4, 10)})
        thread.join(10)
        with PartedReplica(coordinator.address, "policy", transport="zmq") as reader:
            assert reader.pull(timeout=30) == 7
            assert torch.equal(reader.tensors["embed"], full)
            assert torch.equal(reader.tensors["a"], torch.ones(3))


@pytest.mark.parametrize("part0, rows0, part1, rows1, why", [
    ({"a": torch.ones(3)}, {}, {"a": torch.ones(3)}, {}, "'a' is in more than one part"),
    ({"x": torch.zeros(4, 2)}, {"x": (0, 5)}, {"x": torch.zeros(2, 2)}, {"x": (3, 5)},
     "rows 4..3 overlap"),
    ({"x": torch.zeros(2, 2)}, {"x": (0, 5)}, {"x": torch.zeros(2, 2)}, {"x": (3, 5)},
     "rows 2..3 gap"),
])
def test_parts_that_do_not_fit_together_make_no_version(coordinator, part0, rows0, part1,
                                                        rows1, why):
    with Publisher(coordinator.address, "policy", transport="zmq", name="rank0",
                   part=0, parts=2) as rank0, \
            Publisher(coordinator.address, "policy", transport="zmq", name="rank1",
                      part=1, parts=2) as rank1:
        thread, result = in_background(lambda: rank0.publish(part0, version=1, rows=rows0))
        wait_for(lambda: status(coordinator.address, 1).parts_in == [0], 10, "part 0 is in")
        with pytest.raises(CoordinatorError, match=why) as err:
            rank1.publish(part1, version=1, rows=rows1)
        assert err.value.code == "bad_request"
        thread.join(10)
        assert isinstance(result[0], TensorHubError) and result[0].code == "aborted"
        assert status(coordinator.address, 1).state == "aborted"
        assert _models(coordinator.address) == []
        # The next version, with parts that fit, is published as usual.
        thread, result = in_background(lambda: rank0.publish(rank_state(0, 2), version=2))
        assert rank1.publish(rank_state(1, 2), version=2) == 2
        thread.join(10)
        assert result == [2]


def _models(address: str):
    client = CoordinatorClient(address, timeout=5.0)
    try:
        return client.call(StatusRequest()).models
    finally:
        client.close()


RANK1 = """
import sys, threading, torch
from tensorhub import Publisher
from tests.test_sharded import rank_state
pub = Publisher(sys.argv[1], "policy", transport="nixl", name="rank1", part=1, parts=2)
for v in map(int, sys.argv[2:]):
    print("publishing", v, flush=True)
    pub.publish(rank_state(1, v), version=v)
    print("published", v, flush=True)
threading.Event().wait()  # serve until killed
"""


def rank1_process(address: str, *versions: int) -> ChildProcess:
    return ChildProcess([sys.executable, "-c", RANK1, address, *map(str, versions)],
                        name="rank1", cwd=os.path.dirname(os.path.dirname(__file__)))


def said(rank: ChildProcess, timeout: float) -> str:
    """The rank's next line of its own (NIXL logs on stdout too)."""
    deadline = time.monotonic() + timeout
    while True:
        line = rank.next_line(max(0.1, deadline - time.monotonic()))
        if line.startswith("publish"):
            return line


def test_a_rank_that_dies_mid_publish_takes_that_version_away_and_the_next_lands():
    coordinator = CoordinatorProcess().start()
    rank1 = rank1_process(coordinator.address, 1, 2)
    try:
        with Publisher(coordinator.address, "policy", transport="nixl", name="rank0",
                       part=0, parts=2) as rank0, \
                PartedReplica(coordinator.address, "policy", transport="nixl") as reader:
            assert said(rank1, 60) == "publishing 1"
            assert rank0.publish(rank_state(0, 1), version=1) == 1
            assert reader.pull(timeout=60) == 1
            assert said(rank1, 30) == "published 1"
            assert said(rank1, 30) == "publishing 2"
            wait_for(lambda: status(coordinator.address, 2).parts_in == [1], 30,
                     "rank 1's part of v2 is in")
            os.killpg(rank1.pid, signal.SIGKILL)  # rank 1 dies before rank 0 publishes
            wait_for(lambda: status(coordinator.address, 2).state == "aborted", 30,
                     "v2 is given up once rank 1 is forgotten")
            with pytest.raises(TensorHubError, match="given up") as err:
                rank0.publish(rank_state(0, 2), version=2)
            assert err.value.code == "aborted"
            assert reader.pull(timeout=30) == 1  # v1 is still the newest, and still whole
            rank1.stop()
            rank1 = rank1_process(coordinator.address, 3)  # the restarted rank
            assert said(rank1, 60) == "publishing 3"
            assert rank0.publish(rank_state(0, 3), version=3) == 3
            assert reader.pull(timeout=60) == 3
            want = {**rank_state(0, 3), **rank_state(1, 3)}
            assert all(torch.equal(reader.tensors[n], want[n]) for n in want)
    finally:
        rank1.stop()
        coordinator.stop()


def test_a_sharded_version_comes_back_whole_after_a_coordinator_restart():
    coordinator = CoordinatorProcess().start()
    try:
        with Publisher(coordinator.address, "policy", transport="zmq", name="rank0",
                       part=0, parts=2) as rank0, \
                Publisher(coordinator.address, "policy", transport="zmq", name="rank1",
                          part=1, parts=2) as rank1:
            thread, _ = in_background(lambda: rank0.publish(rank_state(0, 4), version=4))
            rank1.publish(rank_state(1, 4), version=4)
            thread.join(10)
            coordinator.kill()
            coordinator.start()
            # Each rank's part comes back with its holder (soft state), as one version.
            wait_for(lambda: status(coordinator.address, 4).state == "complete", 30,
                     "both parts of v4 are re-announced")
            with PartedReplica(coordinator.address, "policy", transport="zmq") as reader:
                assert reader.pull(timeout=30) == 4
                want = {**rank_state(0, 4), **rank_state(1, 4)}
                assert all(torch.equal(reader.tensors[n], want[n]) for n in want)
    finally:
        coordinator.stop()


def test_a_reader_follows_when_the_trainer_changes_how_it_shards(coordinator):
    """One trainer, then two ranks, then two ranks splitting otherwise (one job: the model
    stays its own): the same reader follows each version whole (new buffers where the
    layout changed)."""
    address = coordinator.address
    with PartedReplica(address, "policy", transport="zmq", name="r") as reader, \
            Publisher(address, "policy", transport="zmq", name="t") as one:
        one.publish({**rank_state(0, 1), **rank_state(1, 1)}, version=1)
        assert reader.pull(timeout=30) == 1
        for version, split in ((2, 3), (3, 1)):
            state = {**rank_state(0, version), **rank_state(1, version)}
            names = sorted(state)
            # (the same job: its rank 0 shows the credential of part 0, which the one
            # trainer, still registered, bound)
            ranks = [Publisher(address, "policy", transport="zmq", name=f"rank{r}", part=r,
                               parts=2, owners=one.owners if r == 0 else None)
                     for r in range(2)]
            try:
                first = functools.partial(ranks[0].publish,
                                          {n: state[n] for n in names[:split]}, version)
                thread, _ = in_background(first)
                ranks[1].publish({n: state[n] for n in names[split:]}, version=version)
                thread.join(10)
                assert reader.pull(timeout=30) == version
                assert all(torch.equal(reader.tensors[n], state[n]) for n in names)
            finally:
                for rank in ranks:
                    rank.close()


def test_a_plain_replica_refuses_a_sharded_version_and_says_what_to_use(coordinator):
    from tensorhub import LayoutError, Replica

    with Publisher(coordinator.address, "policy", transport="zmq", name="rank0",
                   part=0, parts=2) as rank0, \
            Publisher(coordinator.address, "policy", transport="zmq", name="rank1",
                      part=1, parts=2) as rank1:
        thread, _ = in_background(functools.partial(rank0.publish, rank_state(0, 1), 1))
        rank1.publish(rank_state(1, 1), version=1)
        thread.join(10)
        with Replica(coordinator.address, "policy", transport="zmq") as plain, \
                pytest.raises(LayoutError, match="PartedReplica"):
            plain.pull(timeout=10)  # part 0 alone would be half a state dict


def _part(client: CoordinatorClient, rank: int, version: int):
    """A raw trainer rank: its worker id, and the Publish and Hold of its part."""
    from tensorhub.core.data_types import Endpoint, Hold, Publish, Register
    from tensorhub.core.layout import BoundLayout, manifest_of

    state = rank_state(rank, version)
    layout = BoundLayout.allocate(manifest_of(state.items()))
    layout.copy_large_from(list(state.values()))
    layout.pack(list(state.values()))
    wid = client.call(Register(name=f"rank{rank}", role="trainer", endpoint=Endpoint(
        transport="zmq", address="tcp://127.0.0.1:1"))).worker_id
    common = dict(worker_id=wid, model="policy", version=version, part=rank, parts=2,
                  manifest=layout.manifest, checksums=layout.checksums(),
                  memory=layout.memory())
    return Publish(**common), Hold(layout_id=layout.layout_id, **common)


@pytest.mark.parametrize("first", ["hold", "publish"])
def test_after_a_restart_mid_publish_the_parts_meet_in_one_version(coordinator, first):
    """The coordinator restarted (this one is fresh) while v5 was being published: rank 1
    had seen it complete and announces its part again (`Hold`); rank 0 was still waiting
    and sends its part again (`Publish`). Whichever comes first, v5 is one version."""
    client = CoordinatorClient(coordinator.address)
    try:
        publish0, _ = _part(client, 0, 5)
        _, hold1 = _part(client, 1, 5)
        if first == "hold":
            client.call(hold1)
            assert status(coordinator.address, 5).state == "pending"
            assert client.call(publish0).complete
        else:
            assert not client.call(publish0).complete
            client.call(hold1)
        assert status(coordinator.address, 5).state == "complete"
        manifest = client.call(GetManifest(model="policy", version=5, part=1))
        assert (manifest.version, manifest.parts) == (5, 2)
    finally:
        client.close()
