"""Fleet sizes 8 ... 4096: the simulated planner against a star and a ring, per lower bound.

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

from tensorhub.sim.fleet import GB, FleetResult, SimConfig, simulate


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


def run_sweep(base: SimConfig, sizes: list[int], echo=print) -> list[SweepRow]:
    import logging
    import time

    # simulated deaths make the coordinator log warnings by the hundred: keep errors only
    logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)
    rows = []
    for n in sizes:
        config = replace(base, workers=n)
        started = time.perf_counter()
        result: FleetResult = simulate(config)
        wall = time.perf_counter() - started
        times = sorted(result.finished.values())
        row = SweepRow(n, config.lower_bound, result.worst,
                       times[len(times) // 2] if times else float("inf"),
                       star_time(config), ring_time(config), optimum_time(config),
                       result.plans, result.busy,
                       len(result.unfinished), wall)
        rows.append(row)
        echo(f"N={n:5d}  tensorhub {row.tensorhub / row.lower_bound:6.3f}x "
             f"(median {row.tensorhub_median / row.lower_bound:.3f}x)  "
             f"star {row.star / row.lower_bound:8.1f}x  ring {row.ring / row.lower_bound:7.2f}x"
             f"  optimum {row.optimum / row.lower_bound:.3f}x"
             f"  lower bound {row.lower_bound * 1e3:.0f} ms  [{row.plans} plans, "
             f"{row.busy} busy, {row.unfinished} unfinished, {wall:.1f}s wall]")
    return rows


def plot(rows: list[SweepRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r.workers for r in rows]
    # left: every curve (log scale, the star and ring run away); right: the same close up
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for a in (ax, zoom):
        a.plot(n, [r.tensorhub / r.lower_bound for r in rows], "o-", label="TensorHub (worst)")
        a.plot(n, [r.tensorhub_median / r.lower_bound for r in rows], "o--",
               label="TensorHub (median)")
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
    ax.set_title("Simulated fan-out of one version (real planner)")
    ax.legend()
    zoom.set_ylim(0.98, 1.32)
    zoom.set_title("close up: 1.0 - 1.3 x the lower bound")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
