"""How long a vLLM worker busy-waits for its next call (`TENSORHUB_WORKER_SPIN`).

vLLM's workers read their calls from a shared-memory ring buffer and, after each call, spin
on it (yielding the core between looks) for a second before they sleep on a socket
(`shm_broadcast.SpinCondition.busy_loop_s`). A swap is a handful of calls, so every worker
of every engine that swaps spins a core for about a second after it. Where engines share
cores, that second is taken from the other engines' front ends and engine cores, whose
calls then wait for a core: swaps of a tiny model that take up to a second. A short spin
keeps the worker's reply to a call in flight as quick (it is already looking) and costs a
call that arrives after a longer gap only the socket's wake-up.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tensorhub.vllm")


def shorten_worker_spin(seconds: float) -> bool:
    """Make every ring-buffer reader this process creates from now on spin at most
    `seconds` after a call. Whether this vLLM has the spin to shorten."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    init = SpinCondition.__init__
    if getattr(init, "tensorhub_spin", None) == seconds:
        return True

    original = getattr(init, "__wrapped__", init)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = min(self.busy_loop_s, seconds)

    __init__.__wrapped__ = original
    __init__.tensorhub_spin = seconds
    SpinCondition.__init__ = __init__
    return True
