"""Swaps across a small fleet on shared cores: the demo's fleet (two `vllm serve` engines and
an SGLang server on this machine, a trainer publishing a 0.8 MiB float32 model after each
optimizer step), run twice: with the engines as they come, whose idle workers spin (vLLM's
workers for a second after every call, SGLang's scheduler whenever idle), and as TensorHub
runs them on shared cores (`TENSORHUB_WORKER_SPIN=0.01`, SGLang `--sleep-on-idle`).

Per run: each engine's stall (its own record: pause to resume) and publish → serving (from
the publish call to the engine's resume), worst and median over 7 versions of 3 engines,
beside the bound measured in the same run: the install call alone (the weights' load, the
`update` step of the swap), which no pause can undercut.

Run: python -m bench.fleet_swaps [--versions 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import Report

ROOT = Path(__file__).resolve().parent.parent


def demo(engine_idle: str, versions: int, workdir: str) -> list[dict]:
    """One demo run; its records (one per engine per version after the first)."""
    record = Path(workdir) / f"{engine_idle}.json"
    log = Path(workdir) / f"{engine_idle}.log"
    with log.open("w") as out:
        subprocess.run([sys.executable, "-m", "integration.demo", "--engine-idle",
                        engine_idle, "--versions", str(versions), "--record", str(record)],
                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True,
                       timeout=900)
    return json.loads(record.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=8)
    args = p.parse_args()
    report = Report("fleet_swaps")
    workdir = tempfile.mkdtemp(prefix="tensorhub-bench-fleet-swaps-")
    print(f"logs in {workdir}", flush=True)
    runs = {mode: demo(mode, args.versions, workdir) for mode in ("engine", "tensorhub")}
    bound = statistics.median(r["update_ms"] for rs in runs.values() for r in rs
                              if r["update_ms"])
    report.add("install call alone (median, both runs)", bound, "ms")
    for mode, what in (("engine", "engines as they come (idle workers spin)"),
                       ("tensorhub", "TensorHub on shared cores")):
        records = runs[mode]
        stalls = [r["stall_ms"] for r in records]
        serving = [r["serving_after_s"] for r in records]
        report.add(f"{what}: worst stall", max(stalls), "ms", "install call alone", bound,
                   higher_is_better=False)
        report.add(f"{what}: median stall", statistics.median(stalls), "ms",
                   "install call alone", bound, higher_is_better=False)
        report.add(f"{what}: stalls over 100 ms", sum(s > 100 for s in stalls), "swaps",
                   f"of {len(stalls)}")
        report.add(f"{what}: worst publish -> serving", max(serving) * 1e3, "ms")
        report.add(f"{what}: median publish -> serving", statistics.median(serving) * 1e3,
                   "ms")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
