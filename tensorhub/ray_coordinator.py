"""The coordinator as a named, detached Ray actor, and how any actor in the cluster finds it.

An RL job on Ray (verl, OpenRLHF, NeMo-RL or a loop of one's own) starts its trainer and
engine actors on whichever nodes Ray picks. None of them should need a coordinator address
passed down by hand: `start_coordinator` starts the coordinator once for the cluster (or
finds the one already running) under a well-known name, and `find_coordinator` gives any
actor, on any node, its address and token. The actor is detached, so it outlives the driver
that started it (a restarted driver finds the same coordinator, and the engines' references
survive); `stop_coordinator` ends it.

Across nodes by default: the coordinator binds its node's Ray address, with a token made
for the cluster (anyone who can reach the port but is not in the cluster cannot publish or
read references, and the control plane is encrypted with keys derived from it). To have the
coordinator prove who it is as well, pass a CURVE secret (`curve_secret=`, from `tensorhub
keygen`) and give the engines its public key. `coordinator_env` is what a launcher puts in
an engine's environment (`vllm serve`, an SGLang server) so that its TensorHub plugin finds
the coordinator with no flag.

Ray is imported only here, so TensorHub itself does not depend on it.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

# Where every actor of a job finds the coordinator actor unless told another name.
DEFAULT_NAME = "tensorhub-coordinator"
DEFAULT_NAMESPACE = "tensorhub"

log = logging.getLogger("tensorhub.ray")


@dataclass(frozen=True)
class CoordinatorInfo:
    """How to reach the cluster's coordinator."""

    address: str  # requests (tcp://node-ip:port)
    token: str | None
    node_ip: str
    metrics_url: str | None = None


class CoordinatorActor:
    """Runs a coordinator in this actor's process (a Ray worker of its own: killing the
    actor ends the coordinator with it, nothing is left behind)."""

    def __init__(self, port: int = 0, token: str | None = None,
                 metrics_port: int | None = None, **config: Any):
        import ray

        from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
        from tensorhub.core.net import free_port

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.node_ip = ray.util.get_node_ip_address()
        port = port or free_port()
        self.token = token
        if token is None:
            log.warning("the coordinator actor runs without a token: anyone who can reach "
                        "%s can publish and read references", self.node_ip)
        # the node's Ray address only: the interface the cluster reaches it by
        self.coordinator = Coordinator(CoordinatorConfig(
            bind=f"tcp://{self.node_ip}:{port}", announce=f"tcp://{self.node_ip}:{free_port()}",
            token=token, **config)).start()
        self.address = f"tcp://{self.node_ip}:{port}"
        self.metrics_url = None
        if metrics_port is not None:
            self.coordinator.serve_metrics(metrics_port, self.node_ip)
            self.metrics_url = f"http://{self.node_ip}:{metrics_port}/metrics"
        log.info("tensorhub coordinator actor on %s: requests on %s", self.node_ip,
                 self.address)

    def info(self) -> CoordinatorInfo:
        return CoordinatorInfo(self.address, self.token, self.node_ip, self.metrics_url)

    def stop(self) -> None:
        self.coordinator.stop()


def start_coordinator(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *,
                      token: str | None = "generate", port: int = 0,
                      metrics_port: int | None = None, options: dict | None = None,
                      **config: Any) -> CoordinatorInfo:
    """Start the cluster's coordinator as the named, detached actor `name` (or find it, if
    it is running already) and return how to reach it. Call it from the driver, after
    `ray.init`. `token`: "generate" (the default) makes a random one; None runs without a
    token. `options`: Ray actor options, e.g. ``{"resources": {"head": 0.01}}`` or a
    scheduling strategy to pin it to a node; `config`: `CoordinatorConfig` fields
    (``stripes=4``, ``worker_ttl=10.0``, ...)."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=0)(CoordinatorActor).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
        **(options or {})).remote(port=port, metrics_port=metrics_port,
                                  token=secrets.token_hex(16) if token == "generate" else token,
                                  **config)
    return ray.get(actor.info.remote())


def find_coordinator(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE,
                     timeout: float = 60.0) -> CoordinatorInfo:
    """From any actor or driver in the cluster: the running coordinator's address and
    token, waiting up to `timeout` seconds for it to be started."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            actor = ray.get_actor(name, namespace=namespace)
            return ray.get(actor.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ValueError:  # no actor of that name (yet)
            if time.monotonic() > deadline:
                raise LookupError(
                    f"no TensorHub coordinator actor {name!r} in Ray namespace "
                    f"{namespace!r} after {timeout:.0f} s: start one from the driver with "
                    f"tensorhub.ray_coordinator.start_coordinator()") from None
            time.sleep(0.5)


def coordinator_env(info: CoordinatorInfo, model: str) -> dict[str, str]:
    """The environment an engine process needs for its TensorHub plugin to find the
    coordinator and follow `model` (vLLM also needs ``VLLM_PLUGINS=tensorhub``)."""
    env = {"TENSORHUB_COORDINATOR": info.address, "TENSORHUB_MODEL": model}
    if info.token:
        env["TENSORHUB_TOKEN"] = info.token
    return env


def stop_coordinator(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> bool:
    """End the coordinator actor; False if there was none."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=10)
    except Exception as exc:  # it is killed next either way
        log.warning("the coordinator actor did not stop cleanly: %s", exc)
    ray.kill(actor)
    return True
