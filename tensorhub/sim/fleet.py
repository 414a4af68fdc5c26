"""A fleet of simulated workers pulling one version through the REAL coordinator.

Every decision (who reads which chunk from whom, who is busy, who failed) is made by
`Coordinator` handlers running on the simulated clock; only the network and the workers'
reading are simulated (`links.py`). A worker follows the chunked protocol as a real replica
would, striping over holders by keeping one lease per stream:

- it reads at most `streams` chunks at once, at most one from any source;
- whenever a stream would idle (fewer than `streams` reads in flight and no chunk of an
  open plan can start on it) it asks for a plan (one request at a time) with `missing` =
  every chunk neither read nor in an open plan; the planner gives one holder per plan;
- `Progress` per chunk read; `ReadDone` for a lease as soon as its own chunks are read
  (not when the whole pull ends), which frees that holder's slot;
- a `busy` reply: ask again after `retry_after` times 1 +- `retry_jitter` (uniform), streams
  still reading go on;
- a failed read: its chunks are missing again; no new plan is asked while that lease is
  open, and its `ReadDone` names the failed holder;
- `Hold` when every chunk is read and every lease ended.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.server import Coordinator
from tensorhub.coordinator.state import CoordinatorConfig, Reject
from tensorhub.core.chunks import CHUNK_BYTES, chunks_of, merge
from tensorhub.core.client import BUSY_RETRY_JITTER, Credentials, busy_wait
from tensorhub.core.data_types import (
    Endpoint,
    ErrorReply,
    Heartbeat,
    Hold,
    Manifest,
    MemoryDesc,
    PlanRequest,
    Progress,
    Publish,
    ReadDone,
    Register,
    TensorSpec,
)
from tensorhub.core.layout import layout_id, plan_items
from tensorhub.core.wire import decode_reply, encode
from tensorhub.sim.coordinator_queue import CoordinatorQueue, Expiry
from tensorhub.sim.links import EventLoop, Network, Nic, Transfer

GB = 1e9


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    model_bytes: int = 8 << 30
    tensor_bytes: int = 512 << 20  # the model is tensors of this size plus a compact region
    chunk_bytes: int = CHUNK_BYTES
    nic_gbps: float = 100.0  # every worker's NIC, each way
    latency: float = 10e-6  # one-sided read start, inside a datacenter
    wan_gbps: float = 100.0  # one stream between datacenters
    wan_latency: float = 1e-3
    rpc: float = 100e-6  # a coordinator round trip
    dcs: int = 1  # workers are spread round robin over this many datacenters
    per_node: int = 8  # workers per node (same-node peers come first)
    streams: int = 2  # chunks a reader reads at once (striped over sources)
    lookahead: int = 0  # chunks planned beyond its streams (>0 measured worse: holds slots)
    busy_retry_chunks: float = 0.5  # a busy reader asks again after this many chunk times
    # ... times 1 +- this (uniform), as a real replica's: retries in lockstep (every worker
    # asked at t=0, so all asked again on the same 0.5 chunk-time grid) left a holder freed
    # just after a tick idle until the next one, at every doubling of the start-up
    retry_jitter: float = BUSY_RETRY_JITTER
    seed: int = 0  # of the retry jitter
    kill: tuple[int, ...] = ()  # workers killed mid-pull ...
    kill_at: float = 0.5  # ... at this fraction of the lower bound
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    wire: bool = False  # encode/decode every message (slower; proves the wire path)
    time_limit: float = 600.0  # simulated seconds
    # Striped simulator only: 2 times the second of two versions, which readers pull by
    # the parents they had for the first (a steady fleet: no plan requests).
    version: int = 1
    # Striped simulator only: readers stand by before the first version exists (placed
    # ahead in its forest), and pull it as the next ones, from the parents they were told.
    standby: bool = False

    @property
    def lower_bound(self) -> float:
        """A reader cannot finish before its NIC has received every byte."""
        return self.model_bytes * 8 / (self.nic_gbps * GB) + self.latency + self.rpc


class Completions:
    """Completion figures of a simulated fan-out: `finished` (worker -> seconds) over the
    `config`'s lower bound."""

    config: SimConfig
    finished: dict[str, float]

    @property
    def worst(self) -> float:
        return max(self.finished.values()) if self.finished else math.inf

    @property
    def ratio(self) -> float:
        """Worst completion over the lower bound."""
        return self.worst / self.config.lower_bound

    @property
    def median_ratio(self) -> float:
        times = sorted(self.finished.values())
        return times[len(times) // 2] / self.config.lower_bound if times else math.inf


@dataclass
class FleetResult(Completions):
    config: SimConfig
    finished: dict[str, float]  # worker -> completion time (simulated seconds)
    killed: list[str]
    unfinished: list[str]  # alive workers that never completed (should be none)
    plans: int
    busy: int
    coordinator_busy: float = 0.0  # simulated seconds the coordinator served (queue only)
    messages: dict[str, int] = field(default_factory=dict)  # by type (queue only)


def synthetic_manifest(model_bytes: int, tensor_bytes: int) -> Manifest:
    """A model of uint8 tensors: 64 tiny ones (the compact region) and large ones."""
    tensors = [TensorSpec(name=f"norm.{i}", dtype="uint8", shape=[4096], nbytes=4096)
               for i in range(64)]
    left, i = model_bytes - 64 * 4096, 0
    while left > 0:
        n = min(tensor_bytes, left)
        tensors.append(TensorSpec(name=f"layer.{i}", dtype="uint8", shape=[n], nbytes=n))
        left, i = left - n, i + 1
    return Manifest(tensors=tensors, compact_threshold=1 << 20)


@dataclass
class _Lease:
    """One plan being read: its chunks not started yet, reads in flight, failed sources."""

    lease_id: str
    pending: list[tuple[int, str, int]]  # (chunk, source, nbytes) not started yet
    inflight: int = 0
    failed: set[str] = field(default_factory=set)


class _Worker:
    """A reader following the chunked protocol (see the module doc)."""

    def __init__(self, sim: FleetSim, name: str, labels: dict[str, str]):
        self.sim, self.name = sim, name
        reply = sim.call(Register(name=name, role="replica", endpoint=sim.endpoint,
                                  labels=labels))
        self.id = reply.worker_id
        self.done: set[int] = set()
        self.planned: set[int] = set()  # chunks in some open lease, not done yet
        self.leases: dict[str, _Lease] = {}
        self.reading: dict[str, int] = {}  # source -> my reads from it in flight
        self.asking = False  # a plan request (or its retry) is under way
        self.alive = True
        self.finished: float | None = None

    @property
    def inflight(self) -> int:
        return sum(lease.inflight for lease in self.leases.values())

    # -- the protocol
    def _want_plan(self) -> bool:
        """Ask for another plan when a stream would otherwise idle: fewer than `streams`
        reads in flight and no chunk of an open plan can start (the rest are from sources
        already being read, one stream per source). One request at a time, and never while
        a lease that saw a source fail is open (the coordinator learns of the death from
        its `ReadDone`, and would plan the dead source again)."""
        if self.asking or not self.alive or self.finished is not None:
            return False
        if len(self.done) + len(self.planned) >= len(self.sim.chunks):
            return False
        leases = self.leases.values()
        if any(lease.failed for lease in leases):
            return False
        startable = sum(1 for lease in leases for p in lease.pending
                        if p[1] not in self.reading)
        return self.inflight + startable < self.sim.config.streams + self.sim.config.lookahead

    def _maybe_ask(self) -> None:
        if self._want_plan():
            self.asking = True
            # (a modelled queue adds the half round trip itself)
            delay = 0.0 if self.sim.queue is not None else self.sim.config.rpc / 2
            self.sim.loop.at(self.sim.loop.now + delay, self.ask)

    def ask(self) -> None:
        """Send a PlanRequest (the reply arrives half a round trip later)."""
        if not self.alive:
            self.asking = False
            return
        sim = self.sim
        missing = None
        if self.done or self.planned:
            missing = merge(s for c in sim.chunks
                            if c.index not in self.done and c.index not in self.planned
                            for s in c.segments)
        sim.plans += 1
        if sim.queue is not None:
            sim.queue.send(PlanRequest(worker_id=self.id, model="m", version=1,
                                       missing=missing, chunked=True), self._answered)
            return
        self._answered(sim.call(PlanRequest(worker_id=self.id, model="m", version=1,
                                            missing=missing, chunked=True)))

    def _answered(self, reply) -> None:
        sim = self.sim
        if not self.alive:
            self.asking = False
            return
        if isinstance(reply, ErrorReply):
            if reply.code == "busy":
                sim.busy += 1
            wait = busy_wait(reply.retry_after or 1.0, sim.config.retry_jitter, sim.rng)
            sim.loop.at(sim.loop.now + wait, self.ask)
            return
        pending: list[tuple[int, str, int]] = []
        for r in reply.ranges:  # pieces of chunk segments
            index = sim.chunk_at[(r.item, r.offset)]
            if pending and pending[-1][0] == index:
                pending[-1] = (index, r.source, pending[-1][2] + r.nbytes)
            else:
                pending.append((index, r.source, r.nbytes))
        lease = _Lease(reply.lease_id, pending)
        if sim.queue is not None:  # the queue delivered the reply after its round trip
            self._got(lease)
        else:
            sim.loop.at(sim.loop.now + sim.config.rpc / 2, lambda: self._got(lease))

    def _got(self, lease: _Lease) -> None:
        self.asking = False
        if not self.alive:
            return
        self.leases[lease.lease_id] = lease
        self.planned.update(p[0] for p in lease.pending)
        self._fill()

    def _fill(self) -> None:
        streams = self.sim.config.streams
        for lease in list(self.leases.values()):  # oldest plan first
            while self.alive and lease.pending and self.inflight < streams:
                # one stream per source at a time: striping spreads the load over holders
                k = next((k for k, p in enumerate(lease.pending) if p[1] not in self.reading),
                         None)
                if k is None:
                    break
                index, src, nbytes = lease.pending.pop(k)
                lease.inflight += 1
                self.reading[src] = self.reading.get(src, 0) + 1
                self.sim.read(self, src, nbytes, (lease.lease_id, index))
            if self.alive and not lease.pending and lease.inflight == 0:
                self._end_lease(lease)
        if self.alive and self.finished is None:
            self._maybe_ask()

    def _landed(self, t: Transfer) -> _Lease:
        self.reading[t.src] -= 1
        if not self.reading[t.src]:
            del self.reading[t.src]
        lease = self.leases[t.tag[0]]
        lease.inflight -= 1
        return lease

    def chunk_read(self, t: Transfer) -> None:
        self._landed(t)
        if not self.alive:
            return
        index = t.tag[1]
        self.done.add(index)
        self.planned.discard(index)
        # memory with the first report only, as a real replica (the coordinator keeps it)
        self.sim.tell(Progress(worker_id=self.id, model="m", version=1,
                               layout_id=self.sim.layout_id,
                               memory=None if len(self.done) > 1 else self.sim.memory,
                               chunks=[index]))
        self._fill()

    def chunk_failed(self, t: Transfer) -> None:
        lease = self._landed(t)
        if not self.alive:
            return
        lease.failed.add(t.src)
        self.planned.discard(t.tag[1])
        self.planned.difference_update(p[0] for p in lease.pending if p[1] == t.src)
        lease.pending = [p for p in lease.pending if p[1] != t.src]
        self._fill()

    def _end_lease(self, lease: _Lease) -> None:
        sim = self.sim
        del self.leases[lease.lease_id]
        ok = not lease.failed
        sim.tell(ReadDone(worker_id=self.id, lease_id=lease.lease_id, ok=ok,
                          failed_holders=sorted(lease.failed),
                          error=None if ok else "source died"))
        if len(self.done) == len(sim.chunks) and not self.leases:
            sim.tell(Hold(worker_id=self.id, model="m", version=1, layout_id=sim.layout_id,
                          memory=sim.memory))
            self.finished = sim.loop.now


class FleetSim:
    def __init__(self, config: SimConfig, socket_cost: float | None = None):
        self.config = config
        self.loop = EventLoop()
        self.rng = random.Random(config.seed)
        self.net = Network(self.loop, config.wan_gbps * GB / 8)
        chunk_time = config.chunk_bytes * 8 / (config.nic_gbps * GB)
        self.coordinator = Coordinator(
            CoordinatorConfig(bind="tcp://127.0.0.1:0", announce="tcp://127.0.0.1:0",
                              worker_ttl=5.0, heartbeat_interval=1.0, lease_ttl=60.0,
                              busy_retry=chunk_time * config.busy_retry_chunks,
                              planner=PlannerConfig(**{
                                  **config.planner.__dict__, "chunk_bytes": config.chunk_bytes,
                                  "min_chunks": 1,  # exactly the configured chunks
                                  # as the coordinator's defaults: twice the busy retry
                                  "starving_ttl": 2 * chunk_time * config.busy_retry_chunks})),
            clock=lambda: self.loop.now)
        # The coordinator as one server with a queue (its real time per message), or None:
        # every call served at once, for free (how this simulator first ran).
        self.queue = CoordinatorQueue(self.loop, self.coordinator, config.rpc, socket_cost) \
            if socket_cost is not None else None
        self.credentials = self.queue.credentials if self.queue else Credentials()
        self.endpoint = Endpoint(transport="zmq", address="tcp://sim:1")
        manifest = synthetic_manifest(config.model_bytes, config.tensor_bytes)
        items = plan_items(manifest)
        self.layout_id = layout_id(manifest)
        self.chunks = chunks_of(items, config.chunk_bytes)
        self.chunk_at = {(s.item, s.offset): c.index for c in self.chunks for s in c.segments}
        base = itertools.count(1 << 30, 1 << 40)
        self.memory = [MemoryDesc(addr=next(base), nbytes=it.nbytes) for it in items]
        self.plans = self.busy = 0
        self.names: dict[str, str] = {}  # worker id -> sim name (the NIC key)
        nic = config.nic_gbps * GB / 8
        trainer = self.call(Register(name="trainer", role="trainer", endpoint=self.endpoint,
                                     labels={"dc": "dc0", "node": "trainer"}))
        self.trainer = trainer.worker_id
        self.net.add(self.trainer, Nic(nic, nic, "dc0", "trainer"))
        self.call(Publish(worker_id=self.trainer, model="m", version=1, manifest=manifest,
                          checksums=["x"] * len(items), memory=self.memory))
        self.workers: list[_Worker] = []
        for i in range(config.workers):
            labels = {"dc": f"dc{i % config.dcs}", "node": f"n{i // config.dcs // config.per_node}"}
            w = _Worker(self, f"w{i}", labels)
            self.net.add(w.id, Nic(nic, nic, labels["dc"], labels["node"]))
            self.workers.append(w)

    def tell(self, request) -> None:
        """A message whose reply nobody waits for (through the queue, when modelled)."""
        if self.queue is not None:
            self.queue.send(request)
        else:
            self.call(request)

    def call(self, request):
        """One request to the real coordinator, as the socket loop would hand it over."""
        if self.config.wire:
            reply = decode_reply(encode(self.coordinator.handle(
                encode(self.credentials.envelope(request)))))
            self.credentials.learn(reply)
            return reply
        try:
            return self.coordinator._handlers[type(request)](request)
        except Reject as rej:
            return rej.reply

    def read(self, worker: _Worker, src: str, nbytes: int, index: int) -> None:
        """A one-sided read: starts after the link latency, then moves at the fluid rate."""
        far = self.net.nics[src].dc != self.net.nics[worker.id].dc
        start = self.loop.now + (self.config.wan_latency if far else self.config.latency)
        self.loop.at(start, lambda: self.net.start(src, worker.id, nbytes, worker.chunk_read,
                                                   worker.chunk_failed, tag=index))

    def _tick(self) -> None:
        """Heartbeats of the living and the coordinator's expiry sweep, once a second."""
        for w in self.workers:
            if w.alive:
                self.tell(Heartbeat(worker_id=w.id))
        self.tell(Heartbeat(worker_id=self.trainer))
        if self.queue is not None:
            self.queue.send(Expiry())
        else:
            self.coordinator._expire()
        if any(w.alive and w.finished is None for w in self.workers):
            self.loop.at(self.loop.now + self.coordinator.config.heartbeat_interval, self._tick)

    def _kill(self, w: _Worker) -> None:
        w.alive = False
        self.net.kill(w.id)

    def run(self) -> FleetResult:
        try:
            for w in self.workers:
                self.loop.at(0.0, w._maybe_ask)
            for i in self.config.kill:
                self.loop.at(self.config.kill_at * self.config.lower_bound,
                             lambda w=self.workers[i]: self._kill(w))
            self.loop.at(self.coordinator.config.heartbeat_interval, self._tick)
            self.loop.run(until=self.config.time_limit)
        finally:
            self.coordinator.stop()
        return FleetResult(
            self.config,
            finished={w.name: w.finished for w in self.workers if w.finished is not None},
            killed=[w.name for w in self.workers if not w.alive],
            unfinished=[w.name for w in self.workers if w.alive and w.finished is None],
            plans=self.plans, busy=self.busy,
            coordinator_busy=self.queue.busy if self.queue else 0.0,
            messages=dict(self.queue.messages) if self.queue else {})


def simulate(config: SimConfig, socket_cost: float | None = None) -> FleetResult:
    """`socket_cost`: model the coordinator as a queue (see `coordinator_queue.py`)."""
    return FleetSim(config, socket_cost).run()
