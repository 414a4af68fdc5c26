"""The coordinator under load: 4096 workers heartbeating and asking for plans, against a
real coordinator process (`tensorhub coordinator`) over its ZeroMQ socket.

Open loop, as a fleet behaves: every worker heartbeats once per interval (1 s, the default)
and readers ask for plans at a set rate (Poisson arrivals), whatever the coordinator's
speed; each plan's lease is then ended with its own `ReadDone` (a real replica carries it on
its next request: this is more load, not less). Latency is measured from a request's
*scheduled* send time to its reply, so a coordinator (or a load generator) that falls
behind shows as latency rather than as a quietly lower rate. Half the fleet holds the
version (the planner scans a large holder set); the other half reads. One load-generator
process (one thread, a poller over 16 sockets) drives all 4096 worker ids.

Printed per offered rate: whole-item plan p50/p99 beside heartbeat latency (the
socket-and-codec floor) and the goal, and the coordinator's CPU from /proc/<pid>/stat.
Then the time inside `dispatch.answer` per plan (what the socket loop runs), free of
scheduling on a shared machine: whole-item plans (8 GiB) and striped plans for a 1 TiB
version (16,384 chunks); `--inside-only` measures only these (no process, seconds).
`python -m bench.plan_latency [--workers 4096] [--rates 250,500,1000,2000] [--seconds 10]`.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager

import msgpack
import zmq

from bench.results import Report
from tensorhub.core.client import CoordinatorClient, Credentials
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
    ReplanStripes,
    StatusRequest,
    StripedPlanRequest,
    TensorSpec,
)
from tensorhub.core.layout import layout_id, plan_items
from tensorhub.core.wire import encode

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
SOCKETS = 16


def _holds(w: int) -> bool:
    """Half the fleet holds the version, half of every datacenter (`dc{w % 4}`): a reader
    finds holders in its own datacenter (across them, one stream per datacenter at a time)."""
    return (w // 4) % 2 == 0


def _labels(w: int) -> dict[str, str]:
    return {"dc": f"dc{w % 4}", "node": f"n{w // 8}"}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CREDENTIALS = Credentials()  # the load's workers' secrets, from their registrations


def _payload(request) -> bytes:
    return encode(CREDENTIALS.envelope(request))


class _Fleet:
    """Worker ids multiplexed over a few DEALER sockets; requests pipelined, replies matched
    by request id. Replies are read with plain msgpack: only a lease id is needed, and
    validating 4096 workers' replies in this one thread would make the generator, not the
    coordinator, the bottleneck."""

    def __init__(self, address: str):
        ctx = zmq.Context.instance()
        self.socks = []
        for _ in range(SOCKETS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks.append(sock)
        self.poller = zmq.Poller()
        for sock in self.socks:
            self.poller.register(sock, zmq.POLLIN)
        self.pending: dict[bytes, tuple[str, float, int]] = {}
        self.ids = itertools.count()

    def send(self, worker: int, kind: str, payload: bytes, scheduled: float) -> None:
        req_id = next(self.ids).to_bytes(8, "little")
        self.pending[req_id] = (kind, scheduled, worker)
        self.socks[worker % SOCKETS].send_multipart([req_id, payload])

    def receive(self, timeout_ms: int):
        """Yield (kind, latency, worker, reply dict) for every reply that arrived."""
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    req_id, body = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind, scheduled, worker = self.pending.pop(req_id)
                yield kind, time.perf_counter() - scheduled, worker, msgpack.unpackb(body)

    def drain(self, deadline: float):
        while self.pending and time.perf_counter() < deadline:
            yield from self.receive(100)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


class _Load:
    """The fleet's side: 4096 registered worker ids, half holding the version."""

    def __init__(self, address: str, workers: int, heartbeat_interval: float):
        self.fleet = _Fleet(address)
        self.workers, self.interval = workers, heartbeat_interval
        ids: list[str] = [""] * workers
        for w in range(workers):
            self.fleet.send(w, "register", _payload(Register(
                name=f"w{w}", role="replica", endpoint=ENDPOINT, labels=_labels(w))),
                time.perf_counter())
        for _, _, w, reply in self.fleet.drain(time.perf_counter() + 120):
            ids[w] = reply["worker_id"]
            CREDENTIALS.remember(reply["worker_id"], reply["secret"])
        for w in filter(_holds, range(workers)):
            self.fleet.send(w, "hold", _payload(Hold(
                worker_id=ids[w], model="m", version=1, layout_id=layout_id(MANIFEST),
                memory=MEMORY)), time.perf_counter())
        list(self.fleet.drain(time.perf_counter() + 120))
        self.ids = ids
        self.readers = [w for w in range(workers) if not _holds(w)]
        self.beats = [_payload(Heartbeat(worker_id=i)) for i in ids]
        # A reader's first plan brings the manifest and checksums, its later ones leave them
        # out (`known_manifest`), as a `Replica` pulling a version does.
        self.plans = {known: {
            w: _payload(PlanRequest(worker_id=ids[w], model="m", version=1,
                                    known_manifest=known)) for w in self.readers}
            for known in (True, False)}
        self.asked: set[int] = set()
        self.rng = random.Random(0)

    def offer(self, rate: float, seconds: float) -> dict:
        """Heartbeats from every worker and `rate` plans/s for `seconds`; latencies by kind."""
        lat: dict[str, list[float]] = {"heartbeat": [], "plan_whole": []}
        errors = 0
        t0 = time.perf_counter() + 0.1
        end = t0 + seconds
        seq = itertools.count()  # (time, tie-breaker, kind, worker)
        events: list[tuple[float, int, str, int]] = [
            (t0 + self.interval * w / self.workers, next(seq), "heartbeat", w)
            for w in range(self.workers)]
        t_plan, k = t0 + self.rng.expovariate(rate), 0
        while t_plan < end:
            events.append((t_plan, next(seq), "plan", self.readers[k % len(self.readers)]))
            t_plan, k = t_plan + self.rng.expovariate(rate), k + 1
        heapq.heapify(events)
        fleet = self.fleet
        while events:
            now = time.perf_counter()
            while events and events[0][0] <= now:
                t, _, kind, w = heapq.heappop(events)
                if kind == "heartbeat":
                    fleet.send(w, kind, self.beats[w], t)
                    if t + self.interval < end:
                        heapq.heappush(events, (t + self.interval, next(seq), kind, w))
                else:
                    fleet.send(w, "plan_whole", self.plans[w in self.asked][w], t)
                    self.asked.add(w)
            wait = events[0][0] - time.perf_counter() if events else 0.0
            got, bad = self._collect(fleet.receive(int(wait * 1000)), lat) if wait > 0 \
                else (0, 0)
            if got == 0 and 0 < wait < 1e-3:
                time.sleep(wait)  # poll waits whole milliseconds: do not spin below one
            errors += bad
        errors += self._collect(fleet.drain(time.perf_counter() + 30), lat)[1]
        unanswered = len(fleet.pending)
        fleet.pending.clear()
        return {"lat": lat, "errors": errors, "unanswered": unanswered}

    def _collect(self, replies, lat: dict[str, list[float]]) -> tuple[int, int]:
        """Record latencies; end each plan's lease at once. Returns (replies, errors)."""
        errors, got = 0, 0
        for kind, latency, w, reply in replies:
            got += 1
            if kind == "done":
                continue
            lat[kind].append(latency)
            if reply.get("type") == "error":
                errors += 1
            elif kind.startswith("plan"):
                self.fleet.send(w, "done", _payload(ReadDone(
                    worker_id=self.ids[w], lease_id=reply["lease_id"], ok=True)),
                    time.perf_counter())
        return got, errors


