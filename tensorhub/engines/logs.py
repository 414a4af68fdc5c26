"""Make TensorHub's log lines visible inside an engine, whose logging setup covers only its
own loggers: one stderr handler on the `tensorhub` logger, installed once per process."""

from __future__ import annotations

import logging

from tensorhub import settings


def show_tensorhub_logs(engine: str) -> None:
    logger = logging.getLogger("tensorhub")
    if any(getattr(h, "_tensorhub", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"(tensorhub/{engine} pid=%(process)d) %(levelname)s %(asctime)s %(name)s: %(message)s",
        "%m-%d %H:%M:%S"))
    handler._tensorhub = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(settings.LOG_LEVEL.get().upper())
    logger.propagate = False
