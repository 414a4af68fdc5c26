"""What an engine asks the coordinator (`engines.fleet`): its workers' holdings, the newest
version, and who holds which version in a layout, by layout id."""

from __future__ import annotations

import torch

from tensorhub import Publisher, Replica
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD
from tensorhub.engines import FleetView, layout_labels


def test_holdings_latest_and_manifests(coordinator):
    fleet = FleetView.connect(coordinator.address, "policy")
    try:
        assert fleet.latest() == 0
        with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
                Replica(coordinator.address, "policy", transport="zmq", name="engine") as r:
            pub.publish({"w": torch.ones(4)})
            r.pull(timeout=10)
            pub.publish({"w": torch.full((4,), 2.0)})
            held = fleet.holdings(["engine", "absent"])
            assert (held.latest, held.held) == (2, {"engine": [1], "absent": []})
            assert held.common() is None and fleet.holdings(["engine"]).common() == 1
            assert [t.name for t in fleet.manifests(2)[0].tensors] == ["w"]
    finally:
        fleet.close()


def test_who_serves_a_layout_is_known_by_its_id_not_by_names(coordinator):
    compact = DEFAULT_COMPACT_THRESHOLD  # the publisher's: b pulls from it
    labels = layout_labels([("w", torch.zeros(4))], compact)
    fleet = FleetView.connect(coordinator.address, "policy")
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
                Replica(coordinator.address, "policy", [("w", torch.zeros(4))],
                        transport="zmq", name="a", labels=labels) as a, \
                Replica(coordinator.address, "policy", [("w", torch.zeros(4))],
                        transport="zmq", name="b") as b:
            assert labels["layout"] == a.layout.layout_id == b.layout.layout_id
            peers = fleet.in_layout(a.layout.layout_id)
            assert peers.held == {"a": []}  # registered as serving it, holding nothing
            assert peers.others(["b"]) and not peers.others(["a"])
            pub.publish({"w": torch.ones(4)})
            b.pull(timeout=10)
            peers = fleet.in_layout(a.layout.layout_id)
            assert peers.held == {"a": [], "b": [1], pub.session.name: [1]}
            assert peers.held_by_others(1, ["a"]) and not peers.held_by_others(1, ["b", "trainer"])
    finally:
        fleet.close()


def test_a_front_end_is_woken_by_the_announcement_of_a_version(coordinator):
    """`news` waits for the coordinator's announcement of the model (what follow mode
    sleeps on): a publish wakes it; with nothing published it waits its whole timeout."""
    import asyncio

    fleet = FleetView.connect(coordinator.address, "policy")
    try:
        assert fleet.latest() == 0  # (the first holdings names the announcement address)

        async def publish_while_waiting(pub: Publisher) -> bool:
            waiting = asyncio.create_task(fleet.news(60.0))
            for k in range(20):  # (until the new subscription is connected and hears one)
                await asyncio.to_thread(pub.publish, {"w": torch.full((4,), float(k))})
                done, _ = await asyncio.wait([waiting], timeout=0.5)
                if done:
                    break
            return await waiting

        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            assert asyncio.run(publish_while_waiting(pub)) is True
            assert asyncio.run(fleet.news(0.3)) is False
    finally:
        fleet.close()