@contextmanager
def _published(manifest: Manifest, memory: list[MemoryDesc]):
    """A coordinator's state with no socket (its requests answered as the socket loop
    answers them) and a trainer that has published version 1 of "m"; yields a function
    answering a payload with the reply's bytes, and a `call(request)` returning the reply."""
    from tensorhub.coordinator import dispatch
    from tensorhub.coordinator.server import settle_gc
    from tensorhub.coordinator.state import CoordinatorState

    settle_gc()  # as `tensorhub coordinator` does
    state = CoordinatorState()

    def call(request):
        reply = dispatch.handle(state, _payload(request))
        CREDENTIALS.learn(reply)
        return reply

    t = call(Register(name="trainer", role="trainer", endpoint=ENDPOINT)).worker_id
    call(Publish(worker_id=t, model="m", version=1, manifest=manifest,
                 checksums=["c"] * len(plan_items(manifest)), memory=memory))
    yield (lambda payload: dispatch.answer(state, payload)), call


def service_times(workers: int, plans: int = 1000) -> dict[str, list[float]]:
    """Seconds inside `dispatch.answer` per plan (decode, plan, the reply's bytes), with
    `workers` registered and half of them holding: the coordinator's own share of the
    latency, free of client-side and scheduling delays on a shared machine."""
    with _published(MANIFEST, MEMORY) as (answer, call):
        ids = [call(Register(name=f"w{i}", role="replica", endpoint=ENDPOINT,
                             labels=_labels(i))).worker_id for i in range(workers)]
        for i in filter(_holds, range(workers)):
            call(Hold(worker_id=ids[i], model="m", version=1, layout_id=layout_id(MANIFEST),
                      memory=MEMORY))
        out: dict[str, list[float]] = {"plan_whole": []}
        readers = [ids[i] for i in range(workers) if not _holds(i)]
        for k in range(plans):
            w = readers[k % len(readers)]
            payload = _payload(PlanRequest(worker_id=w, model="m", version=1))
            started = time.perf_counter()
            reply = answer(payload)
            out["plan_whole"].append(time.perf_counter() - started)
            call(ReadDone(worker_id=w, lease_id=msgpack.unpackb(reply)["lease_id"], ok=True))
        return out


