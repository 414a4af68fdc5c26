"""What a real RL step changes in an fp8 engine's weights: the case for quantizing once and
moving fp8 patches, measured before building it.

A bf16 transformer trained with AdamW at RL learning rates (`tensorhub/tools/synthetic_weights.py`),
warmed up 3 steps; each following step's 2-D weights are quantized before and after with each
recipe the engines run (`tensorhub.quant`: vLLM per-channel and 128 x 128 block, SGLang block
with UE8M0 scales, each byte-equal to its engine's own function on CPU). Per step:

- density: the share of bf16 words the step changed, against the share of fp8 bytes and of
  scales it changed once quantized (fp8 is coarser: most one-ulp bf16 moves quantize to the
  same byte);
- what an install that re-quantizes only what changed would redo: the share of channels
  (per-channel) or 128 x 128 blocks (block recipes) with any changed bf16 word;
- patch bytes (TensorHub's codec, `core/patch.py`) of the fp8 step (values and scales)
  against the bf16 step's patch and against the whole fp8 weights;
- an fp8 engine's install, on this CPU: quantizing every weight (what vLLM's reload does
  inside the pause today) and writing only the changed fp8 bytes, beside a memcpy of the
  fp8 weights (the bound).

Run: python -m bench.quantized_steps [--size-mb 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.results import Report, median_seconds
from tensorhub.core.patch import PatchWriter
from tensorhub.quant.fp8 import BLOCK, Fp8Weight
from tensorhub.quant.sglang_fp8 import sglang_block_ue8m0
from tensorhub.quant.vllm_fp8 import vllm_block, vllm_per_channel
from tensorhub.tools.synthetic_weights import AdamWSteps

RECIPES: dict[str, Callable[[torch.Tensor], Fp8Weight]] = {
    "vLLM fp8 per channel": vllm_per_channel,
    "vLLM fp8 128x128 block": vllm_block,
    "SGLang fp8 block (UE8M0 scales)": sglang_block_ue8m0,
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _patch_bytes(old: list[torch.Tensor], new: list[torch.Tensor]) -> int:
    writer = PatchWriter(1, 2, "bench")
    for k, (a, b) in enumerate(zip(old, new, strict=True)):
        writer.item(k, _bytes(a), _bytes(b))
    return len(writer.finish())


def _touched(changed: torch.Tensor, per_channel: bool) -> tuple[int, int]:
    """(units with a changed word, units): rows, or 128 x 128 blocks (edges padded)."""
    if per_channel:
        return int(changed.any(1).sum()), changed.shape[0]
    rows, cols = changed.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK, dtype=torch.bool)
    padded[:rows, :cols] = changed
    blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK).any(3).any(1)
    return int(blocks.sum()), blocks.numel()


def measure(report: Report, size_mb: float, steps: int, lr: float) -> None:
    trainer = AdamWSteps(size_mb, lr)
    for _ in range(3):  # AdamW's first steps change nearly every element
        trainer.step()
    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    for _ in range(steps):
        old = {n: t.clone() for n, t in trainer.state_dict().items() if t.dim() == 2}
        trainer.step()
        new = {n: t for n, t in trainer.state_dict().items() if t.dim() == 2}
        changed = {n: new[n].view(torch.int16) != old[n].view(torch.int16) for n in new}
        words = sum(c.numel() for c in changed.values())
        note("bf16", sum(int(c.sum()) for c in changed.values()) / words)
        bf16_patch = _patch_bytes(list(old.values()), list(new.values()))
        note("bf16 patch", bf16_patch)
        for recipe, quantize in RECIPES.items():
            before = [quantize(old[n]) for n in new]
            after = [quantize(new[n]) for n in new]
            fp8_bytes = sum(q.weight.numel() + q.scale.numel() * 4 for q in after)
            note(f"{recipe} values", sum(int((_bytes(a.weight) != _bytes(b.weight)).sum())
                                         for a, b in zip(before, after, strict=True))
                 / sum(q.weight.numel() for q in after))
            note(f"{recipe} scales", sum(int((a.scale != b.scale).sum())
                                         for a, b in zip(before, after, strict=True))
                 / sum(q.scale.numel() for q in after))
            touched = [_touched(c, recipe.endswith("channel")) for c in changed.values()]
            note(f"{recipe} touched", sum(t for t, _ in touched) / sum(n for _, n in touched))
            patch = _patch_bytes([q.weight for q in before] + [q.scale for q in before],
                                 [q.weight for q in after] + [q.scale for q in after])
            note(f"{recipe} patch", patch)
            note(f"{recipe} fp8 bytes", fp8_bytes)
    model = f"AdamW bf16 step at lr {lr:g} ({size_mb:.0f} MiB)"
    density = statistics.mean(figures["bf16"])
    report.add(f"{model}: bf16 words changed", density, "")
    for recipe in RECIPES:
        values = statistics.mean(figures[f"{recipe} values"])
        report.add(f"{model}, {recipe}: fp8 bytes changed", values, "", "bf16 words changed",
                   density, higher_is_better=False)
        report.add(f"{model}, {recipe}: scales changed",
                   statistics.mean(figures[f"{recipe} scales"]), "")
        unit = "channels" if recipe.endswith("channel") else "128x128 blocks"
        report.add(f"{model}, {recipe}: {unit} with a changed bf16 word",
                   statistics.mean(figures[f"{recipe} touched"]), "")
        patch = statistics.mean(figures[f"{recipe} patch"])
        report.add(f"{model}, {recipe}: fp8 patch bytes", patch / 2**20, "MiB",
                   "the bf16 step's patch", statistics.mean(figures["bf16 patch"]) / 2**20,
                   higher_is_better=False)
        report.add(f"{model}, {recipe}: fp8 patch bytes (against the whole fp8 weights)",
                   patch / 2**20, "MiB", "the whole fp8 weights and scales",
                   statistics.mean(figures[f"{recipe} fp8 bytes"]) / 2**20,
                   higher_is_better=False)
        print(f"{model}, {recipe}: bf16 {density:.4f}, fp8 values {values:.4f}", flush=True)


def install_costs(report: Report, size_mb: float, lr: float) -> None:
    """An fp8 engine's install of one step, per-channel: every weight quantized again (what
    the reload does inside the pause) against a write of only the fp8 bytes that changed,
    beside a memcpy of the fp8 weights."""
    trainer = AdamWSteps(size_mb, lr)
    for _ in range(4):
        trainer.step()
    weights = [t.clone() for t in trainer.state_dict().values() if t.dim() == 2]
    live = [vllm_per_channel(w).weight for w in weights]
    trainer.step()
    new = [t for t in trainer.state_dict().values() if t.dim() == 2]
    quantized = [vllm_per_channel(w).weight for w in new]
    where = [torch.nonzero(_bytes(a) != _bytes(b)).reshape(-1)
             for a, b in zip(live, quantized, strict=True)]
    values = [_bytes(q)[i] for q, i in zip(quantized, where, strict=True)]
    targets = [_bytes(t).clone() for t in live]
    fp8_mib = sum(t.numel() for t in targets) / 2**20
    copy = [torch.empty_like(t) for t in targets]

    def requantize() -> None:
        for w in new:
            vllm_per_channel(w)

    def scatter() -> None:
        for t, i, v in zip(targets, where, values, strict=True):
            t[i] = v

    def memcpy() -> None:
        for dst, src in zip(copy, targets, strict=True):
            dst.copy_(src)

    bound = median_seconds(memcpy, 5) * 1e3
    name = f"fp8 per-channel engine, {fp8_mib:.0f} MiB of fp8 weights, a step at lr {lr:g}"
    report.add(f"{name}: every weight quantized again (today's install)",
               median_seconds(requantize, 3) * 1e3, "ms", "a memcpy of the fp8 weights", bound,
               higher_is_better=False)
    report.add(f"{name}: only the changed fp8 bytes written",
               median_seconds(scatter, 5) * 1e3, "ms", "a memcpy of the fp8 weights", bound,
               higher_is_better=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = Report("quantized_steps")
    started = time.perf_counter()
    for lr in (1e-6, 1e-5):
        measure(report, args.size_mb, args.steps, lr)
    install_costs(report, args.size_mb, 1e-6)
    print(f"({time.perf_counter() - started:.0f} s)")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
