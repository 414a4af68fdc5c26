"""The holder side of the transfer benchmarks, run as its own process.

  raw:      register tensors with a bare NIXL agent, print metadata + descriptors, wait.
  publish:  a TensorHub Publisher; publishes a new version each time it gets SIGUSR1.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
import threading

import torch


def tiny_tensors(n: int, seed: int = 0) -> list[torch.Tensor]:
    """`n` tensors of 4-64 KiB (norms, biases, small projections)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(torch.randint(1024, 16 * 1024, (1,), generator=g)), generator=g)
            for _ in range(n)]


def big_tensors(total_mb: int) -> list[torch.Tensor]:
    return [torch.randn(2048, 4096) for _ in range(total_mb // 32)]  # 32 MiB each


def _raw(args) -> None:
    from tensorhub.core.transport.nixl import apply_ucx_defaults, make_agent

    apply_ucx_defaults()
    tensors = tiny_tensors(args.tiny) if args.tiny else big_tensors(args.size_mb)
    agent = make_agent("raw-holder")
    agent.register_memory(tensors)
    compact = None
    if args.tiny:  # the same bytes, packed, as TensorHub's compaction would
        compact = torch.cat([t.view(torch.uint8) for t in tensors])
        agent.register_memory([compact])
    print(json.dumps({
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "descs": [[t.data_ptr(), t.numel() * t.element_size()] for t in tensors],
        "compact": None if compact is None else [compact.data_ptr(), compact.numel()],
    }), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _publish(args) -> None:
    from tensorhub.publisher import Publisher

    state = {f"w{i}": t for i, t in enumerate(big_tensors(args.size_mb))}
    pub = Publisher(args.coordinator, args.model, transport=args.transport, name="trainer")
    wake = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: wake.set())
    signal.signal(signal.SIGTERM, lambda *_: (pub.close(), sys.exit(0)))
    while True:
        version = pub.publish(state)
        print(json.dumps({"version": version}), flush=True)
        wake.wait()
        wake.clear()
        for t in state.values():
            t.add_(1.0)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["raw", "publish"])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--tiny", type=int, default=0)
    p.add_argument("--coordinator")
    p.add_argument("--model", default="bench")
    p.add_argument("--transport", default="nixl")
    args = p.parse_args()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}) \
        if args.mode == "raw" else None
    (_raw if args.mode == "raw" else _publish)(args)
