"""Carrying out a read plan: group ranges by source, read them, verify the bytes.

Kept apart from `Replica` so that its whole-item reads, its striped reads (`reader/striped.py`)
and a patch's pull (`reader/patches.py`) read and verify ranges the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tensorhub import settings
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import MemoryDesc, ReadPlan, ReadRange
from tensorhub.core.errors import IntegrityError, TransferError
from tensorhub.core.transport import Peer, ReadOp, Transport


@dataclass
class PullStats:
    """What one pull did; engines log it and the demo prints it."""

    model: str
    version: int
    sources: list[str]
    nbytes: int
    seconds: float
    verify_seconds: float = 0.0
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


BATCH_BYTES = 64 << 20  # progress is tracked per batch: a failure loses at most this much


def split(plan: ReadPlan, batch_bytes: int | None = None) -> list[ReadRange]:
    """The plan's ranges cut into pieces of at most `batch_bytes` (idempotent)."""
    batch_bytes = batch_bytes or BATCH_BYTES
    pieces = []
    for r in plan.ranges:
        for off in range(0, max(r.nbytes, 1), batch_bytes):
            n = min(batch_bytes, r.nbytes - off)
            pieces.append(r.model_copy(update={"offset": r.offset + off, "nbytes": n}))
    return pieces


def read_op(dest: list[torch.Tensor], memory: list[MemoryDesc], item: int, offset: int,
            nbytes: int) -> ReadOp:
    """Bytes [offset, offset + nbytes) of `item`: from a holder's region to ours."""
    m = memory[item]
    return ReadOp(local=dest[item][offset:offset + nbytes],
                  remote=MemoryDesc(addr=m.addr + offset, nbytes=nbytes, device=m.device,
                                    mem=m.mem))


def read_plan(transport: Transport, plan: ReadPlan, dest: list[torch.Tensor],
              timeout: float, done: set[tuple[int, int, int]] | None = None,
              stats: PullStats | None = None, batch_bytes: int | None = None,
              stall_timeout: float | None = None,
              verifier: Verifier | None = None,
              on_batch: Callable[[list[ReadRange]], None] | None = None) -> PullStats:
    """Read the ranges of `plan` into `dest` (one uint8 buffer per item), in batches of at
    most `batch_bytes`. Every range read is added to `done` (and ranges already in it are
    skipped), so after a `TransferError` (which names the failing source) the caller knows
    exactly which bytes are still missing and re-plans only those. `stats` (if given)
    accumulates across such attempts. A batch taking longer than `stall_timeout` fails like
    a dead source, and the connection to that source is dropped so that none of its late
    bytes can land after the ranges were read again elsewhere. A `verifier` is told of every
    range read, and checks each item as soon as it is complete, while later batches read.
    `on_batch` is called with the ranges of each batch once they have landed (a chunked
    reader reports the chunks it finished there, and serves them from then on)."""
    if len(dest) != len(plan.checksums):
        raise ValueError(f"{len(dest)} destination items for a plan of {len(plan.checksums)}")
    done = set() if done is None else done
    batch_bytes = batch_bytes or BATCH_BYTES
    sources = {s.worker_id: s for s in plan.sources}
    batches: list[tuple[str, list[ReadRange]]] = []
    filled = 0  # bytes in the last batch
    for r in split(plan, batch_bytes):
        if r.key() in done:
            continue
        if batches and batches[-1][0] == r.source and filled + r.nbytes <= batch_bytes:
            batches[-1][1].append(r)
            filled += r.nbytes
        else:
            batches.append((r.source, [r]))
            filled = r.nbytes
    if stats is None:
        stats = PullStats(plan.model, plan.version, [], 0, 0.0)
    deadline = time.monotonic() + timeout
    # A batch with no progress this long means a stalled holder (SIGSTOP, a hung engine, a
    # dead link with no reset): it is reported like a dead one and the pull re-planned.
    stall_timeout = settings.STALL_TIMEOUT.get() if stall_timeout is None else stall_timeout
    for sid, ranges in batches:
        src = sources[sid]
        ops = [read_op(dest, src.memory, r.item, r.offset, r.nbytes) for r in ranges]
        started = time.perf_counter()
        try:
            transport.read(Peer(sid, src.endpoint, src.grant), ops,
                           timeout=max(0.001, min(stall_timeout, deadline - time.monotonic())))
        except TransferError:
            transport.forget_peer(sid)
            raise
        finally:
            stats.seconds += time.perf_counter() - started
        done.update(r.key() for r in ranges)
        if verifier is not None:
            for r in ranges:
                verifier.add(r.item, r.nbytes)
        nbytes = sum(r.nbytes for r in ranges)
        if src.name not in stats.by_source:
            stats.sources.append(src.name)
        stats.by_source[src.name] = stats.by_source.get(src.name, 0) + nbytes
        stats.nbytes += nbytes
        if on_batch is not None:
            on_batch(ranges)
    return stats


