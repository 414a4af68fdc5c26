"""Foundation benchmarks (issue 2): pulls between two processes on this machine.

  1 GiB:  Replica.pull over NIXL (with and without checksum verification), raw NIXL READ
          of the same bytes, Replica.pull over the zmq fallback, and memcpy — GB/s and
          ratios, all measured in this one run.
  tiny:   2000 tensors of 4-64 KiB: one compacted READ (+ scatter) vs one READ per tensor,
          and vs one READ carrying 2000 descriptors.

Run: python -m bench.foundation [--size-mb 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import base64
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from bench.holder import big_tensors, tiny_tensors
from bench.results import Report, median_seconds
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core.transport.nixl import apply_ucx_defaults, make_agent
from tensorhub.processes import ChildProcess
from tensorhub.replica import Replica


def _holder(*args: str) -> tuple[ChildProcess, dict]:
    proc = ChildProcess([sys.executable, "-m", "bench.holder", *args], name="holder")
    return proc, proc.next_json(timeout=120)


class RawReader:
    """A bare NIXL agent reading from the raw holder: the baseline without TensorHub.
    (Same agent settings as ours, progress-thread delay included, so only our layers
    differ.)"""

    def __init__(self, info: dict):
        self.agent = make_agent("raw-reader")
        self.peer = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))

    def register(self, tensors: list[torch.Tensor]) -> None:
        self.agent.register_memory(tensors)

    def read(self, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        ldesc = self.agent.get_xfer_descs(np.array([(a, n, 0) for a, n in local],
                                                   dtype=np.uint64), "DRAM")
        rdesc = self.agent.get_xfer_descs(np.array([(a, n, 0) for a, n in remote],
                                                   dtype=np.uint64), "DRAM")
        handle = self.agent.initialize_xfer("READ", ldesc, rdesc, self.peer, b"")
        state = self.agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("raw NIXL READ failed")
            state = self.agent.check_xfer_state(handle)
        handle.release()


def bench_gib(report: Report, size_mb: int, repeat: int) -> None:
    nbytes = size_mb * 2**20
    gb = nbytes / 1e9

    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    memcpy = gb / median_seconds(lambda: dst.copy_(src), repeat)
    report.add(f"memcpy {size_mb} MiB (torch copy_, one process)", memcpy, "GB/s")
    src = dst = None  # free 2 GiB before the next figures

    holder, info = _holder("raw", "--size-mb", str(size_mb))
    try:
        raw = RawReader(info)
        local = big_tensors(size_mb)
        raw.register(local)
        pairs = [(t.data_ptr(), t.numel() * 4) for t in local]
        remote = [tuple(d) for d in info["descs"]]
        raw_gbps = gb / median_seconds(lambda: raw.read(pairs, remote), repeat)
        report.add(f"raw NIXL READ {size_mb} MiB ({len(pairs)} descs)", raw_gbps, "GB/s",
                   "memcpy", memcpy)
        del local
    finally:
        holder.stop()

    for transport in ("nixl", "zmq"):
        for verify in ((True, False) if transport == "nixl" else (True,)):
            gbps = _replica_pull(size_mb, repeat, transport, verify)
            label = f"Replica.pull {size_mb} MiB over {transport}" + \
                ("" if verify else " (verify off)")
            report.add(label, gbps, "GB/s", "raw NIXL READ", raw_gbps)
            report.add(label + " / memcpy", gbps / memcpy, "x", None, None)


@contextmanager
def publishing_holder(size_mb: int, transport: str,
                      **replica_kw) -> Iterator[tuple[ChildProcess, Replica]]:
    """A coordinator, a publisher process (a new version per SIGUSR1) and a warmed-up
    replica of `size_mb` MiB pulling from it; everything stopped afterwards."""
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    holder = ChildProcess([sys.executable, "-m", "bench.holder", "publish", "--size-mb",
                           str(size_mb), "--coordinator", coordinator.address,
                           "--transport", transport], name="publisher")
    try:
        holder.next_json(timeout=120)
        live = {f"w{i}": t for i, t in enumerate(big_tensors(size_mb))}
        with Replica(coordinator.address, "bench", live, transport=transport,
                     **replica_kw) as rep:
            rep.pull(timeout=120)  # warm-up: connection set-up, first touch
            yield holder, rep
    finally:
        holder.stop()
        coordinator.stop()


def _replica_pull(size_mb: int, repeat: int, transport: str, verify: bool) -> float:
    with publishing_holder(size_mb, transport, verify=verify) as (holder, rep):
        times = []
        for _ in range(repeat):
            holder.proc.send_signal(signal.SIGUSR1)
            version = holder.next_json(timeout=120)["version"]
            started = time.perf_counter()
            assert rep.pull(version=version, timeout=120) == version
            times.append(time.perf_counter() - started)
        return size_mb * 2**20 / 1e9 / sorted(times)[len(times) // 2]


def bench_tiny(report: Report, count: int, repeat: int) -> None:
    holder, info = _holder("raw", "--tiny", str(count))
    try:
        raw = RawReader(info)
        local = [torch.empty_like(t) for t in tiny_tensors(count)]  # same sizes
        compact = torch.empty(info["compact"][1], dtype=torch.uint8)
        raw.register(local)
        raw.register([compact])
        pairs = [(t.data_ptr(), t.numel() * 4) for t in local]
        remote = [tuple(d) for d in info["descs"]]
        total_mib = sum(n for _, n in pairs) / 2**20

        def per_tensor():
            for lp, rp in zip(pairs, remote, strict=True):
                raw.read([lp], [rp])

        def one_read_many_descs():
            raw.read(pairs, remote)

        offsets = np.cumsum([0] + [n for _, n in pairs])
        region = memoryview(compact.numpy())
        views = [memoryview(t.view(torch.uint8).numpy()) for t in local]

        def compacted_in_place():  # a replica's small tensors are views of its region
            raw.read([(compact.data_ptr(), compact.numel())], [tuple(info["compact"])])

        def compacted():  # an engine's small tensors live elsewhere: scatter them
            compacted_in_place()
            for k, v in enumerate(views):
                v[:] = region[offsets[k]: offsets[k + 1]]

        t_per = median_seconds(per_tensor, repeat)
        t_many = median_seconds(one_read_many_descs, repeat)
        t_compact = median_seconds(compacted, repeat)
        t_in_place = median_seconds(compacted_in_place, repeat)
        label = f"{count} tiny tensors ({total_mib:.0f} MiB)"
        report.add(f"{label}: compacted READ (tensors in the region)", t_in_place * 1e3, "ms",
                   "one READ per tensor", t_per * 1e3, higher_is_better=False)
        report.add(f"{label}: compacted READ + scatter", t_compact * 1e3, "ms",
                   "one READ per tensor", t_per * 1e3, higher_is_better=False)
        report.add(f"{label}: compacted READ + scatter", t_compact * 1e3, "ms",
                   f"one READ, {count} descriptors", t_many * 1e3, higher_is_better=False)
    finally:
        holder.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--tiny", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    apply_ucx_defaults()
    report = Report("foundation")
    bench_gib(report, args.size_mb, args.repeat)
    bench_tiny(report, args.tiny, args.repeat * 2)
    report.write()


if __name__ == "__main__":
    main()
