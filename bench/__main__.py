"""Run every benchmark, one after another, each in its own process: `python -m bench`
(or `bash scripts/bench.sh`, which sets up the core venv first).

Each writes bench/results/<name>.{jsonl,md} with our figure beside its baseline measured in
the same run. Engine benchmarks need their own venvs and are opt-in (`--engines`). They
share the machine's cores, so nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from integration.engine_venvs import engine_python

ROOT = Path(__file__).resolve().parent.parent

# name -> (arguments, quick arguments)
CORE = {
    "foundation": ([], ["--size-mb", "256", "--repeat", "3"]),
    "same_node": ([], ["--size-mb", "256", "--repeat", "3"]),
    "fanout": ([], ["--size-mb", "256", "--versions", "2"]),
    "plan_latency": ([], ["--workers", "512", "--rates", "250", "--seconds", "3"]),
    "simulate": ([], ["--max", "256", "--tib-readers", "8"]),
    "hosts": ([], ["--quick"]),  # emulated hosts: needs root and iproute2
    "patches": ([], ["--quick"]),  # its WAN figures need emulated hosts
    "waiting": ([], ["--readers", "2", "--seconds", "4"]),  # emulated hosts
    "stalled_source": ([], ["--size-mb", "64", "--stall-timeout", "8", "--window", "5"]),
}
ENGINES = {
    "vllm_update": ("vllm", [], ["--updates", "1"]),
    # the demo's fleet, driven from the core venv (the demo plots with matplotlib)
    "fleet_swaps": ("core", [], ["--versions", "3"]),
    "vllm_fp8": ("vllm", [], ["--updates", "1", "--layers", "2"]),
    "sglang_update": ("sglang", [], ["--quick", "--updates", "1"]),
    "tp_update": ("vllm", [], ["--updates", "1"]),
    "tp_update_sglang": ("sglang", ["--engine", "sglang"],
                         ["--engine", "sglang", "--updates", "1"]),
    "engine_stopped_source": ("vllm", [], ["--seconds", "5"]),
    "engine_pause": ("vllm", [], ["--updates", "1", "--layers", "2"]),
    "engine_pause_sglang": ("sglang", ["--engine", "sglang"],
                            ["--engine", "sglang", "--updates", "1", "--layers", "2"]),
}
# a benchmark run by another's module
MODULES = {"tp_update_sglang": "tp_update", "engine_pause_sglang": "engine_pause"}




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[*CORE, *ENGINES],
                        help="run just these benchmarks")
    parser.add_argument("--engines", action="store_true",
                        help="also the vLLM and SGLang update benchmarks (their venvs are "
                             "created by scripts/setup.sh on first use; ~10 min each)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: checks that every benchmark runs (figures go to "
                             "bench/results/quick/, apart from the README's)")
    args = parser.parse_args(argv)
    wanted = args.only or [*CORE, *(ENGINES if args.engines else [])]
    results = ROOT / "bench" / "results" / ("quick" if args.quick else "")
    env = {**os.environ, "TENSORHUB_BENCH_RESULTS": str(results)}
    failed = []
    for name in wanted:
        if name in CORE:
            python, (full, quick) = sys.executable, CORE[name]
        else:
            kind, full, quick = ENGINES[name]
            python = engine_python(kind)
        cmd = [python, "-m", f"bench.{MODULES.get(name, name)}", *(quick if args.quick else full)]
        print(f"\n=== bench.{name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        print(f"=== bench.{name}: exit {rc} after {time.monotonic() - started:.0f} s",
              flush=True)
        if rc:
            failed.append(name)
    print(f"\nresults: {results}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
