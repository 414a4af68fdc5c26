"""A version in an engine's quantized layout, made once by the trainer.

An fp8 engine fed the trainer's bf16 versions pulls and holds twice the bytes it serves and
quantizes every weight itself, and each fp8 engine of a fleet does the same work on the
same bytes. The trainer can quantize each version once instead, with the reference
quantizer of the engine's recipe (byte-equal to the engine's own), and publish the result
as a companion model, `<model>@<recipe>`, with the same version numbers: the engines of
that recipe pull it (half the bytes), relay it to each other like any version, and write it
into their live weights with no quantization in their pause. Its checksums are the
trainer's, made from the bytes it quantized, so a reader checks it as it checks any version
and no peer can hand out quantized bytes of its own.

In the quantized layout each quantized (bf16) weight keeps its checkpoint name and `[out, in]`
shape, in fp8, and gains `<module>.weight_scale` (fp32, `[out, 1]` per channel), as a
pre-quantized checkpoint stores them; every other tensor is the bf16 one. Which weights a
recipe quantizes is the engines' rule for the decoder's linear layers (`QUANTIZED`): the
attention and MLP projections, never embeddings, norms or the LM head.

Only a recipe whose scales are per row is offered (`RECIPES`): its bytes do not depend on
how the engine stacks q/k/v or gate/up into one layer, so the trainer, which sees the
checkpoint's tensors, makes exactly the engine's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tensorhub.quant.fp8 import FP8, Fp8Weight
from tensorhub.quant.vllm_fp8 import vllm_per_channel

SEPARATOR = "@"
# recipe (the engine's `--quantization` name) -> its reference quantizer
RECIPES: dict[str, Callable[[torch.Tensor], Fp8Weight]] = {
    "fp8_per_channel": vllm_per_channel,
}
# the linear layers an engine's fp8 recipe quantizes, by their checkpoint module name
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE = "weight_scale"

Named = list[tuple[str, torch.Tensor]]
Spec = tuple[str, tuple[int, ...]]  # (dtype, shape), as `engines.weights_check` keeps them


def quantized_model(model: str, recipe: str) -> str:
    """The companion model that holds `model`'s versions quantized by `recipe`."""
    check_recipe(recipe)
    return f"{model}{SEPARATOR}{recipe}"


def recipe_of(model: str) -> str | None:
    """The recipe a companion model's versions are quantized by (None: not one)."""
    _, sep, recipe = model.rpartition(SEPARATOR)
    return recipe if sep and recipe in RECIPES else None


def model_of(companion: str) -> str | None:
    """The model whose versions `companion` holds quantized (None: not a companion)."""
    return companion.rpartition(SEPARATOR)[0] if recipe_of(companion) is not None else None


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"no quantized layout for {recipe!r}: TensorHub makes "
                         f"{', '.join(sorted(RECIPES))} (a recipe with per-row scales)")


def quantizable(name: str, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a recipe quantizes the checkpoint tensor `name`: a decoder projection's 2-d
    bf16 weight. (An engine quantizes what it loaded in its own dtype, bf16, and fp8 bytes
    no longer say what they were made from: a weight in another dtype is left as it is,
    and the engine's check refuses the version.)"""
    stem, _, leaf = name.rpartition(".")
    return (leaf == "weight" and stem.rpartition(".")[2] in QUANTIZED and len(shape) == 2
            and dtype == "bfloat16")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], recipe: str) -> Named:
    """The quantized layout of `named` (see the module's docstring), in `named`'s order."""
    check_recipe(recipe)
    quantizer, out = RECIPES[recipe], []
    for name, t in named:
        if not quantizable(name, _dtype(t), tuple(t.shape)):
            out.append((name, t))
            continue
        q = quantizer(t)
        out += [(name, q.weight), (f"{name.removesuffix('weight')}{SCALE}", q.scale)]
    return out


def quantized_specs(specs: dict[str, Spec]) -> dict[str, Spec]:
    """What a version in the quantized layout holds, for a model that loads `specs` (the
    bf16 checkpoint's names, dtypes and shapes)."""
    out: dict[str, Spec] = {}
    for name, (dtype, shape) in specs.items():
        if not quantizable(name, dtype, shape):
            out[name] = (dtype, shape)
            continue
        out[name] = (str(FP8).removeprefix("torch."), shape)
        out[f"{name.removesuffix('weight')}{SCALE}"] = ("float32", (shape[0], 1))
    return out


def stand_ins(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Empty tensors (no data, `meta`) with the names, dtypes and shapes the quantized layout
    of `named` has: what a trainer declares ahead without quantizing anything."""
    specs = quantized_specs({n: (_dtype(t), tuple(t.shape)) for n, t in named})
    return [(n, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
            for n, (dtype, shape) in specs.items()]


def split_quantized(named: Iterable[tuple[str, torch.Tensor]]
                    ) -> tuple[dict[str, Fp8Weight], Named]:
    """A version in the quantized layout as (module -> its fp8 weight, the other tensors).
    Raises `KeyError` for a quantized weight without its scale."""
    tensors = dict(named)
    quantized: dict[str, Fp8Weight] = {}
    for name, t in tensors.items():
        if t.dtype == FP8 and name.endswith(".weight"):
            module = name.removesuffix(".weight")
            scale = tensors.get(f"{module}.{SCALE}")
            if scale is None:
                raise KeyError(f"{name} is quantized but the version has no {module}.{SCALE}")
            quantized[module] = Fp8Weight(t, scale)
    taken = {f"{m}.{kind}" for m in quantized for kind in ("weight", SCALE)}
    return quantized, [(n, t) for n, t in tensors.items() if n not in taken]
