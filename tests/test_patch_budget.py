"""A patch never costs more than the whole: the trainer decides before building one, on a
sample of the words and measured rates, and each reader takes one only when it expects to
hold the version sooner than through a whole pull."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.core.patch import sample_changes
from tensorhub.core.patch_budget import PatchCosts, Rate

GIB = 1 << 30
WAN = 25e6  # bytes/s: 200 Mbit/s
MEMCPY = 10e9  # bytes/s: a same-host pull


def weights(mib: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = mib * 2**20 // 2 // 1024 // 4
    return {f"layer{i}.weight": (torch.randn(rows, 1024, generator=g) * 0.02)
            .to(torch.bfloat16) for i in range(4)}


def step(w: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Change `density` of the elements by about one bf16 step, in place."""
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        changed = torch.rand(t.shape, generator=g) < density
        t[changed] = (t[changed].float() * 1.01 + 1e-3).to(torch.bfloat16)


def sums(w: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: checksum(t) for n, t in w.items()}


def costs(pull_rate: float | None = None) -> PatchCosts:
    c = PatchCosts()
    if pull_rate is not None:
        c.pull_s_per_byte = Rate.known(1 / pull_rate)
    return c


# ------------------------------------------------------------------ the rule, no I/O


def test_a_sparse_step_of_a_gib_is_a_patch_across_a_wan_and_whole_on_one_host():
    words = GIB // 2
    sampled, changed = 65536, 655  # 1 % of the words
    assert costs(WAN).trainer_verdict(sampled, changed, words, GIB).patch
    assert not costs(MEMCPY).trainer_verdict(sampled, changed, words, GIB).patch


def test_a_dense_step_is_no_patch_whatever_the_link():
    words = GIB // 2
    for rate in (WAN, MEMCPY, None):
        verdict = costs(rate).trainer_verdict(65536, 60000, words, GIB)
        assert not verdict.patch and "over 25%" in verdict.why


def test_before_any_whole_pull_is_measured_a_sparse_patch_is_not_ruled_out_by_time():
    verdict = costs().trainer_verdict(65536, 655, GIB // 2, GIB)
    assert verdict.patch and verdict.whole_s is None


def test_a_reader_with_a_slow_apply_rate_takes_the_whole():
    c = costs(WAN)
    assert c.reader_verdict(GIB // 100, GIB).patch
    c.applied(patch_bytes=1000, apply_s=1.0, checked_bytes=GIB, check_s=0.1)  # 1 ms a byte
    verdict = c.reader_verdict(GIB // 100, GIB)
    assert not verdict.patch and verdict.patch_s > verdict.whole_s


def test_rates_learn_from_measurements_and_a_known_one_stays():
    c = PatchCosts()
    c.built(words=1000, changes=10, make_s=1e-5, encode_s=2e-5, nbytes=15)
    assert c.make_s_per_word.per_unit == pytest.approx(1e-8)
    assert c.encode_s_per_change.per_unit == pytest.approx(2e-6)
    assert c.bytes_per_change.per_unit == 1.5
    c.built(words=1000, changes=10, make_s=2e-5, encode_s=2e-5, nbytes=15)
    assert c.make_s_per_word.per_unit == pytest.approx(1.3e-8)  # 0.7 old + 0.3 new
    c.pulled_whole(100, 1.0)  # too small to tell a link's rate
    assert not c.pull_s_per_byte.measured
    c.pulled_whole(8 << 20, 1.0)
    assert c.pull_s_per_byte.per_unit == 1 / (8 << 20)
    c.pulled_patches(patches=2, patch_bytes=8 << 20, seconds=1.2)
    assert c.pull_s_per_patch.per_unit == pytest.approx(0.1)  # (1.2 s - 1 s at that rate) / 2
    known = costs(WAN)
    known.pulled_whole(8 << 20, 1e-3)
    assert known.pull_s_per_byte.per_unit == 1 / WAN


def test_the_density_sample_looks_at_a_small_share_of_the_words_and_finds_the_density():
    g = torch.Generator().manual_seed(1)
    old = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
           for n in (8 << 20, 6 << 20, 3)]
    new = [t.clone() for t in old]
    for t in new[:2]:
        words = t.view(torch.int16)
        idx = torch.randperm(words.numel(), generator=g)[:words.numel() // 20]
        words[idx] ^= 1  # 5 % of the words
    looked, changed = sample_changes(old, new, seed=3)
    assert looked == 64 * 1024 and looked < (14 << 20) // 2 // 100
    assert 0.04 < changed / looked < 0.06


# ------------------------------------------------------------------ trainer and readers


def test_a_dense_step_builds_no_patch_and_deciding_compares_under_1_percent_of_the_words(
        coordinator):
    w = weights()
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(w)
        step(w, 0.5, seed=1)
        pub.publish(w)
        decision = pub.last_patch_decision
        assert decision.version == 2 and not decision.verdict.patch
        assert pub.last_patch is None
        assert not pub.patch_costs.encode_s_per_change.measured  # nothing was encoded
        assert decision.sampled_words <= decision.words / 100


def test_a_sparse_step_builds_a_patch_and_the_trainer_learns_its_rates(coordinator):
    w = weights()
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(w)
        step(w, 0.01, seed=2)
        pub.publish(w)
        assert pub.last_patch_decision.verdict.patch
        assert pub.last_patch is not None and pub.last_patch.version == 2
        assert 0.005 < pub.last_patch.density < 0.02
        assert pub.patch_costs.encode_s_per_change.measured
        assert pub.patch_costs.bytes_per_change.per_unit < 3


def test_the_trainer_is_told_its_readers_whole_pull_rate(coordinator):
    w = weights()
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", {n: torch.zeros_like(t) for n, t in
                                                    w.items()}, transport="zmq") as r:
        pub.publish(w)
        assert r.pull(1) == 1
        assert not pub.patch_costs.pull_s_per_byte.measured
        step(w, 0.01, seed=3)
        pub.publish(w)
        told = 1 / pub.patch_costs.pull_s_per_byte.per_unit
        assert abs(told - r.last_pull.nbytes / r.last_pull.seconds) < 0.01 * told


def test_a_reader_with_a_slow_apply_rate_pulls_the_whole_and_one_across_a_wan_the_patch(
        coordinator):
    w = weights()
    zeros = {n: torch.zeros_like(t) for n, t in w.items()}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", zeros, name="slow", transport="zmq") as slow, \
            Replica(coordinator.address, "policy", {n: t.clone() for n, t in zeros.items()},
                    name="far", transport="zmq") as far:
        pub.patch_costs.pull_s_per_byte = Rate.known(1 / WAN)
        pub.publish(w)
        assert slow.pull(1) == 1 and far.pull(1) == 1
        for r in (slow, far):
            r.patch_costs.pull_s_per_byte = Rate.known(1 / WAN)
        slow.patch_costs.apply_s_per_patch_byte = Rate.known(1e-3)
        step(w, 0.01, seed=4)
        pub.publish(w)
        assert pub.last_patch is not None
        assert far.pull(2) == 2 and far.last_pull_patches == [2]
        assert far.last_patch_verdict.patch and far.patch_costs.check_s_per_byte.measured
        assert far.patch_costs.apply_s_per_patch_byte.measured
        assert slow.pull(2) == 2 and slow.last_pull_patches == []
        assert not slow.last_patch_verdict.patch
        assert slow.last_pull.nbytes == slow.layout.nbytes
        assert sums(slow.tensors) == sums(w) == sums(far.tensors)
