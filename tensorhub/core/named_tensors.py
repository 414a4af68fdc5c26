"""The tensors a user hands to `Publisher.publish` or `Replica`, checked where they come in.

A mistake found here names the offending key and the fix; found later it would surface as
a raw `AttributeError` deep in a copy, or a validation dump of the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from tensorhub.core.schema import MAX_NAME

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_list(named_tensors: NamedTensors, *,
               empty_ok: bool = True) -> list[tuple[str, torch.Tensor]]:
    """`named_tensors` (a state dict, or (name, tensor) pairs) as a list of detached pairs;
    raises `TypeError` or `ValueError` naming the first key that cannot be published as
    it is."""
    if isinstance(named_tensors, torch.nn.Module):
        raise TypeError(f"got a module ({type(named_tensors).__name__}), not its tensors: "
                        f"pass model.state_dict() (or dict(model.named_parameters()))")
    if isinstance(named_tensors, torch.Tensor) or not isinstance(named_tensors,
                                                                 Mapping | Iterable):
        raise TypeError(f"expected a dict of name -> torch.Tensor (a state dict), got "
                        f"{type(named_tensors).__name__}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    named = []
    for pair in items:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise TypeError(f"expected (name, tensor) pairs, got {type(pair).__name__} "
                            f"{pair!r:.60}: pass a dict of name -> tensor")
        name, tensor = pair
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str: key {name!r} is "
                            f"{type(name).__name__}; name it by a string, e.g. str({name!r})")
        if not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"tensor name {name[:40]!r}{'...' if len(name) > 40 else ''} "
                             f"must have 1 to {MAX_NAME} characters")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is {type(tensor).__name__}, not a torch.Tensor: "
                            f"publish only tensors (wrap a number as torch.tensor(x), keep "
                            f"other state out of the dict)")
        if not tensor.is_contiguous():
            raise ValueError(f"{name!r} is not contiguous (a transposed or strided view): "
                             f"pass {name!r}: tensor.contiguous()")
        named.append((name, tensor.detach()))
    if not named and not empty_ok:
        raise ValueError("nothing to publish: no tensors given (an empty state dict)")
    return named
