"""One checkpoint copy per engine: the ranks of an engine apply a version from rank 0's
copy (`apply_shared`), all of them or none, and a load that fails on one rank is torn on
every rank. Ranks are threads here; the group's broadcast and vote stand in for
`votes.RankVote` (`test_votes.py`)."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorhub import Publisher, TensorHubError
from tensorhub.engines.checkpoint_copy import CheckpointCopy, TornLoad
from tensorhub.engines.shared_copy import SharedCopyReader, apply_shared
from tensorhub_testing.ranks import on_every_rank


class Group:
    """A broadcast from rank 0 and an all-reduce MIN vote, for ranks that are threads."""

    def __init__(self, ranks: int):
        self._barrier = threading.Barrier(ranks)
        self._votes: list[bool] = []
        self._payload = b""

    def _sync(self) -> None:
        self._barrier.wait(timeout=30)

    def broadcast_from(self, rank: int):
        def broadcast(payload: bytes | None) -> bytes:
            if rank == 0:
                self._payload = payload or b""
            self._sync()
            got = self._payload
            self._sync()
            return got
        return broadcast

    def vote(self, ok: bool) -> bool:
        self._votes.append(ok)
        self._sync()
        result = all(self._votes)
        if self._barrier.wait(timeout=30) == 0:
            self._votes.clear()
        self._sync()
        return result


def apply_on_both(holder, version: int, failure_on_rank1: Exception | None = None,
                  load_fails_on_rank1: bool = False):
    """Each rank applies `version` in a thread; returns (loaded tensors, error) per rank."""
    group, results = Group(2), [None, None]

    def run(rank: int) -> None:
        loaded: dict[str, torch.Tensor] = {}

        def load(named) -> None:
            loaded.update({n: t.clone() for n, t in named})
            if rank == 1 and load_fails_on_rank1:
                raise RuntimeError("load_weights: a bug half-way")

        try:
            apply_shared(version, load, group.broadcast_from(rank), group.vote,
                checkpoint=holder if rank == 0 else None,
                reader=SharedCopyReader() if rank == 1 else None,
                failure=failure_on_rank1 if rank == 1 else None)
            results[rank] = (loaded, None)
        except Exception as exc:
            results[rank] = (loaded, exc)

    on_every_rank(run, 2, timeout=60)
    return results


@pytest.fixture
def holder_of_v1(coordinator):
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    holder = CheckpointCopy(coordinator.address, "policy", "engine-rank0", transport="zmq",
                            follow=False)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        holder.pull(1)
        yield holder, state
    holder.close()


def test_every_rank_loads_the_version_from_rank_0s_copy(holder_of_v1):
    holder, state = holder_of_v1
    (rank0, error0), (rank1, error1) = apply_on_both(holder, 1)
    assert error0 is None and error1 is None
    for loaded in (rank0, rank1):
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[n], state[n]) for n in state)
    assert holder.applied == 1


def test_a_rank_that_cannot_apply_makes_every_rank_keep_its_weights(holder_of_v1):
    holder, _ = holder_of_v1
    (rank0, error0), (rank1, error1) = apply_on_both(
        holder, 1, failure_on_rank1=RuntimeError("its live parameters are still being read"))
    assert rank0 == {} and rank1 == {}  # nothing loaded anywhere
    assert isinstance(error0, TensorHubError) and error0.code == "refused"
    assert "still being read" in str(error1)
    assert holder.refused == 1 and holder.applied is None  # the copy may move on


def test_a_load_that_fails_on_one_rank_is_torn_on_every_rank(holder_of_v1):
    holder, _ = holder_of_v1
    (_, error0), (_, error1) = apply_on_both(holder, 1, load_fails_on_rank1=True)
    assert isinstance(error0, TornLoad) and isinstance(error1, TornLoad)
    assert "bug half-way" in str(error1) and "another rank" in str(error0)
    assert holder.applied is None and holder.refused == 1


def test_an_engine_on_several_nodes_keeps_one_copy_per_node():
    """Each node's lowest rank holds its copy (ranks are placed on nodes in consecutive
    blocks); with one rank per node every rank keeps its own, which is its node's."""
    from tensorhub.engines.shared_copy import copy_holders, node_of, one_copy_per_engine

    assert one_copy_per_engine(2) and one_copy_per_engine(4, nodes=2)
    assert not one_copy_per_engine(2, nodes=2)  # one rank per node: a copy each anyway
    assert copy_holders(4) == [0] and copy_holders(4, 2) == [0, 2]
    assert copy_holders(16, 2) == [0, 8] and copy_holders(2, 2) == [0, 1]
    assert node_of(3, 4, 2) == [2, 3] and node_of(1, 4, 2) == [0, 1]
    assert node_of(1, 4) == [0, 1, 2, 3]


