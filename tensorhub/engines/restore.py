"""A load that fails half-way is undone before the engine answers again.

The checks before a swap (`weights_check`, the ranks' vote) refuse every version an engine
cannot load, so a load that still fails half-way is a bug, not bad input. The model then
holds parts of two versions. The engine loads a whole version again at once: the one it
served before, from its checkpoint copy or, as that copy now holds the failed version, from
its peers; where no peer holds it any more (a fleet that moved on together), or the engine
had applied no version yet, the checkpoint it started from. Only if that fails too are the
weights torn: the engine then keeps generation paused (torn weights are never served)
until a whole version is loaded.

The outcome travels to the engine's front end in the error's words (an engine re-raises a
worker's error as text): `RESTORED` or `TORN` is in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, NoReturn

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.holder import TornLoad

log = logging.getLogger("tensorhub.engines")

RESTORED = "restored the version it served before"
RESTORED_CHECKPOINT = "restored the checkpoint it started from"
TORN = "the weights are torn"


def restore_after(torn: TornLoad, previous: int | None, load_version: Callable[[int], None],
                  load_disk: Callable[[], None] | None) -> NoReturn:
    """After `torn`, load a whole version: `previous` (`load_version`, from the copy or
    peers), else the checkpoint on disk (`load_disk`, None: there is none). Raises what
    happened: code "restored" (the words say which was loaded), or "torn" if none was."""
    tries: list[tuple[str, str, Callable[[], None]]] = []
    if previous is not None:
        tries.append((f"v{previous}", RESTORED, lambda: load_version(previous)))
    if load_disk is not None:
        tries.append(("the checkpoint it started from", RESTORED_CHECKPOINT, load_disk))
    log.error("%s; restoring %s before the engine answers again", torn,
              " or ".join(what for what, _, _ in tries) or "nothing (none to restore)")
    failures = []
    for what, words, load in tries:
        try:
            load()
        except Exception as exc:
            log.error("restoring %s failed: %s", what, exc)
            failures.append(f"restoring {what} failed ({exc})")
            continue
        log.warning("%s (%s) after a load that failed half-way", words, what)
        raise TensorHubError(f"{torn}; {words} ({what})", code="restored") from torn
    log.error("%s; generation stays paused until a whole version is loaded", TORN)
    raise TensorHubError(f"{torn}; {'; '.join(failures) or 'nothing to restore'}: {TORN}",
                         code="torn") from torn


def outcome_in(message: str) -> Literal["restored", "restored_checkpoint", "torn"] | None:
    """Whether an error's words say a failed load was undone (by the version served
    before, or by the checkpoint the engine started from) or left the weights torn."""
    if TORN in message:
        return "torn"
    if RESTORED_CHECKPOINT in message:
        return "restored_checkpoint"
    if RESTORED in message:
        return "restored"
    return None
