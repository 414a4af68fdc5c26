"""The swap sequence both engine plugins run (`engines.SwapController`), with an engine
stand-in that records its calls: the order of the steps, what each outcome leaves served,
and that the stall is the pause alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from tensorhub.core.errors import TensorHubError
from tensorhub.engines import FollowLoop, InstallFailed, LoadOutcome, PendingPulls, worst_outcome
from tensorhub.engines.swap import StepClock, SwapController


class Engine:
    def __init__(self, check: InstallFailed | None = None,
                 install: BaseException | None = None, check_s: float = 0.0,
                 pause_s: float = 0.0, drains: bool = False):
        self.calls: list[str] = []
        self._check, self._install, self.check_s = check, install, check_s
        self.pause_s, self.drains = pause_s, drains
        self.serving = None
        self.torn = None
        self.last_error = None

    async def check(self, version: int) -> None:
        self.calls.append(f"check {version}")
        await asyncio.sleep(self.check_s)
        if self._check is not None:
            raise self._check

    async def pause(self) -> float | None:
        self.calls.append("pause")
        asked = time.perf_counter()
        await asyncio.sleep(self.pause_s)  # (the step in flight, or a drain)
        return asked if self.drains else None

    async def install(self, version: int, path: str, fetch: bool) -> dict | None:
        self.calls.append(f"install {version}")
        if self._install is not None:
            raise self._install
        return None

    async def resume(self) -> None:
        self.calls.append("resume")

    def next_update(self):
        return None


def controller(engine: Engine) -> SwapController:
    return SwapController("policy", engine, FollowLoop(engine, 0.1), swap_timeout=5.0)


def swap(ctl: SwapController, version: int, **kw) -> dict:
    return asyncio.run(ctl.swap(version, **kw))


def test_a_swap_checks_before_it_pauses_and_the_stall_leaves_the_check_out():
    engine = Engine(check_s=0.3)
    ctl = controller(engine)
    got = swap(ctl, 2)
    assert engine.calls == ["check 2", "pause", "install 2", "resume"]
    assert ctl.serving == 2 and got["changed"]
    assert ctl.last_update["check_ms"] >= 300
    assert ctl.last_update["stall_ms"] < ctl.last_update["check_ms"]


def test_the_stall_starts_once_the_engine_stopped_stepping_not_when_the_pause_was_asked():
    ctl = controller(Engine(pause_s=0.3))  # (its step in flight sends its tokens first)
    swap(ctl, 2)
    assert ctl.last_update["pause_ms"] >= 300
    assert ctl.last_update["stall_ms"] < 300


def test_a_pause_that_drains_counts_as_stall_from_the_call():
    ctl = controller(Engine(pause_s=0.3, drains=True))  # (new requests wait from the call)
    swap(ctl, 2)
    assert ctl.last_update["stall_ms"] >= 300
    assert ctl.last_update["pause_ms"] < 300


def test_a_version_the_model_cannot_load_is_refused_before_the_pause_and_never_again():
    engine = Engine(check=InstallFailed.of("unloadable", 3, "v3 does not fit the engine's model"))
    ctl = controller(engine)
    with pytest.raises(TensorHubError) as caught:
        swap(ctl, 3)
    assert caught.value.code == "unloadable"
    assert engine.calls == ["check 3"]  # generation never paused
    assert ctl.unloadable == {"version": 3, "reason": "v3 does not fit the engine's model"}
    assert ctl.follow._retry_at[3] == float("inf")


def test_a_load_undone_serves_the_version_before_and_is_never_tried_again():
    engine = Engine()
    ctl = controller(engine)
    swap(ctl, 3)
    engine._install = InstallFailed.of("restored", 4, "loading v4 failed half-way")
    with pytest.raises(InstallFailed):
        swap(ctl, 4)
    assert engine.calls[-3:] == ["pause", "install 4", "resume"]
    assert ctl.serving == 3 and ctl.torn is None
    assert ctl.follow._retry_at[4] == float("inf")


def test_a_restored_checkpoint_means_no_version_is_served():
    engine = Engine()
    ctl = controller(engine)
    swap(ctl, 3)
    engine._install = InstallFailed.of("restored_checkpoint", 4, "half-way")
    with pytest.raises(InstallFailed):
        swap(ctl, 4)
    assert ctl.serving is None


def test_torn_weights_keep_generation_paused_until_a_whole_version_is_installed():
    engine = Engine()
    ctl = controller(engine)
    swap(ctl, 3)
    engine._install = InstallFailed.of("torn", 4, "restoring v3 failed")
    with pytest.raises(InstallFailed):
        swap(ctl, 4)
    assert engine.calls[-2:] == ["pause", "install 4"]  # no resume
    assert ctl.torn["version"] == 4
    engine._install = None
    swap(ctl, 3, fetch=True)  # the repair: the version served before, whole
    assert engine.calls[-3:] == ["check 3", "install 3", "resume"]  # (paused already)
    assert ctl.torn is None and ctl.serving == 3


def test_an_install_that_does_not_finish_in_time_counts_as_torn():
    engine = Engine(install=TensorHubError("applying v5 did not finish", code="timeout"))
    ctl = controller(engine)
    with pytest.raises(TensorHubError):
        swap(ctl, 5)
    assert ctl.torn is not None and "resume" not in engine.calls


def test_a_refused_install_may_be_tried_again_later():
    engine = Engine(install=InstallFailed.of("refused", 6, "another rank holds v7"))
    ctl = controller(engine)
    with pytest.raises(InstallFailed):
        swap(ctl, 6)
    assert 6 not in ctl.follow._retry_at  # (the follow loop sets its own back-off)
    assert engine.calls[-1] == "resume"


def test_the_worst_outcome_a_rank_says_is_the_one_acted_on():
    said = [LoadOutcome(kind="refused", version=7), None,
            LoadOutcome(kind="torn", version=7, reason="rank 1 stopped half-way"),
            LoadOutcome(kind="restored", version=7)]
    assert worst_outcome(said).reason == "rank 1 stopped half-way"
    assert worst_outcome(said[:2]).kind == "refused"
    assert worst_outcome([None, None]) is None


def test_a_copy_counts_as_pulling_a_newer_version_for_a_bounded_time(monkeypatch):
    from tensorhub import settings

    pulls = PendingPulls()
    assert not pulls.pending(3, 3)
    assert pulls.pending(4, 3)
    monkeypatch.setattr(settings, "POLL_PENDING_FOR", 0.0)
    time.sleep(0.01)
    assert not pulls.pending(4, 3)  # it cannot get it: back to the slow rate


def test_each_paused_swap_starts_a_new_salt_epoch_once_generation_is_paused():
    """A request arriving once a swap has paused the engine is salted with a new epoch; one
    that arrived before keeps the old one (its prompt may be cached under the old weights)."""
    from tensorhub.engines import salted

    seen: list[tuple[str, int]] = []

    class Recording(Engine):
        async def pause(self) -> None:
            seen.append(("pause", ctl.epoch))

        async def install(self, version: int, path: str, fetch: bool) -> dict | None:
            seen.append((f"install {version}", ctl.epoch))
            return None

    ctl = controller(Recording())
    swap(ctl, 1, pause=False)  # a join: nothing was served yet
    swap(ctl, 2)
    swap(ctl, 3)
    assert seen == [("install 1", 0), ("pause", 0), ("install 2", 1), ("pause", 1),
                    ("install 3", 2)]
    assert salted(None, ctl.epoch).endswith("-2") and salted(None, 1) != salted(None, 2)
    assert salted("tenant-a", 2) == "tenant-a|" + salted(None, 2)


class TimedEngine(Engine):
    async def install(self, version: int, path: str, fetch: bool) -> dict:
        clock = StepClock()
        await asyncio.sleep(0.02)
        clock.mark("update")
        clock.mark("end")
        return {"steps_ms": clock.ms}


def test_an_install_reports_the_time_of_each_of_its_calls(caplog):
    ctl = controller(TimedEngine())
    with caplog.at_level("INFO", logger="tensorhub.engines"):
        swap(ctl, 2)
    steps = ctl.last_update["steps_ms"]
    assert list(steps) == ["update", "end"]
    assert steps["update"] >= 20 and steps["end"] < steps["update"]
    assert f"[update {steps['update']}, end {steps['end']}]" in caplog.text


class FailingLook(Engine):
    pending = True

    def next_update(self):
        raise TensorHubError("the coordinator did not answer", code="timeout")


def test_a_look_that_fails_puts_the_loop_back_to_its_usual_pace():
    engine = FailingLook()
    asyncio.run(FollowLoop(engine, 0.1).step())
    assert engine.pending is False
    assert engine.last_error == "the coordinator did not answer"


def test_a_version_whose_swap_failed_is_backed_off_from():
    engine = Engine(install=TensorHubError("refused by a rank", code="refused"))
    engine.next_update = lambda: (4, "checkpoint")
    follow = FollowLoop(engine, 0.1)
    engine.swap_to = lambda update: ctl.swap(update[0])
    ctl = SwapController("policy", engine, follow, swap_timeout=5.0)
    assert not follow.backing_off(4)
    asyncio.run(follow.step())
    assert follow.backing_off(4)
