"""Patches: a version made from the one before by its exact changes, pulled, applied,
verified and served like version data; whole versions wherever a patch cannot serve."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tensorhub.publisher
import tensorhub.replica
from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import Manifest, TensorSpec
from tensorhub.core.errors import TransferError
from tensorhub.core.patch import (
    GAP_MAX,
    PatchError,
    PatchWriter,
    apply_patch,
    base_of,
    decode_changes,
    encode_changes,
    patch_model,
    patch_tensor_name,
)
from tensorhub.core.patch_budget import PatchCosts, Rate
from tensorhub.reader.patches import Link, PatchPuller, choose_chain


@pytest.fixture(autouse=True)
def across_a_wan(monkeypatch):
    """Every worker here weighs patches as if its readers sat across a 20 Mbit/s WAN, where
    a sparse step's patch pays: what these tests pin is how patches move, not whether one
    pays on this host's loopback (`test_patch_budget.py` pins that)."""
    def wan_costs() -> PatchCosts:
        return PatchCosts(pull_s_per_byte=Rate.known(8 / 20e6))
    monkeypatch.setattr(tensorhub.publisher, "PatchCosts", wan_costs)
    monkeypatch.setattr(tensorhub.replica, "PatchCosts", wan_costs)


def sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: checksum(t) for n, t in tensors.items()}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {f"layer{i}.weight": (torch.randn(768, 1024, generator=g) * 0.02).to(torch.bfloat16)
         for i in range(4)}
    w["norm.weight"] = torch.ones(1024, dtype=torch.bfloat16)  # compacted (tiny)
    w["odd.bias"] = torch.zeros(3, dtype=torch.uint8)
    return w


def step(w: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Change `density` of every tensor's elements by about one bf16 step, in place."""
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        if t.dtype == torch.bfloat16:
            changed = torch.rand(t.shape, generator=g) < density
            t[changed] = (t[changed].float() * 1.01 + 1e-3).to(torch.bfloat16)


def zeros_like(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in w.items()}


@contextlib.contextmanager
def trainer_and_reader(address: str, w: dict[str, torch.Tensor],
                       **replica: object) -> Iterator[tuple[Publisher, Replica]]:
    """A trainer that published `w` as v1 and a replica (zmq) that pulled it."""
    with Publisher(address, "policy", transport="zmq") as pub, \
            Replica(address, "policy", zeros_like(w), name="r", transport="zmq",
                    **replica) as r:
        pub.publish(w)
        r.pull(1)
        yield pub, r


# ------------------------------------------------------------------ the encoding


def _patch(old: list[torch.Tensor], new: list[torch.Tensor]) -> bytes:
    writer = PatchWriter(1, 2, "L")
    for k, (a, b) in enumerate(zip(old, new, strict=True)):
        writer.item(k, a, b)
    return writer.finish()


def test_a_patch_gives_the_new_bytes_exactly_across_long_gaps_and_odd_items():
    g = torch.Generator().manual_seed(0)
    old = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
           for n in (8 * GAP_MAX + 10, 1 << 20, 5)]
    new = [t.clone() for t in old]
    new[0].view(torch.int16)[[0, 1, 3 * GAP_MAX + 2]] ^= 0x0101  # gaps over GAP_MAX words
    new[1].view(torch.int16)[torch.randperm(1 << 19, generator=g)[:5000]] += 1
    new[2][4] ^= 0xFF  # an odd-sized item changes bytes, not words
    patched = [t.clone() for t in old]
    assert apply_patch(_patch(old, new), patched, base=1, layout_id="L") == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(patched, new, strict=True))


def test_an_unchanged_version_is_a_patch_of_no_items():
    old = [torch.arange(100, dtype=torch.uint8)]
    patch = _patch(old, [old[0].clone()])
    assert apply_patch(patch, [old[0].clone()], base=1, layout_id="L") == []
    assert len(patch) < 64


@pytest.mark.parametrize("base,layout", [(2, "L"), (1, "other")])
def test_a_patch_for_other_bytes_is_refused_before_any_byte_changes(base, layout):
    old = [torch.zeros(1000, dtype=torch.uint8)]
    new = [torch.ones(1000, dtype=torch.uint8)]
    target = [old[0].clone()]
    with pytest.raises(PatchError, match="the patch is from v1 in layout L"):
        apply_patch(_patch(old, new), target, base=base, layout_id=layout)
    assert torch.equal(target[0], old[0])


