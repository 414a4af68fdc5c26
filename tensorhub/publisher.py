"""The trainer's side: publish a version of its weights in one call.

By default `publish` snapshots the trainer's tensors into buffers the publisher owns and
registers once (the copy is the trainer's only cost), so the trainer may run its next
optimizer step at once. With `zero_copy=True` peers read the trainer's own tensors: no copy,
but the trainer must not touch them until `release()` (or the next `publish`) returns.

Retention: the newest version must outlive the trainer's copy of it. `release()` and
`close()` first wait (bounded by `retain_timeout`) until `min_replicas` replicas hold the
newest version, unless no replica exists that could; the coordinator itself refuses to let
the last holder of a newest version withdraw. Publishing a newer version supersedes the old
one, so `publish` only waits for reads of the old version in flight before reusing buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorhub import settings
from tensorhub.core.data_types import (
    Declare,
    GetManifest,
    Hold,
    Part,
    Publish,
    PublishStatus,
    RetentionRequest,
)
from tensorhub.core.errors import CoordinatorError, TensorHubError
from tensorhub.core.experts import ExpertLayout
from tensorhub.core.held_patches import HeldPatches
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of
from tensorhub.core.memory import as_bytes
from tensorhub.core.named_tensors import NamedTensors, named_list
from tensorhub.core.patch import PatchWriter, sample_changes, word_count
from tensorhub.core.patch_budget import PatchCosts, Verdict
from tensorhub.core.session import WorkerSession
from tensorhub.core.transport import Transport
from tensorhub.quant.layouts import (
    check_recipe,
    quantizable,
    quantize_named,
    quantized_model,
    stand_ins,
)

log = logging.getLogger("tensorhub.publisher")


@dataclass(frozen=True)
class PatchStats:
    """The last patch a publisher offered: its base and version, the share of words that
    changed and its size in bytes."""

    base: int
    version: int
    density: float
    nbytes: int


@dataclass(frozen=True)
class PatchDecision:
    """Whether the patch to `version` was built (`verdict`), and the words sampled to
    decide it against the `words` its building compares."""

    version: int
    verdict: Verdict
    sampled_words: int
    words: int


class Publisher:
    """The trainer's handle on one model: `publish(state_dict)` makes the tensors a new
    immutable version that replicas pull one-sided, from the trainer or from each other.

    By default each publish copies the tensors into buffers of its own (memory the size
    of the model, on the tensors' device), so the trainer may step at once;
    `zero_copy=True` serves the trainer's own tensors instead, which must then stay
    untouched until `release()`.
    Creating one registers with the coordinator: one try of `timeout` seconds unless
    `register_wait` says to keep trying. `close()` (or leaving a `with` block) first waits,
    up to `retain_timeout`, until `min_replicas` replicas hold the newest version, so it
    outlives the trainer; `close(retain=False)` skips that wait.
    """

    def __init__(
        self,
        coordinator: str,
        model: str,
        *,
        name: str = "trainer",
        transport: str | Transport | None = None,
        zero_copy: bool = False,
        compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
        release_timeout: float | None = None,
        min_replicas: int = 1,
        retain_timeout: float = 30.0,
        token: str | None = None,
        timeout: float = 10.0,
        coordinator_wait: float = 120.0,
        register_wait: float = 0.0,
        labels: dict[str, str] | None = None,
        part: int = 0,
        parts: int = 1,
        patches: bool = True,
        owners: dict[str, str] | None = None,
        quantize: Sequence[str] = (),
        _session: WorkerSession | None = None,
    ):
        """`coordinator_wait`: how long a call is tried again while a coordinator that
        answered before does not (a restart, a pause). `register_wait`: how long the
        constructor keeps trying one that has not answered yet (a job that starts it along
        with the trainer); 0: one try of `timeout` seconds, as a `Replica` makes, so a wrong
        address fails within `timeout`.
        `owners`: the credentials of the models an earlier run of this trainer bound
        (`Publisher.owners`, saved with its checkpoint): a resumed job shows them, else
        the coordinator keeps the models its first trainer's (`coordinator/owners.py`).
        `part` of `parts`: this trainer rank publishes one part of each version, and the
        version appears to readers once all `parts` ranks have published theirs (FSDP or
        Megatron ranks, each with the tensors it owns, or row slices; `publish(rows=...)`).
        `release_timeout`: how long `publish` waits for reads of the previous version to end
        before it overwrites it (default: as long as the coordinator lets a read live, so a
        slow reader delays a training step but never fails it).
        `patches`: with each version (after the first, copied, unsharded), also publish the
        patch from the previous one (`core/patch.py`), which readers holding that one pull
        instead of the whole version, where it pays: decided before it is built, on a
        sample of the step and measured rates (`core/patch_budget.py`, `patch_costs`;
        `TENSORHUB_PATCHES=0` turns it off too).
        `quantize`: recipes (`"fp8_per_channel"`) in which each version is also published,
        quantized once here, as the companion model `<model>@<recipe>` with the same
        version number (`tensorhub/quant/layouts.py`): engines that run that recipe pull it
        instead of the bf16 version, half the bytes, with no quantization in their pause.
        Unsharded trainers only; each quantized layout is published through this trainer's
        own session (`_session`), so it is bound to the same worker as the model, which the
        coordinator requires of a model's companions."""
        if quantize and parts > 1:
            raise ValueError("quantize: a sharded trainer cannot publish quantized layouts "
                             "yet (each rank would quantize only its part)")
        for recipe in quantize:
            check_recipe(recipe)
        self.model = model
        self.zero_copy = zero_copy
        self.compact_threshold = compact_threshold
        self.release_timeout = release_timeout
        self.min_replicas = min_replicas
        self.retain_timeout = retain_timeout
        self.coordinator_wait = coordinator_wait
        self.part = Part(part=part, parts=parts)
        self._newest = 0  # never publish below what we published (coordinator restarts)
        self.quantized: dict[str, Publisher] = {}  # by recipe (`quantize`)
        self._owns_session = _session is None
        self.session = _session or WorkerSession(
            coordinator, name, "trainer", transport, labels, token, timeout,
            register_wait=register_wait, owners=owners)
        if self._owns_session:
            self.session.published = self._published
        self._layout: BoundLayout | None = None
        self._buffers_version = 0  # the version our buffers hold whole (0: none, or torn)
        self._patches = patches and settings.PATCHES.get()
        self._held_patches = HeldPatches(self.session, model)
        self.last_patch: PatchStats | None = None
        # what the next patch is weighed on, and the last weighing
        self.patch_costs = PatchCosts()
        self.last_patch_decision: PatchDecision | None = None
        self._patch_started = 0.0
        self.version: int | None = None
        self._previous: int | None = None  # the version published before `version`
        self.layout_id: str | None = None
        self.quantized = {
            recipe: Publisher(
                coordinator, quantized_model(model, recipe), compact_threshold=compact_threshold,
                release_timeout=release_timeout, min_replicas=min_replicas,
                retain_timeout=retain_timeout, coordinator_wait=coordinator_wait,
                patches=patches, _session=self.session)
            for recipe in quantize}

    @property
    def owners(self) -> dict[str, str]:
        """The credentials of the models this trainer bound (its model, its patches' and its
        quantized layouts'), to save with a checkpoint: a resumed job passes them back
        (`owners=`)."""
        return dict(self.session.owners)

    def _published(self) -> dict[str, int]:
        """Our newest version of each model we publish (told at each registration: a
        restarted coordinator drops versions of another run), patches included."""
        out = {self.model: self._newest} if self._newest else {}
        if self._held_patches.newest:
            out[self._held_patches.model] = self._held_patches.newest
        for publisher in self.quantized.values():
            out.update(publisher._published())
        return out

    def latest(self) -> int:
        """The model's newest version on the coordinator (0: none yet)."""
        return self._latest()

    def _latest(self, patient: bool = True) -> int:
        request = GetManifest(model=self.model)
        try:
            if not patient:
                return self.session.client.call(request).version
            return self.session.call_patiently(request, self.coordinator_wait).version
        except CoordinatorError as exc:
            if exc.code in ("unknown_model", "unknown_version"):
                return 0
            raise

    def declare(self, named_tensors: NamedTensors) -> bool:
        """Say ahead what the model's first version will be made of (names, dtypes,
        shapes: no data is read or sent), so that engines' checkpoint copies
        (`PartedReplica`, following versions) allocate their buffers from it within a few
        seconds and stand by: when the first version comes they pull it at once, none
        waiting for a plan. Call it at start with the tensors you will publish, well
        before the first `publish`. False (and nothing declared) once a version is out; a
        whole-version trainer only. Soft state: a coordinator restart forgets it."""
        if self.part.parts > 1:
            raise ValueError("declare: a sharded trainer's parts cannot be declared yet; "
                             "its readers ask for plans when the first version comes")
        named = named_list(named_tensors, empty_ok=False)
        manifest = manifest_of(named, self.compact_threshold)
        try:
            self.session.call(Declare(worker_id=self.session.worker_id, model=self.model,
                                      manifest=manifest))
        except CoordinatorError as exc:
            if exc.code != "stale_version":
                raise
            return False
        for publisher in self.quantized.values():
            publisher.declare(stand_ins(named))
        return True

    def publish(self, named_tensors: NamedTensors, version: int | None = None, *,
                rows: Mapping[str, tuple[int, int]] | None = None,
                cols: Mapping[str, tuple[int, int]] | None = None,
                tiles: int | None = None, blocks: list[int] | None = None,
                experts: ExpertLayout | None = None, kv_heads: int | None = None,
                part_timeout: float | None = None) -> int:
        """Register the tensors (checkpoint layout) as `version` (default: latest + 1) and
        announce it. Returns the version. Raises `CoordinatorError` ("stale_version") for a
        version that is not newer than the model's latest, before touching anything.
        A coordinator that does not answer is tried again for up to `coordinator_wait`
        seconds (a restart, a pause) before `CoordinatorUnavailable`.

        A rank of a sharded version (`parts` > 1) names the version (every rank the same)
        and may give `rows`: name -> (first row, total rows) for tensors it holds a row
        slice of, and `cols` likewise for 2-D tensors it holds a column slice of (`tiles`:
        the parts are a version in tiles, `tensorhub/tiles.py`, `experts` how they hold a
        mixture of experts', `kv_heads` the heads their K/V is split by; `blocks`: in
        layer blocks, `tensorhub/stages.py`). It returns once all parts are in (waiting
        up to `part_timeout`, default `coordinator_wait`), and raises `TensorHubError`
        ("aborted") if the version was given up meanwhile (a rank died, or parts did not
        fit together)."""
        if self.part.parts > 1 and version is None:
            raise ValueError("a sharded publish needs an explicit version, the same on every "
                             "rank (the training step, say)")
        named = named_list(named_tensors, empty_ok=False)
        if self.quantized and not any(quantizable(n, str(t.dtype).removeprefix("torch."),
                                                  tuple(t.shape)) for n, t in named):
            raise ValueError("quantize: none of these tensors is a bf16 decoder projection "
                             "(`tensorhub/quant/layouts.py`), so no engine could take the "
                             "quantized layout; publish bf16 weights, or drop quantize")
        latest = max(self._latest(), self._newest)
        version = latest + 1 if version is None else version
        if version <= latest:
            raise CoordinatorError(
                f"model {self.model!r} is at version {latest}; cannot publish {version}",
                code="stale_version")
        manifest = manifest_of(named, self.compact_threshold, rows, cols, tiles, blocks,
                               experts, kv_heads)
        if self.part.parts > 1:
            self._let_replicas_keep_current()
        self._drop_current()  # buffers are about to change: end reads of the old version first
        tensors = [t for _, t in named]
        patch: PatchWriter | None = None
        # (from here until the version is published, our buffers hold no version whole)
        base, self._buffers_version = self._buffers_version, 0
        if self.zero_copy:
            layout = BoundLayout(manifest, tensors)
        elif self._layout is not None and self._layout.manifest == manifest:
            layout = self._layout
            patch = self._copy_making_patch(layout, tensors, base, version)
        else:
            if self._layout is not None:
                self.session.transport.deregister(self._layout.item_bytes)
            layout = BoundLayout.allocate(manifest, tensors[0].device if tensors else "cpu",
                                          bounded=False)
            layout.copy_large_from(tensors)
        old_compact = layout.compact.clone() \
            if patch is not None and layout.compact is not None else None
        layout.pack(tensors)
        if patch is not None and old_compact is not None:
            patch.item(0, old_compact, layout.compact)
        if self._layout is not None and self._layout is not layout and self.zero_copy:
            self.session.transport.deregister(self._layout.item_bytes)
        self.session.transport.register(layout.item_bytes)
        if patch is not None:
            # Before the version: its Publish then carries our endpoint with the patch's
            # buffer registered, and readers find the patch as soon as they hear of it.
            self._publish_patch(patch, layout.nbytes)
        checksums = layout.checksums()
        publish = Publish(
            worker_id=self.session.worker_id, model=self.model, version=version,
            manifest=manifest, checksums=checksums, memory=layout.memory(),
            endpoint=self.session.transport.endpoint(), part=self.part.part,
            parts=self.part.parts)
        self._layout = layout
        reply = self.session.call_patiently(publish, self.coordinator_wait)
        self.patch_costs.pull_rate_told(reply.pull_rate)
        if not reply.complete:
            self._await_parts(publish, self.coordinator_wait if part_timeout is None
                              else part_timeout)
        self.version = version
        self.layout_id = layout.layout_id  # the current version's (retention counts its holders)
        self._previous = self._newest or None
        self._newest = version
        self._buffers_version = version if not self.zero_copy else 0
        # Kept so a restarted coordinator learns of this version again (soft state).
        self.session.remember(self.model, version, layout, Hold(
            worker_id=self.session.worker_id, model=self.model, version=reply.version,
            layout_id=layout.layout_id, memory=layout.memory(), manifest=manifest,
            checksums=checksums, part=self.part.part, parts=self.part.parts))
        log.info("published %s v%d (%.1f MiB, layout %s)", self.model, version,
                 layout.nbytes / 2**20, layout.layout_id)
        for recipe, publisher in self.quantized.items():
            started = time.perf_counter()
            try:
                publisher.publish(quantize_named(named, recipe), version)
            except TensorHubError as exc:  # (the bf16 version is out: this one skips it)
                log.error("%s v%d: publishing its %s layout failed (%s); engines that follow "
                          "%s stay on its v%s until the next version", self.model, version,
                          recipe, exc, publisher.model, publisher.version)
                continue
            log.info("published %s v%d (quantized in %.0f ms)", publisher.model, version,
                     (time.perf_counter() - started) * 1e3)
        return version

    def _copy_making_patch(self, layout: BoundLayout, tensors: list[torch.Tensor],
                           base: int, version: int) -> PatchWriter | None:
        """Copy the large tensors into our buffers (which hold version `base` whole; 0:
        no version), and make the patch from it to this one on the way (the compact
        region's part is added once it is packed). None when patches are off or cannot be
        made (a sharded trainer; no whole base) or would not pay (`core/patch_budget.py`:
        decided on a sample of the words before any is encoded)."""
        if not self._patches or not base or self.part.parts > 1:
            layout.copy_large_from(tensors)
            return None
        large = [(k, item.tensors[0]) for k, item in enumerate(layout.items)
                 if item.kind == "tensor"]
        try:
            sample = sample_changes([layout.item_bytes[k] for k, _ in large],
                                    [as_bytes(tensors[t]) for _, t in large], seed=version)
        except (TypeError, ValueError, RuntimeError):
            sample = (0, 0)  # (bytes we cannot view as words: the writer finds out)
        words = sum(word_count(b.numel()) for b in layout.item_bytes)
        verdict = self.patch_costs.trainer_verdict(*sample, words, layout.nbytes)
        self.last_patch_decision = PatchDecision(version, verdict, sample[0], words)
        if not verdict.patch:
            log.info("%s v%d: no patch (%s): readers pull it whole", self.model, version,
                     verdict.why)
            layout.copy_large_from(tensors)
            return None
        self._patch_started = time.perf_counter()
        patch = PatchWriter(base, version, layout.layout_id,
                            budget=int(settings.PATCH_MAX_RATIO * layout.nbytes),
                            total_bytes=layout.nbytes)
        for k, item in enumerate(layout.items):
            if item.kind == "tensor":
                ours = layout.tensors[item.tensors[0]]
                new = tensors[item.tensors[0]].to(ours.device).contiguous()
                patch.item(k, layout.item_bytes[k], as_bytes(new))
                ours.copy_(new)
        return patch

    def _publish_patch(self, patch: PatchWriter, nbytes: int) -> None:
        """Offer the patch to readers that hold its base, unless it is not much smaller
        than the version (then they pull the version whole)."""
        if patch.abandoned or patch.nbytes() > settings.PATCH_MAX_RATIO * nbytes:
            log.info("%s v%d: its patch would not be much smaller than the version (over "
                     "%.0f%% of its bytes): readers pull it whole", self.model, patch.version,
                     100 * settings.PATCH_MAX_RATIO)
            return
        data = patch.finish()
        if self._held_patches.publish(patch.version, patch.base, data):
            made = time.perf_counter() - self._patch_started
            self.patch_costs.built(patch.words, patch.changed_words, made - patch.encode_s,
                                   patch.encode_s, len(data))
            self.last_patch = PatchStats(patch.base, patch.version, patch.density, len(data))
            log.info("%s v%d: patch from v%d, %.3f%% of the words changed, %.2f MiB "
                     "(%.4f of the version)", self.model, patch.version, patch.base,
                     100 * patch.density, len(data) / 2**20, len(data) / nbytes)

    def _let_replicas_keep_current(self) -> None:
        """A sharded version is not superseded until every rank's next part is in, so
        before our part of it goes, replicas that exist are given (up to `retain_timeout`)
        the time to hold it: else a rank that runs ahead leaves the newest version with a
        part nobody has."""
        try:
            self.retained()
        except TensorHubError as exc:
            log.warning("publishing anyway: %s", exc)

    def _await_parts(self, publish: Publish, timeout: float) -> None:
        """Wait until every part of `publish.version` is in; a coordinator that restarted
        meanwhile (it forgot the version) is sent our part again."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.session.call_patiently(
                PublishStatus(model=self.model, version=publish.version), self.coordinator_wait)
            if status.state == "complete":
                return
            if status.state == "aborted":
                raise TensorHubError(f"{self.model} v{publish.version} was given up before "
                                     f"all its parts were in: {status.reason}", code="aborted")
            if status.state == "unknown" or (status.state == "pending"
                                             and self.part.part not in status.parts_in):
                # (a coordinator that restarted meanwhile has forgotten our part)
                self.session.call_patiently(publish, self.coordinator_wait)
            if time.monotonic() > deadline:
                raise TensorHubError(
                    f"{self.model} v{publish.version}: parts {status.parts_in} of "
                    f"{self.part.parts} in after {timeout:.0f} s; the others' ranks have not "
                    f"published theirs", code="aborted")
            time.sleep(0.02)

    def retained(self, timeout: float | None = None,
                 waiting: tuple[str, str] | None = None) -> bool:
        """Wait until `min_replicas` replicas hold our current version in our layout (a
        holder of another layout cannot serve our readers). False when no replica is
        registered and none is reading it for 1 s (nobody could keep it); raises
        `TensorHubError` ("last_holder") after `timeout` (default `retain_timeout`).
        `waiting`: (who waits, how to skip it), said in a warning as soon as it is clear
        that this waits: a wait that is not said looks like a hang."""
        if self.version is None or self._latest(patient=False) > self.version:
            return True  # (a newer version supersedes ours: nothing to keep)
        timeout = self.retain_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        nobody_since: float | None = None
        while True:
            r = self.session.client.call(RetentionRequest(
                model=self.model, version=self.version,
                layout_id=self.layout_id))
            if r.replica_holders >= self.min_replicas:
                return True
            if waiting is not None and (r.replicas or r.active_reads):
                log.warning("%s v%d: %s waits up to %g s until %d replica(s) hold it (%d "
                            "do, %d read(s) in flight), so that the trainer's copy is not "
                            "its last; %s", self.model, self.version, waiting[0], timeout,
                            self.min_replicas, r.replica_holders, r.active_reads, waiting[1])
                waiting = None
            if r.replicas == 0 and r.active_reads == 0:
                # Nobody could keep it, unless a replica is re-registering this instant
                # (a reader re-buffering for a new sharding): seen twice, 1 s apart.
                if nobody_since is not None and time.monotonic() - nobody_since >= 1.0:
                    return False
                nobody_since = nobody_since or time.monotonic()
            else:
                nobody_since = None
            if time.monotonic() > deadline:
                raise TensorHubError(
                    f"{self.model} v{self.version}: {r.replica_holders} of {self.min_replicas} "
                    f"replica(s) hold it after {timeout:.1f}s ({r.active_reads} read(s) in "
                    f"flight); the trainer's copy is its last", code="last_holder")
            time.sleep(0.05)

    def release(self, timeout: float | None = None, force: bool = False) -> None:
        """Stop serving the current version and wait (bounded) until reads of it end; after
        this the trainer may modify tensors published with `zero_copy=True`. Unless `force`,
        first waits until the version is retained by replicas (see `retained`)."""
        if self.version is None:
            return
        if not force and not self.retained(
                timeout, waiting=("release()", "release(force=True) skips the wait")):
            log.warning("%s v%d: no replica to keep it; releasing the only copy", self.model,
                        self.version)
        self._drop_current(timeout)

    def _drop_current(self, timeout: float | None = None) -> None:
        if self.version is not None:
            default = self.release_timeout if self.release_timeout is not None else \
                self.session.lease_ttl + self.session.heartbeat_interval
            self.session.withdraw(self.model, self.version,
                                  default if timeout is None else timeout,
                                  force=True)
            self.version = None

    def close(self, retain: bool = True) -> None:
        """Unregister, after waiting (up to `retain_timeout`) for `min_replicas` replicas to
        hold the newest version, said at once when they do not yet; `retain=False`: no
        wait (the newest version is gone unless a replica holds it already). With quantized
        layouts beside it, each model waits only where a replica follows it (holds or reads
        its newest version or the one before): its engines may all follow another of
        them."""
        for publisher in [self, *self.quantized.values()]:
            try:
                if retain and publisher.version is not None \
                        and (not self.quantized or publisher._followed()) \
                        and not publisher.retained(waiting=("close()", "close(retain=False) "
                                                                       "skips the wait")):
                    log.warning("%s v%d: no replica holds it; it is gone when the trainer "
                                "exits", publisher.model, publisher.version)
            except TensorHubError as exc:
                log.warning("closing anyway: %s", exc)
        if self._owns_session:
            self.session.close()

    def _followed(self) -> bool:
        """Whether a replica holds or reads our current version or the one before it (a
        follower that has not started on the newest yet holds the one before)."""
        for version in {self.version, self._previous} - {None}:
            r = self.session.client.call(RetentionRequest(model=self.model, version=version))
            if r.replica_holders > 0 or r.active_reads > 0:
                return True
        return False

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

