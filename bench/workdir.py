"""A benchmark run's scratch folder (models, checkpoints, engine logs) and its teardown:
made at the start, removed when the run ends (kept with TENSORHUB_BENCH_KEEP=1 to read the
logs), after every process the run started has stopped, with the /dev/shm segments its
engines left and no live process uses (`tensorhub_testing.shared_memory`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tensorhub_testing import shared_memory

KEEP_ENV = "TENSORHUB_BENCH_KEEP"
_SHM_BEFORE: dict[Path, set[str]] = {}  # a scratch folder -> the segments there before it


def make_scratch(name: str) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f"tensorhub-bench-{name}-"))
    _SHM_BEFORE[work] = shared_memory.names()
    return work


def remove_scratch(work: Path) -> None:
    """Call in the run's `finally`, after its servers have stopped."""
    if os.environ.get(KEEP_ENV) == "1":
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if work in _SHM_BEFORE:
        shared_memory.remove_unused(_SHM_BEFORE.pop(work))


def tear_down(servers: list, publisher, coordinator, work: Path) -> None:
    """Stop the engine servers, close the trainer, stop the coordinator, drop the folder."""
    for server in servers:
        server.stop()
    if publisher is not None:
        publisher.close()
    coordinator.stop()
    remove_scratch(work)
