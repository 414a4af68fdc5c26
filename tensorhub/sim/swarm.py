"""A fleet of simulated readers pulling one version by the striped protocol.

What runs for real: the coordinator (every handler, through `CoordinatorQueue`: one server
whose time per message is what the real handler takes here, so a busy coordinator shows
in the figures) and each reader's protocol (`reader/session.py`, what `Replica` runs:
the same messages, the same retries, the same state machine over the stripes). What is
simulated: the network (`links.py`, fluid NICs) and the reads themselves. A poll of a
parent's progress bytes costs a round trip of the link latency and sees what the parent
had landed when it arrived.

Every worker heartbeats once a `heartbeat_interval` (random phase; a reader's carries its
pull's progress) and the coordinator sweeps for expiry every `settings.EXPIRY_PERIOD`, in the same
queue as the plans.

With `SimConfig.standby` the readers stand by before the first version exists
(`coordinator/standby.py`): each is placed through the same queue, the version is
published once all are, and the clock of the figures starts there; the placing is
reported apart (`standby_seconds`, `standby_busy`). With `SimConfig.spread` readers ask at
moments spread after the announcement, each timed from its own; with
`SimConfig.failing_first` a reader that can reach no one asks first. With `SimConfig.tiled`
the version is published in tiles (a trainer worker per part, on one NIC) and each worker is
a node of an engine that pulls its ranks' share, a reader per part on the node's NIC, as
`PartedReplica(share=...)` does.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorhub import settings
from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.state import CoordinatorConfig, CoordinatorState
from tensorhub.core.chunks import Chunk, chunks_of
from tensorhub.core.data_types import (
    Announcement,
    Endpoint,
    ErrorReply,
    Heartbeat,
    LatestRequest,
    Manifest,
    MemoryDesc,
    Part,
    Publish,
    PullProgress,
    ReadPlan,
    Register,
)
from tensorhub.core.errors import TransferError
from tensorhub.core.layout import layout_id, plan_items
from tensorhub.core.stripes import Poll, Read, progress_tag
from tensorhub.reader.session import Ask, Parents, PullSession, Reader
from tensorhub.sim.config import GB, Completions, SimConfig, manifest_bytes
from tensorhub.sim.coordinator_queue import CoordinatorQueue, Expiry
from tensorhub.sim.links import EventLoop, Network, Nic


@dataclass
class SwarmResult(Completions):
    config: SimConfig
    finished: dict[str, float]
    killed: list[str]
    unfinished: list[str]
    messages: dict[str, int]  # coordinator messages by type (heartbeats included)
    coordinator_busy: float  # simulated seconds the coordinator served
    longest_wait: float  # the longest a message queued at the coordinator
    socket_cost: float
    max_depth: int
    replans: int
    polls: int = 0
    reader_messages: dict[str, int] = field(default_factory=dict)
    standby_seconds: float = 0.0  # placing every reader ahead (standby), before the version
    standby_busy: float = 0.0  # the coordinator's busy time in it
    trainer_copies: float = 0.0  # what the trainer sent for the version, in models
    model_bytes: int = 0
    node_bytes: dict[str, float] = field(default_factory=dict)  # each node received

    @property
    def engine_copies(self) -> float:
        """The most an engine's nodes received together, in models: 1 for an engine that
        pulls the model once whatever its node count, the node count for a copy per node."""
        engines: Counter[int] = Counter()
        for name, nbytes in self.node_bytes.items():
            engines[int(name[1:]) // self.config.engine_nodes] += nbytes
        return max(engines.values()) / self.model_bytes if engines else math.nan

    @property
    def busy_fraction(self) -> float:
        """The coordinator's busy time over the fan-out's duration."""
        return self.coordinator_busy / self.worst if self.finished else math.nan

    @property
    def messages_per_reader(self) -> float:
        """Coordinator messages per reader for the version, heartbeats aside."""
        n = sum(self.reader_messages.values())
        return n / max(1, self.config.workers)


@dataclass
class _Part:
    """One part of the version (the whole model, or a tile): what its readers pull."""

    number: int
    of: int
    manifest: Manifest
    layout_id: str
    chunks: list[Chunk]
    memory: list[MemoryDesc]

    @classmethod
    def of_manifest(cls, number: int, of: int, manifest: Manifest, chunk_bytes: int,
                    base: itertools.count) -> _Part:
        items = plan_items(manifest)
        return cls(number, of, manifest, layout_id(manifest), chunks_of(items, chunk_bytes),
                   [MemoryDesc(addr=next(base), nbytes=it.nbytes) for it in items])


class _Reader:
    """A simulated reader of one part: a `PullSession` (what `Replica` runs) driven on the
    simulated clock, links and coordinator queue. A node pulling a share of a version in
    tiles has one per part, as `PartedReplica` has a `Replica` per part."""

    def __init__(self, sim: SwarmSim, name: str, labels: dict[str, str],
                 broken: bool = False, delay: float = 0.0, part: int = 0):
        """`broken`: its transport reaches no one; `delay`: it asks for each version this
        long after the announcement."""
        self.sim, self.name, self.broken, self.delay = sim, name, broken, delay
        self.part = sim.parts[part]
        reply = sim.queue.call_now(Register(name=name, role="replica", endpoint=sim.endpoint,
                                            labels=labels, progress=sim.progress))
        self.id = reply.worker_id
        self.reader = Reader("m", self.part.layout_id, self.part.memory)
        self.alive = True
        self.pull: PullSession | None = None
        self.finished: float | None = None
        self.failed: str | None = None
        self.version = 1
        self.held: int | None = None
        self.parents: Parents | None = None  # of its last pull, or its standby placement
        self._wake: float | None = None

    def send(self, request, on_reply=None) -> None:
        self.sim.reader_messages[request.type] += 1
        self.sim.queue.send(request, on_reply)

    def _new_pull(self, warm: ReadPlan | None = None) -> PullSession:
        sim = self.sim
        return PullSession(self.reader, self.id, self.version, now=sim.loop.now,
                           deadline=sim.config.time_limit, warm=warm, held=self.held,
                           stall=sim.stall, poll_min=sim.poll_min, poll_max=sim.poll_max,
                           chunks=self.part.chunks, rng=sim.rng)

    def start(self) -> None:
        """A cold pull: the announcement carried the manifest, so its buffers are allocated
        at once and its first plan request carries them."""
        self.finished, self._wake, self.failed = None, None, None
        self.pull = self._new_pull()
        self._ask_plan()

    def _ask_plan(self) -> None:
        if self.alive:
            self.send(self.pull.first_request(), self._planned)

    def _planned(self, reply) -> None:
        if not self.alive:
            return
        now = self.sim.loop.now
        if isinstance(reply, ErrorReply):
            wait = self.pull.refused(reply.code, reply.retry_after, now)
            if wait is None:
                self._fail(reply.message)
            else:
                self.sim.loop.at(now + wait, self._ask_plan)
            return
        self.pull.planned(reply, now)
        self.step()

    def stand_by(self) -> None:
        """Ask to be placed ahead in the first version's forest (`Replica.stand_by`)."""
        self.send(self.reader.stand_by(self.id), self._placed)

    def _placed(self, reply) -> None:
        if isinstance(reply, ErrorReply) or None in reply.stripes:
            self.sim.loop.at(self.sim.loop.now + (reply.retry_after or 0.5), self.stand_by)
            return
        self.parents = Parents.placed(reply, self.id)
        self.sim.placed_one()

    def start_warm(self, version: int, announcement: Announcement) -> None:
        """The announcement of `version` arrived: pull it from the same parents (or those
        it was placed under on standby) if the announcement allows, asking the coordinator
        nothing but the confirmation, sent as it starts reading; else a cold pull."""
        if not self.alive:
            return
        self.version = version
        warm = None if self.parents is None else self.parents.warm_plan(
            announcement, self.part.manifest, self.id, self.held)
        if warm is None:
            self.start()
            return
        self.finished, self._wake, self.failed = None, None, None
        self.pull = self._new_pull(warm)
        self.step()

    def step(self) -> None:
        if not self.alive or self.pull is None or self.finished is not None or self.failed:
            return
        sim, pull, now = self.sim, self.pull, self.sim.loop.now
        try:
            actions = pull.actions(now)
        except TransferError as exc:
            self._fail(str(exc))
            return
        for action in actions:
            if isinstance(action, Ask):
                sim.replans += not action.confirmation
                self.send(action.request, lambda reply, a=action: self._answered(pull, a, reply))
            elif isinstance(action, Read):
                sim.read(self, action)
            elif isinstance(action, Poll):
                sim.poll(self, action)
        wake = pull.wake_at(now)
        if wake is not None and (self._wake is None or wake < self._wake or self._wake <= now):
            self._wake = wake
            sim.loop.at(wake, self._woken)

    def _woken(self) -> None:
        if self._wake is not None and self._wake <= self.sim.loop.now:
            self._wake = None
        self.step()

    def _answered(self, pull: PullSession, ask: Ask, reply) -> None:
        if not self.alive:
            return
        now = self.sim.loop.now
        if isinstance(reply, ErrorReply):
            if not pull.ended and pull.refused(reply.code, reply.retry_after, now,
                                               ask) is None:
                self._fail(reply.message)
            self.step()
            return
        done = pull.answered(ask, reply, now)
        if done is not None:
            self.send(done)
        if pull is self.pull:
            self._maybe_finish()

    def read_done(self, action: Read, ok: bool) -> None:
        if not self.alive or self.failed:
            return
        self.pull.landed(action, ok, self.sim.loop.now)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if not self.pull.done or self.finished is not None:
            self.step()
            return
        self.finished = self.sim.loop.now
        self.held, self.parents = self.version, self.pull.parents()
        part = self.part
        self.send(self.pull.hold(part.memory, part.manifest, Part(part=part.number,
                                                                  parts=part.of)).by_reference())
        for done in self.pull.end(ok=True):
            self.send(done)
        self.sim.finished_one(self)

    def _fail(self, error: str) -> None:
        """The pull failed (a `Replica` would raise): its leases end, and it stays
        unfinished."""
        self.failed = error
        for done in self.pull.end(ok=False, error=error):
            self.send(done)

    def polled(self, action: Poll, progress: bytes | None) -> None:
        if not self.alive or self.failed:
            return
        self.pull.polled(action, progress, self.sim.loop.now)
        self.step()

    def pulling(self) -> PullProgress | None:
        """The pull in flight, as its heartbeats carry it."""
        if self.pull is None or self.pull.plan is None or self.finished is not None:
            return None
        return self.pull.progress(self.sim.loop.now)

    def landed(self) -> set[int]:
        """The chunks of its current version it has (what a poll of it sees)."""
        stripes = self.pull.stripes if self.pull is not None else None
        return stripes.landed if stripes is not None else set()


