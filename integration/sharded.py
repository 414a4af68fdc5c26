"""Two trainer ranks publishing one version together, for the engine tests: each rank a
share of the tensors, and the largest tensor split by rows between them."""

from __future__ import annotations

import threading

import torch

from tensorhub import Publisher


def publish_in_two_ranks(address: str, model: str, state: dict[str, torch.Tensor],
                         version: int, owners: dict[str, str] | None = None) -> None:
    """`owners`: the job's credentials for the model (`Publisher.owners` of the trainer
    that published it before): rank 0 takes part 0 over from it, as a job that starts
    sharding does."""
    big = max(state, key=lambda n: state[n].numel())
    rest = sorted(n for n in state if n != big)
    total, split = state[big].shape[0], state[big].shape[0] // 2
    shares = [{**{n: state[n] for n in rest[0::2]}, big: state[big][:split]},
              {**{n: state[n] for n in rest[1::2]}, big: state[big][split:]}]
    rows = [{big: (0, total)}, {big: (split, total)}]
    ranks = [Publisher(address, model, name=f"rank{r}", part=r, parts=2,
                       owners=owners if r == 0 else None) for r in range(2)]
    try:
        published: list[int] = []
        first = threading.Thread(target=lambda: published.append(
            ranks[0].publish(shares[0], version, rows=rows[0])))
        first.start()
        published.append(ranks[1].publish(shares[1], version, rows=rows[1]))
        first.join(60)
        assert published == [version, version], published
    finally:
        for rank in ranks:
            rank.close()
