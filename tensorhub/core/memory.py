"""Small helpers over raw tensor memory shared by layouts, transports and workers."""

from __future__ import annotations

import hashlib

import torch

from tensorhub.core.data_types import MemoryDesc

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by TensorHub") from None


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("TensorHub needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


def describe(tensor: torch.Tensor) -> MemoryDesc:
    """Where a tensor's bytes lie, as a peer needs to know to read them."""
    on_gpu = tensor.device.type == "cuda"
    return MemoryDesc(
        addr=tensor.data_ptr(),
        nbytes=tensor.numel() * tensor.element_size(),
        device=(tensor.device.index or 0) if on_gpu else 0,
        mem="VRAM" if on_gpu else "DRAM",
    )


def regions_digest(memory: list[MemoryDesc]) -> str:
    """A short digest of where a holder's items lie: equal digests, same regions (a reader
    re-uses the regions it knows of a publisher only if they did not move)."""
    h = hashlib.sha256()
    for m in memory:
        h.update(f"{m.addr}:{m.nbytes}:{m.device}:{m.mem};".encode())
    return h.hexdigest()[:32]
