"""A benchmark's scratch folder (models, checkpoints, engine logs): made at the start,
removed when the run ends, kept with TENSORHUB_BENCH_KEEP=1 to read the logs."""

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
