"""The check before a pause, run in a worker's own thread while the engine keeps stepping.

Verifying a copy reads every byte of it (~1 s per 13 GB). An engine whose workers answer
its front end between two of its steps (vLLM's `collective_rpc`) makes no step while a
worker is busy answering, so a check answered in place is a pause its clients feel. Here a
worker answers at once: it starts the check in a thread of its own and says how far it got
(`CheckAnswer`); the front end asks again until every rank is done (`refusal_in`), each
question costing the engine a round trip between two steps.

A check belongs to one attempt of one asker (a front end, named by a nonce: an engine may
have several API servers) at one version: asking about a new attempt starts the check again,
on the bytes the copy holds then, so a refusal or an approval never outlives the swap it was
made for. The same asker's earlier check is cancelled if it has not started (one that runs
finishes first: checks run one at a time, each holding the copy's lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.background_priority import yield_to_engine
from tensorhub.engines.outcome import InstallFailed, LoadOutcome


class CheckAnswer(BaseModel):
    """One rank's answer: `checking` (ask again), `ready` (nothing found against the
    version: it may be installed), or `refused` (`outcome` when the refusal is typed, e.g.
    a version the model cannot load; else `reason`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: Literal["checking", "ready", "refused"]
    reason: str = Field(default="", max_length=4000)
    outcome: LoadOutcome | None = None
    # ready to install sparse: the elements it will write (`sparse_install`); None: whole
    sparse: int | None = Field(default=None, ge=0)

    @classmethod
    def refused(cls, reason: str) -> CheckAnswer:
        return cls(state="refused", reason=reason[:4000])


class BackgroundCheck:
    """A worker's checks, one at a time, in a thread of its own."""

    def __init__(self) -> None:
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorhub-check",
                                          initializer=yield_to_engine)
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[tuple[int, int], Future]] = {}  # asker -> its check

    def answer(self, asker: str, attempt: int, version: int,
               check: Callable[[], int | None]) -> CheckAnswer:
        """How far `asker`'s check `attempt` of `version` is (started here, with `check`,
        the first time it is asked about). `check` returns the elements a sparse install
        it prepared will write, or None (a whole install)."""
        key = (attempt, version)
        with self._lock:
            latest = self._latest.get(asker)
            if latest is None or latest[0] != key:
                if latest is not None:
                    latest[1].cancel()  # (superseded: no use checking it)
                self._latest[asker] = (key, self._runner.submit(check))
            done = self._latest[asker][1]
        if not done.done():
            return CheckAnswer(state="checking")
        failure = done.exception()
        if failure is None:
            sparse = done.result()
            return CheckAnswer(state="ready", sparse=sparse if type(sparse) is int else None)
        if isinstance(failure, InstallFailed):
            return CheckAnswer(state="refused", reason=str(failure)[:4000],
                               outcome=failure.outcome)
        return CheckAnswer.refused(str(failure))

    def close(self) -> None:
        """Cancel the checks not started and wait for the one running (it holds the
        copy's lock: the copy closes after it)."""
        self._runner.shutdown(wait=True, cancel_futures=True)


def refusal_in(answers: list[CheckAnswer]) -> TensorHubError | None:
    """What the ranks' answers say against installing: the first typed refusal (the front
    end records it: a version the model cannot load is never tried again), else the first
    refusal. None: none refused."""
    refused = [a for a in answers if a.state == "refused"]
    typed = next((a.outcome for a in refused if a.outcome is not None), None)
    if typed is not None:
        return InstallFailed(typed)
    if refused:
        return TensorHubError(refused[0].reason, code="refused")
    return None


def all_ready(answers: list[CheckAnswer]) -> bool:
    return all(a.state == "ready" for a in answers)
