"""Striped forests: from whom a reader pulls each stripe of a version, decided once.

A version's chunks are dealt into `stripes` stripes (chunk c is in stripe c % stripes).
When a reader first asks for a version it gets one parent per stripe and pulls that stripe's
chunks from it as the parent gets them, learning what the parent has by reading the
parent's progress bytes one-sided (`core/stripes.py`). So the coordinator hears from a
reader a constant number of times per version, whatever the number of chunks; it hears
again only when a parent fails or falls behind.

The shape is SplitStream's: interior-node-disjoint trees. Every reader has a *home* stripe
and forwards only that one, to at most `fanout` children; in the other stripes it is a
leaf. Each reader then uploads at most one model's worth, every reader receives every
stripe at the rate of its parent's share, and each stripe's tree has depth about
log_fanout(readers / stripes), so the pipeline's tail is a few chunk times however many
readers there are. (If every reader forwarded every stripe, with as many parents as
children each, the trees would be chains.)

Online, readers arrive one by one and a leaf must not take a slot that a later interior
reader needs near the root: the forest is told how many readers to expect (the replicas
registered in the datacenter) and a leaf takes a free slot only while more slots are free
than interior readers are still to come, the deepest one. A leaf refused for now is told to
ask again (`pending`), but only while readers keep arriving (one within `settle` of the
last: a burst, as when a fleet hears of a version at once) and for `grace` at most: a reader
that asks alone (rollout workers told to sync one by one, readers that come after one that
failed) does not wait for readers that may come seconds later. It takes the deepest free
slot, even one an interior reader would have needed; that interior reader, finding no slot,
is handed its stripe by a reader ahead of it that receives the stripe without forwarding it
(`_relay`), in place of a slot of that reader's own home stripe: each reader still uploads
at most one model's worth, and the publisher keeps one child per stripe.

Complete holders (the publisher, replicas that hold the version) are roots: they have
every chunk, so they serve any stripe, `fanout // stripes` children in each; of equal depth,
the publisher's slots are taken last (a reader that comes once others hold the version
reads from them, not from the trainer a second time). Each datacenter has a forest of its
own; the first reader of a datacenter with no root in it becomes its gateway, pulling every
stripe from across the WAN once and feeding its datacenter as a root would. No I/O here:
the coordinator and the simulator both drive it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection
from dataclasses import dataclass, field

ROOT_DEPTH = 0
UNSET = 1 << 30  # depth in a stripe with no parent yet


@dataclass(slots=True)
class Member:
    """A reader of the version, or a complete holder (`root`)."""

    worker_id: str
    dc: str
    root: bool  # holds every chunk: serves any stripe, needs nothing
    home: int | None  # the stripe it forwards (None: none, or all if `gateway`)
    seq: int
    gateway: bool = False  # the first reader of its datacenter: forwards every stripe there
    parents: list[str | None] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)  # per stripe
    children: list[int] = field(default_factory=list)  # per stripe
    since: float = 0.0  # when it joined (a pending stripe waits `grace` from here)
    # Children it serves in stripes other than its home (`_relay`): each takes one of its
    # home stripe's slots, so that it still uploads at most one model's worth.
    handed: int = 0
    # The parents it read each stripe from last (kept when it completes): the next
    # version's forest starts from these (`adopt`).
    used: list[str | None] = field(default_factory=list)


class Forest:
    """One forest per (model, version, layout): every datacenter's trees in it. Choosing a
    parent costs O(log readers) (heaps of free slots per datacenter and stripe)."""

    def __init__(self, stripes: int = 2, fanout: int = 2, grace: float = 0.5,
                 settle: float = 0.1):
        """`grace`: the longest a leaf waits for a slot kept for interior readers still to
        come; `settle`: it waits only while readers keep arriving, one within this long of
        the last (`math.inf`: always up to `grace`, where waiting costs nothing)."""
        if stripes < 1 or fanout < 1:
            raise ValueError("stripes and fanout must be at least 1")
        self.stripes = stripes
        self.fanout = fanout
        self.grace = grace
        self.settle = settle
        self._last_join: dict[str, float] = {}  # dc -> when its latest reader joined
        self.members: dict[str, Member] = {}
        self._homes: dict[str, list[int]] = {}  # dc -> interior readers per stripe so far
        self._gateways: dict[str, int] = {}  # dc -> gateways
        self._arrived: dict[str, int] = {}  # dc -> readers that joined
        self._held: dict[str, int] = {}  # dc -> roots that never joined (held it already)
        self._free: dict[tuple[str, int], int] = {}  # (dc, stripe) -> free slots
        # (dc, stripe) -> heaps of (depth or -depth, seq, id): members with a free slot
        # (lazily cleaned: an entry is checked when it comes to the top)
        self._shallow: dict[tuple[str, int], list] = {}
        self._deep: dict[tuple[str, int], list] = {}
        self._seq = 0
        self.deepest = 0  # the deepest any reader has been, in any stripe
        self.publisher: str | None = None  # the version's publisher (a root), if known
        self.departed: dict[str, Member] = {}  # readers that withdrew: kept for `adopt`

    # ------------------------------------------------------------------ membership
    def _new(self, worker_id: str, dc: str, root: bool, home: int | None = None,
             gateway: bool = False, since: float = 0.0) -> Member:
        self._seq += 1
        m = Member(worker_id, dc, root, home, self._seq, gateway=gateway,
                   parents=[None] * self.stripes,
                   depth=[ROOT_DEPTH if root else UNSET] * self.stripes,
                   children=[0] * self.stripes, since=since)
        self.members[worker_id] = m
        return m

    def add_root(self, worker_id: str, dc: str = "", reader: bool = True) -> None:
        """A complete holder (the publisher, or a reader that now holds everything);
        `reader=False`: one not counted among the readers `join` expects (a publisher).
        Set `publisher` first: its slots are offered after every other root's."""
        m = self.members.get(worker_id)
        if m is None:
            m = self._new(worker_id, dc, root=True)
            self._held[dc] = self._held.get(dc, 0) + reader
            for s in range(self.stripes):
                self._offer(m, s, +self._capacity(m, s))
            return
        self.complete(worker_id)

    def remove(self, worker_id: str, keep_history: bool = False) -> None:
        """A member left or failed: its slots at its parents free up. Its children find out
        when their reads fail, and ask for another parent (`replace`). `keep_history`: it
        only stopped serving this version (it withdrew it to pull the next one): the next
        version's forest may still take it in with its parents (`adopt`)."""
        m = self.members.get(worker_id)
        if m is None:
            return
        if keep_history:
            self.departed[worker_id] = m
        for s in range(self.stripes):
            if m.root:
                self._offer(m, s, -max(0, self._capacity(m, s) - m.children[s]))
            else:
                self._detach(m, s)
        del self.members[worker_id]
        if m.gateway:
            self._gateways[m.dc] -= 1

    def forget(self, worker_id: str) -> None:
        """A worker left the fleet (died, unregistered): the next version's forest must not
        take it in as anyone's parent (`adopt`)."""
        self.remove(worker_id)
        self.departed.pop(worker_id, None)

    def join(self, worker_id: str, dc: str, expected: int, now: float,
             relay: bool = True) -> list[str | None]:
        """Parents for a new reader, one per stripe (None: pending, ask again). `expected`:
        workers the datacenter has in all, those that held the version before the forest
        began included (a slot reserve for interior readers still to come);
        `relay=False`: a reader that forwards nothing (it reads into a staging copy)."""
        if worker_id in self.members:
            return self.fill(worker_id, now, expected)
        homes = self._homes.setdefault(dc, [0] * self.stripes)
        self._arrived[dc] = self._arrived.get(dc, 0) + 1
        self._last_join[dc] = max(now, self._last_join.get(dc, now))
        local = any(self._free.get((dc, s), 0) for s in range(self.stripes)) \
            or self._gateways.get(dc, 0) or sum(homes)
        m = self._new(worker_id, dc, root=False, since=now)
        if relay and not local:
            m.gateway = True  # this datacenter's entry: every stripe from the nearest roots
            self._gateways[dc] = self._gateways.get(dc, 0) + 1
        elif relay:
            m.home = min(range(self.stripes), key=lambda s: (homes[s], s))
            homes[m.home] += 1
        for s in range(self.stripes):
            self._assign(m, s, expected, now)
        return list(m.parents)

    def fill(self, worker_id: str, now: float, expected: int = 0,
             avoid: Collection[str] = ()) -> list[str | None]:
        """Try again for the stripes a reader still has no parent for, or whose parent
        left the forest (`remove`: it died, or withdrew) before the reader named it as
        failed; from none in `avoid` (parents it failed to read)."""
        m = self.members[worker_id]
        for s in range(self.stripes):
            if m.parents[s] is not None and m.parents[s] not in self.members:
                self.replace(worker_id, s, set(avoid), now)  # shallower: no loop
            elif m.parents[s] is None:
                self._assign(m, s, expected, now, avoid)
        return list(m.parents)

    def replace(self, worker_id: str, stripe: int, avoid: set[str], now: float) -> str | None:
        """A new parent for `stripe`: the old one failed or fell behind. Never one of the
        reader's own descendants (a loop), and a shallower member first (it is ahead in
        the pipeline): the shallowest free slot, a shallower reader that hands the stripe
        down (`_relay`); then a free slot or a hand-down deeper; only then the least-loaded
        shallower member, one slot over its share (the orphans of a failed parent are
        more than the slots above them)."""
        m = self.members[worker_id]
        old = m.parents[stripe]
        limit = m.depth[stripe]
        self._detach(m, stripe)
        avoid = avoid | ({old} if old else set())
        best = self._top(m.dc, stripe, deep=False)
        if best is None or best is m or best.worker_id in avoid or best.depth[stripe] >= limit \
                or self._descends(best, m, stripe):
            best = self._relay(m, stripe, avoid, limit) \
                or self._scan(m, stripe, avoid, UNSET, free_only=True) \
                or self._relay(m, stripe, avoid, UNSET) \
                or self._scan(m, stripe, avoid, limit)
        if best is not None:
            self._attach(m, stripe, best)
        return m.parents[stripe]

    def complete(self, worker_id: str) -> None:
        """A reader holds every chunk now: a root from here on (its children stay)."""
        m = self.members.get(worker_id)
        if m is None or m.root:
            return
        for s in range(self.stripes):
            self._detach(m, s)
        m.root = True
        for s in range(self.stripes):
            m.depth[s] = ROOT_DEPTH
            self._offer(m, s, max(0, self._capacity(m, s) - m.children[s]))

    def adopt(self, worker_id: str, previous: Forest) -> list[str | None] | None:
        """Take in a reader of the previous version's forest with the parents it had then
        (that version's publisher replaced by this one's), and its ancestors first where
        they are not in yet: the next version's forest grows from the last one's, a reader
        and its ancestors at a time (O(depth)), as readers say they pull by their old
        parents. A stripe whose old parent is gone stays without one (see `fill`). None:
        the previous forest did not know it as a reader."""
        if not self._adoptable(worker_id, previous):
            return None
        self._take_in(worker_id, previous)
        for s in range(self.stripes):
            self._chain(worker_id, s, previous, set())
        return list(self.members[worker_id].parents)

    @staticmethod
    def _old(worker_id: str, previous: Forest) -> Member | None:
        return previous.members.get(worker_id) or previous.departed.get(worker_id)

    def _adoptable(self, worker_id: str, previous: Forest) -> bool:
        old = self._old(worker_id, previous)
        return old is not None and bool(old.used) and worker_id != previous.publisher

    def _take_in(self, worker_id: str, previous: Forest) -> Member:
        m = self.members.get(worker_id)
        if m is not None:
            return m
        old = self._old(worker_id, previous)
        m = self._new(worker_id, old.dc, root=False, home=old.home, gateway=old.gateway)
        if old.home is not None:
            self._homes.setdefault(old.dc, [0] * self.stripes)[old.home] += 1
        self._arrived[old.dc] = self._arrived.get(old.dc, 0) + 1
        if old.gateway:
            self._gateways[old.dc] = self._gateways.get(old.dc, 0) + 1
        return m

    def _chain(self, worker_id: str, stripe: int, previous: Forest, seen: set[str]) -> bool:
        """Attach `worker_id` in `stripe` to its old parent there, that parent first. True
        if it has a parent there now. The old parents may form a loop (a reader that read
        the version again, from a peer that had read it from this reader: engines restoring
        a version they had let go): a parent met twice is not taken (`fill` places it)."""
        m = self.members[worker_id]
        if m.root or m.depth[stripe] < UNSET:
            return True
        p = self._old(worker_id, previous).used[stripe]
        if p is None or p in seen:
            return False
        seen.add(worker_id)
        if p == previous.publisher:
            parent = self.members.get(self.publisher) if self.publisher else None
        elif self._adoptable(p, previous):
            parent = self._take_in(p, previous)
            if not self._chain(p, stripe, previous, seen):
                return False
        else:
            return False  # a parent that left, or one that never read it
        if parent is None or parent.depth[stripe] >= UNSET:
            return False
        self._attach(m, stripe, parent)
        return True

    # ------------------------------------------------------------------ choosing
    def _capacity(self, m: Member, stripe: int) -> int:
        if m.root or m.gateway:
            return max(1, self.fanout // self.stripes)
        return self.fanout - m.handed if m.home == stripe else 0

    def _assign(self, m: Member, stripe: int, expected: int, now: float,
                avoid: Collection[str] = ()) -> None:
        besides = tuple(m.parents)
        if m.gateway:  # the shallowest slot in any datacenter
            best = min((p for p in (self._top(dc, stripe, deep=False, besides=besides)
                                    for dc in {d for d, s in self._free if s == stripe})
                        if p is not None), key=lambda p: (p.depth[stripe], p.seq),
                       default=None) or self._scan(m, stripe, set(), UNSET, any_dc=True)
        elif m.home == stripe:
            best = self._top(m.dc, stripe, deep=False, besides=besides) \
                or self._relay(m, stripe, set(avoid), UNSET) \
                or self._scan(m, stripe, set(), UNSET)
        else:
            # A leaf leaves the slots interior readers still to come need, while readers
            # keep arriving (a burst: they come within a chunk time or so, and the forest
            # stays shallow); a reader that came alone, or last, does not wait for readers
            # that may come much later: it takes a slot now, and an interior reader that
            # finds none is handed the stripe by a reader that has it (`_relay`).
            waiting = now - m.since < self.grace \
                and now - self._last_join.get(m.dc, -math.inf) < self.settle
            best = None
            if not waiting or \
                    self._free.get((m.dc, stripe), 0) > self._reserve(m.dc, stripe, expected):
                best = self._top(m.dc, stripe, deep=True, besides=besides)
            if best is None and not waiting:
                best = self._relay(m, stripe, set(avoid), UNSET) \
                    or self._scan(m, stripe, set(), UNSET)
        if best is not None and (best.worker_id in avoid or self._descends(best, m, stripe)):
            best = self._relay(m, stripe, set(avoid), UNSET) \
                or self._scan(m, stripe, set(avoid), UNSET, any_dc=m.gateway)
        if best is not None:
            self._attach(m, stripe, best)

    def _descends(self, p: Member, m: Member, stripe: int) -> bool:
        """`p` reads `stripe` through `m`: it may not be `m`'s parent there (a loop, which
        no byte enters). Only a reader that kept children while it had no parent (its
        parent failed, or left) has descendants to check."""
        if not m.children[stripe]:
            return False
        for _ in range(len(self.members)):
            if p is m:
                return True
            parent = p.parents[stripe]
            if p.root or parent is None or (p := self.members.get(parent)) is None:
                return False
        return False

    def _reserve(self, dc: str, stripe: int, expected: int) -> int:
        """Interior readers of `stripe` still to come in `dc` (each needs a slot). Homes go
        round robin (to the stripe with the fewest), so after h of them stripe s has
        ceil((h - s) / stripes)."""
        homes = sum(self._homes.get(dc, ()))
        coming = homes + max(0, expected - self._arrived.get(dc, 0) - self._held.get(dc, 0))
        k = self.stripes
        return -(-(coming - stripe) // k) - -(-(homes - stripe) // k)

    def _top(self, dc: str, stripe: int, deep: bool,
             besides: tuple[str | None, ...] = ()) -> Member | None:
        """The shallowest (or deepest) member of `dc` with a free slot in `stripe`, one not
        in `besides` if there is such (a reader's parents in its other stripes: two
        parents share the load, and one death costs one stripe), unless that one is the
        publisher (one upload out of the trainer comes first)."""
        heap = (self._deep if deep else self._shallow).get((dc, stripe))
        skipped, found = [], None
        while heap:
            key, _, wid = heap[0]
            p = self.members.get(wid)
            if p is None or (-key if deep else key) != p.depth[stripe] \
                    or p.children[stripe] >= self._capacity(p, stripe):
                heapq.heappop(heap)  # stale
            elif wid in besides and len(skipped) < 8:
                skipped.append(heapq.heappop(heap))
            else:
                found = p
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if skipped and (found is None or found.worker_id == self.publisher):
            found = self.members[skipped[0][2]]
        return found

    def _relay(self, m: Member, stripe: int, avoid: set[str], limit: int) -> Member | None:
        """A reader that receives `stripe` without forwarding it (its home is another)
        and has a slot to spare in its home stripe: it hands `stripe` on to `m`, in place of
        that slot (`handed`). Where a leaf took the slot an interior reader of `stripe`
        needed (one that did not wait, or came before it), this keeps the publisher to one
        child per stripe: the leaf, ahead of `m`, passes the stripe down. The shallowest,
        then the earliest; O(members), only when no slot is free."""
        best_key, best = None, None
        besides = set(m.parents)
        for p in self.members.values():
            if p is m or p.root or p.gateway or p.home is None or p.home == stripe \
                    or p.dc != m.dc or p.worker_id in avoid or p.depth[stripe] >= limit \
                    or p.children[p.home] >= self._capacity(p, p.home) \
                    or self._descends(p, m, stripe):
                continue
            key = (p.depth[stripe], p.worker_id in besides, p.seq)
            if best_key is None or key < best_key:
                best_key, best = key, p
        return best

    def _scan(self, m: Member, stripe: int, avoid: set[str], limit: int,
              any_dc: bool = False, free_only: bool = False) -> Member | None:
        """Any member shallower than `limit` serving `stripe` (not below `m`), free slots
        first, then (unless `free_only`) the least loaded (a slot over its share), the
        publisher last (every stripe needs its one upload): the fallback, O(members)."""
        best_key, best = None, None
        for p in self.members.values():
            if p is m or p.worker_id in avoid or p.depth[stripe] >= limit:
                continue
            if (not any_dc and p.dc != m.dc) or self._capacity(p, stripe) == 0 \
                    or (free_only and p.children[stripe] >= self._capacity(p, stripe)) \
                    or self._descends(p, m, stripe):
                continue
            over = p.children[stripe] - self._capacity(p, stripe)
            key = (max(0, over + 1), over >= 0 and p.worker_id == self.publisher,
                   p.dc != m.dc, p.depth[stripe], p.seq)
            if best_key is None or key < best_key:
                best_key, best = key, p
        return best

    def _offer(self, m: Member, stripe: int, delta: int) -> None:
        """Count `delta` more free slots of `m` in `stripe`, and list it if it has any."""
        key = (m.dc, stripe)
        self._free[key] = self._free.get(key, 0) + delta
        if m.children[stripe] < self._capacity(m, stripe) and m.depth[stripe] < UNSET:
            # (of equal depth, the oldest first, but the publisher last: a reader that
            # comes once others hold the version reads from them, not from the trainer
            # again)
            publisher = m.worker_id == self.publisher
            heapq.heappush(self._shallow.setdefault(key, []),
                           (m.depth[stripe], (publisher, m.seq), m.worker_id))
            # (the deepest, newest first: a leaf leaves the old, shallow slots, and the
            # publisher's, to others)
            heapq.heappush(self._deep.setdefault(key, []),
                           (-m.depth[stripe], (publisher, -m.seq), m.worker_id))

    def _handed(self, p: Member, stripe: int, delta: int) -> None:
        """`p` serves one child more (or fewer) in `stripe`, not its home: one slot fewer
        (more) in its home stripe."""
        if p.root or p.gateway or p.home is None or p.home == stripe:
            return
        home = p.home
        before = max(0, self._capacity(p, home) - p.children[home])
        p.handed = max(0, p.handed + delta)
        change = max(0, self._capacity(p, home) - p.children[home]) - before
        if change and p.depth[home] < UNSET:
            self._offer(p, home, change)

    def _attach(self, m: Member, stripe: int, parent: Member) -> None:
        if not m.used:
            m.used = [None] * self.stripes
        m.used[stripe] = parent.worker_id
        m.parents[stripe] = parent.worker_id
        m.depth[stripe] = parent.depth[stripe] + 1
        self.deepest = max(self.deepest, m.depth[stripe])
        self._handed(parent, stripe, +1)
        parent.children[stripe] += 1
        if parent.children[stripe] <= self._capacity(parent, stripe):
            self._free[(parent.dc, stripe)] -= 1
        self._offer(m, stripe, max(0, self._capacity(m, stripe) - m.children[stripe]))

    def _detach(self, m: Member, stripe: int) -> None:
        """`m` stops reading `stripe` from its parent (its own depth there is unset)."""
        p = self.members.get(m.parents[stripe]) if m.parents[stripe] else None
        m.parents[stripe] = None
        if m.depth[stripe] < UNSET and not m.root:
            self._offer(m, stripe, -max(0, self._capacity(m, stripe) - m.children[stripe]))
            m.depth[stripe] = UNSET
        if p is not None:
            p.children[stripe] -= 1
            self._offer(p, stripe, 1 if p.children[stripe] < self._capacity(p, stripe) else 0)
            self._handed(p, stripe, -1)
