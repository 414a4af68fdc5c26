"""Whose word drops a holder: trust is earned, never taken on one reader's say-so.

A reader that fails to read from a holder, or finds that the bytes it served fail their
checksums, reports it (`ReadDone.failed_holders`, `ReadDone.bad_bytes`,
`ReplanStripes.failed`). That report alone only steers the reader: it stops being planned
onto that holder for `window` seconds and is re-planned elsewhere. The holder itself is
dropped when it stops heartbeating (the table's expiry), or when credible *witnesses* reach
`quorum` within `window`.

A witness is what the coordinator itself observed of the reporter, never what the reporter
says of itself: the address its registration came from (every registration from one host is
one witness, whatever labels it chose; the simulator, which has no sockets, falls back to
the `node` label). A witness loses its weight:
- while its reader has failed against `broken_after` distinct holders since its last good
  read (its transport, its network is the likelier fault);
- once `liar_after` of its reports were contradicted within `strike_window`: another
  witness read the holder it reported, successfully, under a lease begun after the report.
  Good reads of its own do not restore it; only time does.

A version's publisher (a trainer) and its last complete holder are never dropped on
reports: one misconfigured reader could otherwise make a version vanish for the whole
fleet.

Pure bookkeeping with an injected clock: no I/O, so the coordinator and the simulator run it
the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrustConfig:
    quorum: int = 2  # witnesses (addresses) of weight whose reports drop a holder
    window: float = 30.0  # seconds a report counts, and a reader avoids the holder it reported
    broken_after: int = 2  # distinct holders a reader failed on (no good read since): suspect
    liar_after: int = 2  # contradicted reports that take a witness's weight away ...
    strike_window: float = 600.0  # ... while they are this recent (seconds)


@dataclass
class Trust:
    config: TrustConfig = field(default_factory=TrustConfig)
    clock: Callable[[], float] = time.monotonic
    # holder -> {reader: (its witness, when it reported the holder, of bad bytes)}
    _reports: dict[str, dict[str, tuple[str, float, bool]]] = field(default_factory=dict)
    # witness -> when its reports were contradicted (a good read of the holder since)
    _strikes: dict[str, list[float]] = field(default_factory=dict)
    # reader -> {holder: until when the reader is not planned onto it}
    _avoid: dict[str, dict[str, float]] = field(default_factory=dict)
    # reader -> holders it failed on since its last good read
    _failed: dict[str, set[str]] = field(default_factory=dict)

    def avoided(self, reader: str) -> Collection[str]:
        """Holders `reader` must not be planned onto now (usually none: a cheap lookup)."""
        avoid = self._avoid.get(reader)
        if not avoid:
            return ()
        now = self.clock()
        for holder in [h for h, until in avoid.items() if until <= now]:
            del avoid[holder]
        if not avoid:
            del self._avoid[reader]
            return ()
        return avoid

    def steer(self, reader: str, holder: str) -> None:
        """`reader` is not planned onto `holder` for `window` seconds (its word on a holder
        it cannot report: it steers only itself)."""
        self._avoid.setdefault(reader, {})[holder] = self.clock() + self.config.window

    def credible(self, reader: str) -> bool:
        return len(self._failed.get(reader, ())) < self.config.broken_after

    def strikes(self, witness: str) -> int:
        """The witness's contradicted reports that still count."""
        times = self._strikes.get(witness)
        if not times:
            return 0
        since = self.clock() - self.config.strike_window
        times[:] = [t for t in times if t > since]
        if not times:
            del self._strikes[witness]
        return len(times)

    def weighs(self, reader: str, witness: str) -> bool:
        """Whether a report by `reader` (seen as `witness`) counts towards dropping."""
        return self.credible(reader) and self.strikes(witness) < self.config.liar_after

    def suspects(self) -> list[str]:
        """Readers whose own failures make them the likely fault."""
        return sorted(r for r in self._failed if not self.credible(r))

    def report(self, reader: str, holder: str, protected: bool, witness: str = "",
               bad_bytes: bool = False) -> bool:
        """`reader` (seen as `witness`; its id if unknown) failed to read from `holder`.
        True: drop the holder now (witnesses of weight reach a quorum, and it is not
        `protected`: a publisher, or the last complete holder)."""
        now = self.clock()
        self._avoid.setdefault(reader, {})[holder] = now + self.config.window
        self._failed.setdefault(reader, set()).add(holder)
        reports = self._reports.setdefault(holder, {})
        reports[reader] = (witness or reader, now, bad_bytes)
        for r in [r for r, (_, when, _) in reports.items()
                  if when <= now - self.config.window]:
            del reports[r]
        if protected:
            return False
        witnesses = {w for r, (w, _, _) in reports.items() if self.weighs(r, w)}
        return len(witnesses) >= self.config.quorum

    def read_ok(self, reader: str, holders: dict[str, bool] | None = None, witness: str = "",
                since: float | None = None) -> None:
        """A good read clears the reader's record: it is not the broken one. It read
        `holders` fine (holder -> whether it read the whole version from it; `witness`: as
        seen by us; `since`: when its lease began): a report of one of them by another
        witness, made before `since`, is contradicted (a report of bad bytes only by a
        read of the whole version), and counts against its witness."""
        self._failed.pop(reader, None)
        if since is None or not holders:
            return
        witness = witness or reader
        for holder, whole in holders.items():
            reports = self._reports.get(holder)
            if not reports:
                continue
            for r, (w, when, bad) in list(reports.items()):
                if w != witness and when <= since and (whole or not bad):
                    del reports[r]
                    self._strikes.setdefault(w, []).append(self.clock())

    def forget(self, worker: str) -> None:
        """A worker left (or was dropped): forget it as reader and as holder."""
        self._reports.pop(worker, None)
        self._avoid.pop(worker, None)
        self._failed.pop(worker, None)
        for avoid in self._avoid.values():
            avoid.pop(worker, None)
        for failed in self._failed.values():  # a dead holder says nothing of its readers
            failed.discard(worker)
        for reports in self._reports.values():
            reports.pop(worker, None)
