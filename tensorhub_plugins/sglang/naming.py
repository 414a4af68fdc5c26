"""Names and files the SGLang main process and its schedulers agree on without talking."""

from __future__ import annotations

import os
import tempfile

from tensorhub.engines.settings import EngineSettings

LOADER = "tensorhub_plugins.sglang.loader.apply"


def worker_name(settings: EngineSettings, host: str, port: int, tp_rank: int) -> str:
    return f"{settings.name or 'sglang'}-{host}:{port}-tp{tp_rank}"


def native_worker_name(settings: EngineSettings, host: str, port: int, tp_rank: int) -> str:
    """The holder of the live parameters (native layout): a worker of its own, so that
    withdrawing one layout never touches the other's references."""
    return worker_name(settings, host, port, tp_rank) + "-native"


def status_path(port: int, tp_rank: int) -> str:
    """Where a scheduler records the version it last applied (its loader cannot answer the
    HTTP request that called it, so the driver reads this to confirm a swap)."""
    return os.path.join(tempfile.gettempdir(), f"tensorhub-sglang-{port}-tp{tp_rank}.json")


def driver_status_path(port: int) -> str:
    """Where the driver records what the server serves and its last stall (SGLang has no
    plugin hook for HTTP routes; `tensorhub status`-like tools and the demo read this)."""
    return os.path.join(tempfile.gettempdir(), f"tensorhub-sglang-{port}-driver.json")
