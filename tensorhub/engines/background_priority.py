"""TensorHub's work beside an engine yields the CPU to the engine's own.

Inside an engine's processes TensorHub pulls the next version, verifies it and checks it
against the live weights while the engine generates. Where the two compete for cores (an
engine on a CPU host, or a GPU engine's scheduler thread, which launches every kernel),
whatever delays a step of the engine's is a gap its clients feel. So the threads that do
that work may run at a lower priority (`TENSORHUB_BACKGROUND_NICE`): the kernel's scheduler
shares a busy core by weight, and a thread at nice 10 weighs about a tenth of one at 0,
so it takes the cycles the engine leaves idle and little else. It is off by default: an
engine at full load then checks and serves each version later, by more than it gains in
its clients' gaps where the engine's prefills, not TensorHub, make the worst ones
(`bench/results/engine_pause.md`).

Linux keeps a nice value per thread, and a thread (an OpenMP team, a pool's workers) that
a thread starts inherits it, so this is called once at the top of each such thread. Work
inside a pause (the install, a repair's pull) runs in the engine's own threads and is never
lowered. A lowered thread may still hold a lock a swap takes (the copy's, while it pulls or
checks; the native holder's, while it packs): a swap starts only once the copy's check is
done, so this waits only where a version came in during the pack or a repair needs the copy,
and then on a thread that runs whenever a core is idle: the engine's own are paused.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from tensorhub import settings

log = logging.getLogger("tensorhub.engines")


def yield_to_engine() -> int | None:
    """Lower the calling thread's CPU priority to `TENSORHUB_BACKGROUND_NICE` (never raise
    it: a thread already lower stays so). Returns the thread's nice value now, or None
    where it could not be read or set (not Linux, or refused): the work then runs at the
    engine's priority, which costs latency, never correctness."""
    if not sys.platform.startswith("linux"):  # (elsewhere a thread id is no process id)
        return None
    try:
        wanted = settings.BACKGROUND_NICE.get()
    except settings.SettingError as exc:  # (never fail the thread it is called in)
        log.warning("TensorHub: %s; its threads run at the engine's priority", exc)
        return None
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
