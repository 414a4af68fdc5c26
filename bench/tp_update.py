"""TP engine update benchmark: a vLLM or SGLang engine at TP=2.

Measured in one run, on this machine, for each update the trainer publishes:
  bytes pulled: what the engine's ranks read for the version (the coordinator's transfer
                records), beside the bound: one model's bytes per engine.
  copies held:  checkpoint copies of the version the engine keeps in host memory (its
                workers that hold it), beside the bound: one.
  stall:        the engine's pause-to-resume time for the update, beside vLLM's own
                `reload_weights` of the same weights from safetensors at the same TP size.

SGLang (`--engine sglang`) is measured twice in one run, its ranks sharing one copy (the
default) and with a copy per rank (TENSORHUB_COPY_PER_RANK=1), beside
SGLang's own `/update_weights_from_disk` at the same TP size.

Run: python -m bench.tp_update [--engine vllm|sglang] [--updates 3]
     (needs that engine's venv: scripts/setup.sh vllm|sglang)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.results import Report
from bench.workdir import make_scratch, tear_down
from integration.engine_venvs import engine_python
from integration.tiny_model import build_tiny_model, load_state_dict
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub_testing.local_fleet import coordinator_process

ARCH = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2048, vocab=1024)
TP = 2


def engine_figures(address: str, engine: str, version: int,
                   skip: str | None = None) -> tuple[int, int]:
    """(bytes the engine's workers read for `version`, copies of it they hold; workers whose
    name has `skip` are left out: SGLang's native holders keep the live shards, no copy)."""
    client = CoordinatorClient(address, timeout=10.0)
    try:
        status = client.call(StatusRequest())
    finally:
        client.close()
    pulled = sum(t.nbytes for t in status.transfers
                 if t.version == version and t.ok and t.reader.startswith(engine))
    holders = {h.name for m in status.models for v in m.versions if v.version == version
               for h in v.holders if h.name.startswith(engine) and not h.withdrawn
               and not (skip and skip in h.name)}
    return pulled, len({name.split(".part")[0] for name in holders})


def _tp_model(scratch: str, engine: str) -> tuple[Path, Path, dict, int]:
    """A scratch folder with the benchmark's bf16 model: (folder, model, state, bytes)."""
    work = make_scratch(scratch)
    model_dir = build_tiny_model(work / "model", dtype=torch.bfloat16, **ARCH)
    state = load_state_dict(model_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"model: {model_bytes / 2**20:.0f} MiB bf16, {engine} TP={TP}")
    return work, model_dir, state, model_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    args = p.parse_args()
    if args.engine == "sglang":
        return sglang_main(args.updates)
    from safetensors.torch import save_file

    report = Report("tp_update")
    work, model_dir, state, model_bytes = _tp_model("tp", "vLLM")
    python = engine_python("vllm")
    coordinator, address = coordinator_process()
    tp_args = ["--tensor-parallel-size", str(TP)]
    tp_env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    servers: list[VLLMServer] = []
    publisher = None
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, "policy")
        publisher.publish(state)
        ours = VLLMServer(python, model_dir, dtype="bfloat16",
                          extra_args=[*tp_args, "--weight-transfer-config",
                                      json.dumps({"backend": "tensorhub"})],
                          env={**tp_env, "VLLM_PLUGINS": "tensorhub",
                               "TENSORHUB_COORDINATOR": address, "TENSORHUB_MODEL": "policy",
                               "TENSORHUB_NAME": "tp-engine"},
                          log_path=work / "ours.log")
        servers.append(ours)
        ours.start(timeout=900)
        ours.wait_serving(1, timeout=300)
        pulled, copies, stalls = [], [], []
        for k in range(2, args.updates + 2):
            with torch.no_grad():
                for t in state.values():
                    t.add_(0.001)
            publisher.publish(state)
            status = ours.wait_serving(k, timeout=300, interval=0.01)
            stalls.append(status["last_update"]["stall_ms"] / 1e3)
            nbytes, held = engine_figures(address, "tp-engine", k)
            pulled.append(nbytes)
            copies.append(held)
            print(f"update {k}: pulled {nbytes / 2**20:.1f} MiB, {held} copies held, "
                  f"stall {stalls[-1] * 1e3:.0f} ms")
        ours.stop()  # free the cores for the baseline

        baseline = VLLMServer(python, model_dir, dtype="bfloat16", extra_args=tp_args,
                              env={**tp_env, "VLLM_SERVER_DEV_MODE": "1"},
                              log_path=work / "base.log")
        servers.append(baseline)
        baseline.start(timeout=900)
        base_stall = []
        for _ in range(args.updates):
            with torch.no_grad():
                for t in state.values():
                    t.add_(0.001)
            save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
            started = time.perf_counter()
            baseline.reload_from_disk(model_dir)
            base_stall.append(time.perf_counter() - started)

        med = statistics.median
        report.add(f"bytes pulled per update, engine at TP={TP}", med(pulled) / 2**20, "MiB",
                   "one model (the bound)", model_bytes / 2**20, higher_is_better=False)
        report.add(f"bytes pulled per rank (mean), TP={TP}", med(pulled) / TP / 2**20, "MiB")
        report.add(f"checkpoint copies held in host memory, engine at TP={TP}", med(copies),
                   "copies", "one per engine (the bound)", 1.0, higher_is_better=False)
        report.add(f"engine stall per update, TP={TP} (TensorHub)", med(stalls) * 1e3, "ms",
                   f"vLLM reload_weights from safetensors, TP={TP}", med(base_stall) * 1e3,
                   higher_is_better=False)
        report.write()
    finally:
        tear_down(servers, publisher, coordinator, work)


