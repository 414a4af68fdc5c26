"""Whether an engine can load a version, decided before the model is touched.

An engine's `load_weights` that meets a tensor its model does not have (a value head, a
wrapper's prefix), or one of another shape, raises half-way through: the layers before it
hold the new version, the rest the old one or nothing, and the next request crashes the
engine. So each version is compared, tensor by tensor, with what the engine is known to
load: the checkpoint it started from (its safetensors headers, read without the data) and
from then on the last version it applied. A version that differs in names, shapes or dtypes
is refused with the first differences named; the engine keeps serving what it has.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tensorhub.quant.layouts import check_recipe, quantized_specs

# safetensors' dtype names, as torch names them
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
SHOWN = 3  # differences named in a refusal
MARK = "does not fit the engine's model"  # in every refusal, wherever it is re-raised

Spec = tuple[str, tuple[int, ...]]  # (dtype, shape)


def spec_of(t: torch.Tensor) -> Spec:
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape))


@dataclass
class LoadableWeights:
    """The tensors an engine loads (name -> dtype and shape). `optional`: names a version
    may carry or leave out (a tied `lm_head.weight`, which the engine skips)."""

    specs: dict[str, Spec]
    source: str
    optional: set[str] = field(default_factory=set)

    def problems(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """What keeps the engine from loading `named`, first differences first."""
        found: list[str] = []
        seen = set()
        for name, t in named:
            seen.add(name)
            want = self.specs.get(name)
            if want is None:
                if name not in self.optional:
                    found.append(f"tensor {name!r} is not in the engine's model")
                continue
            got = spec_of(t)
            if got[1] != want[1]:
                found.append(f"tensor {name!r} has shape {list(got[1])}, the engine's model "
                             f"{list(want[1])}")
            elif got[0] != want[0]:
                found.append(f"tensor {name!r} is {got[0]}, the engine's model loads "
                             f"{want[0]}")
        missing = sorted(set(self.specs) - seen - self.optional)
        found += [f"tensor {name!r} is missing" for name in missing]
        return found

    def only(self, held: Callable[[str], bool]) -> LoadableWeights:
        """What the engine loads of the tensors `held` says a share of a version holds
        (a pipeline stage's layers, `tensorhub/stages.py`)."""
        return LoadableWeights({n: s for n, s in self.specs.items() if held(n)}, self.source,
                               self.optional)

    def quantized(self, recipe: str) -> LoadableWeights:
        """What this model loads from a version in the trainer's quantized layout by
        `recipe` (`tensorhub/quant/layouts.py`)."""
        check_recipe(recipe)
        return LoadableWeights(quantized_specs(self.specs), f"{self.source}, quantized "
                               f"{recipe}", set(self.optional))

    def refusal(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
        """Why `version` cannot be loaded (None: it can)."""
        found = self.problems(named)
        if not found:
            return None
        more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
        return f"v{version} {MARK} ({self.source}): {'; '.join(found[:SHOWN])}{more}"


def from_tensors(named: Iterable[tuple[str, torch.Tensor]], source: str,
                 optional: set[str] | None = None, keep: LoadableWeights | None = None
                 ) -> LoadableWeights:
    """What `named` is; `keep`: what is known of the tensors `named` leaves out (a share
    of a version: the others' tensors are still the engine's)."""
    specs = {**(keep.specs if keep else {}), **{name: spec_of(t) for name, t in named}}
    return LoadableWeights(specs, source, set(optional or ()))


def from_manifests(manifests: Iterable, source: str, optional: set[str] | None = None
                   ) -> LoadableWeights:
    """What a published version holds, from its parts' manifests (a tensor split by rows
    or columns over parts counts whole)."""
    specs: dict[str, Spec] = {}
    for manifest in manifests:
        for t in manifest.tensors:
            specs[t.name] = (t.dtype, t.whole_shape)
    return LoadableWeights(specs, source, set(optional or ()))


def from_checkpoint(model_dir: str | Path, optional: set[str] | None = None
                    ) -> LoadableWeights | None:
    """What a checkpoint folder's safetensors files hold (headers only); None where it has
    none (a folder of config and tokenizer, `--load-format dummy`)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    specs: dict[str, Spec] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
            specs[name] = (dtype, tuple(info["shape"]))
    return LoadableWeights(specs, f"the checkpoint in {model_dir}", set(optional or ()))


def tied_optional(hf_config) -> set[str]:
    """Names a version may carry that the engine skips: a tied model's `lm_head.weight`
    (a trainer's `state_dict()` has it, the checkpoint on disk does not)."""
    return {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint folder's safetensors files, one at a time (what an
    engine that started from it restores after a load failed half-way)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
