"""What the fp8 recipes share: the e4m3 type, its range, and the result of a quantizer."""

from __future__ import annotations

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
