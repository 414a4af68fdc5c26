"""A worker answers its front end's check at once while the check runs in its own thread, so
the engine keeps stepping; the front end reads every rank's answer."""

from __future__ import annotations

import threading
import time

import pytest

from tensorhub import TensorHubError
from tensorhub.engines import (
    BackgroundCheck,
    CheckAnswer,
    InstallFailed,
    all_ready,
    refusal_in,
)


@pytest.fixture
def checks():
    checks = BackgroundCheck()
    yield checks
    checks.close()


def answered(checks: BackgroundCheck, attempt: int, check=lambda: None, *,
             asker: str = "front-end", version: int = 4) -> CheckAnswer:
    """The answer once the check has ended, asked as a front end asks."""
    deadline = time.monotonic() + 10
    while (answer := checks.answer(asker, attempt, version, check)).state == "checking":
        assert time.monotonic() < deadline, "the check never ended"
        time.sleep(0.001)
    return answer


def unloadable():
    raise InstallFailed.of("unloadable", 4, "v4: tensor 'w' has shape [127], not [128]")


def test_a_check_still_running_is_answered_checking_and_then_ready(checks):
    verified = threading.Event()
    assert checks.answer("front-end", 1, 4, lambda: verified.wait(5)) == \
        CheckAnswer(state="checking")
    verified.set()
    assert answered(checks, 1) == CheckAnswer(state="ready")


def test_an_attempt_is_checked_once_however_often_it_is_asked(checks):
    runs = []
    answered(checks, 1, lambda: runs.append(1))
    answered(checks, 1, lambda: runs.append(1))
    assert runs == [1]


def test_a_new_attempt_checks_the_copy_again(checks):
    """A refusal never outlives its swap: the next swap's check runs on what the copy holds
    then."""
    def damaged():
        raise TensorHubError("item 3 has checksum 1f, expected 2e", code="integrity")

    assert answered(checks, 1, damaged).state == "refused"
    assert answered(checks, 2) == CheckAnswer(state="ready")


def test_an_answer_is_never_given_for_another_version(checks):
    assert answered(checks, 1, unloadable, version=4).state == "refused"
    assert answered(checks, 1, version=5) == CheckAnswer(state="ready")


def test_two_front_ends_do_not_answer_for_each_other(checks):
    """An engine with several API servers: each front end counts its own attempts."""
    assert answered(checks, 1, unloadable, asker="api-0").state == "refused"
    assert answered(checks, 1, asker="api-1") == CheckAnswer(state="ready")
    assert answered(checks, 1, asker="api-0").state == "refused"  # (its own, still)


def test_a_check_superseded_before_it_started_never_runs(checks):
    """Checks run one at a time, each holding the copy's lock: a swap's check cut by its
    time bound is not run after the next swap asked for its own."""
    running, release, runs = threading.Event(), threading.Event(), []

    def first():
        running.set()
        release.wait(5)

    checks.answer("other-api", 1, 4, first)  # occupies the thread
    assert running.wait(5)
    checks.answer("front-end", 1, 4, lambda: runs.append("cut"))
    checks.answer("front-end", 2, 4, lambda: runs.append("next"))
    release.set()
    assert answered(checks, 2) == CheckAnswer(state="ready")
    assert runs == ["next"]


def test_a_version_the_model_cannot_load_is_answered_with_its_typed_outcome(checks):
    answer = answered(checks, 1, unloadable)
    assert answer.state == "refused"
    assert answer.outcome.kind == "unloadable" and answer.outcome.version == 4
    assert CheckAnswer.model_validate(answer.model_dump()) == answer  # (crosses processes)


def test_the_front_end_raises_a_typed_refusal_from_any_rank_first(checks):
    ready = CheckAnswer(state="ready")
    damaged = CheckAnswer.refused("item 3 is damaged")
    typed = answered(checks, 1, unloadable)
    refusal = refusal_in([ready, damaged, typed])
    assert isinstance(refusal, InstallFailed) and refusal.outcome.kind == "unloadable"
    plain = refusal_in([damaged, ready])
    assert not isinstance(plain, InstallFailed) and "item 3 is damaged" in str(plain)


def test_the_front_end_waits_while_any_rank_is_still_checking():
    ready, checking = CheckAnswer(state="ready"), CheckAnswer(state="checking")
    assert refusal_in([ready, checking]) is None
    assert not all_ready([ready, checking])
    assert all_ready([ready, ready])
