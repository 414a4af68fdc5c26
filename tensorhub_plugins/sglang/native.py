"""SGLang's live parameters as a TensorHub holder, in SGLang's native layout.

On CPU SGLang keeps every parameter as a plain contiguous buffer whose storage never moves
(docs/notes/sglang-0.5.23-cpu.md §2), so the parameters are registered as they are: fused
qkv/gate_up, the TP shard of this scheduler. Tensors of at least `NATIVE_COMPACT_THRESHOLD`
bytes are read from and written into the memory SGLang infers with; the small ones (norms,
biases) travel packed in one compact region, the only memory TensorHub adds here.

Between engines of the same layout a version is pulled straight into the live parameters
(`pull`); an engine that applied a version another way (`load_weights` from the checkpoint
layout) packs and holds it (`hold_applied`) so that same-layout peers can pull it natively.
Two engines that apply the same version hold identical bytes; the coordinator refuses a
hold whose checksums differ, which we log as a consistency failure.

The mutability contract: before anything writes the live parameters, `release` withdraws
the version held and waits until reads of it have ended.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from tensorhub import CoordinatorError, LayoutError, Replica, TensorHubError
from tensorhub.engines import FleetView, layout_labels, yield_to_engine

log = logging.getLogger("tensorhub.sglang")

# Below this a parameter is packed into the compact region. Every weight matrix of a real
# model (and of the tiny test models) is larger, so only norms and biases are copied.
NATIVE_COMPACT_THRESHOLD = 16 << 10


class NotStarted(TensorHubError):
    """A native pull failed before a byte of the live parameters was written."""


class NativeHolder:
    def __init__(self, coordinator: str, model: str, name: str,
                 params: list[tuple[str, torch.Tensor]], *, transport: str | None = None,
                 pull_timeout: float = 120.0):
        # (registered as serving its layout: peers may wait for it while it holds nothing)
        self.replica = Replica(coordinator, model, params, name=name, transport=transport,
                               compact_threshold=NATIVE_COMPACT_THRESHOLD,
                               labels=layout_labels(params, NATIVE_COMPACT_THRESHOLD))
        self.name = name
        self.pull_timeout = pull_timeout
        self._ptrs = [t.data_ptr() for _, t in params]
        self._params = params
        self._lock = threading.Lock()
        self._writes = 0  # bumped whenever the live parameters may be written

    @property
    def layout_id(self) -> str:
        return self.replica.layout.layout_id

    @property
    def compact_bytes(self) -> int:
        compact = self.replica.layout.compact
        return 0 if compact is None else compact.numel()

    def params_moved(self) -> bool:
        """Whether SGLang replaced a parameter's storage since we registered it (then the
        registered memory is stale; never seen on CPU, checked after every update)."""
        return [t.data_ptr() for _, t in self._params] != self._ptrs

    def peer_holds(self, version: int) -> bool:
        """Whether a worker other than us holds `version` in this layout."""
        peers = FleetView(self.replica.session, self.replica.model).in_layout(self.layout_id)
        return peers.held_by_others(version, [self.name])

    def pull(self, version: int) -> list[str]:
        """Read `version` from a same-layout peer straight into the live parameters; return
        the sources. Raises `NotStarted` when nothing was written (no peer, wrong layout);
        any other exception may leave the parameters torn."""
        with self._lock:
            if not self.peer_holds(version):
                raise NotStarted(f"no peer holds v{version} in layout {self.layout_id}")
            previous = self.replica.version
            self._writes += 1
            try:
                self.replica.pull(version, timeout=self.pull_timeout)
            except (CoordinatorError, LayoutError) as exc:
                # Replica.pull gives up its hold just before it writes: while it still
                # holds the old version, nothing was written (plan or layout refused).
                if previous is not None and self.replica.version == previous:
                    raise NotStarted(str(exc)) from exc
                raise
            return list(self.replica.last_pull.sources) if self.replica.last_pull else []

    def release(self) -> None:
        """Withdraw the version held and wait for its reads to end: the live parameters may
        be overwritten after this returns (raises `TensorHubError` if reads stay busy)."""
        with self._lock:
            self._writes += 1
            held = self.replica.version
            if held is not None:
                self.replica.version = None
                self.replica.session.withdraw(self.replica.model, held, self.pull_timeout)

    def hold_applied(self, version: int) -> None:
        """Pack, checksum and hold the live parameters as `version`, in the background (the
        parameters do not change while SGLang serves). Never raises."""
        writes = self._writes

        def run() -> None:
            yield_to_engine()
            with self._lock:
                if self._writes != writes:  # written again since: these are not v's bytes
                    return
                started = time.perf_counter()
                try:
                    layout = self.replica.layout
                    layout.pack()
                    self.replica.session.hold(self.replica.model, version, layout,
                                              layout.checksums())
                    self.replica.version = version
                    log.info("%s holds v%d in the native layout (%.1f ms)", self.name,
                             version, (time.perf_counter() - started) * 1e3)
                except CoordinatorError as exc:
                    if exc.code in ("unknown_version", "unknown_model"):
                        log.info("%s: not serving v%d natively: the coordinator no longer "
                                 "keeps it (%s)", self.name, version, exc)
                    else:
                        log.warning("%s: the coordinator refused our native v%d (%s): this "
                                    "engine's bytes differ from a peer's", self.name, version,
                                    exc)
                except Exception as exc:
                    log.warning("%s: holding v%d natively failed: %s", self.name, version, exc)
        threading.Thread(target=run, daemon=True, name="tensorhub-native-hold").start()

    def close(self) -> None:
        self.replica.close()
