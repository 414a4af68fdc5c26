"""Across emulated hosts (`tensorhub_testing.cluster`): every process on a host of its own,
every host's egress shaped by tbf, default settings. Four figures, each beside its
baseline and the physical bound measured in the same run:

- fan-out: one version to N reader hosts (2, 4, 8): TensorHub against a star (every reader
  reads the whole version from the trainer) and the lower bound, model bytes / the goodput
  of one shaped link (measured here with one TCP stream); beside it, the same bytes a relay
  tree moves sent as N raw TCP streams at once (what 2 shared cores let every link carry
  together);
- arrival patterns: the same fan-out with readers that stand by before the first version
  (`standby`), follow announcements (`follow`), are told to pull a version all at once
  (`on-demand`: `Replica.pull(version=v)`, as an RL framework's rollout workers sync) or at
  moments spread over 2 s (`staggered`), or with a reader whose transport is broken
  (`UCX_NET_DEVICES=lo`) told first (`failing-first`): per version, the worst reader's time
  from when it asked over the bound, and the trainer's egress over the model's bytes;
- elastic join: K joiners start at once while M replicas already hold the version: time
  until all K hold it, against K joiners reading from the trainer only;
- cross-datacenter: trainer in DC A, readers in DC B behind a WAN link 10x slower than
  the NICs: time to all and bytes over the WAN, against every reader crossing the WAN.

Each setting times the second version a fleet pulls (the first warms up connections and
allocations); the arrival patterns report both. What tbf on veth cannot show: RDMA (this is
UCX over TCP), latency or loss (no netem), NIC offloads, and a switch fabric's contention;
all hosts share 2 CPU cores.

Run: python -m bench.hosts [--size-mb 512] [--egress 800mbit] [--sizes 2,4,8] [--quick]
     [--only fanout arrival join dc] [--arrival standby,follow,on-demand,staggered,failing-first]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from bench.results import Report
from tensorhub_testing.cluster import (
    Cluster,
    HostSpec,
    available,
    concurrent_tcp_transfers,
    parse_rate,
    tcp_transfer,
)
from tensorhub_testing.fleet import Fleet


def link_goodput(cluster: Cluster, nbytes: int) -> float:
    """Bytes per second one TCP stream gets over one shaped link (h0 -> h1), median of 3."""
    a, b = cluster.hosts[0], cluster.hosts[1]
    rates = []
    for _ in range(3):
        r = tcp_transfer(a, b, nbytes)
        rates.append(r["bytes"] / r["seconds"])
    return statistics.median(rates)


def timed_fanout(cluster: Cluster, readers: list, size_mb: float, *, star: bool,
                 chunk_mib: float | None, trainer_host=None, log_dir: str) -> dict:
    """Two versions to `readers`; the second timed: publish -> last reader holds it."""
    n = len(readers)
    flags = ("--whole-items",) if star else ()
    with Fleet(cluster, chunk_mib=chunk_mib, max_readers_per_holder=n if star else 2,
               log_dir=log_dir) as fleet:
        procs = [fleet.replica(h, versions=2, extra=flags, pull_timeout=600) for h in readers]
        time.sleep(1.0)  # registered before the first version
        trainer = fleet.trainer(trainer_host or cluster.hosts[0], size_mb, versions=2,
                                wait_replicas=n, extra=("--timeout", "900"))
        first = trainer.next_json(120)
        for p in procs:
            assert p.next_json(900)["event"] == "pulled"
        assert trainer.next_json(900)["event"] == "held"
        wan0 = cluster.wan_traffic(1) if cluster.dcs > 1 else None
        src0 = (trainer_host or cluster.hosts[0]).traffic().sent
        second = trainer.next_json(120)
        published = time.time()
        events = [p.next_json(900) for p in procs]
        assert all(e["event"] == "pulled" and e["version"] == second["version"] for e in events)
        assert all(e["checksums"] == second["checksums"] for e in events)
        seconds = max(e["ended_at"] for e in events) - published
        out = {"seconds": seconds, "nbytes": first["nbytes"],
               "trainer_sent": (trainer_host or cluster.hosts[0]).traffic().sent - src0}
        if wan0 is not None:
            out["wan_bytes"] = (cluster.wan_traffic(1) - wan0).received
        return out


def fanout(report: Report, sizes: list[int], size_mb: float, egress: str,
           chunk_mib: float | None,
           log_root: str) -> None:
    for n in sizes:
        with Cluster(n + 1, egress=egress) as cluster:
            goodput = link_goodput(cluster, 64 << 20)
            ours = timed_fanout(cluster, cluster.hosts[1:], size_mb, star=False,
                                chunk_mib=chunk_mib, log_dir=f"{log_root}/fanout{n}")
            star = timed_fanout(cluster, cluster.hosts[1:], size_mb, star=True,
                                chunk_mib=chunk_mib, log_dir=f"{log_root}/star{n}")
            # The bytes a relay tree moves (every reader receives one copy, every host but
            # the last sends one), as n raw TCP streams at once: what the shared cores let
            # all links carry together, which can be less than n single links.
            chain = list(zip(cluster.hosts[:-1], cluster.hosts[1:], strict=True))
            together = concurrent_tcp_transfers(chain, ours["nbytes"])["seconds"]
        bound = ours["nbytes"] / goodput
        name = f"fan-out {size_mb:g} MiB to {n} hosts, {egress} egress"
        report.add(f"{name}: time to all / lower bound", ours["seconds"] / bound, "x",
                   "star / lower bound", star["seconds"] / bound, higher_is_better=False)
        report.add(f"{name}: the tree's bytes as {n} raw TCP streams at once", together, "s",
                   "one link's bound", bound, higher_is_better=False)
        machine = max(bound, together)
        report.add(f"{name}: time to all / the larger of the two bounds",
                   ours["seconds"] / machine, "x", "star / the larger bound",
                   star["seconds"] / machine, higher_is_better=False)
        report.add(f"{name}: time to all", ours["seconds"], "s", "star", star["seconds"],
                   higher_is_better=False)
        report.add(f"{name}: trainer egress / model bytes", ours["trainer_sent"] / ours["nbytes"],
                   "x", "star", star["trainer_sent"] / star["nbytes"], higher_is_better=False)
        print(f"{n} hosts: ours {ours['seconds']:.2f} s, star {star['seconds']:.2f} s, bound "
              f"{bound:.2f} s ({goodput * 8 / 1e6:.0f} Mbit/s goodput): "
              f"{ours['seconds'] / bound:.2f} x / {star['seconds'] / bound:.2f} x; "
              f"{n} raw streams at once {together:.2f} s", flush=True)


ARRIVALS = ("standby", "follow", "on-demand", "staggered", "failing-first")
SPREAD = 2.0  # staggered: readers are told at moments spread evenly over this many seconds
LEAD = 0.05  # failing-first: the broken reader is told this long before the others
DECLARE_LEAD = 5.0  # standby: seconds between the trainer's declaration and its publish


def arrival_fanout(cluster: Cluster, readers: list, size_mb: float, arrival: str, *,
                   chunk_mib: float | None, log_dir: str, broken_host=None) -> list[dict]:
    """Two versions to `readers`, which ask for each as `arrival` says; per version: each
    reader's time from when it asked (or the publish, whichever is later) to holding it,
    the trainer host's egress, and how many readers asked for a plan."""
    n, h0 = len(readers), cluster.hosts[0]
    on_demand = arrival in ("on-demand", "staggered", "failing-first")
    with Fleet(cluster, chunk_mib=chunk_mib, log_dir=log_dir) as fleet:
        extra = ("--standby",) if arrival == "standby" else ()
        procs = [fleet.replica(h, versions=2, extra=extra, pull_timeout=600,
                               on_demand=on_demand) for h in readers]
        broken = fleet.replica(broken_host, name="broken", versions=2, pull_timeout=600,
                               on_demand=True, env={"UCX_NET_DEVICES": "lo"}) \
            if arrival == "failing-first" else None
        time.sleep(1.0)  # registered before the first version
        sent = h0.traffic().sent
        declare = ("--declare", str(DECLARE_LEAD)) if arrival == "standby" else ()
        trainer = fleet.trainer(h0, size_mb, versions=2, wait_replicas=n,
                                extra=("--timeout", "900", *declare))
        if declare:
            assert trainer.next_json(120)["event"] == "declared"
            for p in procs:
                event = p.next_json(DECLARE_LEAD + 30)
                assert event["event"] == "standing_by", event
        out = []
        for version in (1, 2):
            published = trainer.next_json(900)
            assert published["event"] == "published", published
            at = time.time()
            if broken is not None:
                broken.send_line(str(version))
                time.sleep(LEAD)
            for k, p in enumerate(procs):
                if not on_demand:
                    break
                if arrival == "staggered":
                    time.sleep(max(0.0, at + k * SPREAD / max(1, n - 1) - time.time()))
                p.send_line(str(version))
            events = [p.next_json(900) for p in procs]
            if broken is not None:  # (it fails: how, and when)
                failed = broken.next_json(900)
                print(f"  the broken reader: {failed['event']} {failed.get('code')} after "
                      f"{failed.get('ended_at', at) - failed.get('started_at', at):.2f} s",
                      flush=True)
            assert all(e["event"] == "pulled" and e["version"] == published["version"]
                       and e["checksums"] == published["checksums"] for e in events), \
                [(e["event"], e.get("message")) for e in events]
            assert trainer.next_json(900)["event"] == "held"
            now = h0.traffic().sent
            with open(f"{log_dir}/events.jsonl", "a") as f:  # (who read what from whom)
                for e in events:
                    f.write(json.dumps({k: v for k, v in e.items() if k != "checksums"})
                            + "\n")
            out.append({"times": [e["ended_at"] - max(e["started_at"], at) for e in events],
                        "nbytes": published["nbytes"], "trainer_sent": now - sent,
                        "planned": sum(e["planned"] for e in events)})
            sent = now
        return out