@pytest.mark.parametrize("damage", ["truncated", "trailing", "magic", "header"])
def test_a_malformed_patch_is_refused_before_any_byte_changes(damage):
    old = [torch.zeros(1000, dtype=torch.uint8)]
    new = [old[0].clone()]
    new[0][::7] = 3
    patch = _patch(old, new)
    bad = {"truncated": patch[:-5], "trailing": patch + b"x", "magic": b"XXXX" + patch[4:],
           "header": patch[:8] + b"\xff" * 8 + patch[16:]}[damage]
    target = [old[0].clone()]
    with pytest.raises(PatchError):
        apply_patch(bad, target, base=1, layout_id="L")
    assert torch.equal(target[0], old[0])


def test_a_patch_that_points_outside_its_item_is_refused():
    old = [torch.zeros(64, dtype=torch.uint8)]
    new = [old[0].clone()]
    new[0][-2:] = 1  # the last word
    patch = _patch(old, new)
    with pytest.raises(PatchError, match="changes word 31 of 16"):
        apply_patch(patch, [torch.zeros(32, dtype=torch.uint8)], base=1, layout_id="L")


def test_a_patch_of_one_percent_of_bf16_words_is_under_two_percent_of_the_bytes():
    w = weights()
    old = {n: t.clone() for n, t in w.items()}
    step(w, 0.01, seed=1)
    writer = PatchWriter(1, 2, "L")
    for k, n in enumerate(w):
        writer.item(k, old[n].view(-1).view(torch.uint8), w[n].view(-1).view(torch.uint8))
    total = sum(t.numel() * t.element_size() for t in w.values())
    assert 0.009 < writer.density < 0.011
    assert len(writer.finish()) < 0.02 * total


def test_a_patch_versions_manifest_names_its_base():
    spec = TensorSpec(name=patch_tensor_name(41), dtype="uint8", shape=[10], nbytes=10)
    assert base_of(Manifest(tensors=[spec], compact_threshold=1 << 20)) == 41
    other = spec.model_copy(update={"name": "w"})
    assert base_of(Manifest(tensors=[other], compact_threshold=1 << 20)) is None
    assert patch_model("policy") == "policy.patch"


# ------------------------------------------------------------------ which chain


def _links(*pairs: tuple[int, int, int]) -> dict[int, Link]:
    spec = TensorSpec(name="p", dtype="uint8", shape=[1], nbytes=1)
    return {v: Link(v, b, Manifest(tensors=[spec.model_copy(update={"shape": [n], "nbytes": n})],
                                   compact_threshold=1 << 20))
            for v, b, n in pairs}


def test_a_chain_leads_from_the_held_version_to_the_target_oldest_first():
    links = _links((4, 3, 10), (3, 2, 10), (2, 1, 10))
    assert [link.version for link in choose_chain(2, 4, links, 1000)] == [3, 4]


def test_a_chain_longer_than_retention_or_heavier_than_the_version_is_not_taken():
    links = _links((5, 4, 10), (4, 3, 10), (3, 2, 10), (2, 1, 10))
    assert choose_chain(1, 5, links, 1000, keep=3) is None
    assert choose_chain(3, 5, links, 1000, max_ratio=0.01) is None  # 20 bytes > 10
    assert choose_chain(3, 5, _links((5, 2, 10)), 1000) is None  # the chain passes us by


# ------------------------------------------------------------------ pulls


def test_readers_take_each_version_as_a_patch_bit_exact_and_serve_it(coordinator, transport):
    w = weights()
    with Publisher(coordinator.address, "policy", transport=transport) as pub, \
            Replica(coordinator.address, "policy", zeros_like(w), name="a",
                    transport=transport) as a, \
            Replica(coordinator.address, "policy", zeros_like(w), name="b",
                    transport=transport) as b:
        pub.publish(w)
        assert a.pull(1) == 1 and b.pull(1) == 1
        step(w, 0.01, seed=2)
        pub.publish(w)
        for r in (a, b):
            assert r.pull(2) == 2
            assert r.last_pull_patches == [2]
            assert r.last_pull.nbytes == pub.last_patch.nbytes
            assert sums(r.tensors) == sums(w)
        holders = coordinator.table.models[patch_model("policy")].versions[2]
        names = {coordinator.table.workers[h].name for lr in holders.layouts.values()
                 for h in lr.holders}
        assert {"a", "b"} <= {n.rsplit("-", 1)[0] for n in names}


