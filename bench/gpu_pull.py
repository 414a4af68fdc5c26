"""A version in GPU memory pulled into GPU memory on one host, against a device-to-device
copy of the same bytes (the bound) and a round trip through host memory (the baseline a
system without one-sided GPU reads pays).

  pull:     `Replica.pull` of a version whose publisher holds it in CUDA tensors, into CUDA
            tensors, over NIXL (UCX `cuda_copy`; `TENSORHUB_CUDA_IPC=1` adds `cuda_ipc`),
            checksum verification off and on (checksums are taken on the host);
  bound:    torch copy_ between two CUDA buffers of the same tensors (in one process);
  baseline: the same tensors copied to pinned host memory and back.

Each figure is the median of `--repeat` rounds. The publisher and the reader are two NIXL
agents of one process (the CUDA context is shared; across processes `cuda_ipc` is what
maps peer memory). Needs a CUDA device.

Run: python -m bench.gpu_pull [--size-mb 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.results import Report
from tensorhub import Publisher, Replica, settings
from tensorhub_testing.local_fleet import coordinator_process


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_pull needs a CUDA device")
    if not settings.UCX_DEFAULTS.get():
        mode = "nixl, UCX's own transports"
    else:
        mode = "nixl cuda_copy+cuda_ipc" if settings.CUDA_IPC.get() else "nixl cuda_copy"
    n = 16
    per = args.size_mb * 2**20 // n // 2  # bf16 elements per tensor
    state = {f"layers.{i}.weight": torch.randn(per, device="cuda").to(torch.bfloat16)
             for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = nbytes / 1e9
    report = Report("gpu_pull")
    label = f"{torch.cuda.get_device_name(0)}, {nbytes / 2**30:.1f} GiB bf16"
    copy_to = {k: torch.empty_like(v) for k, v in state.items()}
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    d2d = statistics.median(_seconds(lambda: [copy_to[k].copy_(v) for k, v in state.items()])
                            for _ in range(args.repeat))

    def round_trip() -> None:
        for k, v in state.items():
            host[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        for k, v in host.items():
            copy_to[k].copy_(v, non_blocking=True)

    via_host = statistics.median(_seconds(round_trip) for _ in range(args.repeat))
    coordinator, address = coordinator_process()
    try:
        coordinator.next_line(timeout=60)
        with Publisher(address, "policy", transport="nixl", patches=False) as pub:
            dest = {k: torch.empty_like(v) for k, v in state.items()}
            with Replica(address, "policy", dest, transport="nixl", name="gpu-reader") as rep:
                for verify in (False, True):
                    rep.verify = verify
                    times = []
                    for _ in range(args.repeat + 1):  # (the first pull connects: not counted)
                        for t in state.values():
                            t.mul_(-1)  # a new version, same bytes count
                        version = pub.publish(state)
                        times.append(_seconds(lambda v=version: rep.pull(version=v,
                                                                         timeout=600)))
                    assert all(torch.equal(dest[k], state[k]) for k in state)
                    pulled = statistics.median(times[1:])
                    check = "checksums on" if verify else "checksums off"
                    report.add(f"{label}: pull GPU to GPU, {mode}, {check}", gb / pulled,
                               "GB/s", "device-to-device copy", gb / d2d)
                    report.add(f"{label}: pull GPU to GPU, {mode}, {check} (against host)",
                               gb / pulled, "GB/s", "round trip through pinned host memory",
                               gb / via_host)
    finally:
        coordinator.stop()
    report.write(keep_earlier=True)
    print(f"UCX_TLS={os.environ.get('UCX_TLS')}")


if __name__ == "__main__":
    main()
