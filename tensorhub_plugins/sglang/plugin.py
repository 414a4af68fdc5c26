"""`sglang.srt.plugins` entry point. SGLang calls it in its main, scheduler and detokenizer
processes; it must never raise (SGLang logs plugin errors, but a hook that raises later
kills the server), so every step is guarded.

In the server's main process it puts the weight version spans on every choice of the
OpenAI-compatible answers (`spans`), and when SGLang launches its HTTP server there (a hook
on `launch_server`, which gets SGLang's own parsed arguments, before the schedulers are
spawned) it names this server instance and makes its private status directory
(`naming.start_instance`), adds `GET /tensorhub/status` to SGLang's HTTP app (`routes`) and
starts the driver. On an engine that spans nodes only node 0's main process does (it serves
HTTP); the others serve none."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

log = logging.getLogger("tensorhub.sglang")


def is_server_main(argv: list[str] | None = None) -> bool:
    """Whether this is the main process of an SGLang HTTP server (`python -m
    sglang.launch_server` or `sglang serve`), the one process where the driver and the
    route belong; SGLang's subprocesses are never multiprocessing's main process."""
    argv = sys.argv if argv is None else argv
    if multiprocessing.current_process().name != "MainProcess":
        return False
    launch = any("launch_server" in a for a in argv[:2])
    serve = len(argv) > 1 and os.path.basename(argv[0]) == "sglang" and argv[1] == "serve"
    return launch or serve


def _before_self_kill(parent_pid: int | None = None, include_parent: bool = True,
                      *args, **kwargs) -> None:
    """BEFORE hook on SGLang's `kill_process_tree`: when it is about to SIGKILL this very
    process (no `atexit` then), remove the instance's status directory first. Never
    raises, returns None (SGLang's arguments pass through unchanged)."""
    try:
        if include_parent and parent_pid == os.getpid():
            from tensorhub_plugins.sglang.naming import remove_status_dir

            remove_status_dir()
    except Exception:
        pass


def _cpu_process_groups(original, *args, **kwargs):
    """AROUND hook on SGLang's `init_model_parallel_group`: on a machine without CUDA,
    no PyNccl communicator and no custom all-reduce (both need CUDA; SGLang builds them by
    default off NPU/XPU), so tensor parallelism runs its collectives over gloo."""
    import torch

    if not torch.cuda.is_available():
        args = list(args)
        for position, name in ((3, "use_pynccl"), (4, "use_custom_allreduce")):
            if len(args) > position:
                args[position] = False
            else:
                kwargs[name] = False
    return original(*args, **kwargs)


def _option(server_args, name: str, default):
    """One of SGLang's parsed server arguments (its default where it is unset)."""
    value = getattr(server_args, name, None)
    return default if value is None else value


def _launching(server_args, *args, **kwargs) -> None:
    """BEFORE hook on SGLang's `http_server.launch_server`, which runs in the server's main
    process with SGLang's own parsed arguments, before it spawns the schedulers: start
    TensorHub's side there. Never raises; returns None (the arguments pass unchanged)."""
    try:
        _start_main(server_args)
    except Exception:
        log.exception("TensorHub SGLang plugin failed to start; the server runs without it")


def _start_main(server_args) -> None:
    """Main process: instance name and status directory for the schedulers (before SGLang
    spawns them), the route, and the driver when following."""
    global _driver
    from tensorhub.engines import load_settings

    settings = load_settings(None)
    driver = None
    node_rank = int(_option(server_args, "node_rank", 0))
    if settings is not None and node_rank != 0:
        # This node serves no HTTP: node 0's driver updates the engine, and this node's
        # ranks take its instance name and report to it (`worker.engine_instance`, `reports`).
        log.info("TensorHub: node %d of this engine: node 0 drives its updates", node_rank)
        return
    if settings is not None:
        from tensorhub_plugins.sglang.copies import one_copy_per_engine
        from tensorhub_plugins.sglang.driver import Driver
        from tensorhub_plugins.sglang.naming import start_instance

        if settings.pause == "keep_kv":
            from tensorhub_plugins.sglang.salt import why_not

            problem = why_not(int(_option(server_args, "tokenizer_worker_num", 1)))
            if problem is not None:
                log.error("TensorHub: TENSORHUB_PAUSE=keep_kv cannot be honoured (%s); "
                          "swaps pause as keep", problem)
                settings = settings.model_copy(update={"pause": "keep"})
        port = int(_option(server_args, "port", 30000))
        instance, status_dir = start_instance(settings, port)
        tp_size = int(_option(server_args, "tp_size", 1))
        nodes = int(_option(server_args, "nnodes", 1))
        driver = Driver(settings, str(_option(server_args, "host", "127.0.0.1")), port,
                        tp_size, instance, one_copy=one_copy_per_engine(server_args),
                        api_key=_option(server_args, "api_key", ""), nodes=nodes,
                        tokenizer_workers=int(_option(server_args, "tokenizer_worker_num", 1)))
        log.info("TensorHub SGLang instance %s (status directory %s)", instance, status_dir)
        _driver = driver
    from tensorhub_plugins.sglang.routes import add_routes

    add_routes(driver)
    if driver is not None and settings is not None and settings.mode == "follow":
        driver.start()


_driver = None  # this server's, once `launch_server` started it (`_start_main`)


def _salt_epoch() -> int | None:
    """The swap epoch to salt a request with: in pause mode `keep_kv` only (`salt`)."""
    driver = _driver
    if driver is None or driver.settings.pause != "keep_kv":
        return None
    return driver.swaps.epoch


def _register_main_hooks() -> None:
    """The main process's hooks. SGLang applies hooks once, after loading the plugins, so
    every hook is registered now; what they need from the server's arguments they find once
    `launch_server` ran (`_launching`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from tensorhub_plugins.sglang.salt import salt_requests

    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _launching,
                          HookType.BEFORE)
    HookRegistry.register("sglang.srt.utils.common.kill_process_tree", _before_self_kill,
                          HookType.BEFORE)
    salt_requests(_salt_epoch)


def _add_version_spans() -> None:
    """`weight_versions` on every choice of SGLang's OpenAI answers (`spans`)."""
    try:
        from tensorhub_plugins.sglang.spans import register_hooks

        register_hooks()
    except Exception:
        log.exception("TensorHub: answers carry SGLang's own weight_version only")


def register() -> None:
    try:
        from tensorhub.engines import show_tensorhub_logs

        show_tensorhub_logs("sglang")
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from tensorhub_plugins.sglang.worker import after_load_model

        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model",
                              after_load_model, HookType.AFTER)
        HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group",
                              _cpu_process_groups, HookType.AROUND)
        if is_server_main():
            _add_version_spans()
            _register_main_hooks()
    except Exception:
        log.exception("TensorHub SGLang plugin failed to load; the server runs without it")
