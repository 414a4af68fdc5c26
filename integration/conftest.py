"""Integration fixtures: engine venvs, tiny float32 models, a real coordinator process.

Engines are expensive (30-45 s to start, ~1.5 GB each), so fixtures are module- or
session-scoped and every process is stopped by PID at teardown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from integration.engine_server import EngineServer, free_port
from integration.engine_venvs import engine_python
from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing import shared_memory


def pytest_collection_modifyitems(config, items) -> None:
    """Every engine test is `slow`: out of the fast loop (`pytest -m "not slow"`)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _shared_memory_left_by_engines():
    """At the end of the session, the /dev/shm segments its engines left behind and no
    live process uses are removed (`tensorhub_testing.shared_memory`)."""
    before = shared_memory.names()
    yield
    removed = shared_memory.remove_unused(before)
    if removed:
        print(f"\nremoved {len(removed)} shared-memory segments engines left in /dev/shm")


def _engine_python(target: str) -> str:
    if os.environ.get("TENSORHUB_TEST_ENGINES", "1") == "0":
        pytest.skip(f"TENSORHUB_TEST_ENGINES=0: no {target} venv, so no {target} server")
    return engine_python(target)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return _engine_python("vllm")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return _engine_python("sglang")


@pytest.fixture(scope="session")
def verl_python() -> str:
    return _engine_python("verl")


@pytest.fixture(scope="module")
def coordinator_process(tmp_path_factory):
    """A real `tensorhub coordinator` process; one reader per holder at a time, so that a
    second engine is made to read from the first rather than from the trainer. Its log is
    `coordinator.log` in the module's temp folder."""
    log = tmp_path_factory.mktemp("coordinator") / "coordinator.log"
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = ChildProcess([sys.executable, "-m", "tensorhub.tools.cli", "coordinator", "--bind",
                         address, "--announce", f"tcp://127.0.0.1:{free_port()}",
                         "--max-readers-per-holder", "1"], name="coordinator",
                        log_path=str(log))
    proc.next_line(timeout=60)
    proc.address = address
    proc.log_file = log
    yield proc
    proc.stop()


_STALLS = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tensorhub-stalls-{os.getpid()}.log")


@pytest.fixture(scope="session", autouse=True)
def stall_monitor():
    """A process that notes each time the machine did not run it for over half a second."""
    proc = ChildProcess([sys.executable, "-m", "integration.stall_monitor", _STALLS],
                        name="stall-monitor", stdout=None,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    yield
    proc.stop()
    if os.path.exists(_STALLS):
        os.unlink(_STALLS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the coordinator shows the end of its log, and any stalls
    of the whole machine seen so far (CI keeps no files)."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    coordinator = funcargs.get("coordinator_process") if report.failed else None
    if coordinator is not None and coordinator.log_file.exists():
        tail = coordinator.log_file.read_text().splitlines()[-40:]
        report.sections.append(("coordinator log (last 40 lines)", "\n".join(tail)))
    for server in _engine_servers(funcargs) if report.failed else ():
        tail = [line for line in server.log_tail(2000).splitlines() if "tensorhub" in line]
        report.sections.append((f"{server.url} log, TensorHub lines (last 40)",
                                "\n".join(tail[-40:]) or "none"))
    if report.failed and report.when == "call":
        stalls = Path(_STALLS).read_text().splitlines()[-20:] if os.path.exists(_STALLS) else []
        report.sections.append(("machine stalls (last 20)", "\n".join(stalls) or "none"))


def _engine_servers(funcargs: dict) -> list[EngineServer]:
    """The engine servers a test used: its arguments, or their attributes (a fleet)."""
    found: list[EngineServer] = []
    for value in funcargs.values():
        for candidate in [value, *getattr(value, "__dict__", {}).values()]:
            if isinstance(candidate, EngineServer) and candidate not in found:
                found.append(candidate)
    return found
