"""Same-node pull: 1 GiB between two processes on this machine, against memcpy.

  raw:   one process copies 1 GiB of another's tensors (kept in one shared-memory buffer)
         by cross-memory attach (process_vm_readv, 1 and 2 threads), out of a read-only
         mapping of that buffer (shm, 2 threads) and by a bare NIXL READ (UCX tcp,cma on
         loopback); memcpy (torch copy_ in one process, 2 threads) is the ceiling.
  pull:  Replica.pull of 1 GiB from a publisher process over cma, auto (shm: the
         publisher's snapshot is shared memory; chunked, and with whole-item plans) and
         nixl, checksum verification off and on, each pull right after a memcpy of the
         same size.
The machine is shared and noisy: figures are taken in interleaved rounds, GB/s are medians
over rounds, and "/ memcpy" ratios are medians of per-round ratios (load that comes and
goes between rounds cancels out).

Run: python -m bench.same_node [--size-mb 1024] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import torch

from bench.foundation import RawReader, publishing_holder
from bench.holder import big_tensors
from bench.results import Report
from tensorhub import settings
from tensorhub.core.data_types import Endpoint, MemoryDesc, SharedRegion
from tensorhub.core.transport import cma
from tensorhub.core.transport.base import Peer, ReadOp
from tensorhub.core.transport.nixl import apply_ucx_defaults
from tensorhub.core.transport.shm import ShmReader, region_of
from tensorhub.tools.child_process import ChildProcess


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Rounds:
    """Times of several figures taken in interleaved rounds, each round with its own memcpy:
    a figure's ratio to memcpy is the median of its per-round ratios, so load from other
    users of the machine that comes and goes between rounds cancels out."""

    def __init__(self, nbytes: int):
        self.gb = nbytes / 1e9
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def gbps(self, name: str) -> float:
        return self.gb / statistics.median(self.times[name])

    def ratio(self, name: str, baseline: str) -> float:
        return statistics.median(b / t for t, b in zip(self.times[name], self.times[baseline],
                                                       strict=True))

    def show(self) -> None:
        for k, v in self.times.items():
            print(f"  {k:<36} GB/s per round: " + " ".join(f"{self.gb / t:.2f}" for t in v))


def _memcpy(size_mb: int):
    src = torch.empty(size_mb * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    return lambda: dst.copy_(src)


def bench_raw(report: Report, size_mb: int, repeat: int) -> None:
    """memcpy, raw NIXL READ and raw cma (1 and 2 threads), in interleaved rounds."""
    holder = ChildProcess([sys.executable, "-m", "bench.holder", "raw", "--size-mb",
                           str(size_mb)], name="holder")
    try:
        info = holder.next_json(timeout=120)
        local = big_tensors(size_mb)
        nixl = RawReader(info)
        nixl.register(local)
        pairs = [(t.data_ptr(), t.numel() * t.element_size()) for t in local]
        remote = [tuple(d) for d in info["descs"]]
        reader = cma.CmaTransport()
        # The raw holder is a bare NIXL process: its pid is all cma needs (same user); its
        # tensors lie in one shared buffer, which the shm reader maps.
        peer = Peer("raw-holder", Endpoint(
            transport="cma", pid=holder.pid, pid_started=cma.process_start(holder.pid),
            host=reader.host, shared=[SharedRegion(**r) for r in info["shared"]]))
        ops = [ReadOp(t.view(torch.uint8).reshape(-1), MemoryDesc(addr=a, nbytes=n))
               for t, (a, n) in zip(local, remote, strict=True)]
        shm_reader = ShmReader()
        shm_ops = [(op, region_of(peer, op)) for op in ops]

        def shm_read():
            shm_reader.read(peer, shm_ops, time.monotonic() + 120, 120)

        def cma_read(threads: int):
            def run():
                os.environ[settings.COPY_THREADS.name] = str(threads)
                reader.read(peer, ops, timeout=120)
            return run

        figures = {
            "memcpy": _memcpy(size_mb),
            "raw NIXL READ": lambda: nixl.read(pairs, remote),
            "raw cma, 1 thread": cma_read(1),
            "raw cma, 2 threads": cma_read(2),
            "raw shm, 2 threads": shm_read,
        }
        rounds = Rounds(size_mb * 2**20)
        for fn in figures.values():  # warm-up: first touch, connection set-up
            fn()
        for _ in range(repeat):
            for name, fn in figures.items():
                rounds.add(name, _seconds(fn))
        os.environ.pop(settings.COPY_THREADS.name, None)
        reader.close()
        rounds.show()
        report.add(f"memcpy {size_mb} MiB (torch copy_, one process)", rounds.gbps("memcpy"),
                   "GB/s")
        for k in ("raw NIXL READ", "raw cma, 1 thread", "raw cma, 2 threads",
                  "raw shm, 2 threads"):
            report.add(f"{k} {size_mb} MiB", rounds.gbps(k), "GB/s", "memcpy",
                       rounds.gbps("memcpy"))
            report.add(f"{k} / memcpy (median of per-round ratios)",
                       rounds.ratio(k, "memcpy"), "x")
        for k in ("raw cma, 1 thread", "raw cma, 2 threads", "raw shm, 2 threads"):
            report.add(f"{k} / raw NIXL READ (median of per-round ratios)",
                       rounds.ratio(k, "raw NIXL READ"), "x")
    finally:
        holder.stop()


def bench_pull(report: Report, size_mb: int, repeat: int, transports: list[str]) -> None:
    """Replica.pull per transport, each pull right after a memcpy of the same size.
    "auto/whole" is `auto` with whole-item plans (`whole_items=True`: one plan)."""
    rounds = Rounds(size_mb * 2**20)
    memcpy = _memcpy(size_mb)
    for transport in transports:
        kind, _, whole = transport.partition("/")
        with publishing_holder(size_mb, kind, whole_items=whole) as (holder, rep):
            for _ in range(repeat):
                for verify in (False, True):
                    rep.verify = verify
                    holder.proc.send_signal(signal.SIGUSR1)
                    version = holder.next_json(timeout=120)["version"]
                    rounds.add(f"{transport} memcpy {verify}", _seconds(memcpy))
                    rounds.add(f"{transport} pull {verify}", _seconds(
                        lambda v=version: rep.pull(version=v, timeout=120)))
                    assert rep.version == version
    rounds.show()
    for transport in transports:
        for verify in (False, True):
            label = f"Replica.pull {size_mb} MiB over {transport.replace('/whole', '')}" + \
                (", whole-item plans" if transport.endswith("/whole") else "") + \
                ("" if verify else " (verify off)")
            pull, base = f"{transport} pull {verify}", f"{transport} memcpy {verify}"
            report.add(label, rounds.gbps(pull), "GB/s", "memcpy (same rounds)",
                       rounds.gbps(base))
            report.add(f"{label} / memcpy (median of per-round ratios)",
                       rounds.ratio(pull, base), "x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--raw-only", action="store_true", help="skip the Replica.pull figures")
    p.add_argument("--transports", nargs="+", default=["cma", "auto", "auto/whole", "nixl"],
                   help="cma, auto, nixl; NAME/whole for whole-item plans")
    args = p.parse_args()
    apply_ucx_defaults()
    report = Report("same_node")
    bench_raw(report, args.size_mb, args.repeat)
    if not args.raw_only:
        bench_pull(report, args.size_mb, args.repeat, args.transports)
    report.write()


if __name__ == "__main__":
    main()
