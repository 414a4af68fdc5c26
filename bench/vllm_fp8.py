"""fp8 vLLM engines fed by a bf16 trainer, beside a bf16 engine of the same model: bytes
pulled and held per version, and the stall, with the quantization in each engine or done
once by the trainer.

Three `vllm serve` engines with the plugin, in manual mode so that their swaps do not
overlap (two cores): one bf16, and two `--quantization fp8_per_channel --dtype bfloat16`
(vLLM's online per-channel quantization). The trainer publishes each version in bf16 and,
quantized once (`Publisher(quantize=["fp8_per_channel"])`), as `policy@fp8_per_channel`.
The `fp8` engine pulls bf16 and quantizes each version itself before the pause
(`TENSORHUB_QUANTIZED_LAYOUT=never`; `tensorhub_plugins/vllm/fp8_install.py`); the
`fp8-once` engine follows the quantized layout and writes it as it is, only the bytes
that differ where few do. Each engine is asked to update in turn: whole versions, then
1 %-density steps (that share of each tensor's elements moved by one bf16 step). Per
version: the bytes each engine's worker pulled (the coordinator's transfers), what each
holds (its checkpoint-layout copy plus its model's live parameters), the stall each
reports and its check before the pause (verification, and the fp8 engine's quantization,
while it generates). Baselines: the bytes the fp8 engine serves from (its live parameters:
the physical bound of a pull that brought only what the engine uses), the bf16 engine's
stall, and vLLM's own `reload_weights` from a safetensors checkpoint on the fp8 engine
(which quantizes the same way).

Run: python -m bench.vllm_fp8 [--updates 3] [--layers 12]   (in the vllm venv)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.results import Report
from bench.tp_update import engine_figures
from bench.workdir import make_scratch, tear_down
from integration.engine_venvs import engine_python
from integration.tiny_model import build_tiny_model, load_state_dict
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.quant import quantize_named
from tensorhub.tools.cli import _change as next_version
from tensorhub_testing.local_fleet import coordinator_process

ARCH = dict(hidden=896, layers=12, heads=14, kv_heads=2, intermediate=4864, vocab=1024)
MiB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--layers", type=int, default=ARCH["layers"])
    args = p.parse_args()
    from safetensors.torch import save_file

    report = Report("vllm_fp8")
    work = make_scratch("vllm-fp8")
    model_dir = build_tiny_model(work / "model", dtype=torch.bfloat16,
                                 **{**ARCH, "layers": args.layers})
    state = load_state_dict(model_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    label = f"{model_bytes / MiB:.0f} MiB bf16 Qwen2"
    print(f"model: {label}")
    python = engine_python("vllm")
    coordinator, address = coordinator_process()
    plugin_args = ["--weight-transfer-config", json.dumps({"backend": "tensorhub"})]
    servers: list[VLLMServer] = []
    publisher = None
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, "policy", name="trainer", quantize=["fp8_per_channel"])
        publisher.publish(state)
        engines = {}
        fp8 = ["--quantization", "fp8_per_channel"]
        for kind, quant, layout in (("bf16", [], "never"), ("fp8", fp8, "never"),
                                    ("fp8-once", fp8, "auto")):
            engines[kind] = VLLMServer(
                python, model_dir, dtype="bfloat16", live_weights=True,
                extra_args=[*plugin_args, *quant], log_path=work / f"{kind}.log",
                env={"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                     "TENSORHUB_MODEL": "policy", "TENSORHUB_MODE": "manual",
                     "TENSORHUB_NAME": f"vllm-{kind}", "TENSORHUB_QUANTIZED_LAYOUT": layout})
            servers.append(engines[kind])
            engines[kind].start(timeout=600)
            engines[kind].wait_serving(1, timeout=300)
        live = {kind: sum(e.live_bytes()[0].values()) for kind, e in engines.items()}
        print("live parameters:", {k: f"{v / MiB:.0f} MiB" for k, v in live.items()},
              engines["fp8"].live_bytes()[0])

        pulled: dict[str, list[int]] = {k: [] for k in engines}
        stall: dict[str, list[float]] = {k: [] for k in engines}
        check: dict[str, list[float]] = {k: [] for k in engines}
        quantize_ms: list[float] = []
        for version in range(2, args.updates + 2):
            with torch.no_grad():
                for t in state.values():
                    t.add_(0.001)
            started = time.perf_counter()
            quantize_named(state.items(), "fp8_per_channel")
            quantize_ms.append((time.perf_counter() - started) * 1e3)
            assert publisher.publish(state) == version
            for kind, engine in engines.items():
                reply = engine.request("/tensorhub/update", {"version": version})
                assert reply["version"] == version and reply["changed"], reply
                stall[kind].append(reply["stall_ms"])
                status = engine.tensorhub_status()
                check[kind].append(status["last_update"]["check_ms"])
                worker = status["workers"][0]
                pulled[kind].append(engine_figures(address, worker, version)[0])
            print(f"v{version}: " + "; ".join(
                f"{k} pulled {pulled[k][-1] / MiB:.0f} MiB, stall {stall[k][-1]:.0f} ms"
                for k in engines))

        # 1 % steps: that share of each tensor's elements moves by one bf16 step
        g = torch.Generator().manual_seed(0)
        step_stall: dict[str, list[float]] = {k: [] for k in engines}
        for version in range(args.updates + 2, 2 * args.updates + 2):
            next_version(state, 0.01, g)
            assert publisher.publish(state) == version
            for kind, engine in engines.items():
                reply = engine.request("/tensorhub/update", {"version": version})
                assert reply["version"] == version and reply["changed"], reply
                step_stall[kind].append(reply["stall_ms"])
            print(f"v{version} (1 % step): " + "; ".join(
                f"{k} stall {step_stall[k][-1]:.0f} ms" for k in engines))

        save_file({n: t.contiguous() for n, t in state.items()},
                  str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        reload_stall = []
        for _ in range(args.updates):
            started = time.perf_counter()
            engines["fp8"].reload_from_disk(model_dir)
            reload_stall.append((time.perf_counter() - started) * 1e3)

        med = statistics.median
        for kind in engines:
            report.add(f"{kind} engine, {label}: bytes pulled per version",
                       med(pulled[kind]) / MiB, "MiB",
                       f"the {kind} engine's live parameters (what it serves from)",
                       live[kind] / MiB, higher_is_better=False)
        for kind in ("fp8", "fp8-once"):
            report.add(f"{kind} engine, {label}: bytes pulled per version (against the bf16 "
                       f"engine; goal: at most 0.55 of its bytes, a ratio of 1.82 or more)",
                       med(pulled[kind]) / MiB, "MiB",
                       "the bf16 engine pulls", med(pulled["bf16"]) / MiB,
                       higher_is_better=False)
        for kind in engines:
            copy = model_bytes if kind != "fp8-once" else sum(
                t.numel() * t.element_size() for _, t in quantize_named(state.items(),
                                                                       "fp8_per_channel"))
            held = copy + live[kind]
            report.add(f"{kind} engine, {label}: weights held in host memory (copy + live)",
                       held / MiB, "MiB", f"the {kind} engine's live parameters alone",
                       live[kind] / MiB, higher_is_better=False)
        for kind in ("fp8", "fp8-once"):
            report.add(f"{kind} engine, {label}: stall per version", med(stall[kind]), "ms",
                       "the bf16 engine's stall", med(stall["bf16"]), higher_is_better=False)
        for kind, how in (("fp8", "re-quantized in the engine, written whole"),
                          ("fp8-once", "quantized by the trainer, installed sparse")):
            report.add(f"{kind} engine, {label}: stall of a 1 % step ({how})",
                       med(step_stall[kind]), "ms", f"the {kind} engine's stall of a whole "
                       f"version", med(stall[kind]), higher_is_better=False)
        report.add(f"fp8 engine, {label}: check before the pause (verified and quantized, "
                   f"while it generates)", med(check["fp8"]), "ms",
                   "the bf16 engine's check (verified)", med(check["bf16"]),
                   higher_is_better=False)
        report.add(f"fp8-once engine, {label}: check before the pause (verified; nothing "
                   f"to quantize)", med(check["fp8-once"]), "ms",
                   "the fp8 engine's check (verified and quantized)", med(check["fp8"]),
                   higher_is_better=False)
        report.add(f"trainer, {label}: quantizing a version once, for every fp8 engine "
                   f"(the trainer's CPU)", med(quantize_ms), "ms",
                   "one fp8 engine's check, which quantizes it again in each engine",
                   med(check["fp8"]), higher_is_better=False)
        report.add(f"fp8 engine, {label}: stall per version (against vLLM's own reload)",
                   med(stall["fp8"]), "ms",
                   "vLLM reload_weights from safetensors on the fp8 engine",
                   med(reload_stall), higher_is_better=False)
        report.write()
    finally:
        tear_down(servers, publisher, coordinator, work)


if __name__ == "__main__":
    main()
