"""Share reads: what a node's share of a tensor-parallel weight costs to read one-sided,
against a contiguous read of the same bytes.

A node whose ranks load a column-parallel weight (q/k/v, gate/up, embeddings) needs a
contiguous range of its rows; one whose ranks load a row-parallel weight (o_proj, down_proj)
needs a run of columns in every row, i.e. one read descriptor per row. Whether a node can
pull only its share (`docs/design/sharded-versions.md`, "A node's share") depends first on
what those strided reads cost.

The holder is `bench.holder raw` (a bare NIXL agent holding `--size-mb` in 32 MiB tensors).
The reader is this module's `read` mode, in a process of its own, through TensorHub's own
transports (`NixlTransport.read`, `CmaTransport.read`): on the holder's host (nixl over
loopback tcp, and cma) and on a second emulated host (nixl across a veth link, unshaped).
Each 32 MiB tensor is viewed as a matrix with rows of `--row-kib` (8 KiB: a 4096-wide bf16
weight); a TP=k node's share is 1/k of it: rows [0, R/k), one descriptor per tensor, or
columns [0, row/k) of every row, one descriptor per row. Figures are GB/s of the share's
bytes (medians of interleaved rounds), the strided share against the contiguous one, and
a whole read of every tensor (the transport's own bound here).

Run: python -m bench.share_reads [--size-mb 256] [--repeat 5] [--tp 2,8] [--row-kib 8]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import time

import torch

from bench.results import Report
from tensorhub.core.data_types import Endpoint, MemoryDesc
from tensorhub.core.transport.base import Peer, ReadOp, Transport
from tensorhub.tools.child_process import ChildProcess

TENSOR_BYTES = 32 * 2**20  # (bench.holder's big tensors)


def share_ops(local: list[torch.Tensor], remote: list[tuple[int, int]], row_bytes: int,
              tp: int | None, strided: bool) -> list[ReadOp]:
    """Read ops of every tensor's TP=`tp` share (None: the whole tensor): its first rows
    (one op), or the first `row_bytes / tp` bytes of every row (one op per row)."""
    ops = []
    for dst, (addr, nbytes) in zip(local, remote, strict=True):
        if tp is None:
            ops.append(ReadOp(dst, MemoryDesc(addr=addr, nbytes=nbytes)))
        elif not strided:
            n = nbytes // tp
            ops.append(ReadOp(dst[:n], MemoryDesc(addr=addr, nbytes=n)))
        else:
            run = row_bytes // tp
            for row in range(nbytes // row_bytes):
                at = row * row_bytes
                ops.append(ReadOp(dst[at:at + run], MemoryDesc(addr=addr + at, nbytes=run)))
    return ops


def measure(transport: Transport, peer: Peer, remote: list[tuple[int, int]], row_bytes: int,
            tps: list[int], repeat: int) -> dict[str, dict]:
    """Seconds per read of each figure (interleaved rounds), and the bytes each reads."""
    local = [torch.empty(nbytes, dtype=torch.uint8) for _, nbytes in remote]
    transport.register(local)
    figures: dict[str, list[ReadOp]] = {"whole": share_ops(local, remote, row_bytes, None, False)}
    for tp in tps:
        figures[f"rows/{tp}"] = share_ops(local, remote, row_bytes, tp, False)
        figures[f"columns/{tp}"] = share_ops(local, remote, row_bytes, tp, True)
    times: dict[str, list[float]] = {name: [] for name in figures}
    for rnd in range(repeat + 1):  # (round 0 warms up: connections, first touch)
        for name, ops in figures.items():
            started = time.perf_counter()
            transport.read(peer, ops, timeout=120)
            if rnd:
                times[name].append(time.perf_counter() - started)
    return {name: {"seconds": statistics.median(times[name]), "ops": len(ops),
                   "bytes": sum(op.remote.nbytes for op in ops)}
            for name, ops in figures.items()}


def _read(args) -> None:
    """The reader process: told the holder (one JSON line on stdin), prints its figures."""
    from tensorhub.core.transport.nixl import NixlTransport, apply_ucx_defaults

    holder = json.loads(sys.stdin.readline())
    remote = [tuple(d) for d in holder["descs"]]
    tps = [int(x) for x in args.tp.split(",")]
    out = {}
    apply_ucx_defaults(args.host)
    nixl = NixlTransport("share-reader", host=args.host)
    peer = Peer("raw-holder", Endpoint(transport="nixl", agent_name="raw-holder",
                                       agent_metadata=base64.b64decode(holder["metadata"])))
    out["nixl"] = measure(nixl, peer, remote, args.row_kib * 1024, tps, args.repeat)
    nixl.close()
    if args.cma:
        from tensorhub.core.transport import cma

        reader = cma.CmaTransport()
        peer = Peer("raw-holder", Endpoint(transport="cma", pid=holder["pid"],
                                           pid_started=cma.process_start(holder["pid"]),
                                           host=reader.host))
        out["cma"] = measure(reader, peer, remote, args.row_kib * 1024, tps, args.repeat)
        reader.close()
    print(json.dumps(out), flush=True)


def _run_pair(holder_cmd, reader_cmd, args, where: str) -> dict:
    """Start the holder, then a reader told of it; the reader's figures."""
    argv = [sys.executable, "-m", "bench.holder", "raw", "--size-mb", str(args.size_mb)]
    holder = holder_cmd(argv)
    reader = None
    try:
        info = holder.next_json(timeout=120)
        info["pid"] = holder.pid
        reader = reader_cmd([sys.executable, "-m", "bench.share_reads", "read", "--tp", args.tp,
                             "--row-kib", str(args.row_kib), "--repeat", str(args.repeat)])
        reader.send_line(json.dumps(info))
        figures = reader.next_json(timeout=1200)
        print(f"{where}: {json.dumps(figures)}", flush=True)
        return figures
    finally:
        if reader is not None:
            reader.stop()
        holder.stop()


