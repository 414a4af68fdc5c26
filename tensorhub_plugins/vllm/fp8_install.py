"""An fp8 engine's install with its quantization done before the pause.

vLLM quantizes online: its layerwise reload takes the bf16 checkpoint tensors and quantizes
every linear layer inside the pause (`bench/results/vllm_fp8.md`: 2.08 s where the bf16
engine stalls 0.18 s). The quantization is deterministic and `tensorhub.quant`'s
per-channel quantizer is byte-equal to vLLM's, so a version's fp8 values and scales are
computed from the checkpoint copy while the engine generates (`quantize`, in the check
before the pause), and the install writes them into the live parameters (`write`) and
reloads only the layers that are not quantized (embeddings, norms, the LM head).

It is used only where it was shown to hold: one rank (TP=1) on a CPU (the quantizer runs
on the host copy: a GPU engine's own quantization on its device is faster than that), every
quantized layer vLLM's per-channel online method, and the engine's own reload of a version
giving exactly the bytes `quantize` gives for it (`matches`, on the first version the engine
loads). Elsewhere the engine's reload runs as before.

A version of the trainer's quantized layout (`<model>@fp8_per_channel`, quantized once by
the trainer with the same reference) is written the same way (`from_layout`), with nothing
to quantize at all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorhub.engines import sparse_install
from tensorhub.quant import Fp8Weight, quantizable, split_quantized, vllm_per_channel

# The share of a version's fp8 bytes past which it is written whole: each byte a sparse
# install writes moves with an 8-byte index (`bench/results/vllm_fp8.md`: a version that
# changed 18 % of them took longer written sparse than whole).
MAX_DENSITY = 0.04

# vLLM's fused linear layers and the checkpoint tensors stacked (by rows) into each, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

Named = Iterable[tuple[str, torch.Tensor]]


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's linear layers quantized per channel online, by module name."""
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), Fp8PtpcOnlineLinearMethod)}


def only_per_channel(model: torch.nn.Module) -> bool:
    """Whether the model has quantized layers and every one is per-channel online (the
    others' methods are vLLM's unquantized ones)."""
    quantized = {id(m) for m in quantized_layers(model).values()}
    methods = {type(m.quant_method).__name__ for m in model.modules()
               if getattr(m, "quant_method", None) is not None and id(m) not in quantized}
    return bool(quantized) and all(name.startswith("Unquantized") for name in methods)


def _sources(layer: str) -> list[str]:
    """The checkpoint tensors (without `.weight`/`.bias`) stacked into `layer`."""
    stem, _, leaf = layer.rpartition(".")
    return [f"{stem}.{part}" for part in FUSED.get(leaf, (leaf,))]


def _stacked(named: dict[str, torch.Tensor], layer: str, kind: str) -> torch.Tensor | None:
    parts = [named.get(f"{source}.{kind}") for source in _sources(layer)]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def quantize(model: torch.nn.Module, named: Named) -> dict[str, Fp8Weight]:
    """Each quantized layer's fp8 values and scales for the checkpoint tensors `named`."""
    tensors = dict(named)
    out = {}
    for layer in quantized_layers(model):
        weight = _stacked(tensors, layer, "weight")
        if weight is None:
            raise KeyError(f"no checkpoint weight for {layer}")
        out[layer] = vllm_per_channel(weight)
    return out


def layout_gaps(model: torch.nn.Module, specs: dict[str, tuple[str, tuple[int, ...]]]
                ) -> str | None:
    """Why the trainer's quantized layout of a checkpoint holding `specs` (name -> dtype,
    shape) would not fill exactly this model's fp8 layers (None: it would)."""
    made = {n.removesuffix(".weight") for n, (dtype, shape) in specs.items()
            if quantizable(n, dtype, shape)}
    wanted = {source for layer in quantized_layers(model) for source in _sources(layer)}
    if missing := sorted(wanted - made):
        return f"the trainer would not quantize {missing[0]}.weight, which this engine does"
    if extra := sorted(made - wanted):
        return f"the trainer would quantize {extra[0]}.weight, which this engine keeps in bf16"
    return None


def _rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """fp8 weights stacked by rows (as bytes: PyTorch's CPU `cat` has no fast fp8 path)."""
    return torch.cat([w.view(torch.uint8) for w in weights]).view(weights[0].dtype)


def from_layout(model: torch.nn.Module, named: Named
                ) -> tuple[dict[str, Fp8Weight], list[tuple[str, torch.Tensor]]]:
    """A version in the trainer's quantized layout (`tensorhub.quant.split_quantized`) as
    (each quantized layer's fp8 weight, stacked as the layer holds it; the other tensors),
    for `write`. Raises `KeyError` for a layer the version did not quantize."""
    published, rest = split_quantized(named)
    out = {}
    for layer in quantized_layers(model):
        parts = [published.get(source) for source in _sources(layer)]
        if any(p is None for p in parts):
            raise KeyError(f"the version has no fp8 weight for {layer}")
        out[layer] = parts[0] if len(parts) == 1 else Fp8Weight(
            _rows([p.weight for p in parts]), torch.cat([p.scale for p in parts]))
    if len(published) != sum(len(_sources(layer)) for layer in out):
        extra = set(published) - {s for layer in out for s in _sources(layer)}
        raise KeyError(f"the version quantizes {sorted(extra)[:3]}, which this engine keeps "
                       f"unquantized")
    return out, rest


