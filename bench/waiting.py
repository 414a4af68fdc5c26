"""Waiting is cheap: the control bytes a reader waiting for a version not yet published
draws across a WAN, waiting for its announcement (`pull(version=N, announce_wait=...)`)
against asking for it again and again (`pull(version=N)` every 0.2 s, as a user loops on
"unknown_version"), beside readers that wait for nothing (heartbeats only): the bound.

Trainer and coordinator in DC A, readers in DC B behind a shaped WAN link (emulated hosts,
`tensorhub_testing.cluster`); each reader holds v1 and then, for a fixed window, waits for
v2, which the trainer never publishes. Bytes are the WAN link's counters (Ethernet frames,
both directions), per waiting reader per second.

Run: python -m bench.waiting [--readers 4] [--seconds 10] [--wan 200mbit]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from bench.results import Report

MODES = ("idle", "announce", "poll")
POLL_EVERY = 0.2  # seconds between a polling reader's tries


def _reader(coordinator: str, name: str) -> int:
    """A reader on its host: pull v1, then for each line `MODE SECONDS` on stdin wait for v2
    that way for that long; one JSON line per step."""
    from tensorhub import Replica
    from tensorhub.core.errors import CoordinatorError

    with Replica(coordinator, "policy", name=name) as rep:
        rep.pull(1, timeout=120)
        print(json.dumps({"event": "ready"}), flush=True)
        for line in sys.stdin:
            mode, seconds = line.split()[0], float(line.split()[1])
            tries, end = 0, time.monotonic() + seconds
            if mode == "announce":
                tries = 1
                try:
                    rep.pull(2, announce_wait=seconds)
                except CoordinatorError:
                    pass
            elif mode == "poll":
                while time.monotonic() < end:
                    tries += 1
                    try:
                        rep.pull(2)
                    except CoordinatorError:
                        time.sleep(POLL_EVERY)
            else:
                time.sleep(seconds)
            print(json.dumps({"event": "done", "mode": mode, "tries": tries}), flush=True)
    return 0


def waiting(report: Report, readers: int, seconds: float, wan: str, log_dir: str) -> None:
    from tensorhub_testing.cluster import Cluster, HostSpec
    from tensorhub_testing.fleet import Fleet

    specs = [HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1) for i in range(readers))]
    with Cluster(specs, wan=wan) as cluster, Fleet(cluster, log_dir=log_dir) as fleet:
        trainer = fleet.trainer(cluster.hosts[0], 1, versions=1, extra=("--tiny", "8"))
        assert trainer.next_json(120)["event"] == "published"
        procs = []
        for i, host in enumerate(cluster.hosts[1:]):
            proc = host.popen([sys.executable, "-m", "bench.waiting", "--reader",
                               fleet.address, f"b{i}"], env=fleet.host_env(host),
                              name=f"b{i}", log_path=f"{log_dir}/b{i}.log",
                              stdin=subprocess.PIPE)
            fleet.procs.append(proc)
            procs.append(proc)
        for p in procs:
            assert p.next_json(120)["event"] == "ready"
        per_reader: dict[str, float] = {}
        for mode in MODES:
            before, started = cluster.wan_traffic(1), time.monotonic()
            for p in procs:
                p.send_line(f"{mode} {seconds}")
            done = [p.next_json(seconds + 60) for p in procs]
            took = time.monotonic() - started
            crossed = cluster.wan_traffic(1) - before
            total = crossed.sent + crossed.received
            per_reader[mode] = total / readers / took
            tries = sum(d["tries"] for d in done) / readers
            print(f"{mode}: {total} WAN bytes in {took:.1f} s, {tries:.0f} tries a reader: "
                  f"{per_reader[mode]:.0f} B/s a reader", flush=True)
        name = f"WAN {wan}, {readers} readers waiting {seconds:g} s for a version not out yet"
        report.add(f"{name}: WAN bytes/s a reader, waiting for its announcement",
                   per_reader["announce"], "B/s", f"asking every {POLL_EVERY:g} s",
                   per_reader["poll"], higher_is_better=False)
        report.add(f"{name}: WAN bytes/s a reader, waiting for its announcement",
                   per_reader["announce"], "B/s", "waiting for nothing (heartbeats only)",
                   per_reader["idle"], higher_is_better=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--wan", default="200mbit")
    parser.add_argument("--reader", nargs=2, metavar=("COORDINATOR", "NAME"),
                        help=argparse.SUPPRESS)  # (a reader process on its host)
    args = parser.parse_args(argv)
    if args.reader:
        return _reader(*args.reader)
    from tensorhub_testing.cluster import available

    reason = available()
    if reason is not None:
        print(f"bench.waiting: cannot emulate hosts here: {reason}", file=sys.stderr)
        return 1
    report = Report("waiting")
    logs = tempfile.mkdtemp(prefix="tensorhub-bench-waiting-")
    print(f"logs in {logs}", flush=True)
    waiting(report, args.readers, args.seconds, args.wan, logs)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
