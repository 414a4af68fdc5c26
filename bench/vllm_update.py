"""vLLM update benchmark: ~0.4B random Qwen2 (hidden 896, 24 layers), bf16.

Measured in one run, on this machine:
  TensorHub: trainer `publish` -> the engine (follow mode) serves the version:
             publish-to-serving time, and the engine's stall (pause -> resume).
  baseline:  trainer saves a safetensors checkpoint (counted), then vLLM's own
             `reload_weights(weights_path=...)` between /pause and /resume (dev-mode routes):
             save + reload time, and the stall.
  join:      an engine started with `--load-format dummy` that pulls the newest version from
             peers before serving, vs a plain start from the saved checkpoint.

Run: python -m bench.vllm_update [--updates 3]   (needs the vllm venv: scripts/setup.sh vllm)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.results import Report
from bench.workdir import make_scratch, tear_down
from integration.engine_venvs import engine_python
from integration.tiny_model import build_tiny_model, load_state_dict
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub_testing.local_fleet import coordinator_process

ARCH = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=1024)


def _start_timed(server: VLLMServer) -> float:
    started = time.perf_counter()
    server.start(timeout=600)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=3)
    args = p.parse_args()
    from safetensors.torch import save_file

    report = Report("vllm_update")
    work = make_scratch("vllm")
    model_dir = build_tiny_model(work / "model", dtype=torch.bfloat16, **ARCH)
    state = load_state_dict(model_dir)
    params = sum(t.numel() for t in state.values())
    print(f"model: {params / 1e6:.0f}M parameters, "
          f"{sum(t.numel() * t.element_size() for t in state.values()) / 2**20:.0f} MiB bf16")
    python = engine_python("vllm")
    coordinator, address = coordinator_process()
    common = ["--dtype", "bfloat16"]
    plugin_env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                  "TENSORHUB_MODEL": "policy"}
    plugin_args = ["--weight-transfer-config", json.dumps({"backend": "tensorhub"})]
    servers: list[VLLMServer] = []
    publisher = None
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, "policy")
        publisher.publish(state)

        baseline = VLLMServer(python, model_dir, extra_args=common, dtype="bfloat16",
                              env={"VLLM_SERVER_DEV_MODE": "1"}, log_path=work / "base.log")
        servers.append(baseline)
        plain_start = _start_timed(baseline)
        ours = VLLMServer(python, model_dir, extra_args=plugin_args, dtype="bfloat16",
                          env=plugin_env, log_path=work / "ours.log")
        servers.append(ours)
        ours.start(timeout=600)
        ours.wait_serving(1, timeout=300)

        ours_total, ours_stall, base_total, base_stall, base_save = [], [], [], [], []
        for k in range(2, args.updates + 2):
            with torch.no_grad():
                for t in state.values():
                    t.add_(0.001)
            started = time.perf_counter()
            publisher.publish(state)
            status = ours.wait_serving(k, timeout=300, interval=0.01)
            ours_total.append(time.perf_counter() - started)
            ours_stall.append(status["last_update"]["stall_ms"] / 1e3)

            started = time.perf_counter()
            save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
            saved = time.perf_counter()
            baseline.reload_from_disk(model_dir)
            done = time.perf_counter()
            base_save.append(saved - started)
            base_total.append(done - started)
            base_stall.append(done - saved)
            print(f"update {k}: ours {ours_total[-1]:.2f}s (stall {ours_stall[-1] * 1e3:.0f} ms)"
                  f"; baseline save {base_save[-1]:.2f}s + reload {base_stall[-1]:.2f}s")

        med = statistics.median
        report.add("engine stall per update (TensorHub)", med(ours_stall) * 1e3, "ms",
                   "vLLM reload_weights from safetensors", med(base_stall) * 1e3,
                   higher_is_better=False)
        report.add("publish to serving (TensorHub)", med(ours_total), "s",
                   "trainer save + vLLM reload_weights", med(base_total),
                   higher_is_better=False)
        report.add("trainer save of the checkpoint (baseline only)", med(base_save), "s")

        weightless = work / "weightless"
        weightless.mkdir()
        for f in model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                (weightless / f.name).write_bytes(f.read_bytes())
        baseline.stop()  # free cores for the join measurement
        joiner = VLLMServer(python, weightless, extra_args=[*plugin_args, "--load-format",
                                                            "dummy"], dtype="bfloat16",
                            env=plugin_env, log_path=work / "join.log")
        servers.append(joiner)
        join_start = _start_timed(joiner)
        assert joiner.request("/tensorhub/status")["serving_version"] == args.updates + 1
        report.add("elastic join: start to serving the newest version (dummy load + pull)",
                   join_start, "s", "plain start from the checkpoint on disk", plain_start,
                   higher_is_better=False)
        report.write()
    finally:
        tear_down(servers, publisher, coordinator, work)


if __name__ == "__main__":
    main()
