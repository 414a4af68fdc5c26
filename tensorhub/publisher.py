"""The trainer's side: publish a version of its weights in one call.

By default `publish` snapshots the trainer's tensors into buffers the publisher owns and
registers once (the copy is the trainer's only cost), so the trainer may run its next
optimizer step at once. With `zero_copy=True` peers read the trainer's own tensors: no copy,
but the trainer must not touch them until `release()` (or the next `publish`) returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch

from tensorhub.core.data_types import GetManifest, Hold, Publish
from tensorhub.core.errors import CoordinatorError
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of
from tensorhub.core.session import WorkerSession
from tensorhub.core.transport import Transport

log = logging.getLogger("tensorhub.publisher")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(name, t.detach()) for name, t in items]


class Publisher:
    def __init__(
        self,
        coordinator: str,
        model: str,
        *,
        name: str = "trainer",
        transport: str | Transport | None = None,
        zero_copy: bool = False,
        compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
        release_timeout: float = 60.0,
        token: str | None = None,
        timeout: float = 10.0,
        labels: dict[str, str] | None = None,
    ):
        self.model = model
        self.zero_copy = zero_copy
        self.compact_threshold = compact_threshold
        self.release_timeout = release_timeout
        self.session = WorkerSession(coordinator, name, "trainer", transport, labels, token,
                                     timeout)
        self._layout: BoundLayout | None = None
        self.version: int | None = None

    def _latest(self) -> int:
        try:
            return self.session.client.call(GetManifest(model=self.model)).version
        except CoordinatorError as exc:
            if exc.code in ("unknown_model", "unknown_version"):
                return 0
            raise

    def publish(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Register the tensors (checkpoint layout) as `version` (default: latest + 1) and
        announce it. Returns the version. Raises `CoordinatorError` ("stale_version") for a
        version that is not newer than the model's latest, before touching anything."""
        named = named_list(named_tensors)
        latest = self._latest()
        version = latest + 1 if version is None else version
        if version <= latest:
            raise CoordinatorError(
                f"model {self.model!r} is at version {latest}; cannot publish {version}",
                code="stale_version")
        manifest = manifest_of(named, self.compact_threshold)
        self.release()  # our buffers are about to change: end reads of the old version first
        tensors = [t for _, t in named]
        if self.zero_copy:
            layout = BoundLayout(manifest, tensors)
        elif self._layout is not None and self._layout.manifest == manifest:
            layout = self._layout
            layout.copy_large_from(tensors)
        else:
            if self._layout is not None:
                self.session.transport.deregister(self._layout.item_bytes)
            layout = BoundLayout.allocate(manifest, tensors[0].device if tensors else "cpu")
            layout.copy_large_from(tensors)
        layout.pack(tensors)
        if self._layout is not None and self._layout is not layout and self.zero_copy:
            self.session.transport.deregister(self._layout.item_bytes)
        self.session.transport.register(layout.item_bytes)
        checksums = layout.checksums()
        reply = self.session.call(Publish(
            worker_id=self.session.worker_id, model=self.model, version=version,
            manifest=manifest, checksums=checksums, memory=layout.memory(),
            endpoint=self.session.transport.endpoint()))
        self._layout = layout
        self.version = version
        # Kept so a restarted coordinator learns of this version again (soft state).
        self.session.remember(self.model, version, layout, Hold(
            worker_id=self.session.worker_id, model=self.model, version=reply.version,
            layout_id=layout.layout_id, memory=layout.memory(), manifest=manifest,
            checksums=checksums))
        log.info("published %s v%d (%.1f MiB, layout %s)", self.model, version,
                 layout.nbytes / 2**20, layout.layout_id)
        return version

    def release(self, timeout: float | None = None) -> None:
        """Stop serving the current version and wait (bounded) until reads of it end; after
        this the trainer may modify tensors published with `zero_copy=True`."""
        if self.version is not None:
            self.session.withdraw(self.model, self.version,
                                  self.release_timeout if timeout is None else timeout)
            self.version = None

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