def test_the_tp_ranks_of_a_pipeline_stage_share_one_copy_on_each_node():
    """Ranks are numbered stage by stage: PP=2 x TP=2 on one host keeps a copy per stage
    (ranks 0 and 2 hold them), on two hosts one per host, which is its stage's; a stage of
    TP=4 over two hosts keeps one on each host; one rank per node and stage keeps its own."""
    from tensorhub.engines.shared_copy import copy_holders, node_of, one_copy_per_engine

    assert one_copy_per_engine(4, stages=2) and copy_holders(4, stages=2) == [0, 2]
    assert node_of(3, 4, stages=2) == [2, 3] and node_of(1, 4, stages=2) == [0, 1]
    assert copy_holders(4, nodes=2, stages=2) == [0, 2]
    assert copy_holders(8, nodes=2, stages=4) == [0, 2, 4, 6]  # (two stages a host)
    assert copy_holders(8, nodes=4, stages=2) == [0, 2, 4, 6]  # (a stage over two hosts)
    assert node_of(5, 8, nodes=4, stages=2) == [4, 5]
    assert not one_copy_per_engine(2, stages=2) and copy_holders(2, stages=2) == [0, 1]
    assert not one_copy_per_engine(4, nodes=2, stages=4)


def test_every_rank_on_two_nodes_loads_the_version_from_its_nodes_copy(coordinator):
    """TP=4 on two nodes: ranks 0 and 2 each pull and hold their node's copy, ranks 1 and 3
    load from it (a broadcast among the node's ranks), and all four vote as one engine."""
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    nodes = [Group(2), Group(2)]
    engine = Group(4)
    results: list = [None] * 4
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        holders = {r: CheckpointCopy(coordinator.address, "policy", f"engine-rank{r}",
                                     transport="zmq", follow=False) for r in (0, 2)}
        try:
            for holder in holders.values():
                holder.pull(1)

            def run(rank: int) -> None:
                loaded: dict[str, torch.Tensor] = {}
                try:
                    apply_shared(1, lambda named: loaded.update(
                                     {n: t.clone() for n, t in named}),
                                 nodes[rank // 2].broadcast_from(rank % 2), engine.vote,
                                 checkpoint=holders.get(rank),
                                 reader=None if rank in holders else SharedCopyReader())
                    results[rank] = (loaded, None)
                except Exception as exc:
                    results[rank] = (loaded, exc)

            on_every_rank(run, 4, timeout=60)
        finally:
            for holder in holders.values():
                holder.close()
    for loaded, error in results:
        assert error is None
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[n], state[n]) for n in state)
    assert all(holder.applied == 1 for holder in holders.values())


def test_an_sglang_engine_shares_copies_from_its_own_server_arguments():
    """SGLang's TP ranks share a copy per node; under its pipeline stages every rank keeps
    its own (the plugin knows a rank by its TP rank alone)."""
    from types import SimpleNamespace

    from tensorhub_plugins.sglang.copies import one_copy_per_engine

    assert one_copy_per_engine(SimpleNamespace(tp_size=2, pp_size=1, nnodes=1))
    assert one_copy_per_engine(SimpleNamespace(tp_size=4, pp_size=None, nnodes=2))
    assert not one_copy_per_engine(SimpleNamespace(tp_size=2, pp_size=1, nnodes=2))
    assert not one_copy_per_engine(SimpleNamespace(tp_size=4, pp_size=2, nnodes=1))
