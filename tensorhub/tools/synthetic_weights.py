"""Weights to publish without a model, for the demo and `tensorhub publish --synthetic-mb`:
a model-shaped state dict of random tensors (`synthetic_state_dict`), and a small
transformer trained in bf16 with AdamW at RL learning rates (`AdamWSteps`,
`tensorhub publish --adamw-lr`), whose versions change as real optimizer steps do.

The AdamW model's loss is next-token prediction on random tokens, a stand-in for a
policy-gradient loss: what decides how many bf16 words a step changes is AdamW's update size
against bf16's rounding step, which the data does not change much. Pure torch (no model
library), so any venv runs it.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 4096


def synthetic_state_dict(total_mb: float, n_tiny: int = 500, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A model-shaped state dict: `n_tiny` small tensors (norms, biases; 4-64 KiB) and large
    matrices making up the rest of `total_mb`."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    tiny_bytes = 0
    for i in range(n_tiny):
        n = int(torch.randint(1024, 16 * 1024, (1,), generator=g))
        out[f"layers.{i // 4}.tiny.{i % 4}"] = torch.randn(n, generator=g).to(dtype)
        tiny_bytes += n * elem
    remaining = int(total_mb * 2**20) - tiny_bytes
    big = 0
    while remaining > 0:
        rows = min(remaining // (4096 * elem), 2048) or 1
        out[f"big.{big}.weight"] = torch.randn(rows, 4096, generator=g).to(dtype)
        remaining -= rows * 4096 * elem
        big += 1
    return out


class TinyLM(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, src_mask=causal.to(x.dtype))
        return self.head(self.norm(x))


def shape_for(total_mb: float, dim: int = 512) -> tuple[int, int]:
    """(dim, layers) of a TinyLM of about `total_mb` MiB in bf16."""
    per_layer = 12 * dim * dim + 13 * dim  # attention 4d^2, MLP 8d^2, norms and biases
    rest = 2 * VOCAB * dim
    layers = max(1, round((total_mb * 2**20 / 2 - rest) / per_layer))
    return dim, layers


class AdamWSteps:
    """A bf16 TinyLM and its AdamW; `step()` takes one optimizer step on a fresh batch."""

    def __init__(self, total_mb: float, lr: float, seed: int = 0, batch: int = 2,
                 seq: int = 32):
        torch.manual_seed(seed)
        dim, layers = shape_for(total_mb)
        self.model = TinyLM(dim, layers).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.batch, self.seq = batch, seq
        self._gen = torch.Generator().manual_seed(seed + 1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live parameters (publish them as they are; they change at each step)."""
        return {n: p.data for n, p in self.model.named_parameters()}

    def step(self) -> float:
        tokens = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=self._gen)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                           tokens[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())
