"""A sparse step installed as sparse: only the words that changed are written into an
engine's live parameters, where they keep the checkpoint's layout (SGLang; vLLM on a GPU).

Where each checkpoint tensor lands in the live parameters is learnt once from the model's
own weight loaders (`live_blocks`): each checkpoint tensor is loaded, as a tensor of its
element indices, into a scratch copy of its live parameter, so the fused q/k/v and
gate/up row offsets, a TP rank's slice and the embedding's padding come out exactly as
the engine's `load_weights` lays them. A tensor is supported when it lands as one
rectangular block, element for element, in a live parameter of its dtype; a model with any
other tensor (an unknown name, a tied lm_head kept as a separate parameter, a dtype cast,
a weight the engine repacked: vLLM's CPU GEMMs) is installed whole, always.

Before the pause (`plan`), the new version in the checkpoint copy is compared word for word
with the live parameters through those blocks; the pause then writes only the words that
differ (`install`). The result is byte-equal to a whole install by construction: every other
word already held the new version's bits. A plan is only valid for the live bytes it was
compared with (the caller keys it by the version they hold and a count of writes).

The engine plugins give what is theirs: the loader a parameter without one of its own is
loaded with (both engines fuse the same parameters: `STACKED`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("tensorhub.engines")

# Llama/Qwen2-style models' fused parameters, as both engines name them (their
# `stacked_params_mapping`): (live parameter, checkpoint name part, shard id).
STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
           ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
           ("gate_up_proj", "up_proj", 1))
Loader = Callable[..., None]  # (param, loaded_weight[, shard id])
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Above this fraction of changed words a whole install is as fast: no plan.
MAX_DENSITY = 0.25


@dataclass(frozen=True)
class Block:
    """Checkpoint tensor `src` region == live parameter `param` region `dst`."""

    param: str
    dst: tuple[slice, ...]
    src: tuple[slice, ...]


class Unsupported(Exception):
    pass


def _target(name: str, params: dict) -> tuple[str, object]:
    for fused, part, shard in STACKED:
        if f".{part}." in name:
            fused_name = name.replace(f".{part}.", f".{fused}.")
            if fused_name in params:
                return fused_name, shard
    if name in params:
        return name, None
    raise Unsupported(f"{name}: no live parameter")


def _scratch(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A float32 parameter of `param`'s shape, class and attributes (loaders that are the
    parameter's own methods, as vLLM's, see what they expect), in host memory, zeros."""
    data = torch.zeros(param.shape, dtype=torch.float32)
    scratch = torch.nn.Parameter(data, requires_grad=False) if type(param) is \
        torch.nn.Parameter else torch.Tensor._make_subclass(type(param), data, False)
    own = type(param) is not torch.nn.Parameter  # (a class whose methods read `_` fields)
    for key, value in vars(param).items():  # output_dim, weight_loader, tp_rank, ...
        if not key.startswith("__") and (own or not key.startswith("_")):
            setattr(scratch, key, value)
    return scratch


def _probe(param: torch.nn.Parameter, shape: torch.Size, shard,
           default_loader: Loader) -> list[torch.Tensor]:
    """Where each element of a checkpoint tensor of `shape` lands in `param`: for each of
    its dims, a float32 copy of `param` holding 1 + the element's index along that dim
    where it landed, 0 elsewhere (a loader that zero-fills padding leaves it a miss). The
    index is a broadcast view, so a probe holds no more than `param`'s size per dim. The
    live parameter is not touched."""
    if max(shape) >= 1 << 24:
        raise Unsupported(f"a dim of {tuple(shape)} past float32's exact integers")
    loader = getattr(param, "weight_loader", None) or default_loader
    wheres = []
    for dim, n in enumerate(shape):
        view = [1] * len(shape)
        view[dim] = n
        index = torch.arange(1, n + 1, dtype=torch.float32).view(view).expand(shape)
        for loaded in (index, index.contiguous()):  # (a loader that cannot take a view)
            scratch = _scratch(param)
            try:
                loader(scratch, loaded) if shard is None else loader(scratch, loaded, shard)
                break
            except Exception:
                if loaded is not index:
                    raise
        wheres.append(scratch.data)
    return wheres


