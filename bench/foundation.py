"""Foundation benchmarks: pulls between two processes on this machine.

  1 GiB:  Replica.pull over NIXL (with and without checksum verification), raw NIXL READ
          of the same bytes, Replica.pull over the zmq fallback, and memcpy — GB/s and
          ratios, all measured in this one run.
  tiny:   2000 tiny tensors, in two size distributions: `models`, the sizes of the norms
          and biases of five real models (Qwen2.5-0.5B, Qwen2-7B, Llama-3.1-8B, Qwen3-8B,
          Qwen2-72B; bf16, 256 B-16 KiB, 10.5 MiB in all; see bench.holder.MODEL_TINY_NUMEL),
          and `uniform`, 4-64 KiB fp32 (67 MiB; larger than any real norm or bias, kept so
          the first figures stay comparable). Raw NIXL: one compacted READ, with the tensors
          as views into the region (a joining replica, a holder) or scattered into tensors
          of their own (an engine's parameters), vs one READ per tensor, each waited (what a
          naive per-tensor loader does), and vs one READ carrying 2000 descriptors.
          TensorHub: Replica.pull of a model of those 2000 tensors, compacted (the default
          threshold), vs compact_threshold=0 (every tensor an item of its own).

The compacted READ moves the same bytes as the others, so its advantage is the per-READ
cost saved (~10 us each here) against the bytes' own transfer time: the smaller the tensors,
the larger the ratio. That is why the size distribution matters, and both are reported.

Run: python -m bench.foundation [--size-mb 1024] [--repeat 5] [--tiny 2000]
"""

from __future__ import annotations

import argparse
import base64
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from bench.holder import TINY_SIZES, big_tensors, numbered
from bench.results import Report, median_seconds
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of
from tensorhub.core.transport.nixl import apply_ucx_defaults, make_agent
from tensorhub.replica import Replica
from tensorhub.tools.child_process import ChildProcess


def _holder(*args: str) -> tuple[ChildProcess, dict]:
    proc = ChildProcess([sys.executable, "-m", "bench.holder", *args], name="holder")
    return proc, proc.next_json(timeout=120)


class RawReader:
    """A bare NIXL agent reading from the raw holder: the baseline without TensorHub.
    (The same agent settings as ours, so only our layers differ.)"""

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
def publishing_holder(size_mb: int, transport: str, tiny: int = 0, tiny_sizes: str = "uniform",
                      own_buffers: bool = True,
                      compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
                      **replica_kw) -> Iterator[tuple[ChildProcess, Replica]]:
    """A coordinator, a publisher process (a new version per SIGUSR1) and a warmed-up
    replica pulling from it; everything stopped afterwards. The model is `size_mb` MiB of
    large tensors, or `tiny` tiny ones; the replica pulls into buffers of its own, or
    (`own_buffers=False`) into what it allocates from the manifest, as a joining worker."""
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    holder = ChildProcess([sys.executable, "-m", "bench.holder", "publish", "--size-mb",
                           str(size_mb), "--tiny", str(tiny), "--tiny-sizes", tiny_sizes,
                           "--compact-threshold", str(compact_threshold),
                           "--coordinator", coordinator.address,
                           "--transport", transport], name="publisher")
    try:
        holder.next_json(timeout=120)
        live = None
        if own_buffers:
            live = dict(numbered(TINY_SIZES[tiny_sizes](tiny) if tiny else big_tensors(size_mb)))
        with Replica(coordinator.address, "bench", live, transport=transport,
                     compact_threshold=compact_threshold, **replica_kw) as rep:
            rep.pull(timeout=120)  # warm-up: connection set-up, first touch
            yield holder, rep
    finally:
        holder.stop()
        coordinator.stop()


def _pull_seconds(holder: ChildProcess, rep: Replica, repeat: int) -> float:
    """Median seconds of `repeat` pulls, each of a version published just before."""
    times = []
    for _ in range(repeat):
        holder.proc.send_signal(signal.SIGUSR1)
        version = holder.next_json(timeout=120)["version"]
        started = time.perf_counter()
        assert rep.pull(version=version, timeout=120) == version
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _replica_pull(size_mb: int, repeat: int, transport: str, verify: bool) -> float:
    with publishing_holder(size_mb, transport, verify=verify) as (holder, rep):
        return size_mb * 2**20 / 1e9 / _pull_seconds(holder, rep, repeat)


TINY_LABELS = {"models": "real models' norm/bias sizes, bf16", "uniform": "4-64 KiB fp32"}


