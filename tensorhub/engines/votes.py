"""How the ranks of one engine agree on a swap, with a bound: a rank that hangs is named and
the others go on with the weights they have.

A gloo all-reduce waits for every rank as long as the group's timeout allows, and a group
whose collective timed out cannot be used again. So the ranks vote through the job's
key-value store instead (torch.distributed's default store, which every rank of the engine
reaches): each rank writes its answer under the round's key and waits for the others' at
most `timeout`. A round's outcome is fixed once, by compare-and-set, so a rank that arrives
after the others gave up on it reads the same "no" they acted on, and the rounds stay in
step. The ranks call the votes in the same order, so their round counters agree.
"""

from __future__ import annotations

import logging
from datetime import timedelta

log = logging.getLogger("tensorhub.engines")

YES, NO = b"1", b"0"


class RankVote:
    """The votes of the ranks `ranks` (global ranks) of one engine, as `rank`. `store`: a
    `torch.distributed.Store` every rank reaches (default: the job's)."""

    def __init__(self, ranks: list[int], rank: int, timeout: float, store=None):
        import torch.distributed as dist

        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        self.ranks = list(ranks)
        self.rank = rank
        self.timeout = timeout
        self.store = dist.PrefixStore("tensorhub/" + "-".join(map(str, self.ranks)), store)
        self.missing: list[int] = []  # ranks the last round went on without
        self._round = 0

    def _wait(self, keys: list[str]) -> bool:
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
            return True
        except RuntimeError:  # the store's timeout (DistStoreError)
            return False

    def __call__(self, ok: bool) -> bool:
        """Whether every rank is ready (each rank calls it once per round)."""
        self._round += 1
        r = self._round
        self.store.set(f"{r}/{self.rank}", YES if ok else NO)
        keys = [f"{r}/{k}" for k in self.ranks]
        if self._wait(keys):
            self.missing = []
            outcome = YES if all(self.store.get(k) == YES for k in keys) else NO
        else:
            self.missing = [k for k in self.ranks if not self.store.check([f"{r}/{k}"])]
            log.error("rank(s) %s of this engine did not answer within %.0f s: the others "
                      "go on without them and keep the weights they have",
                      ", ".join(map(str, self.missing)), self.timeout)
            outcome = NO
        return self.store.compare_set(f"{r}/outcome", "", outcome) == YES

    def broadcast(self, payload: bytes | None) -> bytes:
        """The first rank's `payload` to every rank (b"" where it did not come in time)."""
        self._round += 1
        key = f"{self._round}/payload"
        if self.rank == self.ranks[0]:
            self.store.set(key, payload or b"")
            return payload or b""
        if not self._wait([key]):
            log.error("rank %d of this engine did not share its copy within %.0f s",
                      self.ranks[0], self.timeout)
            return b""
        return self.store.get(key)
