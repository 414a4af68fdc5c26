"""The questions an engine asks the coordinator about its model, as small typed queries.

An engine's front end decides when to swap from a few facts: the model's newest version,
which versions its own workers hold (and their last pulls, for its /metrics), who holds a
version in a given byte layout (SGLang's native layout: a same-layout peer can be read
straight into the live parameters), and a version's manifest. Each is one targeted message
(`HoldingsRequest`, `GetManifest`), never the operator's whole-fleet status. Layouts are
named by layout id, never guessed from worker names: a worker that serves a layout before it
holds a version in it says so when it registers (`layout_labels`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    LAYOUT_LABEL,
    GetManifest,
    HoldingsRequest,
    Manifest,
    TransferRecord,
)
from tensorhub.core.layout import layout_id, manifest_of


class Caller(Protocol):
    """What sends a request to the coordinator: a `CoordinatorClient`, or a worker's session
    (which asks as that worker)."""

    def call(self, request, timeout: float | None = None): ...


@dataclass(frozen=True)
class Holdings:
    """What some workers hold of the model, and its newest version (0: none yet)."""

    latest: int
    held: dict[str, list[int]]  # worker name -> versions it holds completely
    pulls: dict[str, TransferRecord] = field(default_factory=dict)  # its last pull

    def common(self) -> int | None:
        """The newest version every one of the workers holds (None: there is none)."""
        every = set.intersection(*(set(v) for v in self.held.values())) if self.held else set()
        return max(every) if every else None


@dataclass(frozen=True)
class LayoutHolders:
    """Who holds which versions of the model in one layout; a worker that registered as
    serving the layout and holds nothing at the moment (it is applying a version) has []."""

    layout_id: str
    held: dict[str, list[int]]

    def held_by_others(self, version: int, ours: Iterable[str]) -> bool:
        """Whether a worker not in `ours` holds `version` in this layout."""
        mine = set(ours)
        return any(version in vs for name, vs in self.held.items() if name not in mine)

    def others(self, ours: Iterable[str]) -> bool:
        """Whether a worker not in `ours` serves this layout (holding a version or not)."""
        return bool(set(self.held) - set(ours))


class FleetView:
    """The coordinator's answers about `model`, through `caller` (a client or a session)."""

    def __init__(self, caller: Caller, model: str):
        self.caller = caller
        self.model = model
        self._owned: CoordinatorClient | None = None

    @classmethod
    def connect(cls, coordinator: str, model: str, *, token: str | None = None,
                timeout: float | None = None) -> FleetView:
        """A view over a client of its own (closed by `close`); `timeout`: each call's
        (default: the client's)."""
        client = CoordinatorClient(coordinator, token=token, **(
            {} if timeout is None else {"timeout": timeout}))
        view = cls(client, model)
        view._owned = client
        return view

    def holdings(self, names: list[str]) -> Holdings:
        reply = self.caller.call(HoldingsRequest(model=self.model, names=names))
        return Holdings(reply.latest, reply.holdings, reply.pulls)

    def latest(self) -> int:
        """The model's newest version (0: none yet)."""
        return self.holdings([]).latest

    def in_layout(self, layout: str) -> LayoutHolders:
        reply = self.caller.call(HoldingsRequest(model=self.model, names=[], layout_id=layout))
        return LayoutHolders(layout, reply.in_layout)

    def manifests(self, version: int) -> list[Manifest]:
        """The manifests of `version`, one per part (raises `CoordinatorError` when the
        coordinator no longer has it)."""
        first = self.caller.call(GetManifest(model=self.model, version=version))
        return [first.manifest] + [
            self.caller.call(GetManifest(model=self.model, version=version, part=k)).manifest
            for k in range(1, first.parts)]

    def close(self) -> None:
        if self._owned is not None:
            self._owned.close()


def layout_labels(named: list[tuple[str, torch.Tensor]], compact_threshold: int
                  ) -> dict[str, str]:
    """The labels a worker registers with to serve `named` in their own layout."""
    return {LAYOUT_LABEL: layout_id(manifest_of(named, compact_threshold))}

