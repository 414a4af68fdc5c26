"""`tensorhub forget MODEL`: a model nobody uses any more leaves the coordinator's records
with its patches; a model in use is refused with the names of its users."""

import pytest
import torch

from tensorhub import CoordinatorError, Publisher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import Forget, StatusRequest
from tensorhub.tools.cli import main


def _call(address: str, request):
    client = CoordinatorClient(address)
    try:
        return client.call(request)
    finally:
        client.close()


def _publish_two_versions(address: str, *, close: bool = True) -> Publisher:
    """v1, then v2 with one element changed (so v2 also goes out as a patch); v1, held by
    nobody, is dropped once v2 is out."""
    pub = Publisher(address, "lm", name="trainer", transport="zmq")
    w = torch.zeros(1 << 16)
    pub.publish({"w": w})
    w[7] = 1.0
    pub.publish({"w": w})
    if close:
        pub.close(retain=False)
    return pub


def test_a_model_in_use_is_refused_naming_its_users(coordinator):
    pub = _publish_two_versions(coordinator.address, close=False)
    try:
        with pytest.raises(CoordinatorError) as caught:
            _call(coordinator.address, Forget(model="lm"))
    finally:
        pub.close(retain=False)
    assert caught.value.code == "in_use"
    assert str(caught.value) == ("model 'lm' is in use by trainer: a model is forgotten only "
                                 "once no worker holds, publishes or reads it; close them (or "
                                 "let them leave) and ask again")


def test_a_model_nobody_uses_is_forgotten_with_its_patches(coordinator, capsys):
    _publish_two_versions(coordinator.address)
    assert {m.model for m in _call(coordinator.address, StatusRequest()).models} \
        == {"lm", "lm.patch"}
    assert main(["forget", "lm", "--coordinator", coordinator.address]) == 0
    assert capsys.readouterr().out == "forgot lm (v2); lm.patch (v2)\n"
    assert _call(coordinator.address, StatusRequest()).models == []


def test_an_unknown_model_names_the_known_ones(coordinator):
    _publish_two_versions(coordinator.address)
    with pytest.raises(CoordinatorError) as caught:
        _call(coordinator.address, Forget(model="nope"))
    assert str(caught.value) == "model 'nope' is not known (known: lm, lm.patch)"


def test_status_shows_a_models_patches_under_it(coordinator, capsys):
    _publish_two_versions(coordinator.address)
    assert main(["status", "--coordinator", coordinator.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    model, patches = lines.index("model lm: latest v2"), lines.index("  patches (lm.patch):")
    assert lines[model + 1:patches] == [next(li for li in lines if li.startswith("  v2 layout "))]
    assert lines[patches + 1].startswith("    v2 layout ")
    assert not any(line.startswith("model lm.patch") for line in lines)


def test_a_model_is_forgotten_with_its_quantized_layouts(coordinator):
    w = torch.randn(256, 128).to(torch.bfloat16)
    pub = Publisher(coordinator.address, "lm", name="trainer", transport="zmq",
                    quantize=["fp8_per_channel"])
    pub.publish({"model.layers.0.mlp.down_proj.weight": w})
    pub.close(retain=False)
    forgotten = _call(coordinator.address, Forget(model="lm"))
    assert set(forgotten.versions) == {"lm", "lm@fp8_per_channel"}
    assert _call(coordinator.address, StatusRequest()).models == []
