"""An engine's request latency while the only source of a version it pulls is stopped:
`python -m bench.engine_stopped_source` (needs root: two emulated hosts).

A vLLM engine on one emulated host serves its disk weights; greedy requests go to it back
to back for `--seconds` and their latencies are the baseline (no transfer at all). Then a
trainer on the other host publishes a version and stops (SIGSTOP) at once: the engine's
checkpoint copy starts reading from it and gets no byte until its stall timeout gives the
source up. The same requests for the same time give our figure: p50 and p99 beside the
baseline's (goal: p99 at most 1.5x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.results import Report
from bench.workdir import make_scratch, remove_scratch
from integration.engine_venvs import engine_python
from integration.tiny_model import Versions, pick_stable_prompts, save_version
from integration.vllm_server import VLLMServer
from tensorhub_testing.cluster import Cluster, available
from tensorhub_testing.fleet import Fleet

TOKENS = 12
PLUGIN_ARGS = ["--weight-transfer-config", '{"backend": "tensorhub"}']


def latencies(engine: VLLMServer, prompt: list[int], seconds: float) -> list[float]:
    out, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.monotonic()
        engine.greedy([prompt], TOKENS)
        out.append(time.monotonic() - started)
    return out


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=25.0,
                   help="requests per phase (within the 30 s stall timeout)")
    args = p.parse_args()
    if available() is not None:
        sys.exit(f"no emulated hosts here: {available()}")
    python = engine_python("vllm")
    root = make_scratch("engine-stopped-source")
    try:
        versions = Versions(root, count=2)
        published = save_version(versions.dir, versions.state(2), root / "v2")
        prompts, _ = pick_stable_prompts(versions.dir, 1, 12, TOKENS,
                                         state_dicts=[versions.state(1)])
        with Cluster(2, egress="800mbit") as cluster, \
                Fleet(cluster, log_dir=root) as fleet:
            h0, h1 = cluster.hosts
            env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": fleet.address,
                   "TENSORHUB_MODEL": "policy"}
            engine = VLLMServer(python, versions.dir, extra_args=PLUGIN_ARGS, env=env,
                                log_path=root / "vllm.log").on(h1)
            trainer = None
            try:
                engine.start(300)
                latencies(engine, prompts[0], 3.0)  # warm-up
                quiet = latencies(engine, prompts[0], args.seconds)
                trainer = h0.popen([sys.executable, "-m", "integration.stopping_trainer",
                                    fleet.address, str(published)], name="stopping-trainer")
                assert trainer.next_json(120) == {"version": 1}
                stopped = latencies(engine, prompts[0], args.seconds)
            finally:
                if trainer is not None:
                    trainer.kill()
                engine.stop()
        report = Report("engine_stopped_source")
        report.add("engine request p50, its source stopped", statistics.median(stopped) * 1e3,
                   "ms", "no transfer", statistics.median(quiet) * 1e3,
                   higher_is_better=False)
        report.add("engine request p99, its source stopped", p99(stopped) * 1e3, "ms",
                   "no transfer", p99(quiet) * 1e3, higher_is_better=False)
        report.add("requests answered, its source stopped", len(stopped), "requests",
                   "no transfer", len(quiet))
        report.write()
    finally:
        remove_scratch(root)


if __name__ == "__main__":
    main()
