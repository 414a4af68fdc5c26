"""An RL loop on a Ray cluster: a trainer actor on one node, `vllm serve` engine actors on
another, TensorHub moving each new policy between them.

    python -m examples.ray_rl_loop --address HEAD_IP:6379 --engines 2 --versions 4

The driver starts the cluster's coordinator as a named, detached actor
(`tensorhub.ray_coordinator`); the trainer and every engine actor find it by name, on
whatever node Ray placed them. The trainer (`integration/learner.py`) takes one Adam step
per version toward answering with a target word and publishes the version; each engine
actor runs a real `vllm serve` with the TensorHub plugin, which pulls the version from
whichever peer holds it (the trainer, or an engine that already has it) straight into
vLLM's weights. The driver measures each engine's reward on its answers and its
publish-to-serving time, and prints one JSON line per version and a last one with each
engine's answers to probe prompts (the test compares those with HF transformers on the
trainer's final weights, which the trainer writes to `--out`).

Nodes are chosen by custom resources: the trainer needs `trainer_host`, the engines
`engine_host` (start the nodes with ``ray start --resources '{"trainer_host": 1}'`` and
``'{"engine_host": 1}'``); `--any-node` drops that for a one-node cluster. The model folder
(`--out`) must be on a filesystem every node sees, as a checkpoint folder usually is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ray

from tensorhub.ray_coordinator import (
    coordinator_env,
    find_coordinator,
    start_coordinator,
    stop_coordinator,
)

MODEL = "policy"
PROBE_TOKENS = 12


@ray.remote(num_cpus=0)
class TrainerActor:
    """Trains and publishes; the coordinator is found by name, not passed in."""

    def __init__(self, model_dir: str):
        from integration.learner import Learner
        from tensorhub import Publisher

        info = find_coordinator()
        self.learner = Learner(model_dir)
        self.publisher = Publisher(info.address, MODEL, name="trainer", token=info.token)
        self.publisher.publish(self.learner.state())  # v1: the weights in the model folder

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def step(self) -> tuple[int, float, float]:
        """One optimizer step, published: the version, the loss, when it was published."""
        loss = self.learner.train()
        version = self.publisher.publish(self.learner.state())
        return version, loss, time.time()

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file(self.learner.state(), path)

    def close(self) -> None:
        self.publisher.close()


@ray.remote(num_cpus=0)
class EngineActor:
    """Owns one `vllm serve` on its node, started with the TensorHub plugin pointed at the
    coordinator found by name."""

    def __init__(self, vllm_python: str, model_dir: str, log_path: str):
        from integration.vllm_server import VLLMServer

        env = {"VLLM_PLUGINS": "tensorhub", **coordinator_env(find_coordinator(), MODEL)}
        self.server = VLLMServer(
            vllm_python, model_dir, env=env, log_path=log_path,
            extra_args=["--weight-transfer-config", json.dumps({"backend": "tensorhub"})])
        self.server.start(300)

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def name(self) -> str:
        return self.server.tensorhub_status()["name"]

    def wait_serving(self, version: int) -> float:
        """Block until the engine serves `version`; the wall-clock time it was seen."""
        self.server.wait_serving(version, timeout=180.0, interval=0.05)
        return time.time()

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return self.server.greedy(prompts, tokens)

    def stop(self) -> None:
        self.server.stop()


def run(args: argparse.Namespace) -> int:
    from integration.learner import ANSWER_TOKENS, Learner
    from integration.tiny_model import build_tiny_model, make_prompts

    out = Path(args.out).resolve()
    model_dir = build_tiny_model(out / "model")
    scorer = Learner(model_dir)  # the driver's copy scores answers; it never trains
    ray.init(address=args.address, namespace="tensorhub-example")
    trainer_opts = {} if args.any_node else {"resources": {"trainer_host": 0.01}}
    engine_opts = {} if args.any_node else {"resources": {"engine_host": 0.01}}
    info = start_coordinator(options=trainer_opts)
    print(json.dumps({"event": "coordinator", "address": info.address}), flush=True)
    trainer = TrainerActor.options(**trainer_opts).remote(str(model_dir))
    engines = [EngineActor.options(**engine_opts).remote(
        args.vllm_python, str(model_dir), str(out / f"vllm-{i}.log"))
        for i in range(args.engines)]
    try:
        names = ray.get([e.name.remote() for e in engines])
        print(json.dumps({"event": "started", "trainer_node": ray.get(trainer.node.remote()),
                          "engine_nodes": ray.get([e.node.remote() for e in engines]),
                          "engines": names}), flush=True)
        for version in range(1, args.versions + 1):
            published, loss = time.time(), None
            if version > 1:
                got, loss, published = ray.get(trainer.step.remote())
                assert got == version, (got, version)
            seen = ray.get([e.wait_serving.remote(version) for e in engines])
            answers = ray.get([e.greedy.remote(scorer.prompts, ANSWER_TOKENS)
                               for e in engines])
            print(json.dumps({
                "event": "version", "version": version, "loss": loss,
                "reward": {n: scorer.reward(a) for n, a in zip(names, answers, strict=True)},
                "publish_to_serving_s": {n: round(max(0.0, s - published), 3)
                                         for n, s in zip(names, seen, strict=True)}}),
                  flush=True)
        ray.get(trainer.save.remote(str(out / "final.safetensors")))
        probes = make_prompts(8, 12)
        print(json.dumps({"event": "done", "version": args.versions, "probes": probes,
                          "answers": dict(zip(names, ray.get(
                              [e.greedy.remote(probes, PROBE_TOKENS) for e in engines]),
                              strict=True))}), flush=True)
        return 0
    finally:
        try:
            for actor in (*engines, trainer):
                try:
                    ray.get(actor.stop.remote() if actor is not trainer
                            else trainer.close.remote(), timeout=60)
                except Exception as exc:  # a dead actor: the others are still stopped
                    print(f"stopping {actor}: {exc}", file=sys.stderr)
        finally:
            stop_coordinator()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--engines", type=int, default=2, help="vLLM engine actors (default 2)")
    p.add_argument("--versions", type=int, default=4,
                   help="versions, one optimizer step each (default 4)")
    p.add_argument("--out", required=True,
                   help="a folder every node sees: the model, engine logs, final weights")
    p.add_argument("--vllm-python", default=None,
                   help="python of the vLLM venv (default: scripts/setup.sh vllm builds it)")
    p.add_argument("--any-node", action="store_true",
                   help="no trainer_host/engine_host resources: any node will do")
    args = p.parse_args()
    if args.vllm_python is None:
        from integration.engine_venvs import engine_python

        args.vllm_python = engine_python("vllm")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