class SwarmSim:
    def __init__(self, config: SimConfig, socket_cost: float = 0.0,
                 stripes: int = 2, stall: float = 5.0):
        if config.tiled and config.standby:
            raise ValueError("readers of a version in tiles do not stand by here: "
                             "PartedReplica stands by with part 0 only")
        self.config = config
        self.loop = EventLoop()
        self.rng = random.Random(config.seed)
        self.net = Network(self.loop, config.wan_gbps * GB / 8)
        chunk_time = config.chunk_bytes * 8 / (config.nic_gbps * GB)
        self.stall = max(stall, 8 * chunk_time)
        self.poll_min, self.poll_max = max(config.latency, chunk_time / 16), chunk_time / 4
        self.coordinator = CoordinatorState(
            CoordinatorConfig(worker_ttl=5.0, heartbeat_interval=1.0, lease_ttl=600.0,
                              stripes=stripes, pending_retry=max(0.002, chunk_time / 4),
                              # (readers closer than a chunk time apart are one burst)
                              pending_settle=max(0.004, chunk_time),
                              planner=PlannerConfig(
                                  max_readers_per_holder=config.planner.max_readers_per_holder,
                                  chunk_bytes=config.chunk_bytes, min_chunks=1)),
            clock=lambda: self.loop.now)
        self.queue = CoordinatorQueue(self.loop, self.coordinator, config.rpc, socket_cost)
        self.endpoint = Endpoint(transport="zmq", address="tcp://sim:1")
        self.progress = MemoryDesc(addr=1 << 20, nbytes=1 << 16)
        base = itertools.count(1 << 30, 1 << 40)
        manifests = config.parts
        self.parts = [_Part.of_manifest(k, len(manifests), m, config.chunk_bytes, base)
                      for k, m in enumerate(manifests)]
        self.model_bytes = sum(manifest_bytes(m) for m in manifests)
        self.replans = self.polls = 0
        self.reader_messages: Counter[str] = Counter()
        nic = config.nic_gbps * GB / 8
        # One trainer worker per part (as `TiledPublisher` has a `Publisher` per part),
        # all on the trainer's one NIC.
        trainer_nic = Nic(nic, nic, "dc0", "trainer")
        self.trainers: list[str] = []
        self._publishes: list[Publish] = []
        for part in self.parts:
            name = "trainer" if part.of == 1 else f"trainer.tile{part.number}"
            trainer = self.queue.call_now(Register(name=name, role="trainer",
                                                   endpoint=self.endpoint,
                                                   labels={"dc": "dc0", "node": "trainer"}))
            self.trainers.append(trainer.worker_id)
            self.net.add(trainer.worker_id, trainer_nic)
            self._publishes.append(Publish(
                worker_id=trainer.worker_id, model="m", version=1, manifest=part.manifest,
                checksums=["x"] * len(part.memory), memory=part.memory, part=part.number,
                parts=part.of))
        self.readers: list[_Reader] = []  # every part's reader, of every node
        self.nodes: dict[str, list[_Reader]] = {}  # a node's readers, by the node's name
        self.by_id: dict[str, _Reader] = {}
        self.broken: _Reader | None = None
        if config.failing_first:  # (registered first, so on no node of the others)
            self.broken = _Reader(self, "broken", {"dc": "dc0", "node": "broken"},
                                  broken=True)
            self.net.add(self.broken.id, Nic(nic, nic, "dc0", "broken"))
            self.by_id[self.broken.id] = self.broken
        lead = config.rpc if config.failing_first else 0.0  # (after the broken one)
        for i in range(config.workers):
            labels = {"dc": f"dc{i % config.dcs}",
                      "node": f"n{i // config.dcs // config.per_node}"}
            node_nic = Nic(nic, nic, labels["dc"], labels["node"])
            for p in config.node_parts(i):
                r = _Reader(self, Part.worker_name(f"w{i}", p), labels,
                            delay=lead + i * config.spread / max(1, config.workers - 1),
                            part=p)
                self.net.add(r.id, node_nic)
                self.readers.append(r)
                self.nodes.setdefault(f"w{i}", []).append(r)
                self.by_id[r.id] = r
        self.trainer_sent = 0.0  # what the trainer had sent when the measured version came
        self.received: dict[str, float] = {}  # what each reader had received by then
        self.version = 1  # the version published last
        self.done_count = 0
        self.measured_from = 0.0  # when the measured version was published
        self.placed = 0  # readers placed on standby
        self.standby_seconds = self.standby_busy = 0.0

    # ------------------------------------------------------------------ the network
    def _latency(self, a: str, b: str) -> float:
        far = self.net.nics[a].dc != self.net.nics[b].dc
        return self.config.wan_latency if far else self.config.latency

    def _unreachable(self, reader: _Reader, source: str) -> bool:
        """A broken transport at either end: the read or poll fails."""
        src = self.by_id.get(source)
        return reader.broken or (src is not None and src.broken)

    def read(self, reader: _Reader, action: Read) -> None:
        nbytes = sum(reader.part.chunks[c].nbytes for c in action.chunks)
        start = self.loop.now + self._latency(action.source, reader.id)
        if self._unreachable(reader, action.source):
            self.loop.at(start, lambda: reader.read_done(action, False))
            return

        def begin() -> None:
            self.net.start(action.source, reader.id, nbytes,
                           lambda t: reader.read_done(action, True),
                           lambda t: reader.read_done(action, False))
        self.loop.at(start, begin)

    def poll(self, reader: _Reader, action: Poll) -> None:
        """The parent's bytes as they are half a round trip from now, back after a full."""
        self.polls += 1
        one_way = self._latency(action.source, reader.id)

        def look() -> None:
            src = self.by_id.get(action.source)
            if not self.net.nics[action.source].alive or self._unreachable(reader,
                                                                          action.source):
                self.loop.at(self.loop.now + one_way, lambda: reader.polled(action, None))
                return
            if src is None:  # the trainer: it has everything of the newest version
                seen = bytes([progress_tag(self.version)]) * (action.hi - action.lo)
            else:
                landed, tag = src.landed(), progress_tag(src.version)
                seen = bytes(tag if c in landed else 0 for c in range(action.lo, action.hi))
            self.loop.at(self.loop.now + one_way, lambda: reader.polled(action, seen))
        self.loop.at(self.loop.now + one_way, look)

    # ------------------------------------------------------------------ the run
    def _beat(self, worker_id: str) -> None:
        trainer = worker_id not in self.by_id
        if not trainer and not self.by_id[worker_id].alive:
            return
        pull = None if trainer else self.by_id[worker_id].pulling()
        self.queue.send(Heartbeat(worker_id=worker_id, pull=pull))
        if self._running():
            self.loop.at(self.loop.now + 1.0, lambda: self._beat(worker_id))

    def _expire(self) -> None:
        self.queue.send(Expiry())
        if self._running():
            self.loop.at(self.loop.now + settings.EXPIRY_PERIOD, self._expire)

    def _running(self) -> bool:
        return self.version < self.config.version or \
            any(r.alive and r.finished is None and not r.failed for r in self.readers)

    def finished_one(self, reader: _Reader) -> None:
        """Once every reader has the first version, publish the second (same layout and
        memory) and announce it: each reader pulls it from the parents it had."""
        self.done_count += 1
        alive = sum(r.alive for r in self.readers)
        if self.version < self.config.version and self.done_count >= alive:
            self.version += 1
            self.done_count = 0
            # (a step later, once the coordinator has served the last version's `Hold`s
            # and `ReadDone`s, as between two training steps)
            self.loop.at(self.loop.now + 1.0, self._publish_next)

    def placed_one(self) -> None:
        """Once every reader stood by, the first version is published (the figures'
        clock starts there)."""
        self.placed += 1
        if self.placed == len(self.readers):
            self.standby_seconds, self.standby_busy = self.loop.now, self.queue.busy
            self.loop.at(self.loop.now, self._publish_next)
            self._schedule_kills(self.loop.now)

    def _publish_next(self) -> None:
        if self.queue.backlog():
            self.loop.at(self.loop.now + 0.01, self._publish_next)
            return
        self.measured_from = self.loop.now
        self.trainer_sent = self._trainer_sent()
        self.received = dict(self.net.received)
        self.queue.busy, self.queue.longest_wait = 0.0, 0.0
        self.queue.messages.clear()
        self.reader_messages.clear()
        self.replans = self.polls = 0
        self._publish_parts(self._announce)

    def _trainer_sent(self) -> float:
        return sum(self.net.sent.get(t, 0.0) for t in self.trainers)

    def _publish_parts(self, then: Callable[[], None]) -> None:
        """Every part of `self.version`, one publish each (the version is announced with
        the last); `then` once the coordinator took them all."""
        def bound(k: int, reply) -> None:
            """A part's first publish: the model's credential, shown by every later one."""
            owner = getattr(reply, "owner", None)
            if owner is not None:
                self._publishes[k] = self._publishes[k].model_copy(update={"owner": owner})
            if k == len(self._publishes) - 1:
                then()

        for k, publish in enumerate(self._publishes):
            self.queue.send(publish.model_copy(update={"version": self.version}),
                            lambda reply, k=k: bound(k, reply))

    def _announce(self) -> None:
        """The version's announcement, as the coordinator's PUB socket carries it to every
        reader."""
        announcement = self.queue.call_now(LatestRequest(model="m"))
        for r in self._askers():
            self.loop.at(self.loop.now + self.config.rpc / 2 + r.delay,
                         lambda r=r: r.start_warm(self.version, announcement))

    def _askers(self) -> list[_Reader]:
        """Every reader, the broken one (if any) first."""
        return [self.broken, *self.readers] if self.broken is not None else self.readers

    def _schedule_kills(self, start: float) -> None:
        """`SimConfig.kill` at `kill_at` of the lower bound after `start` (the publish): a
        worker killed is its node, every part's reader on it."""
        for i in self.config.kill:
            self.loop.at(start + self.config.kill_at * self.config.lower_bound,
                         lambda node=self.nodes[f"w{i}"]: self._kill(node))

    def _kill(self, node: list[_Reader]) -> None:
        for r in node:
            r.alive = False
            self.net.kill(r.id)

    def run(self) -> SwarmResult:
        if self.config.standby:
            for r in self.readers:
                self.loop.at(0.0, r.stand_by)
        else:
            self._publish_parts(lambda: [
                self.loop.at(self.loop.now + self.config.rpc / 2 + r.delay, r.start)
                for r in self._askers()])
        for wid in [*self.trainers, *self.by_id]:
            self.loop.at(self.rng.random(), lambda w=wid: self._beat(w))
        self.loop.at(settings.EXPIRY_PERIOD, self._expire)
        if not self.config.standby:
            self._schedule_kills(0.0)
        self.loop.run(until=self.config.time_limit)
        layout = next(iter(
            self.coordinator.table.models["m"].versions[self.version].layouts.values()))
        done = {name: max(r.finished for r in node) - self.measured_from - node[0].delay
                for name, node in self.nodes.items()
                if all(r.finished is not None and r.version == self.config.version
                       for r in node)}
        return SwarmResult(
            self.config,
            finished=done,
            killed=[name for name, node in self.nodes.items() if not node[0].alive],
            unfinished=[name for name, node in self.nodes.items()
                        if node[0].alive and any(r.finished is None for r in node)],
            messages=dict(self.queue.messages), coordinator_busy=self.queue.busy,
            longest_wait=self.queue.longest_wait, socket_cost=self.queue.socket_cost,
            max_depth=layout.forest.deepest if layout.forest else 0,
            replans=self.replans, polls=self.polls,
            reader_messages=dict(self.reader_messages),
            standby_seconds=self.standby_seconds, standby_busy=self.standby_busy,
            trainer_copies=(self._trainer_sent() - self.trainer_sent) / self.model_bytes,
            model_bytes=self.model_bytes,
            node_bytes={name: sum(self.net.received.get(r.id, 0.0)
                                  - self.received.get(r.id, 0.0) for r in node)
                        for name, node in self.nodes.items()})


def simulate_swarm(config: SimConfig, socket_cost: float = 0.0, **kwargs) -> SwarmResult:
    return SwarmSim(config, socket_cost, **kwargs).run()
