"""Shared fixtures: an in-process coordinator per test, and helpers for replica processes."""

from __future__ import annotations

import logging
import os

import pytest

from tensorhub.coordinator.server import Coordinator, CoordinatorConfig

os.environ.setdefault("TENSORHUB_UCX_DEFAULTS", "1")
logging.getLogger("nixl").setLevel(logging.WARNING)

TRANSPORTS = ["nixl", "zmq", "cma", "auto"]


@pytest.fixture
def coordinator():
    c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.2,
                                      worker_ttl=2.0)).start()
    yield c
    c.stop()


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param
