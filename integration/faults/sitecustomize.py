"""Test-only fault, loaded by an engine whose PYTHONPATH starts with this folder: while the
file named by `TENSORHUB_TEST_FAULT_LOAD` holds a version number, the engine's load of that
version fails half-way through its tensors, as a bug in a model's `load_weights` would. The
layers before it then hold the new version: what the engine does next is under test. No
product code knows of it: it wraps `CheckpointHolder.tensors_of` once that module loads.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

FAULT_FILE = os.environ.get("TENSORHUB_TEST_FAULT_LOAD")
TARGET = "tensorhub.engines.holder"


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


def wrap(module) -> None:
    original = module.CheckpointHolder.tensors_of

    @contextmanager
    def tensors_of(self, version, *args, **kwargs):
        with original(self, version, *args, **kwargs) as named:
            yield HalfWay(named) if version == faulty_version() else named

    module.CheckpointHolder.tensors_of = tensors_of


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


if FAULT_FILE:
    sys.meta_path.insert(0, WrapOnImport())