def arrivals(report: Report, sizes: list[int], size_mb: float, egress: str,
             chunk_mib: float | None, patterns: list[str], log_root: str) -> None:
    for n in sizes:
        for arrival in patterns:
            broken = arrival == "failing-first"
            with Cluster(n + 1 + broken, egress=egress) as cluster:
                goodput = link_goodput(cluster, 64 << 20)
                runs = arrival_fanout(cluster, cluster.hosts[1:n + 1], size_mb, arrival,
                                      chunk_mib=chunk_mib, log_dir=f"{log_root}/{arrival}{n}",
                                      broken_host=cluster.hosts[-1] if broken else None)
            bound = runs[0]["nbytes"] / goodput
            worst = [max(r["times"]) / bound for r in runs]
            egress_x = [r["trainer_sent"] / r["nbytes"] for r in runs]
            name = f"fan-out {size_mb:g} MiB to {n} hosts, {egress} egress, readers {arrival}"
            report.add(f"{name}: worst reader / bound, 2nd version", worst[1], "x",
                       "1st version", worst[0], higher_is_better=False)
            report.add(f"{name}: trainer egress / model bytes, 2nd version", egress_x[1], "x",
                       "1st version", egress_x[0], higher_is_better=False)
            print(f"{n} hosts, {arrival}: worst/bound {worst[0]:.2f} / {worst[1]:.2f}, trainer "
                  f"egress {egress_x[0]:.2f} / {egress_x[1]:.2f} copies, readers that asked "
                  f"for a plan {runs[0]['planned']} / {runs[1]['planned']} (bound "
                  f"{bound:.2f} s; per reader: "
                  f"{[round(t / bound, 2) for t in runs[0]['times']]} / "
                  f"{[round(t / bound, 2) for t in runs[1]['times']]})", flush=True)


