"""The patches a worker keeps and serves: the newest few, each a version of the model's
companion patch model (`core/patch.py`), so that readers a version or two behind can pull
patches from any peer that has them, as they would pull a version."""

from __future__ import annotations

import logging

import torch

from tensorhub import settings
from tensorhub.core.data_types import Hold, Publish
from tensorhub.core.errors import TensorHubError
from tensorhub.core.layout import BoundLayout, manifest_of
from tensorhub.core.patch import patch_model, patch_tensor_name
from tensorhub.core.session import WorkerSession

log = logging.getLogger("tensorhub.patches")


def patch_layout(patch: bytes, base: int, device: str | torch.device = "cpu") -> BoundLayout:
    """A registered-to-be buffer holding `patch` as the one tensor of its version."""
    data = torch.frombuffer(bytearray(patch), dtype=torch.uint8)
    manifest = manifest_of([(patch_tensor_name(base), data)])
    layout = BoundLayout.allocate(manifest, device, bounded=False)
    layout.tensors[0].copy_(data)
    layout.pack()
    return layout


class HeldPatches:
    """A worker's retained patches of one model: held (served) until `keep` newer ones
    are, then withdrawn and their buffers given back."""

    def __init__(self, session: WorkerSession, model: str, keep: int = settings.PATCH_KEEP):
        self.session = session
        self.model = patch_model(model)
        self.keep = keep
        self._held: dict[int, BoundLayout] = {}
        self._retiring: dict[int, BoundLayout] = {}  # withdrawn while reads were in flight

    @property
    def newest(self) -> int:
        return max(self._held, default=0)

    def __contains__(self, version: int) -> bool:
        return version in self._held

    def layout(self, version: int) -> BoundLayout:
        return self._held[version]

    def publish(self, version: int, base: int, patch: bytes) -> bool:
        """A trainer offers the patch that makes its `version` from `base`; False (and
        readers pull the version whole) if the coordinator did not take it."""
        layout = patch_layout(patch, base)
        self.session.transport.register(layout.item_bytes)
        checksums = layout.checksums()
        try:
            self.session.call(Publish(
                worker_id=self.session.worker_id, model=self.model, version=version,
                manifest=layout.manifest, checksums=checksums, memory=layout.memory(),
                endpoint=self.session.transport.endpoint()))
        except TensorHubError as exc:
            self.session.transport.deregister(layout.item_bytes)
            log.warning("%s v%d: the patch from v%d was not published (%s); readers pull "
                        "the version whole", self.model, version, base, exc)
            return False
        self.session.remember(self.model, version, layout, Hold(
            worker_id=self.session.worker_id, model=self.model, version=version,
            layout_id=layout.layout_id, memory=layout.memory(), manifest=layout.manifest,
            checksums=checksums))
        self._keep(version, layout)
        return True

    def hold(self, version: int, layout: BoundLayout, checksums: list[str]) -> None:
        """A reader holds the patch it pulled (verified), and serves it."""
        self.session.hold(self.model, version, layout, checksums)
        self._keep(version, layout)

    def drop(self, version: int, layout: BoundLayout) -> None:
        """Give back the buffers of a patch whose pull failed: first stop serving the chunks
        of it we relayed and let reads of them end."""
        self._retire(version, layout)

    def _keep(self, version: int, layout: BoundLayout) -> None:
        self._held[version] = layout
        for old in sorted(self._held)[:-self.keep]:
            self._retire(old, self._held.pop(old))
        for old, stale in list(self._retiring.items()):
            self._retire(old, stale)

    def _retire(self, version: int, layout: BoundLayout) -> None:
        """Withdraw a patch and give its buffers back once no read of it is in flight; with
        reads still in flight after `PATCH_WITHDRAW_S`, try again at the next patch."""
        self._retiring.pop(version, None)
        try:
            self.session.withdraw(self.model, version, settings.PATCH_WITHDRAW_S, force=True)
        except TensorHubError as exc:
            log.info("%s v%d: %s; its buffers are given back later", self.model, version, exc)
            self._retiring[version] = layout
            return
        self.session.transport.deregister(layout.item_bytes)
