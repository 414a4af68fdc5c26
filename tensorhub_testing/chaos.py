"""A bounded chaos run: a trainer publishes while replicas and the coordinator are killed.

Real processes throughout: a `tensorhub coordinator` child at fixed addresses (so it can be
SIGKILLed and restarted where every worker expects it), `tensorhub replica` children that
follow versions and print per-tensor checksums of every version they accept, and an
in-process `Publisher`. Every accepted version is compared with what the trainer published:
a mismatch is a torn read. At the end every live replica must hold the newest version.

    python -m tensorhub_testing.chaos --versions 300 --replicas 4 --seed 1   # a longer run
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from tensorhub.core.checksum import checksum
from tensorhub.core.errors import CoordinatorUnavailable
from tensorhub.publisher import Publisher
from tensorhub.tools.synthetic_weights import synthetic_state_dict
from tensorhub_testing.local_fleet import CoordinatorProcess, replica_process


@dataclass
class ChaosConfig:
    versions: int = 30
    replicas: int = 4
    size_mb: float = 8.0
    n_tiny: int = 50
    seed: int = 0
    transport: str = "nixl"
    kill_replica_p: float = 0.3  # per version: SIGKILL a random replica, start a new one
    kill_coordinator_p: float = 0.15  # per version: SIGKILL the coordinator, restart it
    settle_timeout: float = 120.0


@dataclass
class ChaosReport:
    versions_published: list[int] = field(default_factory=list)
    replica_kills: int = 0
    coordinator_restarts: int = 0
    pulls: int = 0
    torn_reads: list[dict] = field(default_factory=list)  # accepted bytes that differ
    refused: int = 0  # pulls that failed (transfer, integrity, no holder): retried later
    final: dict[str, int | None] = field(default_factory=dict)  # replica -> last version
    settled: bool = False
    seconds: float = 0.0
    # replica -> its last lines of output, for each replica not on the newest version at the
    # end (what it was doing instead)
    unsettled: dict[str, list[str]] = field(default_factory=dict)


TAIL_LINES = 20  # lines of a replica's output kept for the report


def _checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: checksum(t) for name, t in state.items()}


def run_chaos(cfg: ChaosConfig) -> ChaosReport:
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    report = ChaosReport()
    expected: dict[int, dict[str, str]] = {}
    last: dict[str, int | None] = {}
    coordinator = CoordinatorProcess().start()
    replicas = {f"r{i}": replica_process(coordinator.address, f"r{i}", cfg.transport)
                for i in range(cfg.replicas)}
    tails = {name: deque(maxlen=TAIL_LINES) for name in replicas}

    def drain(timeout: float = 0.0) -> None:
        for name, proc in replicas.items():
            while True:
                try:
                    line = proc.lines.get(timeout=timeout) if timeout else \
                        proc.lines.get_nowait()
                except Exception:
                    break
                tails[name].append(line.rstrip())
                if not line.startswith("{"):
                    continue
                event = json.loads(line)
                if event["event"] == "pulled":
                    report.pulls += 1
                    v = event["version"]
                    if event["checksums"] != expected.get(v):
                        report.torn_reads.append({"replica": name, "version": v})
                    last[name] = v
                elif event["event"] == "error":
                    report.refused += 1

    state = synthetic_state_dict(cfg.size_mb, n_tiny=cfg.n_tiny, seed=cfg.seed)
    pub = Publisher(coordinator.address, "policy", transport=cfg.transport, timeout=30.0,
                    retain_timeout=5.0)
    try:
        for step in range(cfg.versions):
            with torch.no_grad():
                for t in state.values():
                    t.mul_(0.9).add_(0.01 * (step + 1))
            sums = _checksums(state)
            for attempt in range(5):
                try:
                    version = pub.publish(state)
                    break
                except CoordinatorUnavailable:
                    if attempt == 4:
                        raise
            expected[version] = sums
            report.versions_published.append(version)
            drain()
            if rng.random() < cfg.kill_replica_p:
                victim = rng.choice(sorted(replicas))
                replicas[victim].kill()
                replicas[victim] = replica_process(coordinator.address, victim, cfg.transport)
                last[victim] = None
                tails[victim].clear()
                report.replica_kills += 1
            if rng.random() < cfg.kill_coordinator_p:
                coordinator.kill()
                time.sleep(rng.uniform(0.0, 1.0))
                coordinator.start()
                report.coordinator_restarts += 1
            time.sleep(rng.uniform(0.05, 0.4))
            drain()
        newest = report.versions_published[-1]
        deadline = time.monotonic() + cfg.settle_timeout
        while time.monotonic() < deadline and any(last.get(n) != newest for n in replicas):
            drain(timeout=0.2)
        report.settled = all(last.get(n) == newest for n in replicas)
        report.final = {n: last.get(n) for n in replicas}
        report.unsettled = {
            n: [*tails[n], *([f"(exited with status {replicas[n].proc.poll()})"]
                             if replicas[n].proc.poll() is not None else [])]
            for n in replicas if last.get(n) != newest}
    finally:
        pub.close()
        for proc in replicas.values():
            proc.stop()
        coordinator.stop()
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorhub_testing.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChaosConfig()
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    report = run_chaos(ChaosConfig(**vars(args)))
    print(json.dumps(asdict(report), indent=1))
    return 0 if report.settled and not report.torn_reads else 1


if __name__ == "__main__":
    sys.exit(main())
