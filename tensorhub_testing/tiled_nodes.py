"""A trainer that publishes in tiles and the node copies of TP engines that pull their share,
as processes on emulated hosts: what an engine spanning nodes does to pull a version, without
the engine (`tests/test_node_shares_hosts.py`).

    python -m tensorhub_testing.tiled_nodes trainer COORDINATOR --tiles 4 --layers 6
        # publishes `llama_state(v)` as version v for each line v on stdin, in tiles
    python -m tensorhub_testing.tiled_nodes node COORDINATOR --name A1 --ranks 1 --tp 2
        # pulls every new version's share (`node_share`), prints its checksums, serves it

Each prints one JSON line per event. A node's checksums are of what its ranks load of each
tensor (`share_of`), so the test compares them with the trainer's state computed locally.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

HIDDEN, FFN, VOCAB = 256, 512, 1024


def llama_state(seed: int, layers: int = 2, hidden: int = HIDDEN, ffn: int = FFN,
                vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A small Llama-shaped state dict (fp32), the same for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name, shape in (("self_attn.q_proj", (hidden, hidden)),
                            ("self_attn.k_proj", (hidden, hidden)),
                            ("self_attn.v_proj", (hidden, hidden)),
                            ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (ffn, hidden)), ("mlp.up_proj", (ffn, hidden)),
                            ("mlp.down_proj", (hidden, ffn))):
            state[f"{p}.{name}.weight"] = torch.randn(*shape, generator=g)
        state[f"{p}.input_layernorm.weight"] = torch.randn(hidden, generator=g)
    state["model.norm.weight"] = torch.randn(hidden, generator=g)
    return state


def moe_state(seed: int, layers: int = 2, experts: int = 4, hidden: int = 64,
              ffn: int = 128) -> dict[str, torch.Tensor]:
    """A small Qwen-MoE-shaped state dict (fp32): attention, a router, `experts` routed
    experts and a shared one per layer; the same for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
                  "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
                  "mlp.gate": (experts, hidden)}
        for expert in [*(f"experts.{e}" for e in range(experts)), "shared_expert"]:
            shapes |= {f"mlp.{expert}.gate_proj": (ffn, hidden),
                       f"mlp.{expert}.up_proj": (ffn, hidden),
                       f"mlp.{expert}.down_proj": (hidden, ffn)}
        for name, shape in shapes.items():
            state[f"{p}.{name}.weight"] = torch.randn(*shape, generator=g)
        state[f"{p}.input_layernorm.weight"] = torch.randn(hidden, generator=g)
    state["model.norm.weight"] = torch.randn(hidden, generator=g)
    state["lm_head.weight"] = torch.randn(VOCAB, hidden, generator=g)
    return state


@contextmanager
def two_nodes_and_a_whole_reader(coordinator: str, shares: list, **trainer_kw
                                 ) -> Iterator[tuple]:
    """In this process: a `TiledPublisher` of "policy" (`trainer_kw`: its tiles, experts,
    K/V heads), a reader per share named node0, node1, and one of every part named whole;
    all closed at the end."""
    from tensorhub import PartedReplica
    from tensorhub.tiles import TiledPublisher

    with TiledPublisher(coordinator, "policy", transport="auto", **trainer_kw) as trainer, \
            PartedReplica(coordinator, "policy", name="node0", transport="auto",
                          share=shares[0]) as node0, \
            PartedReplica(coordinator, "policy", name="node1", transport="auto",
                          share=shares[1]) as node1, \
            PartedReplica(coordinator, "policy", name="whole", transport="auto") as whole:
        yield trainer, node0, node1, whole


def held_by(coordinator: str, model: str, names: list[str]) -> dict[str, list[int]]:
    """The versions of `model` the coordinator counts each reader in `names` as holding
    (a reader of a share: its share)."""
    from tensorhub.core.client import CoordinatorClient
    from tensorhub.core.data_types import HoldingsRequest

    client = CoordinatorClient(coordinator)
    try:
        return client.call(HoldingsRequest(model=model, names=names)).holdings
    finally:
        client.close()


def share_of(state: dict[str, torch.Tensor], ranks: list[int], tp: int
             ) -> dict[str, torch.Tensor]:
    """What TP ranks `ranks` (contiguous) load of each tensor of a version in tiles: their
    rows or columns of a tiled weight, the rest whole."""
    from tensorhub.tiles import split_dim

    out = {}
    for name, t in state.items():
        dim = split_dim(name)
        if dim is None:
            out[name] = t
            continue
        step = t.shape[dim] // tp
        out[name] = t.narrow(dim, min(ranks) * step, len(ranks) * step).contiguous()
    return out


def share_checksums(state: dict[str, torch.Tensor], ranks: list[int], tp: int
                    ) -> dict[str, str]:
    from tensorhub.core.checksum import checksum

    return {n: checksum(t) for n, t in share_of(state, ranks, tp).items()}


def _stopper() -> list:
    stop: list = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    return stop


def _trainer(args: argparse.Namespace) -> None:
    from tensorhub.tiles import TiledPublisher

    with TiledPublisher(args.coordinator, "policy", args.tiles, name="trainer") as trainer:
        for line in sys.stdin:  # (its end: stop serving)
            state = llama_state(int(line), args.layers, args.hidden, args.ffn)
            version = trainer.publish(state, int(line))
            print(json.dumps({"event": "published", "version": version}), flush=True)


def _node(args: argparse.Namespace) -> None:
    from tensorhub.core.errors import TensorHubError
    from tensorhub.parted import PartedReplica
    from tensorhub.tiles import node_share

    ranks = [int(r) for r in args.ranks.split(",")]
    stop = _stopper()
    with PartedReplica(args.coordinator, "policy", name=args.name,
                       share=node_share(ranks, args.tp)) as node:
        while not stop:
            if node.wait_for_newer(timeout=0.5) is None:
                continue
            try:
                version = node.pull("latest", timeout=args.pull_timeout)
            except TensorHubError as exc:
                print(json.dumps({"event": "error", "code": exc.code, "message": str(exc)}),
                      flush=True)
                continue
            stats = [r.last_pull for r in node.replicas if r.last_pull is not None]
            by_source: dict[str, int] = {}
            for s in stats:
                for source, n in s.by_source.items():
                    by_source[source] = by_source.get(source, 0) + n
            print(json.dumps({"event": "pulled", "version": version,
                              "nbytes": sum(s.nbytes for s in stats),
                              "by_source": by_source,
                              "checksums": share_checksums(node.tensors, ranks, args.tp)}),
                  flush=True)
        while not stop:
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tensorhub_testing.tiled_nodes")
    sub = p.add_subparsers(dest="role", required=True)
    t = sub.add_parser("trainer", help="publish llama_state(v) in tiles for each v on stdin")
    t.add_argument("coordinator")
    t.add_argument("--tiles", type=int, default=4)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=HIDDEN)
    t.add_argument("--ffn", type=int, default=FFN)
    n = sub.add_parser("node", help="a node's copy: pull each version's share, serve it")
    n.add_argument("coordinator")
    n.add_argument("--name", required=True)
    n.add_argument("--ranks", required=True, help="the node's TP ranks, e.g. 2,3")
    n.add_argument("--tp", type=int, required=True)
    n.add_argument("--pull-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    (_trainer if args.role == "trainer" else _node)(args)


if __name__ == "__main__":
    main()
