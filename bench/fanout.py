"""Fan-out of one version to 1, 2 and 4 real replica processes on this machine: pipelined
chunks (our default) against a star (every replica reads the whole version from the
trainer) and a whole-item tree (a replica serves others only once it holds everything).

Figures per fleet size: time from `publish` returning to the last replica holding the
version (median over `--versions` versions), and the bytes the trainer served per model
byte (a star serves N, a pipeline about 1: the trainer's NIC is what a real fleet runs out
of). On one machine no NIC limits anyone: all processes share two cores and one memory
bus, so the times measure our protocol's overhead more than the fan-out shape; the
simulator (`bench.simulate`) shows the shape at fleet scale.

Run: python -m bench.fanout [--size-mb 512] [--versions 3] [--sizes 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from bench.holder import big_tensors
from bench.results import Report
from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.publisher import Publisher
from tensorhub.tools.child_process import ChildProcess

MODES = {
    # name: (replica flags, max readers per holder (None: the fleet size, i.e. unlimited))
    "pipeline": ((), 2),
    "tree": (("--whole-items",), 2),
    "star": (("--whole-items",), None),
}


@dataclass
class FanoutRun:
    mode: str
    replicas: int
    seconds: list[float]  # per version: publish returned -> last replica holds it
    trainer_share: list[float]  # per version: bytes served by the trainer / model bytes

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def run_fanout(mode: str, replicas: int, size_mb: int, versions: int, transport: str,
               timeout: float = 300.0) -> FanoutRun:
    flags, cap = MODES[mode]
    planner = PlannerConfig(max_readers_per_holder=cap or max(2, replicas))
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0",
                                                planner=planner)).start()
    procs: list[ChildProcess] = []
    try:
        for i in range(replicas):
            procs.append(ChildProcess.tensorhub(
                "--log-level", "WARNING", "replica", "--coordinator", coordinator.address,
                "--model", "fanout", "--name", f"r{i}", "--transport", transport, "--json",
                "--versions", str(versions + 1), "--linger", "--timeout", str(timeout),
                "--pull-timeout", str(timeout), *flags, name=f"r{i}"))
        deadline = time.monotonic() + 120
        while sum(w.role == "replica" for w in coordinator.table.workers.values()) < replicas:
            if time.monotonic() > deadline:
                raise TimeoutError("replica processes did not register within 120 s")
            time.sleep(0.05)
        state = {f"w{i}": t for i, t in enumerate(big_tensors(size_mb))}
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        result = FanoutRun(mode, replicas, [], [])
        with Publisher(coordinator.address, "fanout", transport=transport,
                       name="trainer", min_replicas=0) as pub:
            for k in range(versions + 1):  # the first is a warm-up: allocation, connections
                version = pub.publish(state)
                started = time.perf_counter()
                from_trainer = 0
                for p in procs:
                    event = p.next_json(timeout=timeout)
                    if event.get("event") != "pulled" or event.get("version") != version:
                        raise RuntimeError(f"{p.name}: unexpected {event}")
                    from_trainer += event["by_source"].get("trainer", 0)
                if k:
                    result.seconds.append(time.perf_counter() - started)
                    result.trainer_share.append(from_trainer / model_bytes)
        return result
    finally:
        for p in procs:
            p.stop()
        coordinator.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512, help="model size (32 MiB tensors)")
    parser.add_argument("--versions", type=int, default=3, help="versions timed per setting")
    parser.add_argument("--sizes", default="1,2,4", help="replica counts, comma-separated")
    parser.add_argument("--transport", default="auto", choices=["auto", "nixl", "cma", "zmq"])
    args = parser.parse_args(argv)
    report = Report("fanout")
    for n in (int(x) for x in args.sizes.split(",")):
        runs = {mode: run_fanout(mode, n, args.size_mb, args.versions, args.transport)
                for mode in MODES}
        pipe = runs["pipeline"]
        for mode in ("star", "tree"):
            report.add(f"{args.size_mb} MiB to {n} replica(s): pipeline, time to all "
                       f"(vs {mode})", pipe.median * 1e3, "ms", mode,
                       runs[mode].median * 1e3, higher_is_better=False)
        for mode in ("pipeline", "tree"):
            report.add(f"{args.size_mb} MiB to {n} replica(s): trainer bytes / model bytes, "
                       f"{mode} (vs star)", statistics.median(runs[mode].trainer_share), "x",
                       "star", statistics.median(runs["star"].trainer_share),
                       higher_is_better=False)
    report.write()


if __name__ == "__main__":
    main()
