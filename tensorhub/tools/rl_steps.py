"""A small transformer trained in bf16 with AdamW at RL learning rates: versions whose changes
are those of real optimizer steps, for `tensorhub publish --adamw-lr` and the patch benchmark.

The loss is next-token prediction on random tokens, a stand-in for a policy-gradient loss:
what decides how many bf16 words a step changes is AdamW's update size against bf16's
rounding step, which the data does not change much. Pure torch (no model library), so any
venv runs it.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 4096


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
