"""Whose word drops a holder: trust is earned, never taken on one reader's say-so.

A reader that fails to read from a holder reports it (`ReadDone.failed_holders`). That report
alone only steers the reader: it stops being planned onto that holder for `window` seconds
and is re-planned elsewhere. The holder itself is dropped when it stops heartbeating (the
table's expiry), or when credible readers on `quorum` distinct nodes report it within
`window` (the ranks of one engine, or the workers of one misconfigured host, are one
witness, not several). A reader that has failed against `broken_after` distinct holders since its
last good read is the likelier fault (its transport, its network): its reports stop
counting. A version's publisher (a trainer) and its last complete holder are never dropped
on reports: one misconfigured reader could otherwise make a version vanish for the whole
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
    quorum: int = 2  # distinct nodes whose credible readers' failed reads drop a holder
    window: float = 30.0  # seconds a report counts, and a reader avoids the holder it reported
    broken_after: int = 2  # distinct holders a reader failed on (no good read since): suspect


@dataclass
class Trust:
    config: TrustConfig = field(default_factory=TrustConfig)
    clock: Callable[[], float] = time.monotonic
    # holder -> {reader: (its node, when it reported the holder)}
    _reports: dict[str, dict[str, tuple[str, float]]] = field(default_factory=dict)
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

    def credible(self, reader: str) -> bool:
        return len(self._failed.get(reader, ())) < self.config.broken_after

    def suspects(self) -> list[str]:
        """Readers whose own failures make them the likely fault."""
        return sorted(r for r in self._failed if not self.credible(r))

    def report(self, reader: str, holder: str, protected: bool, node: str = "") -> bool:
        """`reader` (on `node`; its id if unknown) failed to read from `holder`. True: drop
        the holder now (credible readers on a quorum of nodes agree, and it is not
        `protected`: a publisher, or the last complete holder)."""
        now = self.clock()
        self._avoid.setdefault(reader, {})[holder] = now + self.config.window
        self._failed.setdefault(reader, set()).add(holder)
        reports = self._reports.setdefault(holder, {})
        reports[reader] = (node or reader, now)
        for r in [r for r, (_, when) in reports.items() if when <= now - self.config.window]:
            del reports[r]
        if protected:
            return False
        nodes = {n for r, (n, _) in reports.items() if self.credible(r)}
        return len(nodes) >= self.config.quorum

    def read_ok(self, reader: str) -> None:
        """A good read clears the reader's record: it is not the broken one."""
        self._failed.pop(reader, None)

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
