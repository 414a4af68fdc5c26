"""SGLang's fp8 weight quantizers (SGLang 0.5.23), plain torch, as its `Fp8LinearMethod`
runs them on bf16 weights:

- per tensor: `input_to_float8` (`fp8_utils.py`): the online quantization of an unquantized
  checkpoint where no per-channel CUTLASS kernel is used; scale `448 / amax` (amax floored at
  1e-12), values multiplied by it, the stored scale its reciprocal;
- block, UE8M0 scales: `quant_weight_ue8m0` -> `per_block_cast_to_fp8` (copied in SGLang from
  DeepGEMM): 128 x 128 blocks, each scale amax / 448 rounded up to a power of two (the
  UE8M0 value, kept as fp32), values multiplied by `1.0 / scale`.

Both run on CPU in SGLang's venv; SGLang's CPU linear kernels for fp8 need AMX, so an
engine that serves with them needs AMX or a GPU.
"""

from __future__ import annotations

import torch

from tensorhub.quant.fp8 import FP8, FP8_MAX, Fp8Weight, block_cast, check_matrix


def sglang_per_tensor(weight: torch.Tensor) -> Fp8Weight:
    """`input_to_float8`: (fp8 values, the fp32 scale to multiply them by, 0-d)."""
    check_matrix(weight)
    lo, hi = weight.aminmax()
    amax = torch.maximum(lo.abs(), hi.abs()).float().clamp(min=1e-12)
    scale = FP8_MAX / amax
    saturated = (weight.float() * scale).clamp(min=-FP8_MAX, max=FP8_MAX)
    return Fp8Weight(saturated.to(FP8).contiguous(), scale.float().reciprocal())


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= |x| (exponent kept within 2^-126 .. 2^127), as fp32:
    a UE8M0 scale (8 exponent bits, no mantissa)."""
    bits = x.abs().float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    exp = exp + (mantissa != 0).to(torch.int32)
    exp = exp.clamp(1, 254)
    return (exp << 23).view(torch.float32)


def sglang_block_ue8m0(weight: torch.Tensor) -> Fp8Weight:
    """128 x 128 blocks with power-of-two scales: (fp8 values, [ceil(out/128),
    ceil(in/128)] fp32 scales). SGLang calls it on bf16 weights only."""
    return block_cast(weight, lambda amax: ceil_to_ue8m0(amax / FP8_MAX))