TIB_TENSOR = 512 << 20
TIB_MANIFEST = Manifest(
    tensors=[TensorSpec(name=f"norm.{i}", dtype="uint8", shape=[4096], nbytes=4096)
             for i in range(64)]
    + [TensorSpec(name=f"layer.{i}", dtype="uint8", shape=[TIB_TENSOR], nbytes=TIB_TENSOR)
       for i in range(2048)],  # 1 TiB: 2049 items, 16,384 chunks of 64 MiB
    compact_threshold=1 << 20)


def striped_service_times(workers: int) -> dict[str, list[float]]:
    """Seconds inside `dispatch.answer` per striped plan request, for a 1 TiB version
    (16,384 chunks) and `workers` readers joining one after another: a reader's first
    request (it carries its 2049 memory regions; the forest names its parents) and its
    later ones (a stripe it asks for again: a parent that fell behind, replaced). Neither
    carries anything per chunk."""
    items = plan_items(TIB_MANIFEST)
    memory = [MemoryDesc(addr=(k + 1) << 40, nbytes=it.nbytes) for k, it in enumerate(items)]
    progress = MemoryDesc(addr=1 << 20, nbytes=1 << 16)
    with _published(TIB_MANIFEST, memory) as (answer, call):
        ids = [call(Register(name=f"w{i}", role="replica", endpoint=ENDPOINT,
                             progress=progress)).worker_id for i in range(workers)]
        out: dict[str, list[float]] = {"plan_striped_first": [], "plan_striped_again": []}
        parents: dict[str, list] = {}
        for w in ids:
            payload = _payload(StripedPlanRequest(worker_id=w, model="m", version=1,
                                                  memory=memory))
            started = time.perf_counter()
            reply = answer(payload)
            out["plan_striped_first"].append(time.perf_counter() - started)
            parents[w] = msgpack.unpackb(reply)["stripes"]
        for w in ids:
            behind = [p for p in parents[w] if p is not None][:1]
            payload = _payload(ReplanStripes(
                worker_id=w, model="m", version=1, known_manifest=True,
                stripes=[parents[w].index(behind[0])] if behind else [1], behind=behind))
            started = time.perf_counter()
            answer(payload)
            out["plan_striped_again"].append(time.perf_counter() - started)
        return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4096)
    parser.add_argument("--rates", default="250,500,1000,2000",
                        help="offered plan requests per second, one run each (comma list)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each run")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="seconds between a worker's heartbeats (the coordinator's default)")
    parser.add_argument("--inside-only", action="store_true",
                        help="only the time inside `dispatch.answer` (no process, no load)")
    args = parser.parse_args(argv)
    if args.inside_only:
        _report_inside(Report("plan_latency_inside"), args.workers)
        return
    rates = [float(r) for r in args.rates.split(",")]
    port = random.Random(os.getpid()).randrange(20000, 40000, 2)
    address = f"tcp://127.0.0.1:{port}"
    coord = subprocess.Popen(
        [sys.executable, "-m", "tensorhub.tools.cli", "--log-level", "WARNING", "coordinator",
         "--bind", address, "--worker-ttl", "600", "--lease-ttl", "600"],
        stdout=subprocess.DEVNULL)
    runs = []
    try:
        admin = CoordinatorClient(address, timeout=30.0)
        admin.call(StatusRequest())
        trainer = admin.call(Register(name="trainer", role="trainer", endpoint=ENDPOINT))
        admin.call(Publish(worker_id=trainer.worker_id, model="m", version=1,
                           manifest=MANIFEST, checksums=["c"] * len(ITEMS), memory=MEMORY))
        load = _Load(address, args.workers, args.heartbeat_interval)
        for rate in rates:
            cpu0, own0, wall0 = _cpu_seconds(coord.pid), time.process_time(), time.perf_counter()
            run = load.offer(rate, args.seconds)
            wall = time.perf_counter() - wall0
            run["cpu"] = (_cpu_seconds(coord.pid) - cpu0) / wall
            run["generator_cpu"] = (time.process_time() - own0) / wall
            runs.append((rate, run))
        load.fleet.close()
        status = admin.call(StatusRequest())
        holders = len(status.models[0].versions[0].holders) if status.models else 0
        admin.close()
    finally:
        coord.terminate()
        coord.wait(timeout=10)
    report = Report("plan_latency")
    n = args.workers
    for rate, run in runs:
        lat = run["lat"]
        at = f"{n} workers, {rate:g} plans/s"
        hb50 = _pct(lat["heartbeat"], 0.5)
        for kind in ("plan_whole",):
            report.add(f"{at}: {kind} p50", _pct(lat[kind], 0.5) * 1e3, "ms",
                       "heartbeat p50", hb50 * 1e3, higher_is_better=False)
            report.add(f"{at}: {kind} p99", _pct(lat[kind], 0.99) * 1e3, "ms",
                       "goal", 10.0, higher_is_better=False)
        report.add(f"{at}: heartbeat p99", _pct(lat["heartbeat"], 0.99) * 1e3, "ms")
        report.add(f"{at}: coordinator CPU (one core = 100)", 100 * run["cpu"], "%")
        report.add(f"{at}: load generator CPU (one core = 100)", 100 * run["generator_cpu"],
                   "%")
        report.add(f"{at}: error replies / unanswered", run["errors"] + run["unanswered"],
                   "requests")
    report.add("holders at the end", holders, "workers")
    _report_inside(report, n)


def _report_inside(report: Report, n: int) -> None:
    inside = service_times(n)
    inside.update(striped_service_times(n))
    for kind, xs in inside.items():
        report.add(f"{n} workers: {kind} p99 inside the coordinator",
                   _pct(xs, 0.99) * 1e3, "ms", "goal", 10.0, higher_is_better=False)
        report.add(f"{n} workers: {kind} p50 inside the coordinator",
                   _pct(xs, 0.5) * 1e3, "ms")
    report.write()


if __name__ == "__main__":
    main()
