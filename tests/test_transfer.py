"""Publisher -> Replica pulls in one process, over each transport: bytes, versions, failures."""

import pytest
import torch

from tensorhub import IntegrityError, Publisher, Replica
from tensorhub.tools.synthetic_weights import synthetic_state_dict


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_replica_pulls_a_version_bit_exact_and_then_serves_it(coordinator, transport):
    state = synthetic_state_dict(4, n_tiny=50, seed=1)
    with Publisher(coordinator.address, "policy", transport=transport) as pub, \
            Replica(coordinator.address, "policy", transport=transport, name="first") as first, \
            Replica(coordinator.address, "policy", transport=transport, name="second") as second:
        version = pub.publish(state)
        assert first.pull(timeout=30) == version
        assert _equal(first.tensors, state)
        pub.release()  # the trainer stops serving: the second must read from the first
        assert second.pull(timeout=30) == version
        assert _equal(second.tensors, state)
        assert second.last_pull.sources == ["first"]


def test_mixed_dtypes_survive_compaction(coordinator, transport):
    state = {
        "a": torch.randn(7).to(torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(600, 600),  # large
        "e": torch.randn(3, 3, dtype=torch.float16),
    }
    with Publisher(coordinator.address, "m", transport=transport) as pub, \
            Replica(coordinator.address, "m", transport=transport) as rep:
        pub.publish(state)
        rep.pull(timeout=30)
        assert _equal(rep.tensors, state)


def test_successive_versions_replace_the_replica_buffers_in_place(coordinator, transport):
    state = synthetic_state_dict(2, n_tiny=20, seed=2)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in live.items()}
    with Publisher(coordinator.address, "policy", transport=transport) as pub, \
            Replica(coordinator.address, "policy", live, transport=transport) as rep:
        for _ in range(3):
            for t in state.values():
                t.add_(1.0)
            v = pub.publish(state)
            assert rep.pull(timeout=30) == v
            assert _equal(live, state)  # the caller's own tensors hold the new version
        assert {k: v.data_ptr() for k, v in live.items()} == pointers


def test_torn_bytes_are_refused_and_a_staged_replica_stays_on_its_version(coordinator,
                                                                           transport):
    # A zero-copy trainer that breaks its promise (writes before release) serves torn bytes.
    state = synthetic_state_dict(2, n_tiny=20, seed=3)
    with Publisher(coordinator.address, "policy", transport=transport, zero_copy=True) as pub, \
            Replica(coordinator.address, "policy", transport=transport, staging=True) as rep:
        v1 = pub.publish(state)
        rep.pull(timeout=30)
        expected = {k: t.clone() for k, t in rep.tensors.items()}
        pub.release()
        pub.publish({k: t + 1 for k, t in state.items()})
        big = next(k for k in state if k.startswith("big"))
        pub._layout.tensors[list(state).index(big)].mul_(-1)  # overwritten behind our back
        with pytest.raises(IntegrityError, match="checksum"):
            rep.pull(timeout=30)
        assert rep.version == v1
        assert _equal(rep.tensors, expected)


def test_an_in_place_replica_whose_pull_fails_holds_nothing(coordinator, transport):
    state = synthetic_state_dict(2, n_tiny=20, seed=4)
    with Publisher(coordinator.address, "policy", transport=transport, zero_copy=True) as pub, \
            Replica(coordinator.address, "policy", transport=transport) as rep:
        pub.publish(state)
        rep.pull(timeout=30)
        pub.publish({k: t * 2 for k, t in state.items()})
        pub._layout.item_bytes[-1].fill_(7)
        with pytest.raises(IntegrityError):
            rep.pull(timeout=30)
        assert rep.version is None


def test_a_striped_reader_takes_each_stripe_from_a_different_holder(transport):
    from tensorhub.coordinator.planner import PlannerConfig
    from tensorhub.coordinator.server import Coordinator, CoordinatorConfig

    config = CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.2,
                               planner=PlannerConfig(chunk_bytes=256 << 10))  # ~32 chunks
    coordinator = Coordinator(config).start()
    state = synthetic_state_dict(8, n_tiny=20, seed=3)
    try:
        with Publisher(coordinator.address, "policy", transport=transport,
                       name="trainer") as pub, \
                Replica(coordinator.address, "policy", transport=transport,
                        name="first") as first, \
                Replica(coordinator.address, "policy", transport=transport,
                        name="second") as second, \
                Replica(coordinator.address, "policy", transport=transport,
                        name="third") as third:
            version = pub.publish(state)
            assert first.pull(timeout=30) == version
            # a reader that comes once a replica holds it reads from that one, not from
            # the trainer a second time
            assert second.pull(timeout=30) == version
            assert set(second.last_pull.sources) == {"first"}
            assert third.pull(timeout=30) == version
            assert _equal(third.tensors, state)
            # one stripe from each replica; every byte read once, from one of them
            assert set(third.last_pull.sources) == {"first", "second"}
            assert sum(third.last_pull.by_source.values()) == \
                sum(b.numel() for b in third.layout.item_bytes)
    finally:
        coordinator.stop()