def _block(name: str, wheres: list[torch.Tensor], shape: torch.Size) -> tuple[tuple, tuple]:
    """(dst, src) regions when the checkpoint tensor landed as one rectangular block,
    element for element."""
    hit = wheres[0] > 0
    if len(shape) not in (1, 2) or any(w.dim() != len(shape) for w in wheres) \
            or not bool(hit.any()) or any(not torch.equal(w > 0, hit) for w in wheres[1:]):
        raise Unsupported(f"{name}: lands as no block")
    spans = [hit.any(1 - d) if len(shape) == 2 else hit for d in range(len(shape))]
    dst = tuple(slice(int(idx[0]), int(idx[-1]) + 1)
                for idx in (span.nonzero().flatten() for span in spans))
    src = []
    for d, where in enumerate(wheres):
        n = dst[d].stop - dst[d].start
        corner = where[tuple(s.start for s in dst)]
        a = int(corner) - 1
        view = [1] * len(shape)
        view[d] = n
        expect = torch.arange(a + 1, a + 1 + n, dtype=torch.float32).view(view)
        if a < 0 or a + n > shape[d] or \
                not torch.equal(where[dst], expect.expand(where[dst].shape)):
            raise Unsupported(f"{name}: not loaded as one block")
        src.append(slice(a, a + n))
    if int(hit.sum()) != hit[dst].numel():
        raise Unsupported(f"{name}: not loaded as one block")
    return dst, tuple(src)


def live_blocks(model, named: list[tuple[str, torch.Tensor]],
                default_loader: Loader) -> dict[str, Block]:
    """Each checkpoint tensor's block in the live parameters; `Unsupported` when any one has
    none (the model is then always installed whole)."""
    params = dict(model.named_parameters())
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in params:
        raise Unsupported("a tied lm_head kept as a parameter of its own")
    blocks = {}
    for name, tensor in named:
        pname, shard = _target(name, params)
        param = params[pname]
        if param.dtype != tensor.dtype:
            raise Unsupported(f"{name}: {tensor.dtype} loaded into {param.dtype}")
        if param.dim() != tensor.dim() or param.numel() == 0:
            raise Unsupported(f"{name}: its live parameter {pname} is "
                              f"{tuple(param.shape)} (repacked by the engine)")
        if not param.is_contiguous():
            raise Unsupported(f"{name}: its live parameter {pname} is not contiguous")
        if shard is None and param.shape == tensor.shape \
                and getattr(param, "weight_loader", None) is None:
            # the engine's default loader: a plain copy of the whole tensor
            whole = tuple(slice(0, n) for n in tensor.shape)
            blocks[name] = Block(pname, whole, whole)
            continue
        try:
            where = _probe(param, tensor.shape, shard, default_loader)
        except Exception as exc:  # (a loader that cannot be probed this way)
            raise Unsupported(f"{name}: its loader could not be probed ({exc})") from None
        dst, src = _block(name, where, tensor.shape)
        blocks[name] = Block(pname, dst, src)
    return blocks


class LiveBlocks:
    """A model's `live_blocks`, learnt once (the first version an engine would install
    sparse), or why there are none: then every version is installed whole (`error`)."""

    def __init__(self) -> None:
        self.blocks: dict[str, Block] | None = None
        self.error: str | None = None

    def learn(self, model, named: list[tuple[str, torch.Tensor]],
              default_loader: Callable[[], Loader]) -> bool:
        """Whether a sparse install is possible on `model` (`default_loader()`: the
        engine's, imported only when needed)."""
        if self.blocks is None and self.error is None:
            started = time.perf_counter()
            try:
                self.blocks = live_blocks(model, named, default_loader())
                log.info("TensorHub: sparse steps are installed sparse (their tensors' places "
                         "in the live parameters learnt in %.0f ms)",
                         (time.perf_counter() - started) * 1e3)
            except Exception as exc:  # (Unsupported, or a loader that cannot be probed)
                self.error = str(exc)
                log.info("TensorHub: versions are installed whole on this model (%s)", exc)
        return self.blocks is not None

    def plan(self, model, named: list[tuple[str, torch.Tensor]], version: int,
             key: tuple) -> Plan | None:
        """`plan` through the blocks learnt; None where it cannot be made (logged: the
        version is installed whole, never refused; every later one too where the model
        turned out `Unsupported`)."""
        try:
            return plan(model, self.blocks, named, version, key)
        except Exception as exc:
            unsupported = isinstance(exc, Unsupported)
            log.warning("TensorHub: planning a sparse install of v%d failed (%s); it is "
                        "installed whole%s", version, exc,
                        ", and so is every version" if unsupported else "")
            if unsupported:
                self.error = str(exc)
            return None


