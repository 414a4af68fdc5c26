"""Follow mode, as every engine runs it (`engines.follow`): swap to each new version, try a
failed one again only after a while and one the engine cannot load never, repair torn
weights first, and keep serving through every failure."""

from __future__ import annotations

import asyncio

import pytest

from tensorhub import settings
from tensorhub.engines import FollowLoop
from tensorhub.engines import follow as follow_module


class Engine:
    """A front end whose swaps fail for the versions in `failing`; `asynchronous`: its
    methods are coroutines (vLLM's), else plain functions (SGLang's driver)."""

    def __init__(self, asynchronous: bool):
        self.serving: int | None = None
        self.torn: dict | None = None
        self.last_error: str | None = None
        self.latest = 0
        self.failing: set[int] = set()
        self.swaps: list[int] = []
        self.repairs = 0
        if asynchronous:
            for name in ("next_update", "swap_to", "repair"):
                plain = getattr(self, name)
                setattr(self, name, self._coroutine(plain))

    @staticmethod
    def _coroutine(plain):
        async def run(*args):
            return plain(*args)
        return run

    def next_update(self):
        newer = self.latest and (self.serving is None or self.latest > self.serving)
        return (self.latest, "checkpoint") if newer else None

    def swap_to(self, update):
        self.swaps.append(update[0])
        if update[0] in self.failing:
            raise RuntimeError(f"cannot swap to v{update[0]}")
        self.serving = update[0]

    def repair(self):
        self.repairs += 1
        self.torn = None


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(follow_module.time, "monotonic", lambda: now[0])
    return now


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_new_version_is_swapped_to_once(asynchronous, clock):
    engine = Engine(asynchronous)
    loop = FollowLoop(engine, poll_interval=0.1)
    asyncio.run(loop.step())
    engine.latest = 1
    asyncio.run(loop.step())
    asyncio.run(loop.step())
    engine.latest = 2
    asyncio.run(loop.step())
    assert engine.swaps == [1, 2] and engine.serving == 2 and engine.last_error is None


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_version_waits_before_it_is_tried_again(asynchronous, clock):
    engine = Engine(asynchronous)
    loop = FollowLoop(engine, poll_interval=0.1)
    engine.serving, engine.latest, engine.failing = 1, 2, {2}
    asyncio.run(loop.step())
    assert engine.last_error == "cannot swap to v2" and engine.serving == 1
    clock[0] += settings.RETRY_REFUSED / 2
    asyncio.run(loop.step())
    assert engine.swaps == [2]  # not yet
    assert engine.last_error == "cannot swap to v2"  # (why it serves v1 stays shown)
    engine.failing = set()
    clock[0] += settings.RETRY_REFUSED
    asyncio.run(loop.step())
    assert engine.swaps == [2, 2] and engine.serving == 2 and engine.last_error is None


def test_a_version_the_engine_cannot_load_is_never_tried_again(clock):
    engine = Engine(asynchronous=False)
    loop = FollowLoop(engine, poll_interval=0.1)
    engine.serving, engine.latest, engine.failing = 1, 2, {2}
    asyncio.run(loop.step())
    loop.never_again(2)
    clock[0] += 100 * settings.RETRY_REFUSED
    asyncio.run(loop.step())
    assert engine.swaps == [2] and engine.serving == 1


def test_a_later_failure_does_not_lift_the_refusal_of_a_version_it_cannot_load(clock):
    engine = Engine(asynchronous=False)
    loop = FollowLoop(engine, poll_interval=0.1)
    engine.serving, engine.latest, engine.failing = 1, 2, {2, 3}
    asyncio.run(loop.step())
    loop.never_again(2)
    engine.latest = 3
    asyncio.run(loop.step())  # v3 fails too
    engine.latest = 2  # (v3 withdrawn: v2 is the newest again)
    clock[0] += 100 * settings.RETRY_REFUSED
    asyncio.run(loop.step())
    assert engine.swaps == [2, 3] and engine.serving == 1


def test_torn_weights_are_repaired_first_and_then_only_every_so_often(clock):
    engine = Engine(asynchronous=False)
    loop = FollowLoop(engine, poll_interval=0.1)
    engine.serving, engine.torn = 1, {"version": 2, "reason": "half-way"}
    engine.repair = lambda: setattr(engine, "repairs", engine.repairs + 1)  # stays torn
    asyncio.run(loop.step())
    asyncio.run(loop.step())
    assert engine.repairs == 1
    clock[0] += settings.RETRY_REFUSED
    asyncio.run(loop.step())
    assert engine.repairs == 2


def test_the_loop_runs_until_stopped():
    engine = Engine(asynchronous=False)
    engine.latest = 3
    looks = []

    def stopped() -> bool:
        looks.append(1)
        return len(looks) > 2

    asyncio.run(FollowLoop(engine, poll_interval=0.0).run(stopped))
    assert engine.swaps == [3] and len(looks) == 3
