"""What a simulated fan-out is of: the fleet, the model, the links, and how its figures read.

`swarm.py` runs a `SimConfig`; its result is `Completions` (each reader's completion time
over the lower bound: a reader's NIC receiving every byte once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.core.chunks import CHUNK_BYTES
from tensorhub.core.data_types import Manifest, TensorSpec

GB = 1e9


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    model_bytes: int = 8 << 30
    tensor_bytes: int = 512 << 20  # the model is tensors of this size plus a compact region
    chunk_bytes: int = CHUNK_BYTES
    nic_gbps: float = 100.0  # every worker's NIC, each way
    latency: float = 10e-6  # one-sided read start, inside a datacenter
    wan_gbps: float = 100.0  # one stream between datacenters
    wan_latency: float = 1e-3
    rpc: float = 100e-6  # a coordinator round trip
    dcs: int = 1  # workers are spread round robin over this many datacenters
    per_node: int = 8  # workers per node (same-node peers come first)
    seed: int = 0  # of the heartbeats' phases and the busy retries' jitter
    kill: tuple[int, ...] = ()  # workers killed mid-pull ...
    kill_at: float = 0.5  # ... at this fraction of the lower bound
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    time_limit: float = 600.0  # simulated seconds
    # 2: the figures are of the second of two versions, which readers pull by the parents
    # they had for the first (a steady fleet: no plan requests).
    version: int = 1
    # Readers stand by before the first version exists (placed ahead in its forest), and
    # pull it as the next ones, from the parents they were told.
    standby: bool = False
    # Readers ask for each version at moments spread evenly over this many seconds after
    # it is announced (0: all at once), as rollout workers told to sync one by one; each
    # reader's time counts from its own moment.
    spread: float = 0.0
    # One more reader, whose transport reaches no other worker (every read and poll by it
    # or of it fails), asks first; it is in no figure.
    failing_first: bool = False
    # A version in tiles (`tensorhub/tiles.py`): its parts' manifests in part order, as
    # `tiles.manifests` gives them (`model_bytes` and `tensor_bytes` then unused).
    # Worker i is a node, node i % engine_nodes of its engine, whose TP ranks (one per
    # tile) are spread evenly over the engine's nodes; it pulls the parts
    # `tiles.node_parts` gives its ranks, each part by a reader of its own on its NIC.
    tiled: tuple[Manifest, ...] = ()
    engine_nodes: int = 1

    @property
    def parts(self) -> list[Manifest]:
        """The manifests of a version's parts: the tiles, or one synthetic model."""
        return list(self.tiled) or [synthetic_manifest(self.model_bytes, self.tensor_bytes)]

    def node_parts(self, worker: int) -> list[int]:
        """The parts worker `worker` pulls: every part of an untiled version; of a version
        in tiles, what its node's ranks load (`tiles.node_share`: their tiles, the whole
        part, and their heads' K/V parts where the version splits K/V by head)."""
        if not self.tiled:
            return [0]
        from tensorhub.tiles import node_share

        tiles = self.tiled[0].tiles or 1
        per_node = tiles // self.engine_nodes
        node = worker % self.engine_nodes
        share = node_share(range(node * per_node, (node + 1) * per_node), tiles)
        return sorted(share(len(self.tiled), self.tiled[0]))

    @property
    def share_bytes(self) -> int:
        """The most bytes one worker pulls: the model, or its node's share of it."""
        if not self.tiled:
            return self.model_bytes
        sizes = [manifest_bytes(m) for m in self.tiled]
        return max(sum(sizes[p] for p in self.node_parts(w))
                   for w in range(max(1, self.engine_nodes)))

    @property
    def lower_bound(self) -> float:
        """A reader cannot finish before its NIC has received every byte it pulls, nor
        before the trainer's has sent every byte of the version once (more than a node's
        share, for a version in tiles)."""
        nbytes = max(self.share_bytes, sum(manifest_bytes(m) for m in self.tiled))
        return nbytes * 8 / (self.nic_gbps * GB) + self.latency + self.rpc


class Completions:
    """Completion figures of a simulated fan-out: `finished` (worker -> seconds) over the
    `config`'s lower bound."""

    config: SimConfig
    finished: dict[str, float]

    @property
    def worst(self) -> float:
        return max(self.finished.values()) if self.finished else math.inf

    @property
    def ratio(self) -> float:
        """Worst completion over the lower bound."""
        return self.worst / self.config.lower_bound


def manifest_bytes(manifest: Manifest) -> int:
    return sum(t.nbytes for t in manifest.tensors)


def synthetic_manifest(model_bytes: int, tensor_bytes: int) -> Manifest:
    """A model of uint8 tensors: 64 tiny ones (the compact region) and large ones."""
    tensors = [TensorSpec(name=f"norm.{i}", dtype="uint8", shape=[4096], nbytes=4096)
               for i in range(64)]
    left, i = model_bytes - 64 * 4096, 0
    while left > 0:
        n = min(tensor_bytes, left)
        tensors.append(TensorSpec(name=f"layer.{i}", dtype="uint8", shape=[n], nbytes=n))
        left, i = left - n, i + 1
    return Manifest(tensors=tensors, compact_threshold=1 << 20)
