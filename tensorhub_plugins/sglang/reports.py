"""Where each scheduler's report (`status.SchedulerStatus`) travels to the driver.

On one node the driver's main process and every scheduler share a private status directory
(`naming.status_path`): a report is a file. Across nodes that directory is local to each
node, and only node 0's main process drives (it serves HTTP), so a rank on another node
would report where nobody reads. There every rank reports to the engine's own distributed
store instead (torch.distributed's TCPStore, hosted by global rank 0, which every rank of the
engine reaches across hosts), under the instance's name, and node 0's driver reads it there.
The driver learns the store's address from rank 0, which runs beside it on node 0 and writes
it into the shared status directory (`publish_store_address`): SGLang may place the store at
`--dist-init-addr` or wherever its own settings say, and rank 0 reads it off the store itself.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorhub import settings as env
from tensorhub_plugins.sglang.naming import status_path, write_json

log = logging.getLogger("tensorhub.sglang")

STORE_FILE = "store.json"  # in node 0's status directory: where the engine's store listens
STORE_TIMEOUT_S = 10.0  # a store operation of the driver's (it must never hang the route)


class Reports(Protocol):
    """A channel a scheduler writes its report to and the driver reads it from."""

    def write(self, rank: int, report: str) -> None: ...

    def read(self, rank: int) -> str | None: ...


class DirectoryReports:
    """One node: a file per rank in the instance's status directory (none: nobody reads)."""

    def write(self, rank: int, report: str) -> None:
        path = status_path(rank)
        if path is not None:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(report)
            os.replace(tmp, path)

    def read(self, rank: int) -> str | None:
        path = status_path(rank)
        if path is None:
            return None
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None


class StoreReports:
    """Several nodes: a key per rank in the engine's distributed store, under the instance's
    name (a restarted engine is a new instance: it never reads an old one's reports)."""

    def __init__(self, store, instance: str):
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"tensorhub-report/{instance}", store)

    def write(self, rank: int, report: str) -> None:
        self.store.set(f"tp{rank}", report.encode())

    def read(self, rank: int) -> str | None:
        key = f"tp{rank}"
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except (RuntimeError, OSError, ValueError):  # the store is gone (the engine stops)
            return None


class StoreAddress(BaseModel):
    """Where the engine's distributed store listens (rank 0 tells node 0's driver)."""

    model_config = ConfigDict(extra="forbid")
    host: str = Field(min_length=1, max_length=256)
    port: int = Field(ge=1, le=65535)


def engine_store():
    """This rank's handle on the engine's distributed store: the TCPStore under the
    process group's prefixes (a scheduler's, once SGLang initialised torch.distributed)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def publish_store_address(store) -> None:
    """Rank 0 (on node 0): tell the driver beside it where the engine's store listens."""
    status_dir = env.SGLANG_STATUS_DIR.get()
    if not status_dir:
        return
    address = StoreAddress(host=store.host, port=store.port)
    write_json(os.path.join(status_dir, STORE_FILE), address.model_dump())


def connect_store_reports(instance: str) -> StoreReports | None:
    """The driver's side: the engine's store, once rank 0 has said where it is (None
    before that, or when it cannot be reached yet)."""
    status_dir = env.SGLANG_STATUS_DIR.get()
    if not status_dir:
        return None
    try:
        with open(os.path.join(status_dir, STORE_FILE)) as f:
            address = StoreAddress.model_validate(json.load(f))
    except (OSError, ValueError, ValidationError):
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(address.host, address.port, None, False,
                              timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        log.warning("TensorHub: cannot reach the engine's store at %s:%d yet: %s",
                    address.host, address.port, exc)
        return None
    log.info("TensorHub: the ranks report through the engine's store at %s:%d",
             address.host, address.port)
    return StoreReports(store, instance)
