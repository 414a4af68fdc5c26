"""Test-only faults, loaded by an engine whose PYTHONPATH starts with this folder. No
product code knows of them: they wrap `CheckpointCopy` once its module loads.

- `TENSORHUB_TEST_FAULT_LOAD`: while the file it names holds a version number, the engine's
  load of that version fails half-way through its tensors, as a bug in a model's
  `load_weights` would. The layers before it then hold the new version: what the engine
  does next is under test.
- `TENSORHUB_TEST_FAULT_REFUSE` ("<version>@<name suffix>"): the checkpoint copy of the
  worker whose name ends so refuses that version, as a copy that failed verification would.
- `TENSORHUB_TEST_FREEZE`: once the file it names exists, vLLM's engine core pauses its
  scheduler as vLLM's `keep` pause does (requests stay where they are, with their KV) right
  after the first step at which a request in flight has produced a token, and removes the
  file: a request is frozen after its first token however late the test gets there. The
  next resume (a swap's, or `/resume`) ends the freeze.
- `TENSORHUB_TEST_SKEW_SHARE`: while the file it names exists, a checkpoint copy that pulls
  a node's share of a version in tiles pulls the other tiles instead (and the part every
  rank loads whole), as a rule that misjudged which rows the engine's ranks load would.
- `TENSORHUB_TEST_CHECKPOINT_LAYOUT=1`: vLLM's CPU build keeps its linear weights as it
  loaded them and multiplies with `torch.nn.functional.linear`, instead of repacking them for
  its CPU GEMMs: the live weights keep the checkpoint's layout, as vLLM's on a GPU do. The
  CPU twin of a GPU engine for what writes into live weights (a sparse install).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

FAULT_FILE = os.environ.get("TENSORHUB_TEST_FAULT_LOAD")
REFUSE = os.environ.get("TENSORHUB_TEST_FAULT_REFUSE")
FREEZE_FILE = os.environ.get("TENSORHUB_TEST_FREEZE")
SKEW_FILE = os.environ.get("TENSORHUB_TEST_SKEW_SHARE")
CHECKPOINT_LAYOUT = os.environ.get("TENSORHUB_TEST_CHECKPOINT_LAYOUT") == "1"


def faulty_version() -> int | None:
    try:
        return int(Path(FAULT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


class HalfWay:
    """A version's tensors that fail after half of them were handed out."""

    def __init__(self, named: list) -> None:
        self.named = named

    def __iter__(self):
        for i, item in enumerate(self.named):
            if i == len(self.named) // 2:
                raise RuntimeError("test fault: load_weights failed half-way")
            yield item


def refused(name: str, version: int) -> bool:
    wanted, _, suffix = (REFUSE or "").partition("@")
    return bool(REFUSE) and wanted == str(version) and name.endswith(suffix)


def wrap(module) -> None:
    holder = module.CheckpointCopy
    original, not_ready = holder.tensors_of, holder._not_ready

    @contextmanager
    def tensors_of(self, version, *args, **kwargs):
        with original(self, version, *args, **kwargs) as named:
            yield HalfWay(named) if FAULT_FILE and version == faulty_version() else named

    def refusing(self, version, *args, **kwargs):
        problem = not_ready(self, version, *args, **kwargs)
        if problem is None and refused(self.name, version):
            return module.TensorHubError(f"{self.name}: refusing v{version} (test fault)",
                                         code="refused")
        return problem

    holder.tensors_of = tensors_of
    holder._not_ready = refusing


def freezing(module, step):
    """`step` of vLLM's `EngineCore`, then the freeze (`TENSORHUB_TEST_FREEZE`)."""
    def frozen_after(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        if os.path.exists(FREEZE_FILE) and any(
                r.num_output_tokens for r in self.scheduler.running):
            self.scheduler.set_pause_state(module.PauseState.PAUSED_ALL)
            Path(FREEZE_FILE).unlink(missing_ok=True)
        return result

    return frozen_after


def freeze_after_a_first_token(module) -> None:
    core = module.EngineCore
    for name in ("step", "step_with_batch_queue"):
        setattr(core, name, freezing(module, getattr(core, name)))


class WrapOnImport(importlib.abc.MetaPathFinder):
    """Calls `wrap(module)` once the module named `target` has loaded."""

    def __init__(self, target: str, wrap) -> None:
        self.target, self.wrap = target, wrap

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            self.wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def skew(module) -> None:
    replica = module.PartedReplica
    wanted = replica.wanted

    def skewed(self, parts, manifest):
        mine, tiles = wanted(self, parts, manifest), manifest.tiles
        if self.share is None or tiles is None or not os.path.exists(SKEW_FILE) \
                or len(mine) == parts:
            return mine
        return (set(range(tiles)) - mine) | {tiles}

    replica.wanted = skewed


def keep_checkpoint_layout(module) -> None:
    """vLLM's `dispatch_cpu_unquantized_gemm`, as it falls back where no CPU GEMM applies:
    the weight kept, `torch.nn.functional.linear` on it."""
    import torch

    def dispatch(layer, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    module.dispatch_cpu_unquantized_gemm = dispatch


if CHECKPOINT_LAYOUT:
    sys.meta_path.insert(0, WrapOnImport("vllm.model_executor.layers.utils",
                                         keep_checkpoint_layout))
if SKEW_FILE:
    sys.meta_path.insert(0, WrapOnImport("tensorhub.parted", skew))
if FAULT_FILE or REFUSE:
    sys.meta_path.insert(0, WrapOnImport("tensorhub.engines.checkpoint_copy", wrap))
if FREEZE_FILE:
    sys.meta_path.insert(0, WrapOnImport("vllm.v1.engine.core", freeze_after_a_first_token))
