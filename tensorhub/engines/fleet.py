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

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq
import zmq.asyncio

from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    LAYOUT_LABEL,
    GetDeclared,
    GetManifest,
    HoldingsRequest,
    Manifest,
    TransferRecord,
)
from tensorhub.core.errors import CoordinatorError
from tensorhub.core.layout import layout_id, manifest_of
from tensorhub.core.net import reachable_announce


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
        self._announce_address = ""
        self._sub: zmq.asyncio.Socket | None = None  # announcements (`news`)

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
        self._announce_address = self._announce_address or reply.announce_address
        return Holdings(reply.latest, reply.holdings, reply.pulls)

    async def news(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for an announcement of the model (a version or
        its patch): whether one came. A front end that follows the model looks at once
        instead of at its next poll. Before the coordinator's announcement address is
        known (a first `holdings`), or on a view without a client of its own, it waits
        the whole `timeout`."""
        sub = self._subscription()
        if sub is None:
            await asyncio.sleep(timeout)
            return False
        if not await sub.poll(int(timeout * 1000)):
            return False
        while True:  # (take every announcement waiting: one look covers them)
            try:
                await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True

    def _subscription(self) -> zmq.asyncio.Socket | None:
        if self._sub is None and self._owned is not None and self._announce_address:
            self._sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, self.model.encode())
            self._owned.secure(self._sub)  # (CURVE with a token, as the client's requests)
            self._sub.connect(reachable_announce(self._announce_address,
                                                 self._owned.address))
        return self._sub

    def latest(self) -> int:
        """The model's newest version (0: none yet)."""
        return self.holdings([]).latest

    def declared(self) -> bool:
        """Whether the model's first version is declared (`Declare`) and not out yet."""
        try:
            self.caller.call(GetDeclared(model=self.model))
        except CoordinatorError as exc:
            if exc.code == "unknown_model":
                return False
            raise
        return True

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
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._owned is not None:
            self._owned.close()


def layout_labels(named: list[tuple[str, torch.Tensor]], compact_threshold: int
                  ) -> dict[str, str]:
    """The labels a worker registers with to serve `named` in their own layout."""
    return {LAYOUT_LABEL: layout_id(manifest_of(named, compact_threshold))}