def elastic_join(report: Report, fleet_size: int, joiners: int, size_mb: float, egress: str,
                 chunk_mib: float | None, log_root: str) -> None:
    """`joiners` replicas start at once while `fleet_size` replicas (and the trainer) hold
    the version; baseline: the same joiners with only the trainer holding it, reading
    whole items (every joiner from the trainer)."""
    results = {}
    for mode in ("tensorhub", "trainer only"):
        holders = fleet_size if mode == "tensorhub" else 0
        with Cluster(1 + holders + joiners, egress=egress) as cluster, \
                Fleet(cluster, chunk_mib=chunk_mib, log_dir=f"{log_root}/join-{holders}",
                      max_readers_per_holder=2 if holders else joiners) as fleet:
            h0, rest = cluster.hosts[0], cluster.hosts[1:]
            olds = [fleet.replica(h, extra=("--pull-timeout", "600")) for h in rest[:holders]]
            trainer = fleet.trainer(h0, size_mb, wait_replicas=holders,
                                    extra=("--timeout", "900"))
            published = trainer.next_json(120)
            for p in olds:
                assert p.next_json(900)["event"] == "pulled"
            if holders:
                assert trainer.next_json(900)["event"] == "held"
            flags = () if holders else ("--whole-items",)
            news = [fleet.replica(h, extra=flags, pull_timeout=900) for h in rest[holders:]]
            events = [p.next_json(900) for p in news]
            assert all(e["event"] == "pulled" and e["checksums"] == published["checksums"]
                       for e in events), events
            results[mode] = max(e["ended_at"] for e in events) - \
                min(e["started_at"] for e in events)
    name = (f"elastic join: {joiners} joiners, {size_mb:g} MiB, {fleet_size} replicas hold "
            f"it, {egress} egress")
    report.add(f"{name}: time until all hold it", results["tensorhub"], "s",
               "every joiner from the trainer", results["trainer only"],
               higher_is_better=False)
    print(f"{name}: {results['tensorhub']:.2f} s vs {results['trainer only']:.2f} s "
          f"({results['trainer only'] / results['tensorhub']:.2f} x)", flush=True)