def test_a_reader_that_missed_a_version_follows_two_patches(coordinator):
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        for seed in (3, 4):
            step(w, 0.01, seed=seed)
            pub.publish(w)
        assert r.pull() == 3
        assert r.last_pull_patches == [2, 3] and sums(r.tensors) == sums(w)


def test_a_chain_longer_than_retention_pulls_the_version_whole(coordinator):
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        for seed in range(5, 9):  # v2..v5: the trainer keeps the patches of v3..v5
            step(w, 0.01, seed=seed)
            pub.publish(w)
        assert r.pull() == 5
        assert r.last_pull_patches == [] and r.last_pull.nbytes == r.layout.nbytes
        assert sums(r.tensors) == sums(w)


def test_a_dense_step_publishes_no_patch_and_readers_pull_it_whole(coordinator):
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        step(w, 0.9, seed=9)
        pub.publish(w)
        assert pub.last_patch is None
        assert r.pull(2) == 2 and r.last_pull_patches == [] and sums(r.tensors) == sums(w)


@pytest.mark.parametrize("staging", [False, True])
def test_a_patch_made_from_other_bytes_is_refused_and_the_version_pulled_whole(
        coordinator, staging):
    """The trainer's copy of v1 was damaged after readers took it: its patch to v2 is made
    from those bytes, so applied to the true v1 it gives bytes v2's checksums refuse."""
    w = weights()
    with trainer_and_reader(coordinator.address, w, staging=staging) as (pub, r):
        pub._layout.item_bytes[1][:2] ^= 0x55  # the base it diffs against is not v1
        step(w, 0.01, seed=10)
        pub.publish(w)
        assert pub.last_patch is not None and pub.last_patch.version == 2
        assert r.pull(2) == 2
        assert r.last_pull_patches == [] and sums(r.tensors) == sums(w)


def test_a_patch_whose_holder_fails_mid_read_leaves_the_version_pulled_whole(
        coordinator, monkeypatch):
    """Stands in for the peer serving the patch dying mid-read (its real death is the
    failover tests' subject): the patch pull fails, the version is pulled whole."""
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        step(w, 0.01, seed=11)
        pub.publish(w)

        def dies(self, link, deadline):
            raise TransferError("the holder of the patch stopped answering")

        monkeypatch.setattr(PatchPuller, "pull", dies)
        assert r.pull(2) == 2
        assert r.last_pull_patches == [] and sums(r.tensors) == sums(w)
        assert r.version == 2


def test_patches_off_moves_every_version_whole(coordinator, monkeypatch):
    monkeypatch.setenv("TENSORHUB_PATCHES", "0")
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        step(w, 0.01, seed=12)
        pub.publish(w)
        assert pub.last_patch is None and patch_model("policy") not in coordinator.table.models
        assert r.pull(2) == 2 and r.last_pull_patches == [] and sums(r.tensors) == sums(w)


def test_the_patch_bytes_decode_the_same_as_numpy_sees_them():
    """The encoder's gap planes are plain little-endian uint16: a reader on any host
    decodes them the same."""
    positions = np.array([0, 70000, 70001], dtype=np.int64)
    entries, payload = encode_changes(positions, np.array([1, 2, 3], dtype=np.uint16))
    got, xor = decode_changes(payload, entries, 2, 70002)
    assert entries == 4  # one filler bridges the gap of 70000
    assert list(got[xor != 0]) == [0, 70000, 70001] and list(xor[xor != 0]) == [1, 2, 3]


# ------------------------------------------------------------------ what the review found


