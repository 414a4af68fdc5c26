"""The main demo: a coordinator, a trainer that learns, and real inference engines here.

    bash scripts/demo.sh                  # two `vllm serve` engines and one SGLang server
    bash scripts/demo.sh --sglang 0       # vLLM only (no SGLang venv needed)
    bash scripts/demo.sh --vllm 0         # SGLang only
    bash scripts/demo.sh --engines none   # no engines: trainer + replica processes only

The trainer makes real optimizer steps on a tiny float32 model (built on the spot) toward a
target anyone can check: answering with the word " reward" (`integration/learner.py`). It
publishes a version after each step; each engine switches as it pulls the version from
whichever peer already has it. For every version the demo prints each engine's reward
(the share of its answers' tokens that are the target word), its answer to the first
prompt, its publish-to-serving time and its stall, and who pulled from whom. At the end it
writes a PNG: reward per version, and publish-to-serving time per engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from integration.engine_server import EngineServer
from integration.engine_venvs import engine_python
from integration.learner import ANSWER_TOKENS, Learner
from integration.sglang_server import SGLangServer
from integration.tiny_model import build_tiny_model
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub_testing import shared_memory
from tensorhub_testing.local_fleet import coordinator_process


def wait_all_serving(engines: list[EngineServer], version: int, since: float,
                     timeout: float = 180.0) -> tuple[list[dict], list[float]]:
    """Poll every engine until all serve `version`: their statuses, and the seconds from
    `since` (the publish, wall clock) to each one's resume, as the engine recorded it."""
    deadline = time.monotonic() + timeout
    statuses: list[dict | None] = [None] * len(engines)
    while None in statuses:
        for i, e in enumerate(engines):
            if statuses[i] is None:
                status = e.status_now()
                # (its record of the swap, where there was one: an engine that joined at
                # start-up may have none)
                swapped = (status.get("last_update") or {}).get("version", version)
                if status.get("serving_version") == version and swapped == version:
                    statuses[i] = status
        if time.monotonic() > deadline:
            # the one wait that says which engine and why (its log tail)
            engines[statuses.index(None)].wait_serving(version, timeout=0.1)
        time.sleep(0.25)  # (the times are the engines' own: asking often only loads them)
    seconds = [max(0.0, (s["last_update"] or {}).get("at", since) - since)
               for s in statuses]  # type: ignore[union-attr]
    return statuses, seconds  # type: ignore[return-value]


