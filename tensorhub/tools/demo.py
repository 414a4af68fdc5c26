"""The demo: a coordinator, replica processes and an in-process trainer on this machine.

Each published version shows who pulled from whom and how fast, so the tree (not a star
out of the trainer) is visible.
"""

from __future__ import annotations

import argparse
import time

import torch

from tensorhub import settings
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub.publisher import Publisher
from tensorhub.tools.processes import ChildProcess


def synthetic_state_dict(total_mb: float, n_tiny: int = 500, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A model-shaped state dict: `n_tiny` small tensors (norms, biases; 4-64 KiB) and large
    matrices making up the rest of `total_mb`."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    tiny_bytes = 0
    for i in range(n_tiny):
        n = int(torch.randint(1024, 16 * 1024, (1,), generator=g))
        out[f"layers.{i // 4}.tiny.{i % 4}"] = torch.randn(n, generator=g).to(dtype)
        tiny_bytes += n * elem
    remaining = int(total_mb * 2**20) - tiny_bytes
    big = 0
    while remaining > 0:
        rows = min(remaining // (4096 * elem), 2048) or 1
        out[f"big.{big}.weight"] = torch.randn(rows, 4096, generator=g).to(dtype)
        remaining -= rows * 4096 * elem
        big += 1
    return out


def run_demo(args: argparse.Namespace) -> int:
    address = f"tcp://127.0.0.1:{args.port}"
    coordinator = ChildProcess.tensorhub("coordinator", "--bind", address,
                                         "--max-readers-per-holder", "1", name="coordinator")
    replicas: list[ChildProcess] = []
    publisher = None
    try:
        # One reader per holder at a time makes the chain visible: replica-1 reads from
        # replica-0 while the trainer is busy (the default, 2, suits larger fleets).
        print(coordinator.next_line(timeout=30))

        state = synthetic_state_dict(args.size_mb)
        transport = args.transport or settings.TRANSPORT.get()
        publisher = Publisher(address, "policy", transport=transport)
        for i in range(args.replicas):
            replicas.append(ChildProcess.tensorhub(
                "--log-level", "WARNING", "replica", "--coordinator", address,
                "--name", f"replica-{i}", "--transport", transport, "--json",
                "--linger", "--timeout", "300", name=f"replica-{i}"))
        print(f"trainer: {len(state)} tensors, {args.size_mb} MiB, transport {transport}, "
              f"{args.replicas} replicas")
        for v in range(1, args.versions + 1):
            if v > 1:
                for t in state.values():
                    t.add_(0.01)  # "an optimizer step"
            started = time.perf_counter()
            version = publisher.publish(state)
            publish_ms = (time.perf_counter() - started) * 1e3
            print(f"\nversion {version}: published in {publish_ms:.0f} ms (snapshot + checksums)")
            for r in replicas:
                event = r.next_json(timeout=120)
                if event.get("event") != "pulled":
                    print(f"  {r.name}: {event}")
                    continue
                print(f"  {event['name']:<10} v{event['version']} <- "
                      f"{'+'.join(event['sources']):<10} {event['nbytes'] / 2**20:7.1f} MiB "
                      f"{event['seconds'] * 1e3:7.1f} ms {event['gbps']:6.2f} GB/s")
        client = CoordinatorClient(address)
        status = client.call(StatusRequest())
        client.close()
        edges = {}
        for t in status.transfers:
            edges[(t.source, t.reader)] = edges.get((t.source, t.reader), 0) + 1
        print("\nwho pulled from whom (source -> reader: pulls):")
        for (src, dst), n in sorted(edges.items()):
            print(f"  {src} -> {dst}: {n}")
        return 0
    finally:
        if publisher is not None:
            publisher.close()
        for r in replicas:
            r.stop()
        coordinator.stop()
