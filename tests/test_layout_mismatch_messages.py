"""A reader whose tensors do not match the published layout is told, tensor by tensor, why."""

import pytest
import torch

from tensorhub import LayoutError, Publisher, Replica
from tensorhub.core.layout import manifest_of
from tensorhub.core.layout_diff import layout_difference


def _state():
    return {"embed": torch.zeros(4, 8), "norm": torch.ones(8), "head": torch.zeros(8, 2)}


def _refusal(coordinator, published: dict, ours: dict) -> str:
    with Publisher(coordinator.address, "lm", transport="zmq") as pub:
        pub.publish(published)
        with Replica(coordinator.address, "lm", ours, transport="zmq") as rep:
            with pytest.raises(LayoutError) as caught:
                rep.pull(timeout=10)
            assert rep.version is None
        pub.release(force=True)
    return str(caught.value)


def test_missing_and_extra_names_are_listed(coordinator):
    ours = _state()
    del ours["head"]
    ours["lm_head"] = torch.zeros(8, 2)
    message = _refusal(coordinator, _state(), ours)
    assert "'lm' v1 is published in layout" in message
    assert "missing here (1, published but not among this reader's tensors): 'head'" in message
    assert "extra here (1, not in the published version): 'lm_head'" in message


def test_a_differing_shape_and_dtype_are_named_with_both_sides(coordinator):
    ours = _state()
    ours["embed"] = torch.zeros(4, 9)
    ours["norm"] = torch.ones(8, dtype=torch.bfloat16)
    message = _refusal(coordinator, _state(), ours)
    assert ("differing (2): 'embed' is float32[4, 9] here, float32[4, 8] published; "
            "'norm' is bfloat16[8] here, float32[8] published") in message


def test_the_same_tensors_in_another_order_say_that_order_matters(coordinator):
    ours = dict(reversed(list(_state().items())))
    message = _refusal(coordinator, _state(), ours)
    assert ("the same tensors in another order (first at position 0: 'head' here, 'embed' "
            "published); the order matters") in message
    assert "give the tensors in the publisher's order" in message


def test_long_lists_are_cut_to_five_names_and_a_count():
    published = manifest_of([(f"w{i}", torch.zeros(1)) for i in range(8)])
    assert layout_difference(manifest_of([]), published) == [
        "missing here (8, published but not among this reader's tensors): "
        "'w0', 'w1', 'w2', 'w3', 'w4' and 3 more"]


def test_a_differing_compaction_threshold_names_the_value_to_pass():
    tensors = list(_state().items())
    assert layout_difference(manifest_of(tensors, 1024), manifest_of(tensors, 2048)) == [
        "compaction threshold 1024 here, 2048 published: pass compact_threshold=2048"]
