"""One swap, the same for every engine: check, pause, install, resume, and what the engine
serves afterwards.

An engine plugin gives the controller its own calls (`SwapSteps`); the controller runs them
in order, bounds each one, times the pause, and keeps the state both front ends report:
the version served, torn weights (generation stays paused until a whole version is
loaded), the last version refused as unloadable. Everything that can run before the pause
(the load check, the copy's verification) runs in `check`, outside the stall and in the
workers' own threads while the engine generates (`background_check.py`); the stall is what
a client feels: from the moment the engine stopped stepping (the step in flight when the
pause was asked still runs and sends its tokens) to the end of its first step after the
resume.

A failed install says what became of the weights as an `InstallFailed` carrying a
`LoadOutcome` (typed: it crossed from the engine's worker processes as one, see
`outcome.py`), and the controller acts on it: a version the model cannot load, or whose
load failed half-way, is never tried again (`FollowLoop.never_again`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Protocol

from tensorhub import metrics
from tensorhub.core.errors import TensorHubError
from tensorhub.engines.follow import FollowLoop
from tensorhub.engines.outcome import InstallFailed, LoadOutcome

log = logging.getLogger("tensorhub.engines")


class SwapSteps(Protocol):
    """An engine's calls, as the controller runs them (each a coroutine)."""

    async def check(self, version: int) -> None:
        """Raise `InstallFailed` (kind "unloadable") if the model cannot load `version`;
        verify what will be installed. Generation is not paused yet."""

    async def pause(self) -> float | None:
        """Stop generating; requests in flight wait (or finish, or are aborted: the
        engine's pause mode). Return once the engine has stopped stepping; return when its
        clients began to wait (`time.perf_counter()`) where that was earlier: a pause that
        drains holds new requests from the call on."""

    async def install(self, version: int, path: str, fetch: bool) -> dict | None:
        """Put `version` into the live weights by `path` and label them; `fetch`: pull it
        from peers first if the copy holds another. Returns what the engine has to say of
        it (added to `last_update`: how it was installed, its steps), or raises
        `InstallFailed` after labelling what the weights hold."""

    async def resume(self) -> None:
        """Generate again; requests kept through the pause go on with the new weights."""