def plan_sparse(model: torch.nn.Module, quantized: dict[str, Fp8Weight], version: int,
                key: tuple) -> sparse_install.Plan | None:
    """The fp8 bytes and scales of `quantized` that differ from the live ones, to write
    alone (`sparse_install.install`): an RL step changes few fp8 bytes, fewer than bf16
    words. None when too much changed for that to pay (`MAX_DENSITY`, told from every 64th
    row first) or a live weight is not the transposed view of an `[out, in]` block it is on
    vLLM's CPU build."""
    layers = quantized_layers(model)
    rows = sparse_install.SAMPLE_EVERY
    changed = seen = 0
    for name, layer in layers.items():
        live, new = layer.weight.data.t(), quantized[name].weight
        if not live.is_contiguous() or live.shape != new.shape:
            return None
        changed += int((_u8(live[::rows]).to(new.device) != _u8(new[::rows])).sum())
        seen += new[::rows].numel()
    if changed > MAX_DENSITY * max(seen, 1):
        return None
    writes, written, changed, total = [], [], 0, 0
    budget = MAX_DENSITY * sum(q.weight.numel() for q in quantized.values())
    for name, layer in layers.items():
        q = quantized[name]
        for live, new, what in ((layer.weight.data.t(), q.weight, "weight"),
                                (layer.weight_scale.data, q.scale, "weight_scale")):
            flat, bits = _u8(live).reshape(-1), _u8(new.reshape(live.shape)).reshape(-1)
            if flat.data_ptr() != live.data_ptr():
                return None  # (not a view of the live bytes: writes would be lost)
            where = (flat.to(bits.device) != bits).nonzero().flatten()
            total += live.numel() if what == "weight" else 0
            if where.numel() == 0:
                continue
            if what == "weight_scale":  # (a scale that moved: its few bytes written whole)
                where = torch.arange(bits.numel())
            else:
                changed += where.numel()
                if changed > budget:
                    return None
            writes.append((flat, where, bits[where]))
            written.append(f"{name}.{what}")
    return sparse_install.Plan(version, key, writes, changed, total, written)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (fp8 values: one per element; fp32 scales: four)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.uint8)


def matches(model: torch.nn.Module, quantized: dict[str, Fp8Weight]) -> bool:
    """Whether the live fp8 values and scales are byte for byte `quantized`'s (vLLM holds
    each weight transposed: `[in, out]` of the `[out, in]` values)."""
    layers = quantized_layers(model)
    if layers.keys() != quantized.keys():
        return False
    for name, layer in layers.items():
        q = quantized[name]
        live = layer.weight.t()
        if live.shape != q.weight.shape or layer.weight_scale.numel() != q.scale.numel():
            return False
        values = live.contiguous().to(q.weight.device).view(torch.uint8)
        scales = layer.weight_scale.reshape(-1).to(q.scale.device)
        if not torch.equal(values, q.weight.view(torch.uint8)) \
                or not torch.equal(scales, q.scale.reshape(-1)):
            return False
    return True


def write(model: torch.nn.Module, quantized: dict[str, Fp8Weight], named: Named,
          fp8_written: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Write `quantized` (with the quantized layers' biases), and every other tensor of
    `named` that names a parameter of its shape (norms, embeddings and LM heads, through
    the parameter's own loader, which copies in place), into the live parameters; then
    let each unquantized layer whose weight was written make its kernel's packed copy
    again (vLLM's CPU GEMMs). Returns what is left for the engine's reload: the tensors it
    could not place, with every other tensor of their modules (a layer reloaded in part
    would lose the parameters it did not reload). `fp8_written`: the fp8 values and scales
    are in place already (a sparse install wrote the bytes that differ), only the rest is
    written."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    tensors = dict(named)
    layers = quantized_layers(model)
    params = dict(model.named_parameters(remove_duplicate=False))  # (tied names too)
    canonical = {name for name, _ in model.named_parameters()}
    placed: set[int] = set()  # the parameters written, by id
    written: set[str] = set()
    with torch.no_grad():
        for name, layer in layers.items():
            if not fp8_written:
                q = quantized[name]
                layer.weight.copy_(q.weight.t())
                layer.weight_scale.copy_(q.scale.reshape(layer.weight_scale.shape))
            written |= {f"{source}.weight" for source in _sources(name)}
            bias = _stacked(tensors, name, "bias")
            if bias is not None and getattr(layer, "bias", None) is not None:
                layer.bias.copy_(bias)
                written |= {f"{source}.bias" for source in _sources(name)}
        # a parameter's own name first: a tied alias (lm_head.weight) is then skipped, as
        # vLLM's loader skips it
        for name in sorted(tensors.keys() - written, key=lambda n: n not in canonical):
            tensor, param = tensors[name], params.get(name)
            if param is None or param.dim() != tensor.dim() or param.dim() == 0 \
                    or param.shape[1:] != tensor.shape[1:] or param.shape[0] < tensor.shape[0]:
                continue
            if id(param) not in placed:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                placed.add(id(param))
            written.add(name)
    left = {name.rpartition(".")[0] for name in tensors.keys() - written}
    rest = [(n, t) for n, t in tensors.items()
            if n not in written or n.rpartition(".")[0] in left]
    # (a tied LM head shares the embedding's parameter but keeps a packed copy of its own)
    quantized_ids = {id(m) for m in layers.values()}
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None and id(module) not in \
                quantized_ids and id(getattr(module, "weight", None)) in placed:
            module.quant_method.process_weights_after_loading(module)
    return rest
