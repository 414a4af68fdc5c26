"""A load that fails half-way is undone before the engine answers again.

The checks before a swap (`weights_check`, the ranks' vote) refuse every version an engine
cannot load, so a load that still fails half-way is a bug, not bad input. The model then
holds parts of two versions. The engine loads a whole version again at once: the one it
served before, from its checkpoint copy or, as that copy now holds the failed version, from
its peers; where no peer holds it any more (a fleet that moved on together), or the engine
had applied no version yet, the checkpoint it started from. Only if that fails too are the
weights torn: the engine then keeps generation paused (torn weights are never served)
until a whole version is loaded.

The outcome travels to the engine's front end typed (`outcome.LoadOutcome`, in each
plugin's channel from its workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

from tensorhub.engines.checkpoint_copy import TornLoad
from tensorhub.engines.outcome import InstallFailed

log = logging.getLogger("tensorhub.engines")

def restore_after(torn: TornLoad, previous: int | None, load_version: Callable[[int], None],
                  load_disk: Callable[[], None] | None) -> NoReturn:
    """After `torn`, load a whole version: `previous` (`load_version`, from the copy or
    peers), else the checkpoint on disk (`load_disk`, None: there is none). Raises what
    happened as `InstallFailed`: kind "restored" or "restored_checkpoint", or "torn" if
    neither could be loaded."""
    tries: list[tuple[str, str, Callable[[], None]]] = []
    if previous is not None:
        tries.append((f"the version it served before (v{previous})", "restored",
                      lambda: load_version(previous)))
    if load_disk is not None:
        tries.append(("the checkpoint it started from", "restored_checkpoint", load_disk))
    log.error("%s; restoring %s before the engine answers again", torn,
              " or ".join(what for what, _, _ in tries) or "nothing (none to restore)")
    failures = []
    for what, kind, load in tries:
        try:
            load()
        except Exception as exc:
            log.error("restoring %s failed: %s", what, exc)
            failures.append(f"restoring {what} failed ({exc})")
            continue
        log.warning("restored %s after a load that failed half-way", what)
        raise InstallFailed.of(kind, torn.version, f"{torn}; restored {what}") from torn
    log.error("the weights are torn; generation stays paused until a whole version is loaded")
    raise InstallFailed.of("torn", torn.version,
                           f"{torn}; {'; '.join(failures) or 'nothing to restore'}: the "
                           f"weights are torn") from torn
