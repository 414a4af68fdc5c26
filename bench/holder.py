"""The holder side of the transfer benchmarks, run as its own process.

  raw:      register tensors with a bare NIXL agent, print metadata + descriptors, wait.
  publish:  a TensorHub Publisher; publishes a new version each time it gets SIGUSR1.

`--tiny N` holds N tiny tensors (`--tiny-sizes`: `models` or `uniform`) instead of
`--size-mb` of large ones.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
import threading

import torch

from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of
from tensorhub.core.shared_memory import regions_of


def tiny_tensors(n: int, seed: int = 0) -> list[torch.Tensor]:
    """`n` fp32 tensors of 4-64 KiB, uniformly (the first tiny benchmark's sizes: larger than
    the norms and biases of real models, see `model_tiny_tensors`)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(torch.randint(1024, 16 * 1024, (1,), generator=g)), generator=g)
            for _ in range(n)]


# The small tensors of one decoder layer (element counts) of real models, from their
# config.json: input/post-attention norm (hidden_size), q/k/v biases (hidden_size,
# num_key_value_heads * head_dim) where the model has them, q/k norms (head_dim) in Qwen3.
# All five checkpoints are bfloat16. (Each model's one final norm is left out.)
MODEL_TINY_NUMEL: dict[str, list[int]] = {
    "Qwen2.5-0.5B": [896, 896, 896, 128, 128],     # hidden 896, 2 kv heads x 64
    "Qwen2-7B": [3584, 3584, 3584, 512, 512],      # hidden 3584, 4 kv heads x 128
    "Llama-3.1-8B": [4096, 4096],                  # hidden 4096, no biases
    "Qwen3-8B": [4096, 4096, 128, 128],            # hidden 4096, q/k norm of head_dim 128
    "Qwen2-72B": [8192, 8192, 8192, 1024, 1024],   # hidden 8192, 8 kv heads x 128
}


def model_tiny_tensors(n: int, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """`n` tensors with the sizes of real models' norms and biases (`MODEL_TINY_NUMEL`, the
    five models' layers in turn): 256 B-16 KiB in bf16, 5.4 KiB on average."""
    g = torch.Generator().manual_seed(seed)
    sizes = [k for layer in MODEL_TINY_NUMEL.values() for k in layer]
    return [torch.randn(sizes[i % len(sizes)], generator=g).to(dtype) for i in range(n)]


TINY_SIZES = {"models": model_tiny_tensors, "uniform": tiny_tensors}


def numbered(tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Names for a list of tensors, as the publisher and the replica both give them."""
    return [(f"w{i}", t) for i, t in enumerate(tensors)]


def big_tensors(total_mb: int) -> list[torch.Tensor]:
    return [torch.randn(2048, 4096) for _ in range(total_mb // 32)]  # 32 MiB each


def _tensors(args) -> list[torch.Tensor]:
    return TINY_SIZES[args.tiny_sizes](args.tiny) if args.tiny else big_tensors(args.size_mb)


def _raw(args) -> None:
    from tensorhub.core.transport.nixl import ProgressLoop, apply_ucx_defaults, make_agent

    apply_ucx_defaults(args.host)
    tensors = _tensors(args)
    shared = None
    if not args.tiny:  # in one shared buffer, as a publisher's snapshot: raw shm reads too
        layout = BoundLayout.allocate(manifest_of(numbered(tensors)))
        layout.copy_large_from(tensors)
        tensors = layout.tensors
        shared = regions_of(layout.item_bytes)
    agent = make_agent("raw-holder")
    ProgressLoop(agent, threading.Lock(), "raw-holder")  # serves emulated (tcp) reads
    agent.register_memory(tensors)
    compact = None
    if args.tiny:  # the same bytes, packed as TensorHub's compaction packs them
        layout = BoundLayout(manifest_of(numbered(tensors)), tensors)
        layout.pack()
        compact = layout.compact
        agent.register_memory([compact])
    print(json.dumps({
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "descs": [[t.data_ptr(), t.numel() * t.element_size()] for t in tensors],
        "compact": None if compact is None else [compact.data_ptr(), compact.numel()],
        "shared": [r.model_dump() for r in shared or []],
    }), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _publish(args) -> None:
    from tensorhub.publisher import Publisher

    state = dict(numbered(_tensors(args)))
    pub = Publisher(args.coordinator, args.model, transport=args.transport, name="trainer",
                    compact_threshold=args.compact_threshold)
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
    p.add_argument("--tiny-sizes", choices=sorted(TINY_SIZES), default="uniform")
    p.add_argument("--compact-threshold", type=int, default=DEFAULT_COMPACT_THRESHOLD)
    p.add_argument("--coordinator")
    p.add_argument("--model", default="bench")
    p.add_argument("--transport", default="nixl")
    p.add_argument("--host", default="127.0.0.1", help="raw: the address peers read it at")
    args = p.parse_args()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}) \
        if args.mode == "raw" else None
    (_raw if args.mode == "raw" else _publish)(args)
