"""Whether a rank loaded only what its node's copy holds of a version in tiles.

A node's copy of a version in tiles holds its ranks' share (`tensorhub/tiles.py`) and hands
the engine whole-shaped tensors whose other rows and columns are NaN
(`parted.whole_tensors`). Which rows a rank's loaders read is decided by a rule (the tiled
names, the plugins' `_share`), not learnt from the engine, so the first load from a share
is followed by a scan of the rank's live parameters: a NaN there means a loader read
outside the share. The load then fails (the engine restores the version before), and the
copies pull versions whole from then on (`CheckpointCopy.pull_whole_versions`). The
share of a rank depends on the tile count only, so each tile count is checked once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from tensorhub.core.errors import TensorHubError

log = logging.getLogger("tensorhub.engines")


class ShareCheck:
    """One per rank: scans the live parameters after its first load from a share of a
    version in each tile count."""

    def __init__(self) -> None:
        self.passed: set[int] = set()  # tile counts whose first load passed

    def after_load(self, params: Iterable[tuple[str, torch.Tensor]],
                   share_tiles: int | None) -> None:
        """Raise `TensorHubError` ("outside_share") if a parameter holds NaN after the
        first load from a share of a version in `share_tiles` tiles (None: not a share)."""
        if share_tiles is None or share_tiles in self.passed:
            return
        for name, param in params:
            try:
                bad = param.is_floating_point() and bool(torch.isnan(param).any())
            except RuntimeError:  # (a dtype isnan does not take: fp8 on some builds)
                continue
            if bad:
                raise TensorHubError(
                    f"{name} holds NaN after a load from this node's share of a version in "
                    f"tiles: this engine loads rows outside the tiles its TP ranks were "
                    f"given. Its copies pull every part of each version from now on",
                    code="outside_share")
        self.passed.add(share_tiles)
        log.info("TensorHub: this rank loads only its node's share of versions in %d tiles "
                 "(checked once)", share_tiles)
