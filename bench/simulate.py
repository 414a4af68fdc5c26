"""Simulated fan-out to 8 ... 4096 replicas by the striped protocol (a fleet's first version,
cold and with readers on standby, and the next one pulled from the same parents), with the
coordinator modelled as a queue (its real handlers, timed here, one message at a time),
beside a star, a ring and the binomial-pipeline optimum; also 1 TiB. Writes
bench/results/simulate.{jsonl,md} and simulate.png.
`python -m bench.simulate [--max N] [--tib-readers N]`; `--tib-only`
runs the 1 TiB fan-out alone (bench/results/simulate_tib.{jsonl,md}: 1024 readers take
about half an hour here); `--arrivals` runs the arrival patterns alone on a fleet like the
emulated hosts' (512 MiB, 800 Mbit/s NICs; bench/results/simulate_arrivals.{jsonl,md}):
readers on standby, told at once, told one by one over 2 s, or after one that can reach
no one, each timed from when it asked."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from bench.results import RESULTS, Report
from tensorhub.sim.config import SimConfig, manifest_bytes
from tensorhub.sim.coordinator_queue import measure_socket_cost
from tensorhub.sim.swarm import simulate_swarm
from tensorhub.sim.sweep import plot, run_arrivals, run_sweep


def _report(report: Report, rows, label: str = "") -> None:
    for r in rows:
        lb, n = r.lower_bound, f"{label}N={r.workers}"
        report.add(f"{n} worst / lower bound (vs star)", r.tensorhub / lb, "x", "star",
                   r.star / lb, higher_is_better=False)
        report.add(f"{n} worst / lower bound (vs ring)", r.tensorhub / lb, "x", "ring",
                   r.ring / lb, higher_is_better=False)
        report.add(f"{n} worst / lower bound (vs optimum)", r.tensorhub / lb, "x", "optimum",
                   r.optimum / lb, higher_is_better=False)
        report.add(f"{n} coordinator messages per reader", r.messages_per_reader, "msgs")
        report.add(f"{n} median / lower bound", r.tensorhub_median / lb, "x")
        if r.steady:
            report.add(f"{n} next version, same parents: worst / lower bound (vs optimum)",
                       r.steady / lb, "x", "optimum", r.optimum / lb, higher_is_better=False)
            report.add(f"{n} next version: median / lower bound", r.steady_median / lb, "x")
            report.add(f"{n} next version: coordinator busy fraction", r.steady_busy, "")
            report.add(f"{n} next version: coordinator messages per reader",
                       r.steady_messages, "msgs")
        if r.standby:
            report.add(f"{n} first version, readers on standby: worst / lower bound "
                       f"(vs cold first version)", r.standby / lb, "x",
                       "cold: every reader asks once it is announced", r.tensorhub / lb,
                       higher_is_better=False)
            report.add(f"{n} first version on standby: median / lower bound",
                       r.standby_median / lb, "x")
            report.add(f"{n} first version on standby: coordinator busy fraction",
                       r.standby_busy, "")
            report.add(f"{n} first version on standby: coordinator messages per reader",
                       r.standby_messages, "msgs")
            report.add(f"{n} standby: placing every reader before the version (simulated)",
                       r.standby_placing, "s")
            report.add(f"{n} standby: coordinator busy placing them", r.standby_placing_busy,
                       "s")
        report.add(f"{n} coordinator busy fraction", r.coordinator_busy, "")
        report.add(f"{n} deepest stripe tree", r.depth, "hops")


def arrivals(sizes: list[int], socket_cost: float) -> None:
    base = SimConfig(model_bytes=512 << 20, tensor_bytes=32 << 20, chunk_bytes=8 << 20,
                     nic_gbps=0.8)
    report = Report("simulate_arrivals")
    rows = run_arrivals(base, sizes, socket_cost=socket_cost)
    by_key = {(r.workers, r.arrival, r.version): r for r in rows}
    for (n, arrival, version), r in by_key.items():
        if version != 2:
            continue
        first = by_key[(n, arrival, 1)]
        name = f"N={n}, 512 MiB, 800 Mbit/s, readers {arrival}"
        report.add(f"{name}: worst reader / bound, 2nd version", r.worst, "x",
                   "1st version", first.worst, higher_is_better=False)
        report.add(f"{name}: trainer egress / model bytes, 2nd version", r.trainer_copies,
                   "x", "1st version", first.trainer_copies, higher_is_better=False)
    report.write()


def tiled(model: str, engines: int, nodes: int, socket_cost: float) -> None:
    """One version in tiles (`tensorhub.tiles`, the real layout of `model`'s shapes) to
    `engines` engines of `nodes` nodes each, one tile per node (the bytes a node of TP =
    8 x `nodes` pulls with 8 x `nodes` tiles), beside the same fleet pulling it untiled (a
    copy per node): the worst node against the bound (its NIC receiving its share, the
    trainer's sending the version once), bytes out of the trainer, into each node and
    into each engine, in models."""
    from bench.node_shares import MODELS, meta_state
    from tensorhub.tiles import manifests

    parts = tuple(manifests(meta_state(*MODELS[model]), nodes))
    report = Report("simulate_tiled")
    runs = {}
    for label, config in (
            ("in tiles", SimConfig(workers=engines * nodes, tiled=parts, engine_nodes=nodes,
                                   time_limit=3600.0)),
            ("untiled", SimConfig(workers=engines * nodes, engine_nodes=nodes,
                                  model_bytes=sum(manifest_bytes(m) for m in parts),
                                  tensor_bytes=2 << 30, time_limit=3600.0))):
        started = time.monotonic()
        result = simulate_swarm(config, socket_cost)
        runs[label] = (config, result)
        print(f"{label}: worst {result.worst:.2f} s = {result.ratio:.3f} x the bound "
              f"({len(result.finished)} of {config.workers} nodes, unfinished "
              f"{len(result.unfinished)}; {time.monotonic() - started:.0f} s here)", flush=True)
    (config, result), (_, whole) = runs["in tiles"], runs["untiled"]
    share = config.share_bytes / result.model_bytes
    name = f"{model}, {engines} engines x {nodes} nodes, {config.nic_gbps:.0f} Gbit/s NICs"
    report.add(f"{name}: worst node / its bound, in tiles", result.ratio, "x",
               "untiled (a copy per node)", whole.ratio, higher_is_better=False)
    report.add(f"{name}: bytes out of the trainer / the model's, in tiles",
               result.trainer_copies, "x", "one copy", 1.0, higher_is_better=False)
    report.add(f"{name}: bytes into the fullest node / its share", max(
        result.node_bytes.values()) / config.share_bytes, "x", "its share", 1.0,
        higher_is_better=False)
    report.add(f"{name}: a node's share / the model's", share, "x", "untiled", 1.0,
               higher_is_better=False)
    report.add(f"{name}: bytes into the fullest engine / the model's, in tiles",
               result.engine_copies, "x", "untiled", whole.engine_copies,
               higher_is_better=False)
    report.add(f"{name}: worst node, in tiles (simulated)", result.worst, "s", "untiled",
               whole.worst, higher_is_better=False)
    report.write()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max", type=int, default=4096, help="largest fleet (power of two)")
    parser.add_argument("--model-gib", type=float, default=8.0)
    parser.add_argument("--tib-readers", type=int, default=64,
                        help="readers of the 1 TiB fan-out (0: skip it)")
    parser.add_argument("--tib-only", action="store_true",
                        help="run only the 1 TiB fan-out, into simulate_tib.{jsonl,md}")
    parser.add_argument("--arrivals", action="store_true",
                        help="run only the arrival patterns (4 to 512 readers), into "
                             "simulate_arrivals.{jsonl,md}")
    parser.add_argument("--tiled", action="store_true",
                        help="run only a version in tiles to engines spanning nodes, into "
                             "simulate_tiled.{jsonl,md}")
    parser.add_argument("--tiled-model", default="Llama-3.1-70B",
                        help="with --tiled: the model's shapes (bench.node_shares.MODELS)")
    parser.add_argument("--engines", type=int, default=64, help="with --tiled (default 64)")
    parser.add_argument("--nodes", type=int, default=8,
                        help="with --tiled: nodes per engine (default 8)")
    args = parser.parse_args(argv)
    sizes = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= args.max]
    base = SimConfig(model_bytes=int(args.model_gib * 2**30))
    measured = measure_socket_cost()
    socket_cost = measured.saturated
    if args.arrivals:
        arrivals([n for n in (4, 8, 64, 512) if n <= args.max], socket_cost)
        return
    if args.tiled:
        tiled(args.tiled_model, args.engines, args.nodes, socket_cost)
        return
    report = Report("simulate_tib" if args.tib_only else "simulate")
    report.add("coordinator socket cost per message, saturated loop (measured; charged)",
               socket_cost * 1e6, "us", "half a round trip less the handler",
               measured.half_round_trip * 1e6, higher_is_better=False)
    report.add("coordinator heartbeat handler (measured)", measured.handler * 1e6, "us")
    rows = [] if args.tib_only else run_sweep(base, sizes, socket_cost=socket_cost)
    _report(report, rows)
    if args.tib_readers:
        tib = replace(base, model_bytes=1 << 40, tensor_bytes=8 << 30, time_limit=3600.0)
        _report(report, run_sweep(tib, [args.tib_readers], socket_cost=socket_cost,
                                  steady=False, standby=False), label="1 TiB ")
    report.write()
    if rows:
        print(f"plot: {plot(rows, RESULTS / 'simulate.png')}")


if __name__ == "__main__":
    main()
