"""Test-only faults, loaded by an engine whose PYTHONPATH starts with this folder. No
product code knows of them: they wrap `CheckpointCopy` once its module loads.

- `TENSORHUB_TEST_FAULT_LOAD`: while the file it names holds a version number, the engine's
  load of that version fails half-way through its tensors, as a bug in a model's
  `load_weights` would. The layers before it then hold the new version: what the engine
  does next is under test.
- `TENSORHUB_TEST_FAULT_REFUSE` ("<version>@<name suffix>"): the checkpoint copy of the
  worker whose name ends so refuses that version, as a copy that failed verification would.
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
TARGET = "tensorhub.engines.checkpoint_copy"


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


class WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULT_FILE or REFUSE:
    sys.meta_path.insert(0, WrapOnImport())