def bench_tiny(report: Report, count: int, repeat: int, sizes: str) -> None:
    """Raw NIXL reads of `count` tiny tensors: compacted vs one READ per tensor vs one READ
    of `count` descriptors. The scatter is TensorHub's own (`BoundLayout.scatter`)."""
    holder, info = _holder("raw", "--tiny", str(count), "--tiny-sizes", sizes)
    try:
        raw = RawReader(info)
        expected = TINY_SIZES[sizes](count)  # the holder's tensors (same seed)
        local = [torch.empty_like(t) for t in expected]
        layout = BoundLayout(manifest_of(numbered(local)), local)  # tensors outside the region
        compact = layout.compact
        assert compact.numel() == info["compact"][1], "holder and reader disagree on the layout"
        raw.register(local)
        raw.register([compact])
        pairs = [(t.data_ptr(), t.numel() * t.element_size()) for t in local]
        remote = [tuple(d) for d in info["descs"]]
        total_mib = sum(n for _, n in pairs) / 2**20

        def per_tensor():
            for lp, rp in zip(pairs, remote, strict=True):
                raw.read([lp], [rp])

        def one_read_many_descs():
            raw.read(pairs, remote)

        def compacted_in_place():  # a joining replica's, a holder's tensors: views of it
            raw.read([(compact.data_ptr(), compact.numel())], [tuple(info["compact"])])

        def compacted_scatter():  # an engine's own parameters: copied out of the region
            compacted_in_place()
            layout.scatter()

        # Interleaved rounds, so that load from others on this shared machine hits all alike.
        ways = {"per": per_tensor, "many": one_read_many_descs, "in_place": compacted_in_place,
                "scatter": compacted_scatter}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(repeat):
            for k, fn in ways.items():
                times[k].append(median_seconds(fn, 1, warmup=0 if times[k] else 1))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        assert all(torch.equal(a, b) for a, b in zip(local, expected, strict=True)), \
            "the reads did not land the holder's bytes"
        label = f"{count} tiny tensors ({TINY_LABELS[sizes]}, {total_mib:.1f} MiB)"
        per, many = "one READ per tensor", f"one READ, {count} descriptors"
        report.add(f"{label}: compacted READ (tensors are views of the region)", ms["in_place"],
                   "ms", per, ms["per"], higher_is_better=False)
        report.add(f"{label}: compacted READ (tensors are views of the region)", ms["in_place"],
                   "ms", many, ms["many"], higher_is_better=False)
        report.add(f"{label}: compacted READ + scatter (tensors elsewhere)", ms["scatter"],
                   "ms", per, ms["per"], higher_is_better=False)
        report.add(f"{label}: compacted READ + scatter (tensors elsewhere)", ms["scatter"],
                   "ms", many, ms["many"], higher_is_better=False)
    finally:
        holder.stop()


def bench_tiny_pull(report: Report, count: int, repeat: int, sizes: str) -> None:
    """Replica.pull of a model of `count` tiny tensors over NIXL (verification on, as by
    default), compacted vs compact_threshold=0: three publisher/replica pairs side by side,
    pulled in interleaved rounds so that load from others hits all three alike."""
    setups = {"uncompacted": {"own_buffers": False, "compact_threshold": 0},
              "joining": {"own_buffers": False}, "own": {"own_buffers": True}}
    times: dict[str, list[float]] = {k: [] for k in setups}
    with ExitStack() as stack:
        pairs = {k: stack.enter_context(publishing_holder(0, "nixl", tiny=count,
                                                          tiny_sizes=sizes, **kw))
                 for k, kw in setups.items()}
        for _ in range(repeat):
            for k, (holder, rep) in pairs.items():
                times[k].append(_pull_seconds(holder, rep, 1))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    label = f"Replica.pull of {count} tiny tensors ({TINY_LABELS[sizes]})"
    base = f"compact_threshold=0 ({count} items)"
    report.add(f"{label}: compacted, tensors are views of the region", ms["joining"], "ms",
               base, ms["uncompacted"], higher_is_better=False)
    report.add(f"{label}: compacted, own buffers (+ scatter)", ms["own"], "ms",
               base, ms["uncompacted"], higher_is_better=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--tiny", type=int, default=2000)
    p.add_argument("--only-tiny", action="store_true", help="skip the 1 GiB figures")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    apply_ucx_defaults()
    report = Report("foundation")
    if not args.only_tiny:
        bench_gib(report, args.size_mb, args.repeat)
    for sizes in ("models", "uniform"):
        bench_tiny(report, args.tiny, args.repeat * 2, sizes)
        bench_tiny_pull(report, args.tiny, args.repeat * 2, sizes)
    report.write()


if __name__ == "__main__":
    main()
