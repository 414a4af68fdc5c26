"""`sglang.srt.plugins` entry point. SGLang calls it in its main, scheduler and detokenizer
processes; it must never raise (SGLang logs plugin errors, but a hook that raises later
kills the server), so every step is guarded."""

from __future__ import annotations

import logging
import multiprocessing
import sys

log = logging.getLogger("tensorhub.sglang")


def _arg(name: str, default: str) -> str:
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def register() -> None:
    try:
        from tensorhub.engines.logs import show_tensorhub_logs
        from tensorhub.engines.settings import load_settings

        show_tensorhub_logs("sglang")
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from tensorhub_plugins.sglang.worker import after_load_model

        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model",
                              after_load_model, HookType.AFTER)
        is_main = multiprocessing.current_process().name == "MainProcess" and any(
            "launch_server" in a for a in sys.argv[:2])
        settings = load_settings(None)
        if is_main and settings is not None and settings.mode == "follow":
            from tensorhub_plugins.sglang.driver import Driver

            Driver(settings, _arg("--host", "127.0.0.1"), int(_arg("--port", "30000")),
                   int(_arg("--tp-size", _arg("--tp", "1")))).start()
    except Exception:
        log.exception("TensorHub SGLang plugin failed to load; the server runs without it")
