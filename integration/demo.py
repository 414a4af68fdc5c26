"""The main demo: a coordinator, a trainer and real inference engines on this machine.

    bash scripts/demo.sh                  # two `vllm serve` engines and one SGLang server
    bash scripts/demo.sh --sglang 0       # vLLM only (no SGLang venv needed)
    bash scripts/demo.sh --vllm 0         # SGLang only
    bash scripts/demo.sh --engines none   # no engines: trainer + replica processes only

The trainer publishes versions of a tiny float32 model (built on the spot); each engine
switches as it pulls the version from whichever peer already has it. For every version the
demo prints each engine's answer to a fixed prompt, who pulled from whom, and each
engine's stall (the time it did not serve).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from integration.engine_venvs import engine_python
from integration.sglang_server import SGLangServer
from integration.tiny_model import Versions
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub.processes import coordinator_process

PROMPT = "the trainer will publish a new policy and the engine"


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="tensorhub-demo-"))
    print(f"building a tiny float32 model in {work} ...", flush=True)
    versions = Versions(work, count=args.versions)
    tokenizer = AutoTokenizer.from_pretrained(str(versions.dir))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    vllm_python = engine_python("vllm") if args.vllm else None
    sglang_python = engine_python("sglang") if args.sglang else None
    coordinator, address = coordinator_process("--max-readers-per-holder", "1")
    engines: list = []
    publisher = None
    try:
        print(coordinator.next_line(timeout=60))
        publisher = Publisher(address, "policy", name="trainer")
        publisher.publish(versions.state(1))
        print("trainer: published v1 (the weights in the model folder)")
        env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
               "TENSORHUB_MODEL": "policy"}
        for i in range(args.vllm):
            engines.append(VLLMServer(
                vllm_python, versions.dir, env=env, log_path=work / f"vllm-{i}.log",
                extra_args=["--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            ).launch())
        for i in range(args.sglang):
            engines.append(SGLangServer(
                sglang_python, versions.dir, log_path=work / f"sglang-{i}.log",
                env={"SGLANG_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                     "TENSORHUB_MODEL": "policy"},
                extra_args=["--custom-weight-loader", "tensorhub_plugins.sglang.loader.apply"],
            ).launch())
        print(f"starting {args.vllm} vLLM and {args.sglang} SGLang engines (~60 s; logs in "
              f"{work}) ...", flush=True)
        for e in engines:
            e.wait_healthy(300)
        client = CoordinatorClient(address)
        for version in range(1, args.versions + 1):
            if version > 1:
                started = time.perf_counter()
                publisher.publish(versions.state(version))
            statuses = [e.wait_serving(version, timeout=180.0) for e in engines]
            if version > 1:
                print(f"\nversion {version}: all engines serving it "
                      f"{time.perf_counter() - started:.2f}s after publish")
            else:
                print("\nversion 1: engines joined it at start-up")
            for e, status in zip(engines, statuses, strict=True):
                ids = e.greedy([prompt_ids], 12)[0]
                stall = (status["last_update"] or {}).get("stall_ms", 0.0)
                print(f"  {status['name']:<34} stall {stall:6.1f} ms  answers: "
                      f"{tokenizer.decode(ids)!r}")
            for t in client.call(StatusRequest()).transfers:
                if t.version == version and t.ok and t.nbytes:
                    print(f"  pull: {t.reader} <- {t.source}  {t.nbytes / 2**20:.1f} MiB "
                          f"{t.nbytes / max(t.seconds, 1e-9) / 1e9:.2f} GB/s")
        client.close()
        return 0
    finally:
        for e in engines:
            e.stop()
        if publisher is not None:
            publisher.close()
        coordinator.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="vllm",
                   help="vllm (default) or none (trainer + replica processes, no engine)")
    p.add_argument("--vllm", type=int, default=2, help="number of vLLM engines (default 2)")
    p.add_argument("--sglang", type=int, default=1, help="number of SGLang engines (default 1)")
    p.add_argument("--versions", type=int, default=3)
    args, rest = p.parse_known_args()
    if args.engines == "none":
        from tensorhub.cli import main as cli

        return cli(["--log-level", "WARNING", "demo", *rest])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
