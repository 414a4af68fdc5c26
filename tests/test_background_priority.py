"""TensorHub's threads inside an engine run below the engine's priority (`yield_to_engine`)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tensorhub.core.transport.parallel_copy import CopyPool
from tensorhub.engines import yield_to_engine
from tensorhub.engines.background_check import BackgroundCheck

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs os.setpriority")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_a_thread(work):
    got: list = []
    thread = threading.Thread(target=lambda: got.append(work()))
    thread.start()
    thread.join()
    return got[0]


def test_a_thread_that_yields_runs_at_the_setting_and_the_rest_of_the_process_does_not(
        monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "7")
    before = _nice_of_this_thread()

    def work():
        yield_to_engine()
        return _nice_of_this_thread()

    assert _in_a_thread(work) == max(before, 7)
    assert _nice_of_this_thread() == before


def test_threads_started_by_a_yielding_thread_inherit_its_priority(monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "9")

    def work():
        yield_to_engine()
        return _in_a_thread(_nice_of_this_thread)

    assert _in_a_thread(work) == max(_nice_of_this_thread(), 9)


def test_a_thread_already_lower_is_never_raised(monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "3")

    def work():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        return yield_to_engine(), _nice_of_this_thread()

    assert _in_a_thread(work) == (15, 15)


def test_zero_leaves_the_thread_at_the_engines_priority(monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "0")
    before = _nice_of_this_thread()
    assert _in_a_thread(lambda: (yield_to_engine(), _nice_of_this_thread())) == (before, before)


def test_the_check_before_a_pause_runs_lowered(monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "11")
    checks = BackgroundCheck()
    seen: list[int] = []
    try:
        while checks.answer("front end", 1, 1, lambda: seen.append(_nice_of_this_thread())
                            ).state == "checking":
            time.sleep(0.01)
    finally:
        checks.close()
    assert seen == [max(_nice_of_this_thread(), 11)]


def test_a_setting_that_does_not_parse_leaves_the_thread_running_at_its_priority(monkeypatch):
    monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "lowest")
    before = _nice_of_this_thread()
    assert _in_a_thread(lambda: (yield_to_engine(), _nice_of_this_thread())) == (None, before)


def test_a_copy_runs_at_the_priority_of_the_thread_that_asked_for_it(monkeypatch):
    monkeypatch.setenv("TENSORHUB_COPY_THREADS", "2")
    pool = CopyPool("test-copy")
    seen: list[int] = []
    segments = [(0, 0, 1 << 20), (1 << 20, 1 << 20, 1 << 20)]

    def read():
        pool.run(segments, lambda call: seen.append(_nice_of_this_thread()))

    try:
        monkeypatch.setenv("TENSORHUB_BACKGROUND_NICE", "12")
        _in_a_thread(lambda: (yield_to_engine(), read()))  # a pull beside generation
        lowered, seen[:] = list(seen), []
        read()  # a repair inside a pause, in the engine's own thread
        assert lowered == [max(_nice_of_this_thread(), 12)] * 2
        assert seen == [_nice_of_this_thread()] * 2
    finally:
        pool.close()
