"""An engine's checkpoint copies, one per rank: a version is applied on every rank or on
none (the ranks vote before any touches its weights), and a copy is replaced only once its
version was applied, refused or let go, never after a time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorhub import Publisher, TensorHubError
from tensorhub.core.errors import IntegrityError
from tensorhub.engines.checkpoint_copy import (
    CheckpointCopy,
    TornLoad,
    versions_to_release,
)
from tensorhub_testing.ranks import on_every_rank
from tensorhub_testing.waits import wait_for


class Vote:
    """What an all-reduce MIN over the engine's ranks gives, for ranks that are threads."""

    def __init__(self, ranks: int):
        self._barrier = threading.Barrier(ranks)
        self._votes: list[bool] = []

    def __call__(self, ok: bool) -> bool:
        self._votes.append(ok)
        self._barrier.wait()
        result = all(self._votes)
        if self._barrier.wait() == 0:
            self._votes.clear()
        self._barrier.wait()  # cleared before any rank votes again
        return result


def apply_on_every_rank(holders, version: int, weights: list[dict]) -> list[str | None]:
    """Each rank applies `version` to its weights in a thread of its own, as an engine's
    workers do; returns each rank's error code (None: applied)."""
    vote, codes = Vote(len(holders)), [None] * len(holders)

    def apply(rank: int) -> None:
        try:
            with holders[rank].tensors_of(version, vote) as named:
                weights[rank].update({n: t.clone() for n, t in named})
        except TensorHubError as exc:
            codes[rank] = exc.code

    on_every_rank(apply, len(holders))
    return codes


def refusing(holder: CheckpointCopy, refused: int) -> None:
    """Make `holder`'s copy refuse version `refused`, as a copy that failed verification."""
    not_ready = holder._not_ready

    def check(version: int, *args):
        if version == refused:
            return TensorHubError(f"refusing v{version}", code="refused")
        return not_ready(version, *args)

    holder._not_ready = check


def test_a_version_one_rank_refuses_is_applied_on_no_rank(coordinator):
    states = {v: {"w": torch.full((8, 8), float(v))} for v in (1, 2, 3)}
    holders = [CheckpointCopy(coordinator.address, "policy", f"engine-rank{r}",
                              transport="zmq", follow=False) for r in range(2)]
    refusing(holders[1], 2)  # rank 1's copy of v2 "fails verification"
    weights: list[dict] = [{}, {}]
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            for version, codes in ((1, [None, None]), (2, ["refused", "refused"]),
                                   (3, [None, None])):
                pub.publish(states[version])
                for h in holders:
                    assert h.pull(version) == version
                assert apply_on_every_rank(holders, version, weights) == codes
                served = 1 if version == 2 else version  # v2 refused: both stay on v1
                assert all(torch.equal(w["w"], states[served]["w"]) for w in weights)
    finally:
        for h in holders:
            h.close()


def test_a_rank_without_the_version_makes_every_rank_refuse_it(coordinator):
    holders = [CheckpointCopy(coordinator.address, "policy", f"engine-rank{r}",
                              transport="zmq", follow=False) for r in range(2)]
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            pub.publish({"w": torch.ones(4)})
            holders[0].pull(1)  # rank 1 never pulled it
            codes = apply_on_every_rank(holders, 1, [{}, {}])
            assert codes == ["refused", "unknown_version"]
            assert holders[0].applied is None and holders[1].applied is None
    finally:
        for h in holders:
            h.close()


def test_a_followed_copy_keeps_an_unapplied_version_until_the_engine_lets_it_go(coordinator):
    holder = CheckpointCopy(coordinator.address, "policy", "engine-rank0", transport="zmq")
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            pub.publish({"w": torch.ones(4)})
            wait_for(lambda: holder.version == 1, what="v1 held")
            pub.publish({"w": torch.full((4,), 2.0)})
            time.sleep(1.5)  # the follow loop hears of v2 within its 1 s wait, and waits
            assert holder.version == 1  # v1 may still be applied: it stays
            holder.release(1)
            wait_for(lambda: holder.version == 2, what="v2 held")
            assert holder.refused == 1 and holder.applied is None
    finally:
        holder.close()