def plot(path: Path, names: list[str], rewards: dict[str, list[float]],
         delays: dict[str, list[float]], target: str) -> None:
    """Reward per version (each engine's, measured on its answers), and publish-to-serving
    time per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name in names:
        versions = range(1, len(rewards[name]) + 1)
        top.plot(versions, rewards[name], marker="o", label=name)
        bottom.plot(range(2, len(delays[name]) + 2), delays[name], marker="o", label=name)
    top.set_ylabel(f"reward: share of answer tokens = {target!r}")
    top.set_ylim(-0.05, 1.05)
    top.set_title("the engines' answers move toward the trainer's target")
    top.legend(fontsize=8)
    bottom.set_ylabel("publish to serving (s)")
    bottom.set_xlabel("version")
    bottom.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="tensorhub-demo-"))
    shm_before = shared_memory.names()
    print(f"building a tiny float32 model in {work} ...", flush=True)
    model_dir = build_tiny_model(work / "model")
    learner = Learner(model_dir)
    vllm_python = engine_python("vllm") if args.vllm else None
    sglang_python = engine_python("sglang") if args.sglang else None
    coordinator, address = coordinator_process("--max-readers-per-holder", "1")
    engines: list[EngineServer] = []
    publisher = None
    try:
        print(coordinator.next_line(timeout=60))
        publisher = Publisher(address, "policy", name="trainer")
        publisher.publish(learner.state())
        print("trainer: published v1 (the weights in the model folder)")
        env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
               "TENSORHUB_MODEL": "policy"}
        own_spin = args.engine_idle == "engine"  # as the engines come: idle workers spin
        if own_spin:
            env["TENSORHUB_WORKER_SPIN"] = ""
        for i in range(args.vllm):
            engines.append(VLLMServer(
                vllm_python, model_dir, env=env, log_path=work / f"vllm-{i}.log",
                extra_args=["--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            ).launch())
        for i in range(args.sglang):
            engines.append(SGLangServer(
                sglang_python, model_dir, log_path=work / f"sglang-{i}.log",
                env={"SGLANG_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                     "TENSORHUB_MODEL": "policy"},
                extra_args=["--custom-weight-loader", "tensorhub_plugins.sglang.loader.apply"],
                sleep_on_idle=not own_spin).launch())
        print(f"starting {args.vllm} vLLM and {args.sglang} SGLang engines (~60 s; logs in "
              f"{work}) ...", flush=True)
        for e in engines:
            e.wait_healthy(300)
        names = [e.tensorhub_status()["name"] for e in engines]
        rewards: dict[str, list[float]] = {n: [] for n in names}
        delays: dict[str, list[float]] = {n: [] for n in names}
        client = CoordinatorClient(address)
        records: list[dict] = []
        print(f"\ntarget: answers made of the word {learner.target_word!r}; reward = the "
              f"share of answer tokens that are it ({len(learner.prompts)} prompts, "
              f"{ANSWER_TOKENS} tokens each)")
        for version in range(1, args.versions + 1):
            started = time.time()
            if version > 1:
                loss = learner.train()
                started = time.time()
                publisher.publish(learner.state())
            statuses, seconds = wait_all_serving(engines, version, started)
            if version > 1:
                print(f"\nversion {version} (trainer loss {loss:.2f}): all engines serving "
                      f"it {max(seconds, default=0.0):.2f}s after publish")
            else:
                print("\nversion 1: engines joined it at start-up")
            for e, name, status, delay in zip(engines, names, statuses, seconds, strict=True):
                answers = e.greedy(learner.prompts, ANSWER_TOKENS)
                rewards[name].append(learner.reward(answers))
                if version > 1:
                    delays[name].append(delay)
                stall = (status["last_update"] or {}).get("stall_ms", 0.0)
                if version > 1:
                    steps = (status["last_update"] or {}).get("steps_ms") or {}
                    records.append({"engine": name, "kind": name.split("-")[0],
                                    "version": version, "serving_after_s": round(delay, 4),
                                    "stall_ms": stall, "update_ms": steps.get("update")})
                print(f"  {name:<34} reward {rewards[name][-1]:4.2f}  serving after "
                      f"{delay:5.2f}s  stall {stall:6.1f} ms  answers: "
                      f"{learner.tokenizer.decode(answers[0])!r}")
            for t in client.call(StatusRequest()).transfers:
                if t.version == version and t.ok and t.nbytes:
                    print(f"  pull: {t.reader} <- {t.source}  {t.nbytes / 2**20:.1f} MiB "
                          f"{t.nbytes / max(t.seconds, 1e-9) / 1e9:.2f} GB/s")
        client.close()
        if args.record:
            Path(args.record).write_text(json.dumps(records))
        png = Path(args.plot) if args.plot else work / "learning.png"
        plot(png, names, rewards, delays, learner.target_word)
        print(f"\nwrote {png}: reward per version and publish-to-serving time per engine")
        return 0
    finally:
        for e in engines:
            e.stop()
        if publisher is not None:
            publisher.close()
        coordinator.stop()
        shared_memory.remove_unused(shm_before)  # (what the stopped engines left in /dev/shm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="vllm",
                   help="vllm (default) or none (trainer + replica processes, no engine)")
    p.add_argument("--vllm", type=int, default=2, help="number of vLLM engines (default 2)")
    p.add_argument("--sglang", type=int, default=1, help="number of SGLang engines (default 1)")
    p.add_argument("--versions", type=int, default=8,
                   help="versions the trainer publishes, one optimizer step each (default 8)")
    p.add_argument("--plot", default=None,
                   help="where to write the PNG (default: learning.png in the demo's folder)")
    p.add_argument("--engine-idle", choices=("tensorhub", "engine"), default="tensorhub",
                   help="tensorhub (default): engines wait idle without spinning a core "
                        "(TENSORHUB_WORKER_SPIN=0.01, SGLang --sleep-on-idle), as engines "
                        "that share cores should; engine: as the engines come")
    p.add_argument("--record", default=None,
                   help="write each engine's swap of each version as JSON here")
    args, rest = p.parse_known_args()
    if args.engines == "none":
        from tensorhub.tools.cli import main as cli

        return cli(["--log-level", "WARNING", "demo", *rest])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
