"""Fleet sizes 8 ... 4096: the striped protocol against a star and a ring, per lower bound,
with the coordinator modelled as a queue.

The swarm runs the real coordinator through `CoordinatorQueue`: every message costs what
its handler takes on this machine plus the socket's measured cost, one at a time.

The baselines are closed forms on the same links: a *star* sends every byte from the
trainer (its NIC is split N ways), a *ring* (a chain) pipelines chunks through the workers
one after another (the last one waits N-1 chunk times). The lower bound is a reader's NIC
receiving every byte once (`SimConfig.lower_bound`). No schedule reaches it for N > 1: the
*optimum* is the binomial pipeline's C + ceil(log2(N+1)) - 1 chunk times for C chunks (each
round every node that has a chunk sends one, so copies at most double per chunk time): a
pipeline term that grows with log N at a fixed chunk size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from tensorhub.sim.config import GB, SimConfig
from tensorhub.sim.coordinator_queue import measure_socket_cost
from tensorhub.sim.swarm import SwarmResult, simulate_swarm


@dataclass(frozen=True)
class SweepRow:
    workers: int
    lower_bound: float
    tensorhub: float  # worst completion, seconds
    tensorhub_median: float
    star: float
    ring: float
    optimum: float
    plans: int
    busy: int
    unfinished: int
    wall: float  # seconds the simulation took on this machine
    coordinator_busy: float = 0.0  # the coordinator's busy time over the fan-out's
    messages_per_reader: float = 0.0  # heartbeats aside
    depth: int = 0  # the deepest a reader was in a stripe's tree
    longest_wait: float = 0.0  # the longest a message queued at the coordinator
    socket_cost: float = 0.0
    # the next version, pulled from the same parents (a steady fleet), if run
    steady: float | None = None
    steady_median: float | None = None
    steady_busy: float | None = None
    steady_messages: float | None = None
    # the first version with every reader on standby (placed before it exists), if run
    standby: float | None = None
    standby_median: float | None = None
    standby_busy: float | None = None
    standby_messages: float | None = None
    standby_placing: float | None = None  # simulated seconds to place every reader
    standby_placing_busy: float | None = None  # the coordinator's busy time in it


# How readers ask for each version (`SimConfig`): the fleet's bench (`bench.hosts`) has the
# same patterns on emulated hosts; following and being told at once are one here.
ARRIVALS: dict[str, dict] = {
    "standby": {"standby": True},
    "at once": {},
    "staggered": {"spread": 2.0},
    "failing-first": {"failing_first": True},
}


@dataclass(frozen=True)
class ArrivalRow:
    workers: int
    arrival: str
    version: int  # 1: the fleet's first; 2: the next, pulled from the same parents
    worst: float  # the worst reader's time from when it asked, over the lower bound
    trainer_copies: float  # what the trainer sent for the version, in models
    unfinished: int


def run_arrivals(base: SimConfig, sizes: list[int], patterns: list[str] | None = None,
                 echo=print, socket_cost: float = 0.0) -> list[ArrivalRow]:
    """Each arrival pattern at each fleet size, the first version and the next."""
    import logging

    logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)
    rows = []
    for n in sizes:
        for name in patterns or list(ARRIVALS):
            for version in (1, 2):
                r = simulate_swarm(replace(base, workers=n, version=version, **ARRIVALS[name]),
                                   socket_cost)
                rows.append(ArrivalRow(n, name, version, r.ratio, r.trainer_copies,
                                       len(r.unfinished)))
                echo(f"N={n:4d} {name:14s} version {version}: worst / bound {r.ratio:.3f}, "
                     f"trainer egress {r.trainer_copies:.2f} models, "
                     f"{len(r.unfinished)} unfinished")
    return rows


def star_time(c: SimConfig) -> float:
    return c.workers * c.model_bytes * 8 / (c.nic_gbps * GB) + c.latency + c.rpc


def ring_time(c: SimConfig) -> float:
    chunk = c.chunk_bytes * 8 / (c.nic_gbps * GB) + c.latency
    return c.model_bytes * 8 / (c.nic_gbps * GB) + (c.workers - 1) * chunk + c.latency + c.rpc


def optimum_time(c: SimConfig) -> float:
    """Every byte once, plus the pipeline term: ceil(log2(N+1)) - 1 chunk times."""
    chunk = c.chunk_bytes * 8 / (c.nic_gbps * GB)
    return (c.model_bytes * 8 / (c.nic_gbps * GB)
            + (math.ceil(math.log2(c.workers + 1)) - 1) * chunk + c.latency + c.rpc)


def run_sweep(base: SimConfig, sizes: list[int], echo=print,
              socket_cost: float | None = None, steady: bool = True,
              standby: bool = True) -> list[SweepRow]:
    """The striped protocol at each size: a fleet's first version (every reader asks for
    a plan once it is announced); with `standby`, the same first version with every reader
    placed before it existed; with `steady`, the next one (pulled from the same parents)."""
    import logging
    import time

    # simulated deaths make the coordinator log warnings by the hundred: keep errors only
    logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)
    if socket_cost is None:
        socket_cost = measure_socket_cost().saturated
    echo(f"coordinator socket cost per message, measured here: {socket_cost * 1e6:.1f} us")
    rows = []
    for n in sizes:
        config = replace(base, workers=n)
        started = time.perf_counter()
        result: SwarmResult = simulate_swarm(config, socket_cost)
        wall = time.perf_counter() - started
        times = sorted(result.finished.values())
        warm = simulate_swarm(replace(config, version=2), socket_cost) if steady else None
        ahead = simulate_swarm(replace(config, standby=True), socket_cost) if standby else None
        row = SweepRow(n, config.lower_bound, result.worst,
                       times[len(times) // 2] if times else float("inf"),
                       star_time(config), ring_time(config), optimum_time(config),
                       sum(result.reader_messages.get(kind, 0) for kind in
                           ("striped_plan", "replan_stripes", "confirm_parents")),
                       result.replans,
                       len(result.unfinished), wall, result.busy_fraction,
                       result.messages_per_reader, result.max_depth, result.longest_wait,
                       socket_cost,
                       warm.worst if warm else None,
                       sorted(warm.finished.values())[len(warm.finished) // 2] if warm else None,
                       warm.busy_fraction if warm else None,
                       warm.messages_per_reader if warm else None,
                       ahead.worst if ahead else None,
                       sorted(ahead.finished.values())[len(ahead.finished) // 2]
                       if ahead else None,
                       ahead.busy_fraction if ahead else None,
                       ahead.messages_per_reader if ahead else None,
                       ahead.standby_seconds if ahead else None,
                       ahead.standby_busy if ahead else None)
        rows.append(row)
        lb = row.lower_bound
        more = ""
        if ahead is not None:
            more += (f"  on standby {ahead.worst / lb:.3f}x (busy "
                           f"{ahead.busy_fraction:.2f}, placed in {ahead.standby_seconds:.2f}"
                           f" s)")
        if warm is not None:
            more += (f"  steady {warm.worst / lb:.3f}x (busy {warm.busy_fraction:.2f},"
                           f" {warm.messages_per_reader:.2f} msgs/reader)")
        echo(f"N={n:5d}  tensorhub {row.tensorhub / lb:6.3f}x "
             f"(median {row.tensorhub_median / lb:.3f}x)  star {row.star / lb:8.1f}x  "
             f"ring {row.ring / lb:7.2f}x  optimum {row.optimum / lb:.3f}x{more}  "
             f"lower bound {lb * 1e3:.0f} ms  [coordinator busy {row.coordinator_busy:.2f}, "
             f"{row.messages_per_reader:.2f} msgs/reader, depth {row.depth}, longest queue "
             f"{row.longest_wait * 1e3:.1f} ms, {row.unfinished} unfinished, {wall:.1f}s wall]")
    return rows


def plot(rows: list[SweepRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r.workers for r in rows]
    # left: every curve (log scale, the star and ring run away); right: the same close up
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for a in (ax, zoom):
        a.plot(n, [r.tensorhub / r.lower_bound for r in rows], "o-",
               label="striped, a fleet's first version, cold (worst)")
        ahead = [(r.workers, r.standby / r.lower_bound) for r in rows if r.standby]
        if ahead:
            a.plot(*zip(*ahead, strict=True), "v-",
                   label="striped, first version, readers on standby (worst)")
        steady = [(r.workers, r.steady / r.lower_bound) for r in rows if r.steady]
        if steady:
            a.plot(*zip(*steady, strict=True), "D-",
                   label="striped, next version from the same parents (worst)")
        a.plot(n, [r.optimum / r.lower_bound for r in rows], "k:",
               label="optimum (binomial pipeline, same chunks)")
        a.plot(n, [r.ring / r.lower_bound for r in rows], "s-", label="ring (chain pipeline)")
        a.plot(n, [r.star / r.lower_bound for r in rows], "^-", label="star (all from trainer)")
        a.axhline(1.25, color="grey", linestyle=":", label="goal 1.25x")
        a.set_xscale("log", base=2)
        a.set_xlabel("replicas (N)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("completion time / lower bound")
    ax.set_title("Simulated fan-out of one version (real coordinator, as a queue)")
    ax.legend()
    zoom.set_ylim(0.98, 1.32)
    zoom.set_title("close up: 1.0 - 1.3 x the lower bound")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
