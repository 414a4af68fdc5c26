"""The coordinator under load: 4096 workers registering, heartbeating and asking for plans
against a real coordinator process over its ZeroMQ socket.

A few client processes (threads inside, one socket each) multiplex the worker ids. Every
round each worker heartbeats, asks for a plan, ends its lease, and a share of them then hold
the version, so the holder set grows to the whole fleet (the planner's worst case). Printed:
p50/p99 plan latency (chunked and whole-item plans) beside heartbeat latency measured in the
same run (the socket-and-codec floor), and the coordinator's CPU from /proc/<pid>/stat.
`python -m bench.plan_latency [--workers 4096]`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time

from bench.results import Report
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    Endpoint,
    Heartbeat,
    Hold,
    Manifest,
    MemoryDesc,
    PlanRequest,
    Publish,
    ReadDone,
    Register,
    StatusRequest,
    TensorSpec,
)
from tensorhub.core.errors import CoordinatorError
from tensorhub.core.layout import layout_id, plan_items

TENSOR = 64 << 20
MANIFEST = Manifest(
    tensors=[TensorSpec(name=f"norm.{i}", dtype="uint8", shape=[4096], nbytes=4096)
             for i in range(64)]
    + [TensorSpec(name=f"layer.{i}", dtype="uint8", shape=[TENSOR], nbytes=TENSOR)
       for i in range(128)],  # 8 GiB, 129 items, 129 chunks
    compact_threshold=1 << 20)
ITEMS = plan_items(MANIFEST)
MEMORY = [MemoryDesc(addr=(k + 1) << 36, nbytes=it.nbytes) for k, it in enumerate(ITEMS)]
ENDPOINT = Endpoint(transport="zmq", address="tcp://127.0.0.1:1")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(address: str, names: list[str], rounds: int, hold_share: float, threads: int,
            out: mp.Queue, start: mp.Event) -> None:
    """One client process: `threads` sockets, each driving a slice of the worker ids."""
    lat: dict[str, list[float]] = {"heartbeat": [], "plan_chunked": [], "plan_whole": [],
                                   "register": []}
    lock = threading.Lock()

    def drive(mine: list[str]) -> None:
        rng = random.Random(hash(tuple(mine)))
        client = CoordinatorClient(address, timeout=30.0)
        local: dict[str, list[float]] = {k: [] for k in lat}

        def timed(kind, request):
            t = time.perf_counter()
            try:
                return client.call(request)
            except CoordinatorError:
                return None
            finally:
                local[kind].append(time.perf_counter() - t)

        ids = [timed("register", Register(name=n, role="replica", endpoint=ENDPOINT,
                                          labels={"dc": f"dc{i % 4}", "node": f"n{i // 8}"})
                     ).worker_id for i, n in enumerate(mine)]
        start.wait(timeout=600)
        held = set()
        for r in range(rounds):
            for k, wid in enumerate(ids):
                timed("heartbeat", Heartbeat(worker_id=wid))
                chunked = (k + r) % 2 == 0
                plan = timed("plan_chunked" if chunked else "plan_whole",
                             PlanRequest(worker_id=wid, model="m", version=1, chunked=chunked))
                if plan is not None:
                    client.call(ReadDone(worker_id=wid, lease_id=plan.lease_id, ok=True))
                if wid not in held and rng.random() < hold_share:
                    client.call(Hold(worker_id=wid, model="m", version=1,
                                     layout_id=layout_id(MANIFEST), memory=MEMORY))
                    held.add(wid)
        client.close()
        with lock:
            for k, v in local.items():
                lat[k].extend(v)

    slices = [names[i::threads] for i in range(threads)]
    ts = [threading.Thread(target=drive, args=(s,)) for s in slices]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=3600)
    out.put(lat)


def service_times(workers: int, plans: int = 1000) -> dict[str, list[float]]:
    """Seconds inside `Coordinator.handle` per plan (decode, plan, encode-ready reply), with
    `workers` registered and half of them holding: the coordinator's own share of the
    latency, free of client-side and scheduling delays on a shared machine."""
    from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
    from tensorhub.core.data_types import Envelope
    from tensorhub.core.wire import encode

    c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", announce="tcp://127.0.0.1:0"))
    try:
        def call(request):
            return c.handle(encode(Envelope(request=request)))

        t = call(Register(name="trainer", role="trainer", endpoint=ENDPOINT)).worker_id
        call(Publish(worker_id=t, model="m", version=1, manifest=MANIFEST,
                     checksums=["c"] * len(ITEMS), memory=MEMORY))
        ids = [call(Register(name=f"w{i}", role="replica", endpoint=ENDPOINT,
                             labels={"dc": f"dc{i % 4}", "node": f"n{i // 8}"})).worker_id
               for i in range(workers)]
        for w in ids[::2]:
            call(Hold(worker_id=w, model="m", version=1, layout_id=layout_id(MANIFEST),
                      memory=MEMORY))
        out: dict[str, list[float]] = {"plan_chunked": [], "plan_whole": []}
        readers = ids[1::2]
        for k in range(plans):
            w = readers[k % len(readers)]
            chunked = k % 2 == 0
            payload = encode(Envelope(request=PlanRequest(worker_id=w, model="m", version=1,
                                                          chunked=chunked)))
            started = time.perf_counter()
            reply = c.handle(payload)
            out["plan_chunked" if chunked else "plan_whole"].append(
                time.perf_counter() - started)
            call(ReadDone(worker_id=w, lease_id=reply.lease_id, ok=True))
        return out
    finally:
        c.stop()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="sockets per client process")
    parser.add_argument("--hold-share", type=float, default=0.5,
                        help="chance per round that a worker then holds the version")
    args = parser.parse_args(argv)
    port = random.Random(os.getpid()).randrange(20000, 40000, 2)
    address = f"tcp://127.0.0.1:{port}"
    coord = subprocess.Popen(
        [sys.executable, "-m", "tensorhub.cli", "--log-level", "WARNING", "coordinator",
         "--bind", address, "--worker-ttl", "600", "--lease-ttl", "600"],
        stdout=subprocess.DEVNULL)
    try:
        admin = CoordinatorClient(address, timeout=30.0)
        admin.call(StatusRequest())
        trainer = admin.call(Register(name="trainer", role="trainer", endpoint=ENDPOINT))
        admin.call(Publish(worker_id=trainer.worker_id, model="m", version=1,
                           manifest=MANIFEST, checksums=["c"] * len(ITEMS), memory=MEMORY))
        ctx = mp.get_context("spawn")
        out, start = ctx.Queue(), ctx.Event()
        names = [f"w{i}" for i in range(args.workers)]
        procs = [ctx.Process(target=_client,
                             args=(address, names[i::args.clients], args.rounds,
                                   args.hold_share, args.threads, out, start))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        while len(admin.call(StatusRequest()).workers) < args.workers + 1:
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not register in time")
            time.sleep(0.5)
        cpu0, wall0 = _cpu_seconds(coord.pid), time.perf_counter()
        start.set()
        results = [out.get(timeout=3600) for _ in procs]
        cpu, wall = _cpu_seconds(coord.pid) - cpu0, time.perf_counter() - wall0
        for p in procs:
            p.join(timeout=60)
        status = admin.call(StatusRequest())
        holders = len(status.models[0].versions[0].holders) if status.models else 0
        admin.close()
    finally:
        coord.terminate()
        coord.wait(timeout=10)
    lat = {k: [x for r in results for x in r[k]] for k in results[0]}
    requests = sum(len(v) for k, v in lat.items() if k != "register") * 2  # + done / hold
    report = Report("plan_latency")
    hb50, hb99 = _pct(lat["heartbeat"], 0.5), _pct(lat["heartbeat"], 0.99)
    for kind in ("plan_chunked", "plan_whole"):
        report.add(f"{args.workers} workers: {kind} p50", _pct(lat[kind], 0.5) * 1e3, "ms",
                   "heartbeat p50", hb50 * 1e3, higher_is_better=False)
        report.add(f"{args.workers} workers: {kind} p99", _pct(lat[kind], 0.99) * 1e3, "ms",
                   "goal", 10.0, higher_is_better=False)
    report.add(f"{args.workers} workers: heartbeat p99", hb99 * 1e3, "ms")
    inside = service_times(args.workers)
    for kind, xs in inside.items():
        report.add(f"{args.workers} workers: {kind} p99 inside the coordinator",
                   _pct(xs, 0.99) * 1e3, "ms", "goal", 10.0, higher_is_better=False)
        report.add(f"{args.workers} workers: {kind} p50 inside the coordinator",
                   _pct(xs, 0.5) * 1e3, "ms")
    report.add("coordinator CPU (one core = 100)", 100 * cpu / wall, "%")
    report.add("coordinator CPU per request", cpu / max(1, requests) * 1e6, "us")
    report.add("holders at the end", holders, "workers")
    report.add("plans per second", (len(lat["plan_chunked"]) + len(lat["plan_whole"])) / wall,
               "1/s")
    print(f"median plan latency over all kinds: "
          f"{statistics.median(lat['plan_chunked'] + lat['plan_whole']) * 1e3:.2f} ms")
    report.write()


if __name__ == "__main__":
    main()
