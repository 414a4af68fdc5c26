"""Bad inputs to `publish` and a bad coordinator address are refused with the offending key
(or address) and the fix, before anything is registered."""

import pytest
import torch

from tensorhub import AddressError, Publisher, Replica


@pytest.fixture
def publisher(coordinator):
    with Publisher(coordinator.address, "lm", transport="zmq") as pub:
        yield pub


def test_a_non_tensor_value_is_named(publisher):
    with pytest.raises(TypeError) as caught:
        publisher.publish({"w": torch.zeros(2), "step": 3})
    assert str(caught.value) == ("'step' is int, not a torch.Tensor: publish only tensors "
                                 "(wrap a number as torch.tensor(x), keep other state out of "
                                 "the dict)")
    assert publisher.version is None


def test_a_module_is_refused_with_its_state_dict_as_the_fix(publisher):
    with pytest.raises(TypeError) as caught:
        publisher.publish(torch.nn.Linear(2, 2))
    assert str(caught.value) == ("got a module (Linear), not its tensors: pass "
                                 "model.state_dict() (or dict(model.named_parameters()))")


def test_a_non_str_key_is_named(publisher):
    with pytest.raises(TypeError) as caught:
        publisher.publish({0: torch.zeros(2)})
    assert str(caught.value) == ("tensor names must be str: key 0 is int; name it by a "
                                 "string, e.g. str(0)")


def test_a_non_contiguous_tensor_is_named(publisher):
    with pytest.raises(ValueError) as caught:
        publisher.publish({"w": torch.zeros(2), "wt": torch.zeros(3, 4).t()})
    assert str(caught.value) == ("'wt' is not contiguous (a transposed or strided view): "
                                 "pass 'wt': tensor.contiguous()")


def test_an_empty_dict_is_refused_and_publishes_nothing(publisher, coordinator):
    with pytest.raises(ValueError) as caught:
        publisher.publish({})
    assert str(caught.value) == "nothing to publish: no tensors given (an empty state dict)"
    assert publisher.version is None


def test_an_address_without_tcp_names_it_and_the_form():
    with pytest.raises(AddressError) as caught:
        Replica("127.0.0.1:5555", "lm", transport="zmq")
    assert str(caught.value) == ("coordinator address '127.0.0.1:5555' is not of the form "
                                 "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)")


def test_an_address_without_a_port_gets_the_general_example():
    with pytest.raises(AddressError) as caught:
        Publisher("coordinator-host", "lm", transport="zmq")
    assert str(caught.value) == ("coordinator address 'coordinator-host' is not of the form "
                                 "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)")
