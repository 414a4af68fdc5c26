"""Ranks of one engine as threads, for tests of what the ranks agree on."""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_every_rank(run: Callable[[int], None], ranks: int, timeout: float = 30.0) -> None:
    """Run `run(rank)` for every rank at once, each in a thread, as an engine's workers do,
    and wait for all of them."""
    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