@dataclass
class Plan:
    """The words of the live parameters that differ from a version, and their new bits."""

    version: int
    key: tuple  # what the live parameters held when compared (the caller's key)
    # (flat param, idx, bits): the index and bits in host memory, whatever the device
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    changed: int  # elements
    total: int
    params: list[str]  # the live parameters written


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _flat_index(param: torch.Tensor, dst: tuple[slice, ...],
                where: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Positions in `param`'s storage (contiguous) of `where` inside its region `dst`."""
    if len(dst) == 1:
        return where[0] + dst[0].start
    return (where[0] + dst[0].start) * param.shape[1] + where[1] + dst[1].start


SAMPLE_EVERY = 64  # the rows (of a 2-D block; elements of a 1-D one) the sample compares


def _sampled_density(params: dict, blocks: dict[str, Block],
                     named: list[tuple[str, torch.Tensor]]) -> float:
    """The fraction of words that differ in every `SAMPLE_EVERY`-th row of each block."""
    changed = seen = 0
    for name, new in named:
        block = blocks.get(name)
        if block is None:
            raise Unsupported(f"{name}: not in the live blocks")
        live = params[block.param].data[block.dst][::SAMPLE_EVERY]
        src = new[block.src][::SAMPLE_EVERY]
        changed += int((_bits(live.to(src.device)) != _bits(src)).sum())
        seen += src.numel()
    return changed / max(1, seen)


def plan(model, blocks: dict[str, Block], named: list[tuple[str, torch.Tensor]],
         version: int, key: tuple) -> Plan | None:
    """Compare the new version (`named`, checkpoint layout) with the live parameters; None
    when too much changed for a sparse install to pay (told from a sample first: a whole
    new version is not compared in full)."""
    params = dict(model.named_parameters())
    if _sampled_density(params, blocks, named) > MAX_DENSITY:
        return None
    per_param: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    changed = 0
    total = sum(new.numel() for _, new in named)
    budget = int(MAX_DENSITY * total)
    for name, new in named:
        block = blocks.get(name)
        if block is None:
            raise Unsupported(f"{name}: not in the live blocks")
        param = params[block.param].data
        if not param.is_contiguous():
            raise Unsupported(f"{block.param}: not contiguous")
        src = new[block.src]
        live = param[block.dst].to(src.device)  # (a GPU's weights: compared in host memory)
        where = (_bits(live) != _bits(src)).nonzero(as_tuple=True)
        n = where[0].numel()
        if n == 0:
            continue
        changed += n
        if changed > budget:
            return None
        per_param.setdefault(block.param, []).append(
            (_flat_index(param, block.dst, where), _bits(src[where])))
    writes = []
    for pname, parts in per_param.items():
        flat = _bits(params[pname].data).view(-1)
        writes.append((flat, torch.cat([i for i, _ in parts]),
                       torch.cat([v for _, v in parts])))
    return Plan(version, key, writes, changed, total, list(per_param))


def install(p: Plan) -> None:
    """Write the plan's words into the live parameters (inside the pause; on a device,
    each parameter's words moved there as it is written, so a plan holds no device
    memory before the pause)."""
    for flat, index, bits in p.writes:
        # (on CPU ~1.6x faster than an indexed assignment)
        flat.index_copy_(0, index.to(flat.device), bits.to(flat.device))
