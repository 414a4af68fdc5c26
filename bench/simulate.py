"""Simulated fan-out of one version to 8 ... 4096 replicas through the real planner, beside a
star and a ring, as completion time / lower bound; writes bench/results/simulate.{jsonl,md}
and simulate.png.  `python -m bench.simulate [--max N]`."""

from __future__ import annotations

import argparse

from bench.results import RESULTS, Report
from tensorhub.sim.fleet import SimConfig
from tensorhub.sim.sweep import plot, run_sweep


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max", type=int, default=4096, help="largest fleet (power of two)")
    parser.add_argument("--model-gib", type=float, default=8.0)
    args = parser.parse_args(argv)
    sizes = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= args.max]
    base = SimConfig(model_bytes=int(args.model_gib * 2**30))
    rows = run_sweep(base, sizes)
    report = Report("simulate")
    for r in rows:
        lb = r.lower_bound
        report.add(f"N={r.workers} worst / lower bound (vs star)", r.tensorhub / lb, "x",
                   "star", r.star / lb, higher_is_better=False)
        report.add(f"N={r.workers} worst / lower bound (vs ring)", r.tensorhub / lb, "x",
                   "ring", r.ring / lb, higher_is_better=False)
        report.add(f"N={r.workers} median / lower bound", r.tensorhub_median / lb, "x")
        report.add(f"N={r.workers} worst / lower bound (vs optimum)", r.tensorhub / lb, "x",
                   "optimum", r.optimum / lb, higher_is_better=False)
    report.write()
    print(f"plot: {plot(rows, RESULTS / 'simulate.png')}")


if __name__ == "__main__":
    main()
