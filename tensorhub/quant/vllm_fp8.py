"""vLLM's fp8 weight quantizers (vLLM 0.32), as the engine runs them on bf16 weights it
loads with `--quantization fp8_per_channel | fp8_per_tensor | fp8_per_block` (online
quantization at load, and again at every layerwise reload).

- per channel: `Fp8PtpcOnlineLinearMethod` (`online/fp8.py`: `weight_amax(dim=-1)`,
  `_fp8_channel_scale`, `_fp8_quant_per_channel`), plain torch, runs on CPU;
- per tensor: `Fp8PerTensorOnlineLinearMethod`, whose values come from the CUDA kernel
  `static_scaled_fp8_quant` (`1.0f / scale`, then a multiply); the CPU build has only a stub;
- per block: `per_block_cast_to_fp8(use_ue8m0=False)` (`utils/deep_gemm.py`), plain torch,
  fp32 `weight_scale_inv`; the engine's block GEMM needs AMX or a GPU.

Under tensor parallelism vLLM reduces the amax over the ranks wherever a scale spans the
shard boundary, so each rank's bytes are a slice of these (whole-weight) results.
"""

from __future__ import annotations

import torch

from tensorhub.quant.fp8 import FP8, FP8_MAX, FP8_MIN, Fp8Weight, block_cast, check_matrix

# vLLM quantizes this many elements at a time (its fp32 intermediate stays small); the
# bytes do not depend on it, only the peak memory.
_CHUNK_ELEMENTS = 16 * 1024 * 1024


def _amax(weight: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    lo, hi = weight.aminmax(dim=dim, keepdim=keepdim) if dim is not None else weight.aminmax()
    return torch.maximum(lo.abs(), hi.abs())


def _fp8_max(device: torch.device) -> torch.Tensor:
    # A 0-d tensor divisor: a true division, as vLLM does (a Python float divisor would be
    # lowered to a multiply by its reciprocal, which rounds some scales differently).
    return torch.tensor(FP8_MAX, device=device, dtype=torch.float32)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.to(torch.float32)
    return amax / _fp8_max(amax.device)


def vllm_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """`fp8_per_channel`: one scale per output row (`[out, 1]`, fp32), floored at
    1 / (448 * 512); values divided (not multiplied by a reciprocal) by their row's scale.
    vLLM keeps the weight transposed (`weight.t()` of these values) on the layer."""
    check_matrix(weight)
    fp8_max = _fp8_max(weight.device)
    scale = _scale(_amax(weight, dim=-1, keepdim=True)).clamp_min(1.0 / (fp8_max * 512))
    out = torch.empty_like(weight, dtype=FP8)
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[-1])
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        out[part] = (weight[part] / scale[part]).clamp_(FP8_MIN, FP8_MAX).to(FP8)
    return Fp8Weight(out, scale)


def vllm_per_tensor(weight: torch.Tensor) -> Fp8Weight:
    """`fp8_per_tensor`: one scale (`[1]`, fp32, amax / 448 by a true division); each value
    is `float(x) * (1 / scale)`, saturated to ±448, rounded to nearest even, as the CUDA
    kernel `static_scaled_fp8_quant` does."""
    check_matrix(weight)
    scale = _scale(_amax(weight).reshape(1))
    inverse = torch.ones_like(scale) / scale
    out = torch.empty_like(weight, dtype=FP8)
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[-1])
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        out[part] = (weight[part].float() * inverse).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(out, scale)


def vllm_block(weight: torch.Tensor) -> Fp8Weight:
    """`fp8_per_block`: 128 x 128 blocks (the weight zero-padded to whole blocks), each
    with an fp32 scale amax / 448 (amax floored at 1e-4); values multiplied by
    `1.0 / scale`. The scale is vLLM's `weight_scale_inv`. Its bytes are the device's, as
    the engine's are: on CUDA PyTorch divides by the scalar 448 as a multiplication by its
    float32 reciprocal, so about half the scales differ from a CPU's in the last bit;
    quantized bytes are only interchangeable between engines on the same kind of device."""
    return block_cast(weight, lambda amax: amax / FP8_MAX)
