"""Layouts and tiny-tensor compaction, without any transfer."""

import pytest
import torch

from tensorhub.core.errors import LayoutError
from tensorhub.core.layout import ALIGN, BoundLayout, layout_id, manifest_of, plan_items


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 600, generator=g),  # 1.2 MB: large
        "norm": torch.randn(64, generator=g),
        "bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
    }


def test_small_tensors_share_one_compact_item_and_large_ones_travel_alone():
    items = plan_items(manifest_of(_state().items()))
    assert [i.kind for i in items] == ["compact", "tensor"]
    compact = items[0]
    assert compact.tensors == [1, 2, 3]
    assert all(off % ALIGN == 0 for off in compact.offsets)
    assert items[1].nbytes == 512 * 600 * 4


def test_pack_then_scatter_restores_every_small_tensor_bit_exact():
    src = _state()
    manifest = manifest_of(src.items())
    sender = BoundLayout(manifest, list(src.values()))
    sender.pack()
    receiver = BoundLayout.allocate(manifest)
    for mine, theirs in zip(receiver.item_bytes, sender.item_bytes, strict=True):
        mine.copy_(theirs)
    receiver.scatter()
    for name, t in receiver.named_tensors():
        assert torch.equal(t, src[name]), name
    assert receiver.checksums() == sender.checksums()


def test_layout_id_depends_on_shapes_order_and_threshold():
    a = manifest_of(_state().items())
    assert layout_id(a) == layout_id(manifest_of(_state(seed=5).items()))  # values don't count
    reordered = manifest_of(reversed(list(_state().items())))
    assert layout_id(a) != layout_id(reordered)
    assert layout_id(a) != layout_id(manifest_of(_state().items(), compact_threshold=1 << 10))


def test_binding_tensors_of_the_wrong_shape_names_the_tensor():
    manifest = manifest_of(_state().items())
    wrong = list(_state().values())
    wrong[1] = torch.zeros(65)
    with pytest.raises(LayoutError, match="'norm'"):
        BoundLayout(manifest, wrong)


def test_duplicate_names_are_refused():
    t = torch.zeros(2)
    with pytest.raises(LayoutError, match="twice"):
        manifest_of([("a", t), ("a", t)])


def test_allocated_small_tensors_live_inside_the_compact_region():
    layout = BoundLayout.allocate(manifest_of(_state().items()))
    region = layout.compact
    norm = layout.tensors[1]
    assert region.data_ptr() <= norm.data_ptr() < region.data_ptr() + region.numel()
    region.fill_(0)
    assert torch.count_nonzero(norm) == 0  # a read into the region is a read into the tensor