class StepClock:
    """Milliseconds of each step of a sequence, each from the end of the one before: what
    an install reports as `steps_ms`, so a slow swap says which call it waited on."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._at = time.perf_counter()

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.ms[step] = round((now - self._at) * 1e3, 2)
        self._at = now


class SwapController:
    """Runs swaps for one engine and keeps what it serves."""

    def __init__(self, model: str, steps: SwapSteps, follow: FollowLoop,
                 swap_timeout: float):
        self.model = model
        self.steps = steps
        self.follow = follow
        self.swap_timeout = swap_timeout
        self.serving: int | None = None  # None: the weights it started with
        self.torn: dict | None = None  # {version, reason}: generation paused until repaired
        self.unloadable: dict | None = None  # the last version refused: {version, reason}
        self.last_update: dict | None = None
        self.updates = 0
        # Swaps that paused generation so far: requests are salted with the epoch they
        # arrived in (`kv_salt`). It moves on once the engine is paused, so a request of a
        # new epoch is never scheduled on the weights of the one before.
        self.epoch = 0
        self._lock = asyncio.Lock()

    async def _bounded(self, step: Awaitable, what: str):
        """Await one step for at most `swap_timeout` seconds."""
        try:
            return await asyncio.wait_for(step, self.swap_timeout)
        except TimeoutError:
            raise TensorHubError(f"{what} did not finish within {self.swap_timeout:.0f} s "
                                 f"(a rank may hang: see the workers' log)",
                                 code="timeout") from None

    async def swap(self, version: int, path: str = "checkpoint", *, pause: bool = True,
                   fetch: bool = False) -> dict:
        """Make the engine serve `version`. Returns its timings; raises if it could not
        (the engine then serves what it served before, or stays paused if torn)."""
        async with self._lock:
            if self.serving == version and self.torn is None:
                return {"version": version, "stall_ms": 0.0, "changed": False}
            checked = time.perf_counter()
            await self._check(version)
            asked = started = time.perf_counter()
            marks: dict[str, float] = {}
            was_torn = self.torn is not None  # (then generation is paused already)
            extra: dict | None = None
            try:
                if pause and not was_torn:
                    waited_from = await self._bounded(self.steps.pause(), "pausing generation")
                    self.epoch += 1
                    # (the stall starts where the engine stopped: the step in flight when
                    # the pause was asked sent its tokens first)
                    paused = time.perf_counter()
                    started = paused if waited_from is None \
                        else max(asked, min(waited_from, paused))
                    marks["pause"] = paused  # (0 ms in the stall, unless it drained)
                try:
                    extra = await self._bounded(self.steps.install(version, path, fetch),
                                                f"installing v{version}")
                except InstallFailed as exc:
                    self._failed(version, exc.outcome)
                    raise
                except TensorHubError as exc:
                    # a step that did not finish may have stopped half-way: as torn
                    kind = "torn" if exc.code == "timeout" else "refused"
                    self._failed(version, LoadOutcome(kind=kind, version=version,
                                                      reason=str(exc)))
                    raise
                marks["install"] = time.perf_counter()
                if was_torn:
                    log.warning("TensorHub: v%d loaded whole; generation resumes", version)
                self.torn = None
            finally:
                if (pause or was_torn) and self.torn is None:
                    await self._bounded(self.steps.resume(), "resuming generation")
                    marks["resume"] = time.perf_counter()
            stall_ms = (time.perf_counter() - started) * 1e3 if pause or was_torn else 0.0
            steps, last, stall_steps = [], started, {}
            for step, t in marks.items():
                ms = (t - last) * 1e3
                if pause or was_torn:
                    stall_steps[step] = round(ms, 2)
                text = f"{step} {ms:.1f}"
                inner = (extra or {}).get("steps_ms") if step == "install" else None
                if isinstance(inner, dict):  # the install's own calls
                    text += " [" + ", ".join(f"{k} {v}" for k, v in inner.items()) + "]"
                steps.append(text)
                last = t
            self.serving = version
            metrics.switched(self.model, version, stall_ms / 1e3)
            self.updates += 1
            self.last_update = {"version": version, "stall_ms": round(stall_ms, 2),
                                "check_ms": round((asked - checked) * 1e3, 2),
                                # the wait for the engine's step in flight, before the stall
                                "pause_ms": round((started - asked) * 1e3, 2),
                                "stall_steps_ms": stall_steps,
                                "at": time.time(), "path": path, **(extra or {})}
            log.info("now serving %s v%d (stall %.1f ms: %s ms; checked before in %.1f ms, "
                     "paused after %.1f ms)", self.model, version, stall_ms,
                     ", ".join(steps) or "none", (asked - checked) * 1e3,
                     (started - asked) * 1e3)
            return {"version": version, "stall_ms": stall_ms, "changed": True}

    async def _check(self, version: int) -> None:
        """Refuse `version` before generation pauses if the model cannot load it: it is
        never tried again."""
        try:
            await self._bounded(self.steps.check(version), f"checking v{version}")
        except InstallFailed as exc:
            if exc.outcome.kind != "unloadable":
                raise
            self._unloadable(version, exc.outcome.reason)
            self.follow.never_again(version)
            raise TensorHubError(exc.outcome.reason, code="unloadable") from None

    def _unloadable(self, version: int, reason: str) -> None:
        """Record `version` as one the model cannot load (logged and counted once)."""
        if (self.unloadable or {}).get("version") != version:
            metrics.refused_unloadable(self.model)
            log.error("TensorHub: refusing %s; still serving v%s", reason, self.serving)
        self.unloadable = {"version": version, "reason": reason}

    def _failed(self, version: int, outcome: LoadOutcome) -> None:
        """Record a failed install: a version the model cannot load, or whose load failed
        half-way (undone or not), is never tried again; torn weights keep generation
        paused."""
        metrics.UPDATE_FAILURES.labels(self.model).inc()
        if outcome.kind == "unloadable":
            self._unloadable(version, outcome.reason)
        if outcome.kind != "refused":
            self.follow.never_again(version)
        if outcome.kind == "restored_checkpoint":
            self.serving = None  # the weights it started with, loaded again
        if outcome.kind == "torn":
            self.torn = {"version": version, "reason": outcome.reason.splitlines()[0][:500]}
            log.error("swap to v%d left the weights torn: generation stays paused until a "
                      "whole version is loaded (%s)", version, self.torn["reason"])
        elif outcome.kind != "unloadable":
            log.error("swap to v%d failed (%s); still serving %s%s", version,
                      outcome.reason.splitlines()[0][:300] if outcome.reason else outcome.kind,
                      f"v{self.serving}" if self.serving else "the weights loaded at start",
                      " (restored after a load that failed half-way)"
                      if outcome.kind.startswith("restored") else "")
