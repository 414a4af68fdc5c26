"""TensorHub's work beside an engine yields the CPU to the engine's own.

Inside an engine's processes TensorHub pulls the next version, verifies it and checks it
against the live weights while the engine generates. Where the two compete for cores (an
engine on a CPU host, or a GPU engine's scheduler thread, which launches every kernel),
whatever delays a step of the engine's is a gap its clients feel. So the threads that do
that work run at a lower priority (`TENSORHUB_BACKGROUND_NICE`): the kernel's scheduler
shares a busy core by weight, and a thread at nice 10 weighs about a tenth of one at 0,
so it takes the cycles the engine leaves idle and little else.

Linux keeps a nice value per thread, and a thread (an OpenMP team, a pool's workers) that
a thread starts inherits it, so this is called once at the top of each such thread. Work
inside a pause (the install) is never lowered: nothing competes with it then, and the
engine waits for it.
"""

from __future__ import annotations

import logging
import os
import threading

from tensorhub import settings

log = logging.getLogger("tensorhub.engines")


def yield_to_engine() -> int | None:
    """Lower the calling thread's CPU priority to `TENSORHUB_BACKGROUND_NICE` (never raise
    it: a thread already lower stays so). Returns the thread's nice value now, or None
    where it could not be read or set (not Linux, or refused): the work then runs at the
    engine's priority, which costs latency, never correctness."""
    wanted = settings.BACKGROUND_NICE.get()
    try:
        thread = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, thread)
        if wanted > now:
            os.setpriority(os.PRIO_PROCESS, thread, wanted)
            now = wanted
        return now
    except (AttributeError, OSError) as exc:
        log.debug("TensorHub: could not lower the priority of %s: %s",
                  threading.current_thread().name, exc)
        return None
