"""Tiny-tensor compaction without a scatter: small tensors moved into the compact region."""

import torch

from tensorhub.core.layout import BoundLayout, manifest_of


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 600, generator=g),  # 1.2 MB: large, stays where it is
        "norm": torch.randn(64, generator=g),
        "bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
    }


def _inside(layout: BoundLayout, t: torch.Tensor) -> bool:
    base = layout.compact.data_ptr()
    return base <= t.data_ptr() < base + layout.compact.numel()


def test_moved_tensors_keep_their_values_and_identity_and_live_in_the_region():
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    layout = BoundLayout(manifest_of(state.items()), list(state.values()))
    assert layout.move_small_into_region() == 3
    for name, t in layout.named_tensors():
        assert t is state[name], name  # the caller's tensor objects, not copies
        assert torch.equal(t, expected[name]), name
    assert [_inside(layout, t) for t in state.values()] == [False, True, True, True]


def test_a_read_into_the_region_updates_moved_tensors_with_no_scatter():
    sender = BoundLayout(manifest_of(_state(seed=1).items()), list(_state(seed=1).values()))
    sender.pack()
    state = _state()
    receiver = BoundLayout(manifest_of(state.items()), list(state.values()))
    receiver.move_small_into_region()
    receiver.compact.copy_(sender.compact)  # what a READ of the region does; no scatter after
    assert torch.equal(state["norm"], _state(seed=1)["norm"])
    assert torch.equal(state["bias"], _state(seed=1)["bias"])
    assert receiver.checksums()[0] == sender.checksums()[0]


def test_a_moved_parameter_stays_the_modules_parameter():
    module = torch.nn.LayerNorm(16)
    with torch.no_grad():
        module.weight.fill_(2.0)
    named = list(module.named_parameters())
    layout = BoundLayout(manifest_of(named), [p for _, p in named])
    assert layout.move_small_into_region() == 2
    assert module.weight is named[0][1] and _inside(layout, module.weight)
    layout.compact.zero_()
    assert torch.count_nonzero(module.weight) == 0  # the module computes with the region


def test_a_view_into_a_larger_buffer_is_not_moved_and_is_still_scattered():
    flat = torch.zeros(100)
    norm = flat[:64]  # e.g. one slice of a flat parameter buffer: its peers would not follow
    bias = torch.randn(3)
    named = [("norm", norm), ("bias", bias)]
    layout = BoundLayout(manifest_of(named), [norm, bias])
    assert layout.move_small_into_region() == 1
    assert not _inside(layout, norm) and _inside(layout, bias)
    layout.compact[: 64 * 4].copy_(torch.full((64,), 7.0).view(torch.uint8))
    layout.scatter()
    assert torch.equal(flat[:64], torch.full((64,), 7.0))  # the buffer sees the new values


def test_without_small_tensors_nothing_moves():
    big = torch.randn(512, 600)
    layout = BoundLayout(manifest_of([("embed", big)]), [big])
    assert layout.compact is None
    assert layout.move_small_into_region() == 0
