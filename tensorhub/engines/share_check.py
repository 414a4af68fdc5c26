"""Whether a rank loaded only what its node's copy holds of a version in tiles.

A node's copy of a version in tiles holds its ranks' share (`tensorhub/tiles.py`) and hands
the engine whole-shaped tensors whose other rows and columns are NaN
(`parted.whole_tensors`). Which rows a rank's loaders read is decided by a rule (the tiled
names, the plugins' `_share`), not learnt from the engine, so the first load from a share
is followed by a scan of the rank's live parameters of tiled weights: a NaN there means a loader
read outside the share. The load then fails (the engine restores the version before), and
the engine pulls versions whole from then on. A rank's share depends on how the version
is tiled only (`Manifest.tiling`: its tiles, K/V heads, experts), so each tiling is checked
once. Parameters an engine packs away after loading
(vLLM's CPU build keeps its linear weights out of its parameters) cannot be scanned; the
log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from tensorhub.core.errors import TensorHubError

log = logging.getLogger("tensorhub.engines")

# The live parameters tiled checkpoint tensors are loaded into (fused or not; a mixture of
# experts' fused `experts.w13_weight` and `experts.w2_weight` too).
TILED_PARAMS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj",
                "gate_up_proj", "o_proj", "down_proj", "embed_tokens", "lm_head", "experts")
_CHUNK = 1 << 24  # elements scanned at a time (a bounded scratch mask on a full device)


def _has_nan(param: torch.Tensor) -> bool:
    flat = param.detach().reshape(-1)
    return any(bool(torch.isnan(piece).any()) for piece in flat.split(_CHUNK))


class ShareCheck:
    """One per rank: scans the parameters its tiled weights load into after its first load
    from a share of a version in each tile count."""

    def __init__(self) -> None:
        self.passed: set[str] = set()  # tilings whose first load passed

    def after_load(self, params: Iterable[tuple[str, torch.Tensor]],
                   share_layout: str | None) -> None:
        """Raise `TensorHubError` ("outside_share") if a parameter a tiled weight loads
        into holds NaN after the first load from a share of a version tiled as
        `share_layout` (`Manifest.tiling`; None: not a share)."""
        if share_layout is None or share_layout in self.passed:
            return
        scanned, packed = 0, 0
        for name, param in params:
            if not any(f".{p}." in f".{name}" for p in TILED_PARAMS):
                continue
            if not param.numel():  # (its weights packed away by the engine)
                packed += 1
                continue
            if not param.is_floating_point():
                continue
            try:
                bad = _has_nan(param)
            except Exception:  # (a dtype isnan does not take: fp8 on some builds)
                continue
            if bad:
                raise TensorHubError(
                    f"{name} holds NaN after a load from this node's share of a version in "
                    f"tiles: this engine loads rows outside the tiles its TP ranks were "
                    f"given. It pulls every part of each version from now on",
                    code="outside_share")
            scanned += 1
        self.passed.add(share_layout)
        if scanned:
            log.info("TensorHub: this rank loads only its node's share of versions in %s "
                     "(%d tiled weights checked, once)", share_layout, scanned)
        if packed:
            log.info("TensorHub: %d of this rank's tiled weights are not parameters after "
                     "loading (packed by the engine): its loads of them from a share of "
                     "versions in %s cannot be checked", packed, share_layout)