def test_a_dense_step_is_given_up_after_one_count_of_its_changes():
    old = torch.zeros(1 << 20, dtype=torch.uint8)
    writer = PatchWriter(1, 2, "L", budget=(1 << 20) // 4)
    writer.item(0, old, torch.ones(1 << 20, dtype=torch.uint8))
    assert writer.abandoned and writer.changed_words == 0


def test_a_dense_first_item_gives_the_patch_up_before_anything_is_encoded():
    """Of a version of 4 items, the first changed whole: more than its share of the
    budget, although the whole budget would cover it. The writer stops there."""
    size = 1 << 20
    writer = PatchWriter(1, 2, "L", budget=size, total_bytes=4 * size)
    writer.item(0, torch.zeros(size, dtype=torch.uint8), torch.ones(size, dtype=torch.uint8))
    assert writer.abandoned and writer.nbytes() == 64


def test_a_sparse_step_keeps_its_patch_item_after_item():
    size = 1 << 20
    writer = PatchWriter(1, 2, "L", budget=size, total_bytes=4 * size)
    for k in range(4):
        new = torch.zeros(size, dtype=torch.uint8)
        new[::100] = 1
        writer.item(k, torch.zeros(size, dtype=torch.uint8), new)
    assert not writer.abandoned and round(writer.density, 3) == 0.02


def test_a_patch_claiming_more_entries_than_its_item_has_words_is_refused_unread():
    _, payload = encode_changes(np.array([0], dtype=np.int64), np.array([1], dtype=np.uint16))
    with pytest.raises(PatchError, match="entries for 10 words"):
        decode_changes(payload, 1 << 40, 2, 10)


def test_a_patchs_chunks_are_marked_otherwise_than_its_versions():
    from tensorhub.core.stripes import progress_tag
    for v in (1, 2, 127, 128, 254, 255, 1000):
        assert progress_tag(v, patch=True) not in {progress_tag(u) for u in (v - 1, v, v + 1)}
        assert progress_tag(v, patch=True) != 0


def test_after_a_failed_publish_the_next_version_moves_whole(coordinator, monkeypatch):
    """The failed attempt left other bytes in the trainer's buffers than its last version:
    a patch from them would be labelled with the wrong base."""
    from tensorhub.core.data_types import Publish
    from tensorhub.core.errors import CoordinatorUnavailable

    w = weights()
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(w)
        step(w, 0.01, seed=13)
        real = pub.session.call_patiently

        def lost(request, wait):
            if isinstance(request, Publish) and request.model == "policy":
                raise CoordinatorUnavailable("the coordinator did not answer")
            return real(request, wait)

        monkeypatch.setattr(pub.session, "call_patiently", lost)
        with pytest.raises(CoordinatorUnavailable):
            pub.publish(w)
        monkeypatch.setattr(pub.session, "call_patiently", real)
        step(w, 0.01, seed=14)
        pub.last_patch = None
        assert pub.publish(w) == 2 and pub.last_patch is None
        step(w, 0.01, seed=15)
        assert pub.publish(w) == 3 and pub.last_patch.base == 2


def test_a_trainer_tells_a_restarted_coordinator_its_newest_patch_too(coordinator):
    w = weights()
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(w)
        step(w, 0.01, seed=16)
        pub.publish(w)
        assert pub.session.published() == {"policy": 2, "policy.patch": 2}


def test_a_reader_whose_buffers_took_a_late_read_pulls_the_next_version_whole(coordinator,
                                                                              monkeypatch):
    """A read given up earlier that landed later may have written bytes no patch touches:
    only a whole pull rewrites them all."""
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        step(w, 0.01, seed=17)
        pub.publish(w)
        monkeypatch.setattr(type(r.session.transport), "late_reads",
                            property(lambda self: 1))
        assert r.pull(2) == 2
        assert r.last_pull_patches == [] and sums(r.tensors) == sums(w)


def test_a_patch_whose_bytes_fail_their_checksums_ends_every_lease_saying_why(coordinator):
    """The trainer's held patch was damaged after it published it: the reader's patch pull
    refuses the bytes, ends the leases it was given with the reason (none is left open, as
    a read in flight, until it expires), and pulls the version whole."""
    w = weights()
    with trainer_and_reader(coordinator.address, w) as (pub, r):
        step(w, 0.01, seed=12)
        pub.publish(w)
        assert pub.last_patch is not None and pub.last_patch.version == 2
        pub._held_patches.layout(2).item_bytes[0][-8:] ^= 0x55
        ended = []
        end = r._patches._end
        r._patches._end = lambda dones: (ended.extend(dones), end(dones))
        assert r.pull(2) == 2
        assert r.last_pull_patches == [] and sums(r.tensors) == sums(w)
        assert ended and all(not d.ok and "checksum" in (d.error or "") for d in ended), ended
