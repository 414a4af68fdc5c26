"""Names and files the SGLang main process and its schedulers agree on without talking.

SGLang runs the plugin's `register()` in its main process before it spawns the schedulers
(one per TP rank), and those inherit the main process's environment. So the main process
decides, once per launch, the instance's name and a private status directory, and puts both
in `os.environ` (`start_instance`); every scheduler reads them back (`instance_name`,
`status_path`). Nothing is keyed by `--host`/`--port` alone: two nodes started with the same
`--host 0.0.0.0 --port 30000`, or one node restarted, never share a worker name or a file.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile

from tensorhub import settings as env
from tensorhub.engines import EngineSettings

LOADER = "tensorhub_plugins.sglang.loader.apply"
# Set by the main process, inherited by the schedulers: this server's base worker name
# (`sglang-HOST:PORT-1a2b`, or `NAME-1a2b` with TENSORHUB_NAME) and its status directory.
INSTANCE_ENV = env.SGLANG_INSTANCE.name
STATUS_DIR_ENV = env.SGLANG_STATUS_DIR.name

log = logging.getLogger("tensorhub.sglang")


def start_instance(settings: EngineSettings, port: int) -> tuple[str, str]:
    """Main process, before SGLang spawns its schedulers: a fresh instance name (this
    machine's hostname, the port, a random id; as vLLM's) and a private status directory,
    both exported to the schedulers through the environment. Always fresh, even when the
    variables are already set (inherited from whatever launched us): a restart is a new
    instance. The directory is removed when the main process exits."""
    name = settings.instance_name("sglang", port)
    status_dir = tempfile.mkdtemp(prefix="tensorhub-sglang-")
    atexit.register(shutil.rmtree, status_dir, True)
    os.environ[INSTANCE_ENV] = name
    os.environ[STATUS_DIR_ENV] = status_dir
    return name, status_dir


def remove_status_dir() -> None:
    """Remove this instance's status directory now, for exits that skip `atexit` (SGLang's
    main process SIGKILLs itself when a scheduler dies, e.g. on a process-group SIGTERM)."""
    status_dir = env.SGLANG_STATUS_DIR.get()
    if status_dir:
        shutil.rmtree(status_dir, ignore_errors=True)


def instance_name(settings: EngineSettings, port: int) -> str:
    """Scheduler side: the name the main process chose. Without one (SGLang embedded as
    `sglang.Engine`, where no server main process ran `start_instance`) this process makes
    its own, unique but not shared with other ranks, and logs why."""
    name = env.SGLANG_INSTANCE.get()
    if not name:
        name = settings.instance_name("sglang", port)
        os.environ[INSTANCE_ENV] = name
        log.warning("no %s from SGLang's main process; this scheduler names itself %s",
                    INSTANCE_ENV, name)
    return name


def worker_name(instance: str, tp_rank: int) -> str:
    """The holder of one rank's checkpoint-layout copy."""
    return f"{instance}-tp{tp_rank}"


def native_worker_name(instance: str, tp_rank: int) -> str:
    """The holder of the live parameters (native layout): a worker of its own, so that
    withdrawing one layout never touches the other's references."""
    return worker_name(instance, tp_rank) + "-native"


def status_path(tp_rank: int) -> str | None:
    """Where a scheduler records the version it last applied (its loader cannot answer the
    HTTP request that called it, so the driver reads this to confirm a swap); None when no
    server main process made a status directory (then nobody would read it)."""
    status_dir = env.SGLANG_STATUS_DIR.get()
    return os.path.join(status_dir, f"tp{tp_rank}.json") if status_dir else None


def write_json(path: str, data: dict) -> None:
    """Write `data` whole or not at all (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
