"""What the fp8 recipes share: the e4m3 type, its range, the result of a quantizer, and the
128 x 128 block cast the block recipes of both engines make (they differ in the scale)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
FP8_MIN = float(torch.finfo(FP8).min)
BLOCK = 128  # the side of a block in the block recipes (DeepSeek-style 128 x 128)


class Fp8Weight(NamedTuple):
    """A weight as an engine holds it after quantizing: fp8 values of the weight's
    [out, in] shape and their fp32 scales (per tensor: [1]; per channel: [out, 1];
    per block: [ceil(out / 128), ceil(in / 128)]). The value of an element is
    `weight * scale` (vLLM names the block scale `weight_scale_inv` for that reason)."""

    weight: torch.Tensor
    scale: torch.Tensor


def check_matrix(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"a quantizer takes a 2-d [out, in] weight, not {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype == FP8:
        raise ValueError(f"a quantizer takes bf16/fp16/fp32 weights, not {weight.dtype}")


def block_cast(weight: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor]
               ) -> Fp8Weight:
    """DeepGEMM's `per_block_cast_to_fp8`, as both engines copy it: the weight zero-padded to
    whole 128 x 128 blocks, each block's amax (floored at 1e-4) made a scale by `scale_of`
    (vLLM: amax / 448; SGLang: that rounded up to a power of two), values multiplied by
    `1.0 / scale`."""
    check_matrix(weight)
    m, n = weight.shape
    padded = torch.zeros((-(-m // BLOCK) * BLOCK, -(-n // BLOCK) * BLOCK), dtype=weight.dtype,
                         device=weight.device)
    padded[:m, :n] = weight
    blocks = padded.view(-1, BLOCK, padded.size(1) // BLOCK, BLOCK)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = scale_of(amax)
    values = (blocks * (1.0 / scale)).to(FP8)
    return Fp8Weight(values.view_as(padded)[:m, :n].contiguous(),
                     scale.view(blocks.size(0), blocks.size(2)))
