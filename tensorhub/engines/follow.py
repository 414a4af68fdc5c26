"""Follow mode, the same for every engine: watch for a version to swap to, swap, and back
off after a version that failed.

Each try pauses generation, so a version whose swap failed is tried again only after
`settings.RETRY_REFUSED` seconds, and never again once the engine has said it cannot load it (its
tensors do not fit the model, or its load failed half-way: `never_again`). Weights left
torn are repaired first, by loading the version served before again, every
`settings.RETRY_REFUSED` seconds until that succeeds. A failure is logged once and the engine keeps
serving what it has; the loop never dies.

What is engine-specific is passed in (`Followed`): which version to take next and how, the
swap itself, and the repair. Each may be a plain function (SGLang's driver thread) or a
coroutine function (vLLM's front end, on its server's event loop).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tensorhub import settings

log = logging.getLogger("tensorhub.engines")

Update = tuple[int, str]  # (version, the engine's path to it)


class Followed(Protocol):
    """An engine's front end, as follow mode sees it."""

    serving: int | None  # the version it serves (None: the weights it started with)
    torn: dict | None  # set while its weights are torn (generation paused)
    last_error: str | None

    def next_update(self) -> Any:
        """The `Update` to take now, or None (nothing newer, or not yet)."""

    def swap_to(self, update: Update) -> Any:
        """Serve `update`'s version; raises if it could not."""

    def repair(self) -> Any:
        """Load the version served before again, whole (from peers if need be)."""

    # Optional: `pending: bool` says the copy is pulling a newer version.


async def _done(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


class PendingPulls:
    """Whether an engine's copy is pulling a version newer than it holds, for at most
    `settings.POLL_PENDING_FOR` seconds per version (a copy that cannot get a version must
    not have its front end ask the coordinator at the fast rate for ever)."""

    def __init__(self) -> None:
        self._seen: tuple[int, float] | None = None  # (newest version, when first seen)

    def pending(self, latest: int, held: int | None) -> bool:
        if latest <= (held or 0):
            return False
        if self._seen is None or self._seen[0] != latest:
            self._seen = (latest, time.monotonic())
        return time.monotonic() - self._seen[1] < settings.POLL_PENDING_FOR


class FollowLoop:
    def __init__(self, engine: Followed, poll_interval: float,
                 news: Callable[[float], Awaitable[bool]] | None = None):
        """`news(timeout)`: waits at most `timeout` for the coordinator's announcement of a
        version (`FleetView.news`), so a look follows a publish at once."""
        self.engine = engine
        self.poll_interval = poll_interval
        self.news = news
        self._retry_at: dict[int, float] = {}  # a version whose swap failed: not before
        self._repair_at = 0.0  # torn weights: the next try to load the served version again

    def backing_off(self, version: int) -> bool:
        """Whether a swap to `version` failed and is not to be tried again yet (or ever)."""
        return time.monotonic() < self._retry_at.get(version, 0.0)

    def never_again(self, version: int) -> None:
        """The engine cannot load `version`: it is never tried again."""
        self._retry_at[version] = float("inf")

    async def step(self) -> None:
        """One look: repair torn weights, then swap to the next version if it is time."""
        engine = self.engine
        try:
            if engine.torn is not None and engine.serving is not None and \
                    time.monotonic() >= self._repair_at:
                self._repair_at = time.monotonic() + settings.RETRY_REFUSED
                await _done(engine.repair())
            update = await _done(engine.next_update())
            if update is not None and self.backing_off(update[0]):
                return  # (still refused: why stays in `last_error` until it is served)
            if update is not None:
                try:
                    await _done(engine.swap_to(update))
                except Exception:
                    # only the newest failure waits (older ones are not asked for again),
                    # but a version the engine cannot load stays refused
                    version, until = update[0], time.monotonic() + settings.RETRY_REFUSED
                    self._retry_at = {v: t for v, t in self._retry_at.items()
                                      if t == float("inf")}
                    self._retry_at[version] = max(self._retry_at.get(version, 0.0), until)
                    raise
            engine.last_error = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # log once, keep serving the version it has
            if getattr(engine, "pending", False):
                engine.pending = False  # (not known now: back to the usual pace)
            if str(exc) != engine.last_error:
                log.warning("TensorHub follow: %s (still serving v%s)", exc, engine.serving)
            engine.last_error = str(exc)

    async def run(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """Look every `poll_interval` seconds until `stopped()` (or cancelled), and at once
        when the coordinator announces a version (`news`, where given); while the engine's
        copy is pulling a newer version (`engine.pending`), every `settings.POLL_PENDING`
        seconds, so that the swap follows the pull closely."""
        while not stopped():
            await self.step()
            if getattr(self.engine, "pending", False):
                await asyncio.sleep(min(self.poll_interval, settings.POLL_PENDING))
            elif self.news is not None:
                await self.news(self.poll_interval)
            else:
                await asyncio.sleep(self.poll_interval)
