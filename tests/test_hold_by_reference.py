"""A reader that pulled a layout the coordinator planned names it by id alone when it holds
it (`Hold.by_reference`): the manifest and checksums, most of what the coordinator decodes
of a `Hold`, it already has. It sends them only where the coordinator lost the layout."""

from __future__ import annotations

import torch

from tensorhub import Publisher, Replica
from tensorhub.core.data_types import Hold
from tensorhub.core.errors import CoordinatorError
from tensorhub_testing.status import coordinator_status

STATE = {f"layer{i}.w": torch.full((64, 64), float(i)) for i in range(8)}


def _holds_sent(rep: Replica, refuse_first: str | None = None,
                other_digest: bool = False) -> list[Hold]:
    """The `Hold`s `rep` sends from now on; `refuse_first`: the coordinator's answer to
    the first one sent by reference, as a coordinator restarted since the plan answers;
    `other_digest`: that first one says it was verified against other checksums (as after
    a version's record was made again with the same layout id and other bytes)."""
    sent: list[Hold] = []
    call = rep.session.client.call

    def spy(request, timeout=None):
        if isinstance(request, Hold):
            if other_digest and request.manifest is None and not sent:
                request = request.model_copy(update={"checksums_digest": "0" * 16})
            sent.append(request)
            if refuse_first and request.manifest is None and len(sent) == 1:
                raise CoordinatorError(f"model 'policy' has no version {request.version}",
                                       code=refuse_first)
        return call(request, timeout)

    rep.session.client.call = spy
    return sent


def _holders(address: str, version: int) -> set[str]:
    return {h.name for m in coordinator_status(address).models if m.model == "policy"
            for v in m.versions if v.version == version for h in v.holders}


def test_a_reader_names_the_layout_it_pulled_by_id_alone(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="first") as first:
        sent = _holds_sent(first)
        pub.publish(STATE)
        assert first.pull(timeout=30) == 1
        assert [(h.version, h.manifest, h.checksums) for h in sent] == [(1, None, None)]
        assert "first" in _holders(coordinator.address, 1)
        # ... and the coordinator serves it as a holder like any
        with Replica(coordinator.address, "policy", transport="zmq", name="second") as second:
            assert second.pull(timeout=30) == 1
            assert all(torch.equal(second.tensors[n], t) for n, t in STATE.items())


def test_a_coordinator_that_lost_the_version_is_told_it_in_full(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="first") as first:
        sent = _holds_sent(first, refuse_first="unknown_version")
        pub.publish(STATE)
        assert first.pull(timeout=30) == 1
        assert [h.manifest is None for h in sent] == [True, False]
        assert sent[1].manifest == first.layout.manifest and sent[1].checksums is not None
        assert "first" in _holders(coordinator.address, 1)


def test_a_hold_by_reference_verified_against_other_checksums_is_told_in_full(coordinator):
    """The layout id names a manifest, not its bytes: the coordinator compares the digest
    of the checksums too, and a mismatch is answered so that the full Hold is compared."""
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="first") as first:
        sent = _holds_sent(first, other_digest=True)
        pub.publish(STATE)
        assert first.pull(timeout=30) == 1
        assert [h.manifest is None for h in sent] == [True, False]
        assert sent[0].checksums_digest == "0" * 16 and sent[1].checksums is not None
        assert "first" in _holders(coordinator.address, 1)
