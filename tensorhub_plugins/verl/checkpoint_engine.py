"""TensorHub as a verl checkpoint engine (verl 0.9.1, `verl/checkpoint_engine/`).

Select it in a verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorhub
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tensorhub_plugins.verl.checkpoint_engine

verl's own engines build a communication group over the trainer and every rollout worker
at each sync (an NCCL broadcast, a NIXL chain) and rebuild it when replicas come or go.
This one builds none. The trainer's rank 0 publishes the step's weights as version
`global_steps + 1` (versions start at 1, verl's steps at 0); each rollout worker pulls that
version one-sided from whichever peer holds it (the trainer, or a rollout worker that has
it already) and serves it on to the others. A replica that joins later pulls from its peers
like any other; nothing is rebuilt, and a rollout worker that dies takes no group down
with it.

Where the coordinator is, in this order: ``engine_kwargs.tensorhub.coordinator`` (with
``token``), ``TENSORHUB_COORDINATOR`` (and ``TENSORHUB_TOKEN``) in the workers'
environment, else the Ray cluster's named coordinator actor (`tensorhub.ray_coordinator`),
which the driver starts at the first sync if none runs. ``engine_kwargs.tensorhub.model``
names the weights (default "policy"); a run that restarts its step count needs a new name
or a new coordinator (a version is never published twice).

Each rollout worker keeps its pulled copy in host memory (that copy is what it serves to
peers), so a worker needs the model's size in RAM once more than the engine's weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from tensorhub import Publisher, Replica

log = logging.getLogger("tensorhub.verl")
DEFAULT_MODEL = "policy"
PULL_TIMEOUT = 600.0  # seconds a rollout worker waits for the step's version, and pulls it


def version_of(global_steps: int | None) -> int | None:
    """The TensorHub version of verl's step (None: the next one)."""
    return None if global_steps is None else global_steps + 1


@CheckpointEngineRegistry.register("tensorhub")
class TensorHubCheckpointEngine(CheckpointEngine):
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False,
                 coordinator: str | None = None, token: str | None = None,
                 model: str = DEFAULT_MODEL, name: str | None = None,
                 pull_timeout: float = PULL_TIMEOUT):
        """`bucket_size` is verl's (unused: a version moves whole, not bucket by bucket);
        `is_master` is set on the trainer side, True on torch rank 0 (the one that
        publishes)."""
        self.is_master = is_master
        self.coordinator = coordinator or os.environ.get("TENSORHUB_COORDINATOR")
        self.token = token
        self.model = model
        self.name = name
        self.pull_timeout = pull_timeout
        self._publisher: Publisher | None = None
        self._replica: Replica | None = None
        self._connected_to: str | None = None

    # --------------------------------------------------------------- "group" set-up
    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate or register ahead: what a worker was told of the coordinator
        goes to the driver's `build_topology`."""
        return {"coordinator": self.coordinator, "token": self.token}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        """No topology: every worker is told the same coordinator. The first one a worker
        was configured with, else the Ray cluster's coordinator actor (started here, in the
        driver, if none runs yet)."""
        known = [m for m in metadata if m and m.get("coordinator")]
        if known:
            address, token = known[0]["coordinator"], known[0].get("token")
        else:
            from tensorhub.ray_coordinator import start_coordinator

            info = start_coordinator()
            address, token = info.address, info.token
        return ({"coordinator": [address] * actor_wg_world_size,
                 "token": [token] * actor_wg_world_size},
                {"coordinator": [address] * rollout_world_size,
                 "token": [token] * rollout_world_size})

    def init_process_group(self, coordinator: str | None = None, token: str | None = None,
                           **_: Any) -> None:
        """Remember the coordinator; the first sync connects (later ones find it connected,
        and a replica added since needs nothing from the others)."""
        if coordinator and coordinator != self._connected_to:
            self.close()
            self.coordinator, self.token = coordinator, token

    def finalize(self) -> None:
        """Nothing to tear down: a rollout worker keeps serving its copy to peers."""

    # --------------------------------------------------------------- trainer side
    def _worker_name(self, role: str) -> str:
        return self.name or f"verl-{role}-{os.uname().nodename}-{os.getpid()}"

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 publishes the weights as version `global_steps + 1` (or the next one);
        other ranks only drain the generator (each tensor is a collective across them)."""
        if not self.is_master:
            for _ in weights:
                pass
            return {}
        started = time.perf_counter()
        named = [(name, t.detach().to("cpu")) for name, t in weights]
        gathered = time.perf_counter() - started
        if self._publisher is None:
            self._publisher = Publisher(self._address(), self.model, token=self.token,
                                        name=self._worker_name("trainer"))
            self._connected_to = self.coordinator
        version = await asyncio.to_thread(self._publisher.publish, named,
                                        version_of(global_steps))
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        log.info("published %s v%d: %d tensors, %.1f MiB (gathered in %.2f s, published in "
                 "%.2f s)", self.model, version, len(named), nbytes / 2**20, gathered,
                 time.perf_counter() - started - gathered)
        return {"tensorhub/version": float(version), "tensorhub/bytes": float(nbytes),
                "tensorhub/send_seconds": time.perf_counter() - started}

    # --------------------------------------------------------------- rollout side
    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Pull version `global_steps + 1` (or the next newer one) from whichever peers hold
        it, then yield its tensors: views of this worker's copy, which verl's server adapter
        copies into the engine before asking for the next."""
        replica = await asyncio.to_thread(self._pull, global_steps)
        for name, tensor in replica.layout.named_tensors():
            yield name, tensor

    def _pull(self, global_steps: int | None) -> Replica:
        if self._replica is None:
            self._replica = Replica(self._address(), self.model, token=self.token,
                                    name=self._worker_name("rollout"))
            self._connected_to = self.coordinator
        replica = self._replica
        wanted = version_of(global_steps)
        deadline = time.monotonic() + self.pull_timeout
        # the trainer publishes while we wait: send and receive run at the same time
        if wanted is None or replica.version is None or replica.version < wanted:
            than = "ours" if wanted is None else wanted - 1
            if replica.wait_for_newer(max(0.0, deadline - time.monotonic()), than=than) is None:
                raise TimeoutError(
                    f"tensorhub: no {self.model!r} version {wanted or 'newer than ours'} was "
                    f"published within {self.pull_timeout:.0f} s (is the trainer's rank 0 "
                    f"sending to the same coordinator, {self.coordinator}?)")
        replica.pull("latest" if wanted is None else wanted,
                     timeout=max(1.0, deadline - time.monotonic()))
        return replica

    def _address(self) -> str:
        """The coordinator: as configured or told by `init_process_group`, else (a worker
        used before any sync, e.g. a replica joining) the Ray cluster's coordinator actor."""
        if not self.coordinator:
            import ray

            if not ray.is_initialized():
                raise RuntimeError("tensorhub: no coordinator given: set engine_kwargs."
                                   "tensorhub.coordinator, or TENSORHUB_COORDINATOR, or run "
                                   "under Ray (the driver's first sync starts one)")
            from tensorhub.ray_coordinator import find_coordinator

            info = find_coordinator()
            self.coordinator, self.token = info.address, info.token
        return self.coordinator

    def close(self) -> None:
        for client in (self._publisher, self._replica):
            if client is not None:
                client.close()
        self._publisher = self._replica = None
        self._connected_to = None
