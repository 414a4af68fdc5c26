"""TensorHub as a verl checkpoint engine (verl 0.9.1, `verl/checkpoint_engine/`).

Select it in a verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorhub
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tensorhub_plugins.verl.checkpoint_engine

verl's own engines build a communication group over the trainer and every rollout worker
at each sync (an NCCL broadcast, a NIXL chain) and rebuild it when replicas come or go.
This one builds none. At each sync the driver (`build_topology`) names the version, the
model's latest + 1; the trainer's rank 0 publishes the weights as that version, and each
rollout worker pulls it one-sided from whichever peer holds it (the trainer, or a rollout
worker that has it already) and serves it on to the others. A replica that joins later
pulls the latest version from its peers like any other; nothing is rebuilt, and a rollout
worker that dies takes no group down with it. verl's step (`global_steps`) only labels the
logs: verl sends some steps twice (validation, a second manager) or none (a step-less
`update_weights()`), and a resumed run starts its steps again, none of which may publish a
version twice.

Where the coordinator is, in this order: ``engine_kwargs.tensorhub.coordinator`` (with
``token``), ``TENSORHUB_COORDINATOR`` (and ``TENSORHUB_TOKEN``) in the workers'
environment, else the Ray cluster's coordinator actor (`tensorhub.ray_coordinator`), which
the driver starts at the first sync if none runs. ``engine_kwargs.tensorhub.model`` names
the weights; by default ``verl-<Ray job id>``, so two jobs sharing a cluster (and its
coordinator) never mix their versions.

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

from tensorhub import Publisher, Replica, settings
from tensorhub.engines import FleetView

log = logging.getLogger("tensorhub.verl")
PULL_TIMEOUT = 600.0  # seconds a rollout worker waits for the sync's version, and pulls it


def default_model() -> str:
    """The weights' name when none is configured: one per Ray job (the driver and every
    worker it started see the same job id), else "policy"."""
    try:
        import ray

        if ray.is_initialized():
            return f"verl-{ray.get_runtime_context().get_job_id()}"
    except ImportError:
        pass
    return "policy"


def latest_version(coordinator: str, token: str | None, model: str) -> int:
    """The model's newest version on the coordinator (0: none yet)."""
    fleet = FleetView.connect(coordinator, model, token=token)
    try:
        return fleet.latest()
    finally:
        fleet.close()


@CheckpointEngineRegistry.register("tensorhub")
class TensorHubCheckpointEngine(CheckpointEngine):
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False,
                 coordinator: str | None = None, token: str | None = None,
                 model: str | None = None, name: str | None = None,
                 pull_timeout: float = PULL_TIMEOUT):
        """`bucket_size` is verl's (unused: a version moves whole, not bucket by bucket);
        `is_master` is set on the trainer side, True on torch rank 0 (the one that
        publishes)."""
        self.is_master = is_master
        self.coordinator = coordinator or settings.COORDINATOR.get()
        self.token = token
        self.model = model or default_model()
        self.name = name
        self.pull_timeout = pull_timeout
        self._publisher: Publisher | None = None
        self._replica: Replica | None = None
        self._connected_to: str | None = None
        self._version: int | None = None  # the version the driver named for this sync

    # --------------------------------------------------------------- "group" set-up
    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate or register ahead: what a worker knows of the coordinator
        and the model goes to the driver's `build_topology`."""
        return {"coordinator": self.coordinator, "token": self.token, "model": self.model}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        """No topology: every worker is told the same coordinator and the version this sync
        makes (the model's latest + 1). The coordinator is the first one a worker was
        configured with, else the Ray cluster's coordinator actor (started here, in the
        driver, if none runs yet)."""
        known = [m for m in metadata if m and m.get("coordinator")]
        if known:
            address, token = known[0]["coordinator"], known[0].get("token")
        else:
            from tensorhub.ray_coordinator import start_coordinator

            info = start_coordinator()
            address, token = info.address, info.token
        version = latest_version(address, token, metadata[0]["model"]) + 1
        every = {"coordinator": address, "token": token, "version": version}
        return ({k: [v] * actor_wg_world_size for k, v in every.items()},
                {k: [v] * rollout_world_size for k, v in every.items()})

    def init_process_group(self, coordinator: str | None = None, token: str | None = None,
                           version: int | None = None, **_: Any) -> None:
        """Remember the coordinator and this sync's version; the first sync connects (later
        ones find it connected, and a replica added since needs nothing from the others)."""
        if coordinator and coordinator != self._connected_to:
            self.close()
            self.coordinator, self.token = coordinator, token
        self._version = version

    def finalize(self) -> None:
        """Nothing to tear down: a rollout worker keeps serving its copy to peers."""

    # --------------------------------------------------------------- trainer side
    def _worker_name(self, role: str) -> str:
        return self.name or f"verl-{role}-{os.uname().nodename}-{os.getpid()}"

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 publishes the weights as the version the driver named for this sync (the
        next one, outside a sync); other ranks only drain the generator (each tensor is a
        collective across them)."""
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
        version, self._version = self._version, None
        version = await asyncio.to_thread(self._publisher.publish, named, version)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        log.info("step %s: published %s v%d: %d tensors, %.1f MiB (gathered in %.2f s, "
                 "published in %.2f s)", global_steps, self.model, version, len(named),
                 nbytes / 2**20, gathered, time.perf_counter() - started - gathered)
        return {"tensorhub/version": float(version), "tensorhub/bytes": float(nbytes),
                "tensorhub/send_seconds": time.perf_counter() - started}

    # --------------------------------------------------------------- rollout side
    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Pull this sync's version (outside a sync: the latest) from whichever peers hold
        it, then yield its tensors: views of this worker's copy, which verl's server adapter
        copies into the engine before asking for the next."""
        wanted, self._version = self._version, None
        replica = await asyncio.to_thread(self._pull, wanted)
        log.info("step %s: received %s v%s", global_steps, self.model, replica.version)
        for name, tensor in replica.layout.named_tensors():
            yield name, tensor

    def _pull(self, wanted: int | None) -> Replica:
        if self._replica is None:
            self._replica = Replica(self._address(), self.model, token=self.token,
                                    name=self._worker_name("rollout"))
            self._connected_to = self.coordinator
        replica = self._replica
        deadline = time.monotonic() + self.pull_timeout
        # the trainer publishes while we wait: send and receive run at the same time
        if replica.version is None or (wanted is not None and replica.version < wanted):
            than = replica.version if wanted is None else wanted - 1
            if replica.wait_for_newer(max(0.0, deadline - time.monotonic()), than=than) is None:
                raise TimeoutError(
                    f"tensorhub: no {self.model!r} version {wanted or ''} was published "
                    f"within {self.pull_timeout:.0f} s (is the trainer's rank 0 sending "
                    f"to the same coordinator, {self.coordinator}?)")
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
