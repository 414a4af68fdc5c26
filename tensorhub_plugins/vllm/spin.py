"""How long a vLLM worker busy-waits for its next call (`TENSORHUB_WORKER_SPIN`).

vLLM's workers read their calls from a shared-memory ring buffer and, after each call, spin
on it (yielding the core between looks) for a second before they sleep on a socket
(`shm_broadcast.SpinCondition.busy_loop_s`). A swap is a handful of calls, so every worker
of every engine that swaps spins a core for about a second after it. Where engines share
cores, that second is taken from the other engines' front ends and engine cores, whose
calls then wait for a core: swaps of a tiny model that take up to a second. A short spin
still catches a call that follows the last read within it; one that comes later (counted
from the read, not from the end of the call) costs the wake-up of a socket poll.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tensorhub.vllm")


def shorten_worker_spin(seconds: float) -> bool:
    """Make every ring-buffer reader this process creates from now on (a worker's call
    queue, the engine core's reply queue) spin `seconds` after each read. Whether this vLLM
    has the spin to set."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    init = SpinCondition.__init__
    if getattr(init, "tensorhub_spin", None) == seconds:
        return True

    original = init.__wrapped__ if hasattr(init, "tensorhub_spin") else init

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = seconds

    __init__.__wrapped__ = original
    __init__.tensorhub_spin = seconds
    SpinCondition.__init__ = __init__
    return True