class Verifier:
    """Checksums each item on a background thread as soon as all its bytes have arrived, so
    verification overlaps the reads of later batches instead of following them (xxh3 runs
    without the GIL). `finish` waits for the last item and raises the first mismatch."""

    def __init__(self, plan: ReadPlan, dest: list[torch.Tensor]):
        if len(dest) != len(plan.checksums):
            raise ValueError(f"{len(dest)} destination items for a plan of "
                             f"{len(plan.checksums)}")
        self._plan = plan
        self._dest = dest
        self._left = [b.numel() * b.element_size() for b in dest]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorhub-verify")
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self.seconds = 0.0  # time spent checksumming (on the background thread)
        self.bad: dict[int, IntegrityError] = {}  # items whose checksum failed
        for k, left in enumerate(self._left):
            if left == 0:
                self._submit(k)

    def _submit(self, k: int) -> None:
        self._left[k] = -1  # submitted
        self._futures.append(self._pool.submit(self._check, k))

    def _check(self, k: int) -> None:
        started = time.perf_counter()
        try:
            check_item(self._plan, k, self._dest[k])
        except IntegrityError as exc:
            with self._lock:
                self.bad[k] = exc
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - started

    def add(self, item: int, nbytes: int) -> None:
        """`nbytes` more of `item` have arrived (each byte reported once; any thread)."""
        with self._lock:
            if self._left[item] > 0:
                self._left[item] -= nbytes
                if self._left[item] <= 0:
                    self._submit(item)

    def finish(self) -> float:
        """Wait until every item is checked; raise `IntegrityError` on a mismatch (its
        `items`: every item that failed), or `ValueError` if some item never arrived
        completely. Returns the checksum seconds."""
        try:
            with self._lock:
                futures = list(self._futures)
            for f in futures:
                f.result()
            missing = [k for k, left in enumerate(self._left) if left > 0]
            if missing:
                raise ValueError(f"items {missing[:5]} were never read completely")
            if self.bad:
                items = sorted(self.bad)
                exc = IntegrityError(f"{self.bad[items[0]]}"
                                     + (f" (and {len(items) - 1} more item(s))"
                                        if len(items) > 1 else ""))
                exc.items = items
                raise exc
            return self.seconds
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def read_verified(plan: ReadPlan, dest: list[torch.Tensor],
                  read: Callable[[Verifier | None], None], verify: bool = True) -> float:
    """Read a plan's bytes into `dest` (`read`, which tells the verifier it is given, None
    when `verify` is off, what has landed) while each item is checksummed as soon as it is
    complete; returns the seconds spent checksumming. Raises what the read raised, or,
    once everything was read, the first mismatch (`IntegrityError`, its `items` every
    item that failed) or `ValueError` for an item never read completely."""
    verifier = Verifier(plan, dest) if verify else None
    try:
        read(verifier)
    except BaseException:
        if verifier is not None:
            verifier.close()
        raise
    return verifier.finish() if verifier is not None else 0.0


def check_item(plan: ReadPlan, k: int, buf: torch.Tensor) -> None:
    got = checksum(buf)
    if got != plan.checksums[k]:
        raise IntegrityError(
            f"{plan.model} v{plan.version}: item {k} ({buf.numel()} bytes) has checksum "
            f"{got}, expected {plan.checksums[k]}: torn or stale bytes, refusing them")


def verify(plan: ReadPlan, dest: list[torch.Tensor]) -> float:
    """Compare each item's checksum with the version's; return the seconds it took."""
    started = time.perf_counter()
    if len(dest) != len(plan.checksums):
        raise ValueError(f"{len(dest)} destination items for a plan of {len(plan.checksums)}")
    for k, buf in enumerate(dest):
        check_item(plan, k, buf)
    return time.perf_counter() - started
