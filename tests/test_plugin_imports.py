"""The engine plugins build on the engine API alone: they import from `tensorhub.engines`
the names it declares public (`__all__`) and from `tensorhub` its top-level public API,
never `tensorhub.core` or `tensorhub.coordinator` (whose messages and clients may change
under them)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tensorhub
import tensorhub.engines

ROOT = Path(__file__).resolve().parents[1]
# Modules of `tensorhub` a plugin may use besides the two public surfaces: the metrics an
# engine serves, the Ray cluster's coordinator actor (verl), the settings, and the
# reference quantizers (an fp8 engine quantizes with them).
OTHER_MODULES = {"tensorhub.metrics", "tensorhub.ray_coordinator", "tensorhub.settings",
                 "tensorhub.quant"}
PUBLIC = {"tensorhub": set(tensorhub.__all__) | {m.rsplit(".", 1)[1] for m in OTHER_MODULES},
          "tensorhub.engines": set(tensorhub.engines.__all__)}


def imports_beyond_the_api(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "tensorhub" and a.name not in OTHER_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "tensorhub":
            if node.module in OTHER_MODULES:
                continue
            allowed = PUBLIC.get(node.module, set())
            found += [f"{where} from {node.module} import {a.name}" for a in node.names
                      if a.name not in allowed]
    return found


def test_plugins_import_only_the_engine_api_and_tensorhubs_public_one():
    files = sorted((ROOT / "tensorhub_plugins").rglob("*.py"))
    assert len(files) > 10
    assert [hit for f in files for hit in imports_beyond_the_api(f)] == []


def test_the_walk_catches_a_core_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("from tensorhub.core.client import CoordinatorClient\n"
                   "from tensorhub.engines.checkpoint_copy import CheckpointCopy\n"
                   "import tensorhub.coordinator.server\n"
                   "from tensorhub.engines import FleetView\n")
    assert imports_beyond_the_api(bad) == [
        "bad.py:1 from tensorhub.core.client import CoordinatorClient",
        "bad.py:2 from tensorhub.engines.checkpoint_copy import CheckpointCopy",
        "bad.py:3 import tensorhub.coordinator.server"]
