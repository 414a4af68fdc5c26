"""`sglang.srt.plugins` entry point. SGLang calls it in its main, scheduler and detokenizer
processes; it must never raise (SGLang logs plugin errors, but a hook that raises later
kills the server), so every step is guarded.

In the server's main process, which runs it before spawning the schedulers, it also names
this server instance and makes its private status directory (`naming.start_instance`), adds
`GET /tensorhub/status` to SGLang's HTTP app (`routes`), puts the weight version spans on
every choice of the OpenAI-compatible answers (`spans`) and starts the driver. On an engine
that spans nodes only node 0's main process does (it serves HTTP); the others serve none."""

from __future__ import annotations

import logging
import multiprocessing
import os
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


def _start_main() -> None:
    """Main process: instance name and status directory for the schedulers (before SGLang
    spawns them), the route, and the driver when following."""
    from tensorhub.engines import load_settings

    settings = load_settings(None)
    driver = None
    node_rank = int(_arg("--node-rank", "0"))
    if settings is not None and node_rank != 0:
        # This node serves no HTTP: node 0's driver updates the engine, and this node's
        # ranks take its instance name and report to it (`worker.engine_instance`, `reports`).
        log.info("TensorHub: node %d of this engine: node 0 drives its updates", node_rank)
        return
    if settings is not None:
        from tensorhub.engines import one_copy_per_engine
        from tensorhub_plugins.sglang.driver import Driver
        from tensorhub_plugins.sglang.naming import start_instance

        if settings.pause == "keep_kv":
            from tensorhub_plugins.sglang.salt import why_not

            problem = why_not(int(_arg("--tokenizer-worker-num", "1")))
            if problem is not None:
                log.error("TensorHub: TENSORHUB_PAUSE=keep_kv cannot be honoured (%s); "
                          "swaps pause as keep", problem)
                settings = settings.model_copy(update={"pause": "keep"})
        port = int(_arg("--port", "30000"))
        instance, status_dir = start_instance(settings, port)
        tp_size = int(_arg("--tp-size", _arg("--tp", _arg("--tensor-parallel-size", "1"))))
        pp_size = int(_arg("--pp-size", _arg("--pipeline-parallel-size", "1")))
        nodes = int(_arg("--nnodes", "1"))
        driver = Driver(settings, _arg("--host", "127.0.0.1"), port, tp_size, instance,
                        one_copy=one_copy_per_engine(tp_size, pp_size, nodes),
                        api_key=_arg("--api-key", ""), nodes=nodes,
                        tokenizer_workers=int(_arg("--tokenizer-worker-num", "1")))
        log.info("TensorHub SGLang instance %s (status directory %s)", instance, status_dir)
        if settings.pause == "keep_kv":
            from tensorhub_plugins.sglang.salt import salt_requests

            salt_requests(lambda: driver.swaps.epoch)
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.utils.common.kill_process_tree", _before_self_kill,
                              HookType.BEFORE)
    from tensorhub_plugins.sglang.routes import add_routes

    add_routes(driver)
    if driver is not None and settings is not None and settings.mode == "follow":
        driver.start()


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
            _start_main()
    except Exception:
        log.exception("TensorHub SGLang plugin failed to load; the server runs without it")
