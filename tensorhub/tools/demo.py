"""The demo: a coordinator, replica processes and an in-process trainer on this machine.

Each published version shows who pulled from whom and how fast, so the tree (not a star
out of the trainer) is visible.
"""

from __future__ import annotations

import argparse
import time

from tensorhub import settings
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub.publisher import Publisher
from tensorhub.tools.child_process import ChildProcess
from tensorhub.tools.synthetic_weights import synthetic_state_dict


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
