"""A benchmark run's scratch folder (models, checkpoints, engine logs) and its teardown:
made at the start, removed when the run ends (kept with TENSORHUB_BENCH_KEEP=1 to read the
logs), after every process the run started has stopped."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

KEEP_ENV = "TENSORHUB_BENCH_KEEP"


def make_scratch(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"tensorhub-bench-{name}-"))


def remove_scratch(work: Path) -> None:
    """Call in the run's `finally`, after its servers have stopped."""
    if os.environ.get(KEEP_ENV) == "1":
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def tear_down(servers: list, publisher, coordinator, work: Path) -> None:
    """Stop the engine servers, close the trainer, stop the coordinator, drop the folder."""
    for server in servers:
        server.stop()
    if publisher is not None:
        publisher.close()
    coordinator.stop()
    remove_scratch(work)
