"""verl 0.9.1's own `CheckpointEngineManager` moving weights with the TensorHub backend, on
CPU with a local Ray cluster. Runs in the verl venv (`scripts/setup.sh verl`);
`integration/test_verl.py` runs it and reads the JSON lines it prints.

verl's real classes do the work: the manager, `CheckpointEngineWorker` (the rollout side),
`RayWorkerGroup`, `RolloutReplica`. Two stand-ins, where the real part needs a GPU: the
trainer worker exposes the two entry points of verl's `ActorRolloutRefWorker` that the
manager calls (`update_weights`, `execute_checkpoint_engine`) over a synthetic model
instead of an FSDP one, and each rollout worker's server adapter stores what it receives
instead of loading it into a GPU engine. No coordinator is configured: the backend starts
the cluster's coordinator actor at the first sync.

Steps: two syncs to two replicas; a third replica joins and takes the current weights
from its peers with no sync (the trainer sends nothing); then it is added to the manager
and a third sync reaches all three; then verl sends that step again, as its validation
does.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile

import ray
import torch
from verl.checkpoint_engine import (
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    CheckpointEngineWorker,
)
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout import RolloutReplica

from tensorhub.core.checksum import checksum

BACKEND_MODULE = "tensorhub_plugins.verl.checkpoint_engine"


def make_weights(step: int):
    """The trainer's weights at `step`: mixed dtypes, an odd-sized bf16 tensor before an
    fp32 one (misaligned packing shows there), and a tensor of a few MiB."""
    g = torch.Generator().manual_seed(1000 + step)
    yield "model.embed_tokens.weight", torch.randn(64, 33, generator=g).to(torch.bfloat16)
    yield "model.norm.bias", torch.randn(7, generator=g).to(torch.bfloat16)
    yield "model.layers.0.mlp.weight", torch.randn(128, 128, generator=g)
    yield "model.layers.1.mlp.weight", torch.randn(600, 1000, generator=g)
    yield "lm_head.weight", torch.randn(33, 64, generator=g).to(torch.bfloat16)


def checksums(named) -> dict[str, list]:
    return {n: [list(t.shape), str(t.dtype), checksum(t.contiguous())] for n, t in named}


class Trainer(Worker):
    """Stands in for verl's ActorRolloutRefWorker (the FSDP trainer needs a GPU): the same
    construction of the checkpoint engine, and the same two entry points."""

    def __init__(self, ce_config: CheckpointEngineConfig):
        super().__init__()
        import importlib

        importlib.import_module(ce_config.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce_config.backend, is_master=self.rank == 0,
            bucket_size=ce_config.update_weights_bucket_megabytes << 20,
            **ce_config.engine_kwargs.get(ce_config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(make_weights(global_steps or 0),
                                                         global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class StoringAdapter:
    """Stands in for the GPU engine's server adapter: keeps copies of what it is given."""

    replica_rank = 0
    is_leader_rank = True

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}
        self.global_steps = None

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors",
                             **_):
        self.global_steps = global_steps
        async for name, t in weights:
            self.received[name] = t.clone()


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config, model_config, *args, **kwargs):
        super().__init__(rollout_config, model_config, StoringAdapter(), *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self):
        pull = self.checkpoint_engine._replica.last_pull
        return {"global_steps": self.server_adapter.global_steps,
                "checksums": checksums(self.server_adapter.received.items()),
                "sources": list(pull.sources) if pull else [],
                "name": self.checkpoint_engine._replica.session.name}


class Replica(RolloutReplica):
    async def init_hybrid(self, worker_group):
        self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                            self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self):
        raise NotImplementedError

    async def launch_servers(self):
        raise NotImplementedError


def _rollout_group(size: int, rollout_config: RolloutConfig) -> RayWorkerGroup:
    return RayWorkerGroup(
        resource_pool=RayResourcePool(process_on_nodes=[size], use_gpu=False,
                                      max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker),
                                               rollout_config=rollout_config,
                                               model_config=None),
        device_name="cpu")


def _report(event: str, group: RayWorkerGroup, step: int, **extra) -> bool:
    want = checksums(make_weights(step))
    got = group.received()
    ok = all(r["global_steps"] == step and r["checksums"] == want for r in got)
    print(json.dumps({"event": event, "step": step, "bit_exact": ok,
                      "receivers": [{"name": r["name"], "sources": r["sources"],
                                     "bit_exact": r["checksums"] == want} for r in got],
                      **extra}), flush=True)
    return ok


async def main() -> int:
    from tensorhub.ray_coordinator import stop_coordinator

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Unix socket paths in it
    # 4 logical CPUs: one a worker (Ray's count is a label; the machine may have 2 cores)
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir,
             runtime_env={"env_vars": {"PYTHONPATH": repo, "RAY_DEDUP_LOGS": "0"}})
    try:
        ce_config = CheckpointEngineConfig(backend="tensorhub",
                                           update_weights_bucket_megabytes=1,
                                           custom_backend_module=BACKEND_MODULE)
        rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1,
                                       checkpoint_engine=ce_config)
        trainer = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[1], use_gpu=False,
                                          max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer),
                                                   ce_config=ce_config),
            device_name="cpu")
        first_two = _rollout_group(2, rollout_config)
        replicas = [Replica(replica_rank=i, config=rollout_config, model_config=None)
                    for i in range(2)]
        await asyncio.gather(*[r.init_hybrid(first_two) for r in replicas])
        manager = CheckpointEngineManager(config=ce_config, actor_wg=trainer,
                                          replicas=replicas)
        ok = True
        for step in (1, 2):
            metrics = await manager.update_weights(global_steps=step)
            ok &= _report("sync", first_two, step, metrics=metrics)
        # a third replica joins: it takes step 2's weights from its peers, no sync, no group
        late = _rollout_group(1, rollout_config)
        third = Replica(replica_rank=0, config=rollout_config, model_config=None)
        await third.init_hybrid(late)
        ray.get(late.update_weights(global_steps=2))
        ok &= _report("joined", late, 2)
        manager.add_replicas([third])
        metrics = await manager.update_weights(global_steps=3)
        ok &= _report("sync", first_two, 3, metrics=metrics)
        ok &= _report("sync", late, 3, metrics=metrics)
        # verl sends a step again (validation does): a new version of the same weights
        metrics = await manager.update_weights(global_steps=3)
        ok &= _report("resent", first_two, 3, metrics=metrics)
        return 0 if ok else 1
    finally:
        stop_coordinator()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
