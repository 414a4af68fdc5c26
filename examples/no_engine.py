"""TensorHub with no engine, in one process, in well under a minute: a coordinator, a
trainer publishing three versions of a small model, and two replicas that follow them
(the second pulls from the first when it can, not from the trainer).

    python examples/no_engine.py
"""

from __future__ import annotations

import threading

import torch

import tensorhub
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig

VERSIONS = 3


def follow(address: str, name: str, pulled: list[str]) -> None:
    """A worker with no weights of its own: it allocates them from the first version."""
    with tensorhub.Replica(address, "policy", name=name) as rep:
        while rep.version != VERSIONS and rep.wait_for_newer(timeout=30) is not None:
            version = rep.pull()
            sources = "+".join(rep.last_pull.sources)
            pulled.append(f"{name} pulled v{version} from {sources}: "
                          f"w[0, 0] = {rep.tensors['w'][0, 0].item():.0f}")


def main() -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    try:
        model = {"w": torch.zeros(1024, 1024), "b": torch.zeros(16)}
        pulled: list[str] = []
        pub = tensorhub.Publisher(coordinator.address, "policy", min_replicas=2)
        try:
            readers = [threading.Thread(target=follow, args=(coordinator.address, name, pulled))
                       for name in ("reader-a", "reader-b")]
            for reader in readers:
                reader.start()
            for step in range(1, VERSIONS + 1):
                model["w"].fill_(step)  # a "training step"
                version = pub.publish(model)
                pub.retained(timeout=30)  # both readers hold it before the next step
                print(f"trainer published v{version}")
            for reader in readers:
                reader.join()
        finally:
            pub.close(retain=False)  # (the readers have gone: nobody to keep v3 for)
        print("\n".join(pulled))
    finally:
        coordinator.stop()


if __name__ == "__main__":
    main()