def report(rep: Report, where: str, transport: str, figures: dict, row_kib: int) -> None:
    def gbps(name: str) -> float:
        return figures[name]["bytes"] / figures[name]["seconds"] / 1e9

    rep.add(f"{transport}, {where}: whole read", gbps("whole"), "GB/s")
    for name in figures:
        if not name.startswith("columns/"):
            continue
        tp = name.split("/")[1]
        f = figures[name]
        rep.add(f"{transport}, {where}: TP={tp} share, contiguous rows", gbps(f"rows/{tp}"),
                "GB/s", "a whole read", gbps("whole"))
        rep.add(f"{transport}, {where}: TP={tp} share, columns ({f['ops']} reads of "
                f"{row_kib * 1024 // int(tp)} B)", gbps(name), "GB/s",
                "the same bytes as contiguous rows", gbps(f"rows/{tp}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["bench", "read"], default="bench")
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tp", default="2,8", help="TP sizes of the shares, comma-separated")
    p.add_argument("--row-kib", type=int, default=8, help="bytes of a weight's row, KiB")
    p.add_argument("--host", default="127.0.0.1", help="read: this reader's address")
    p.add_argument("--cma", action="store_true", help="read: also over cma (same host)")
    p.add_argument("--local-only", action="store_true", help="skip the emulated hosts")
    args = p.parse_args(argv)
    if args.mode == "read":
        _read(args)
        return 0
    if args.size_mb * 2**20 % TENSOR_BYTES:
        p.error("--size-mb: a multiple of 32")
    rep = Report("share_reads")
    local = _run_pair(lambda a: ChildProcess(a, name="holder"),
                      lambda a: ChildProcess([*a, "--cma"], name="reader", stdin=subprocess.PIPE),
                      args, "one host")
    for transport, figures in local.items():
        report(rep, "one host", transport, figures, args.row_kib)
    if not args.local_only:
        from tensorhub_testing.cluster import Cluster, available

        reason = available()
        if reason is not None:
            print(f"no emulated hosts here: {reason}", file=sys.stderr)
        else:
            with Cluster(2) as cluster:
                h0, h1 = cluster.hosts
                across = _run_pair(
                    lambda a: h0.popen([*a, "--host", h0.address], name="holder"),
                    lambda a: h1.popen([*a, "--host", h1.address], name="reader",
                                       stdin=subprocess.PIPE),
                    args, "two emulated hosts")
            report(rep, "two emulated hosts", "nixl", across["nixl"], args.row_kib)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
