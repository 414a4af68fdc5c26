"""bf16 weights on which the fp8 quantizers are compared with the engines' own."""

from __future__ import annotations

import torch


def bf16_weights() -> dict[str, torch.Tensor]:
    """Weights that reach every branch: a 1M-element matrix (many values near a rounding
    midpoint), shapes that are not whole 128-blocks, rows of very different magnitude
    (the per-channel floor), a zero row and block, and values beyond any block's others."""
    g = torch.Generator().manual_seed(39)
    square = torch.randn(1024, 1024, generator=g) * 0.02
    ragged = torch.randn(300, 200, generator=g) * torch.logspace(-8, 1, 300).unsqueeze(1)
    ragged[7] = 0.0
    ragged[128:256, :128] = 0.0
    spiky = torch.randn(256, 384, generator=g)
    spiky[3, 5], spiky[200, 300] = 900.0, -0.5e-3
    return {n: t.to(torch.bfloat16).contiguous()
            for n, t in {"square": square, "ragged": ragged, "spiky": spiky}.items()}
