"""Integration fixtures: engine venvs, tiny float32 models, a real coordinator process.

Engines are expensive (30-45 s to start, ~1.5 GB each), so fixtures are module- or
session-scoped and every process is stopped by PID at teardown.
"""

from __future__ import annotations

import os
import sys

import pytest

from integration.engine_server import free_port
from integration.engine_venvs import engine_python
from tensorhub.processes import ChildProcess


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


@pytest.fixture(scope="module")
def coordinator_process(tmp_path_factory):
    """A real `tensorhub coordinator` process; one reader per holder at a time, so that a
    second engine is made to read from the first rather than from the trainer. Its log is
    `coordinator.log` in the module's temp folder."""
    log = tmp_path_factory.mktemp("coordinator") / "coordinator.log"
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = ChildProcess([sys.executable, "-m", "tensorhub.cli", "coordinator", "--bind",
                         address, "--announce", f"tcp://127.0.0.1:{free_port()}",
                         "--max-readers-per-holder", "1"], name="coordinator",
                        log_path=str(log))
    proc.next_line(timeout=60)
    proc.address = address
    proc.log_file = log
    yield proc
    proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the coordinator shows the end of its log (CI keeps no files)."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    coordinator = funcargs.get("coordinator_process") if report.failed else None
    if coordinator is not None and coordinator.log_file.exists():
        tail = coordinator.log_file.read_text().splitlines()[-40:]
        report.sections.append(("coordinator log (last 40 lines)", "\n".join(tail)))