def cross_dc(report: Report, readers: int, size_mb: float, nic: str,
             chunk_mib: float | None,
             log_root: str) -> None:
    wan = parse_rate(nic) // 10
    specs = [HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1) for i in range(readers))]
    runs = {}
    for mode in ("tensorhub", "every reader over the WAN"):
        with Cluster(specs, egress=nic, wan=wan) as cluster:
            runs[mode] = timed_fanout(cluster, cluster.hosts[1:], size_mb,
                                      star=mode != "tensorhub", chunk_mib=chunk_mib,
                                      log_dir=f"{log_root}/dc-{len(runs)}")
            if not runs.get("goodput"):
                wan_goodput = tcp_transfer(cluster.hosts[0], cluster.hosts[1], 16 << 20)
                runs["goodput"] = wan_goodput["bytes"] / wan_goodput["seconds"]
    ours, star = runs["tensorhub"], runs["every reader over the WAN"]
    bound = ours["nbytes"] / runs["goodput"]
    name = (f"cross-DC: {size_mb:g} MiB to {readers} readers in DC B, WAN {wan / 1e6:.0f} "
            f"Mbit/s, NICs {nic}")
    report.add(f"{name}: time to all", ours["seconds"], "s", "every reader over the WAN",
               star["seconds"], higher_is_better=False)
    report.add(f"{name}: time to all / one WAN copy", ours["seconds"] / bound, "x",
               "every reader over the WAN", star["seconds"] / bound, higher_is_better=False)
    report.add(f"{name}: WAN bytes / model bytes", ours["wan_bytes"] / ours["nbytes"], "x",
               "every reader over the WAN", star["wan_bytes"] / star["nbytes"],
               higher_is_better=False)
    print(f"{name}: {ours['seconds']:.2f} s vs {star['seconds']:.2f} s; WAN "
          f"{ours['wan_bytes'] / ours['nbytes']:.2f} vs {star['wan_bytes'] / star['nbytes']:.2f}"
          f" copies", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--chunk-mib", type=float, default=None,
                        help="the coordinator's --chunk-mib (default: its own choice)")
    parser.add_argument("--egress", default="800mbit", help="every host's egress (tc rate)")
    parser.add_argument("--sizes", default="2,4,8", help="reader hosts, comma-separated")
    parser.add_argument("--only", nargs="+", choices=["fanout", "arrival", "join", "dc"],
                        default=["fanout", "arrival", "join", "dc"])
    parser.add_argument("--arrival", default=",".join(ARRIVALS),
                        help=f"arrival patterns, comma-separated (default {','.join(ARRIVALS)})")
    parser.add_argument("--quick", action="store_true",
                        help="small: 64 MiB, 2 and 4 hosts")
    args = parser.parse_args(argv)
    reason = available()
    if reason is not None:
        print(f"bench.hosts: cannot emulate hosts here: {reason}", file=sys.stderr)
        return 2
    if args.quick:
        args.size_mb, args.sizes = 64, "2,4"
    report = Report("hosts")
    logs = tempfile.mkdtemp(prefix="tensorhub-bench-hosts-")
    print(f"logs in {logs}", flush=True)
    if "fanout" in args.only:
        fanout(report, [int(x) for x in args.sizes.split(",")], args.size_mb, args.egress,
               args.chunk_mib, logs)
    if "arrival" in args.only:
        patterns = args.arrival.split(",")
        if unknown := set(patterns) - set(ARRIVALS):
            parser.error(f"--arrival: unknown {', '.join(sorted(unknown))}")
        arrivals(report, [int(x) for x in args.sizes.split(",")], args.size_mb, args.egress,
                 args.chunk_mib, patterns, logs)
    if "join" in args.only:
        elastic_join(report, 4, 4, args.size_mb, args.egress, args.chunk_mib, logs)
    if "dc" in args.only:
        dc_mb = args.size_mb / 4
        cross_dc(report, 4, dc_mb, "1gbit", args.chunk_mib and args.chunk_mib / 4, logs)
    report.write(keep_earlier=set(args.only) != {"fanout", "arrival", "join", "dc"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