def sglang_main(updates: int) -> None:
    from bench.sglang_update import _checkpoint_dir, disk_update
    from integration.sglang_server import SGLangServer
    from integration.test_sglang import LOADER

    report = Report("tp_update_sglang")
    work, model_dir, state, model_bytes = _tp_model("tp-sglang", "SGLang")
    ckpt = _checkpoint_dir(model_dir, work / "ckpt")
    python = engine_python("sglang")
    coordinator, address = coordinator_process()
    tp_args = ["--tp-size", str(TP)]
    tp_env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    servers: list = []
    publisher = None
    version = 1
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, "policy")
        publisher.publish(state)
        for mode, extra in (("one copy per engine", {}),
                            ("a copy per rank (before)", {"TENSORHUB_COPY_PER_RANK": "1"})):
            name = f"tp-sglang-{len(servers)}"
            engine = SGLangServer(
                python, model_dir, dtype="bfloat16", log_path=work / f"{name}.log",
                extra_args=[*tp_args, "--custom-weight-loader", LOADER],
                env={**tp_env, **extra, "SGLANG_PLUGINS": "tensorhub",
                     "TENSORHUB_COORDINATOR": address, "TENSORHUB_MODEL": "policy",
                     "TENSORHUB_NAME": name, "TENSORHUB_CHECKPOINT_COPY": "always"})
            servers.append(engine)
            engine.start(timeout=900)
            engine.wait_serving(version, timeout=300)
            pulled, copies, memory, stalls = [], [], [], []
            for _ in range(updates):
                _bump(state)
                version = publisher.publish(state)
                status = engine.wait_serving(version, timeout=300, interval=0.01)
                stalls.append(status["last_update"]["stall_ms"] / 1e3)
                nbytes, held = engine_figures(address, name, version, skip="-native")
                pulled.append(nbytes)
                copies.append(held)
                memory.append((status.get("memory") or {}).get("checkpoint_copy_bytes", 0))
                print(f"{mode}, v{version}: pulled {nbytes / 2**20:.1f} MiB, {held} copies, "
                      f"copy memory {memory[-1] / 2**20:.1f} MiB, stall {stalls[-1] * 1e3:.0f} ms")
            engine.stop()
            med = statistics.median
            report.add(f"bytes pulled per update, {mode}", med(pulled) / 2**20, "MiB",
                       "one model (the bound)", model_bytes / 2**20, higher_is_better=False)
            report.add(f"bytes pulled per rank (mean), {mode}", med(pulled) / TP / 2**20,
                       "MiB")
            report.add(f"checkpoint copies held, {mode}", med(copies), "copies",
                       "one per engine (the bound)", 1.0, higher_is_better=False)
            report.add(f"checkpoint copy memory per engine, {mode}", med(memory) / 2**20,
                       "MiB", "one model (the bound)", model_bytes / 2**20,
                       higher_is_better=False)
            report.add(f"engine stall per update, {mode}", med(stalls) * 1e3, "ms")
        baseline = SGLangServer(python, model_dir, dtype="bfloat16", extra_args=tp_args,
                                env=tp_env, log_path=work / "base.log")
        servers.append(baseline)
        baseline.start(timeout=900)
        base_stall = []
        for k in range(updates):
            _bump(state)
            base_stall.append(disk_update(baseline, ckpt, state, 100 + k)[1])
        report.add(f"SGLang update_weights_from_disk, TP={TP} (baseline stall)",
                   statistics.median(base_stall) * 1e3, "ms")
        report.write()
    finally:
        tear_down(servers, publisher, coordinator, work)


def _bump(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in state.values():
            t.add_(0.001)


if __name__ == "__main__":
    main()
