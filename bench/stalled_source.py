"""CPU a reader spends while its source is stopped: `python -m bench.stalled_source`.

A coordinator, a trainer and a replica, each a process of its own on this host (shared
memory off, so reads take the transport under test). The trainer publishes; the replica
starts pulling; the trainer is stopped (SIGSTOP) and the replica's CPU is sampled from
/proc until its stall timeout gives the source up. Beside each transport's figure: the
same NIXL reader with NIXL's own progress thread (the agent as NIXL's Python API makes it),
and the bound, a process that only sleeps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from bench.results import Report
from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.local_fleet import CoordinatorProcess

TRAINER = """
import sys, threading, torch
from tensorhub import Publisher
pub = Publisher(sys.argv[1], "m", transport=sys.argv[2], name="trainer")
pub.publish({"w": torch.randn(int(sys.argv[3]) << 18)})
print("published", flush=True)
threading.Event().wait()
"""
READER = """
import sys
from tensorhub import Replica
if sys.argv[3] == "nixl-own-thread":  # the baseline: NIXL's own progress thread
    from nixl._api import nixl_agent, nixl_agent_config
    import tensorhub.core.transport.nixl as nixl
    def own_thread(name):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    nixl.make_agent = own_thread
    transport = "nixl"
else:
    transport = sys.argv[3]
r = Replica(sys.argv[1], "m", transport=transport)
print("pulling", flush=True)
try:
    r.pull(1, timeout=float(sys.argv[2]) * 4)
except Exception as exc:
    print("failed", exc, flush=True)
print("done", flush=True)
import time; time.sleep(600)  # (sampled as long as the bench likes)
"""
SLEEPER = "import time; print('pulling', flush=True); time.sleep(600)"


TICK = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reader_cpu(transport: str, size_mib: int, stall: float, window: float) -> float:
    """Cores the reader used, on average over `window` seconds while its source is stopped
    (from 1 s after the stop: the pull's own first second of work is left out)."""
    env = {"TENSORHUB_SHARED_MEMORY": "0", "TENSORHUB_STALL_TIMEOUT": str(stall)}
    coordinator = CoordinatorProcess().start()
    trainer_transport = transport if transport in ("cma", "zmq") else "nixl"
    trainer = ChildProcess([sys.executable, "-c", TRAINER, coordinator.address,
                            trainer_transport, str(size_mib)], env=env, name="trainer")
    reader = None
    try:
        while "published" not in trainer.next_line(120):
            pass
        argv = ["-c", SLEEPER] if transport == "sleep" else \
            ["-c", READER, coordinator.address, str(stall), transport]
        reader = ChildProcess([sys.executable, *argv], env=env, name="reader")
        while "pulling" not in reader.next_line(120):
            pass
        time.sleep(0.05)
        os.kill(trainer.proc.pid, signal.SIGSTOP)
        time.sleep(1.0)
        before, started = cpu_seconds(reader.proc.pid), time.monotonic()
        time.sleep(window)
        cores = (cpu_seconds(reader.proc.pid) - before) / (time.monotonic() - started)
        return max(cores, TICK / window)  # (the clock's resolution: no zero to divide by)
    finally:
        if trainer.proc.poll() is None:
            os.kill(trainer.proc.pid, signal.SIGCONT)
        if reader is not None:
            reader.stop()
        trainer.stop()
        coordinator.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256, help="the model the reader pulls")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="TENSORHUB_STALL_TIMEOUT of the reader: it waits this long")
    p.add_argument("--window", type=float, default=10.0, help="seconds sampled")
    p.add_argument("--transports", nargs="+", default=["nixl", "cma", "zmq", "auto"])
    args = p.parse_args()
    assert args.window + 1.0 < args.stall_timeout, "sample within the stall timeout"
    report = Report("stalled_source")
    bound = reader_cpu("sleep", args.size_mb, args.stall_timeout, args.window)
    own = reader_cpu("nixl-own-thread", args.size_mb, args.stall_timeout, args.window)
    report.add("nixl reader, NIXL's own progress thread: cores while the source is stopped",
               own, "cores", "a sleeping process", bound, higher_is_better=False)
    for transport in args.transports:
        cores = reader_cpu(transport, args.size_mb, args.stall_timeout, args.window)
        report.add(f"{transport} reader: cores while the source is stopped", cores, "cores",
                   "NIXL's own progress thread", own, higher_is_better=False)
    report.write()


if __name__ == "__main__":
    main()