def test_a_version_the_engine_fails_to_load_is_refused_so_the_copy_moves_on(coordinator):
    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            pub.publish({"w": torch.ones(4)})
            holder.pull(1)
            with pytest.raises(RuntimeError, match="shape"), holder.tensors_of(1):
                raise RuntimeError("the engine's load_weights: wrong shape")
            assert holder.refused == 1 and holder.applied is None
    finally:
        holder.close()


def test_a_version_is_let_go_only_where_another_rank_holds_a_newer_one():
    assert versions_to_release({"r0": [5], "r1": [6]}, serving=4) == {5}
    assert versions_to_release({"r0": [5], "r1": [5]}, serving=4) == set()
    assert versions_to_release({"r0": [5], "r1": []}, serving=4) == set()  # r1 is pulling
    assert versions_to_release({"r0": [4], "r1": [5]}, serving=4) == set()  # v4 is served
    assert versions_to_release({"r0": [5], "r1": [7], "r2": [6]}, serving=None) == {5, 6}


def test_a_load_that_fails_on_one_rank_is_torn_on_every_rank(coordinator):
    """Both ranks voted yes, then rank 1's load failed half-way: neither records the
    version as applied, and both hear of it (`TornLoad`), so both restore."""
    holders = [CheckpointCopy(coordinator.address, "policy", f"engine-rank{r}",
                              transport="zmq", follow=False) for r in range(2)]
    vote, errors = Vote(2), [None, None]

    def apply(rank: int) -> None:
        try:
            with holders[rank].tensors_of(1, vote):
                if rank == 1:
                    raise RuntimeError("load_weights: a bug half-way")
        except TornLoad as exc:
            errors[rank] = str(exc)

    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            pub.publish({"w": torch.ones(4)})
            for h in holders:
                h.pull(1)
            on_every_rank(apply, 2)
            assert errors == ["loading v1 failed half-way on another rank of this engine",
                              "loading v1 failed half-way: load_weights: a bug half-way"]
            assert [h.applied for h in holders] == [None, None]
    finally:
        for h in holders:
            h.close()


def test_a_restore_pulls_the_version_served_before_from_peers(coordinator):
    """The copy holds v2 (whose load failed); the engine restores v1, which it no longer
    holds: `fetch` pulls it back from a peer that does."""
    v1, v2 = torch.ones(4), torch.full((4,), 2.0)
    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    peer = CheckpointCopy(coordinator.address, "policy", "peer", transport="zmq",
                          follow=False)
    try:
        with Publisher(coordinator.address, "policy", transport="zmq",
                       min_replicas=0) as pub:  # (nobody else need keep v2 when it leaves)
            pub.publish({"w": v1})
            peer.pull(1)
            pub.publish({"w": v2})  # (the trainer keeps v2 only: v1 is the peer's alone)
            holder.pull(2)
            with holder.tensors_of(1, fetch=True) as named:
                assert torch.equal(dict(named)["w"], v1)
            assert holder.version == 1 and holder.applied == 1
            assert holder.sources() == ["peer"]
    finally:
        holder.close()
        peer.close()


def test_bytes_changed_in_the_copy_after_its_pull_are_never_applied(coordinator):
    """What is applied is what was verified: a byte written into the copy after the pull
    (a peer's one-sided WRITE, a late read) is caught just before the engine reads it."""
    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            pub.publish({"w": torch.ones(1024)})
            holder.pull(1)
            holder.replica.replicas[0].layout.item_bytes[0][7] ^= 0xFF  # the "remote write"
            with pytest.raises(IntegrityError), holder.tensors_of(1):
                pytest.fail("tampered bytes were handed to the engine")
            assert holder.applied is None and holder.version is None
            holder.pull(1)  # pulled again, whole, from the trainer
            with holder.tensors_of(1) as tensors:
                assert torch.equal(dict(tensors)["w"], torch.ones(1024))
    finally:
        holder.close()
