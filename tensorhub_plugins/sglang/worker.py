"""The scheduler-side half: SGLang's live parameters as a native holder, and a
checkpoint-layout copy when one is needed.

Created right after SGLang loads its model (a hook on `ModelRunner.load_model`). A version
reaches the live parameters by one of two paths, chosen by the driver and carried by the
loader's descriptor:

- native: pulled from a peer of the same layout straight into the live parameters (no
  conversion, no staging copy); extra memory: the compact region of the small tensors;
- checkpoint: the checkpoint layout (HF names, as the trainer publishes it) pulled into a
  copy and applied with the model's own `load_weights`; the live parameters are then held
  natively, so same-layout peers can pull them.

Whether an engine keeps the checkpoint copy (a full model of memory) is the setting
`checkpoint_copy`. `auto` (default): an engine that takes the checkpoint path keeps the copy,
pulls the next versions into it in the background while serving, and serves it to other
engine kinds and layouts (one fleet with vLLM); an engine that pulls natively frees it, so
it spends the compact region only. `always` keeps it in every case; `never` builds it for a
checkpoint-path update and frees it right after.

Failures never raise into SGLang from the loader (see `loader`). A native pull that fails
before writing falls back to the checkpoint path; one that fails after it started writing
leaves the parameters torn: the checkpoint path of the new version repairs them. A load that
fails half-way on any rank is undone on every rank by loading the version served before
again, from the checkpoint copy or from peers (`engines/restore.py`); if that fails too the
status says `torn` and the driver keeps generation paused (torn weights are never served)
and tries again.
"""


from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch

from tensorhub import TensorHubError
from tensorhub import settings as env
from tensorhub.engines import (
    CheckpointCopy,
    EngineSettings,
    FleetView,
    InstallFailed,
    LoadOutcome,
    RankVote,
    ShareCheck,
    SharedCopyReader,
    TornLoad,
    alone,
    apply_shared,
    checkpoint_tensors,
    copy_holders,
    from_checkpoint,
    load_settings,
    node_of,
    node_share,
    restore_after,
    sparse_install,
    tied_optional,
    yield_to_engine,
)
from tensorhub_plugins.sglang.copies import one_copy_per_engine
from tensorhub_plugins.sglang.naming import instance_name, native_worker_name, worker_name
from tensorhub_plugins.sglang.native import NativeHolder, NotStarted
from tensorhub_plugins.sglang.reports import (
    Reports,
    StoreReports,
    engine_store,
    publish_store_address,
)
from tensorhub_plugins.sglang.status import Memory, SchedulerStatus

log = logging.getLogger("tensorhub.sglang")


class Scheduler:
    """TensorHub in one SGLang scheduler (one TP rank): its native holder, its checkpoint
    copy when it keeps one, what its live parameters hold, and the status it reports."""

    def __init__(self, settings: EngineSettings, rank: int, one_copy: bool, instance: str,
                 votes: RankVote | None = None, reports: Reports | None = None,
                 nodes: int = 1, tiled_shares: bool = True, kv_heads: int | None = None):
        """`votes`: the TP ranks' votes, if already made (their rounds must stay in step:
        one per process); `reports`: where this rank reports (default: the status
        directory of a one-node engine); `nodes`: the nodes the engine's ranks span;
        `tiled_shares`: whether the copy may pull only its ranks' tiles of a version in
        tiles (`splits_by_tp`); `kv_heads`: the model's K/V heads (`tiles.node_share`)."""
        self.settings = settings
        self.reports = reports
        self.rank = rank
        self.one_copy = one_copy  # the TP ranks of a node share its lowest rank's copy
        self.nodes = nodes
        self.tiled_shares = tiled_shares
        self.kv_heads = kv_heads
        self.name = worker_name(instance, rank)  # the checkpoint copy's
        self.native_name = native_worker_name(instance, rank)
        self.native: NativeHolder | None = None
        self.checkpoint: CheckpointCopy | None = None
        self.reader = SharedCopyReader()  # the other ranks' view of their node's copy
        self._share_check = ShareCheck()  # its first load from a node's share, scanned
        self.applied: int | None = None
        self.torn = False
        self.last: dict = {}  # the last update's path, sources, apply_ms and its steps
        self._steps: dict[str, float] = {}  # the update in progress: ms per step
        self._mark_at = 0.0
        self.model = None  # SGLang's model (set once it is loaded)
        self.prepared: int | None = None  # the version `prepare` last checked
        self._writes = 0  # bumped whenever the live parameters may be written
        self._live = sparse_install.LiveBlocks()  # where checkpoint tensors land
        self._plan: sparse_install.Plan | None = None
        self._install: dict = {}  # the last checkpoint-path install: how, how many elements
        self._applying = False  # an update is writing the live parameters (no preparing)
        self._error: str | None = None  # the last error reported to the driver
        self._outcome: LoadOutcome | None = None  # and what became of that update
        self._tried: tuple | None = None  # (version, live key) `prepare` last ran for
        self._votes: RankVote | None = votes
        self._node_votes: RankVote | None = None  # among this node's ranks (several nodes)

    @property
    def holds_copy(self) -> bool:
        """Whether this rank keeps a checkpoint copy of its own when it needs one: every
        rank, or only each node's lowest when the ranks share (`shared_copy`)."""
        return not self.one_copy or self.rank in copy_holders(_tp_size(), self.nodes)

    def memory(self) -> Memory:
        """Bytes this scheduler spends on TensorHub beside SGLang's own parameters."""
        return Memory(
            compact_bytes=self.native.compact_bytes if self.native is not None else 0,
            checkpoint_copy_bytes=self.checkpoint.nbytes if self.checkpoint is not None
            else 0)

    def record(self, error: str | None = None, keep_error: bool = False,
               outcome: LoadOutcome | None = None) -> None:
        """Write what this scheduler serves for the driver (its loader cannot answer the
        HTTP request that called it); `keep_error`: the last update's error stays (a
        report between updates, e.g. a version prepared)."""
        native = self.native
        if keep_error:
            error, outcome = self._error, self._outcome
        self._error, self._outcome = error, outcome
        try:
            SchedulerStatus(
                applied=self.applied, error=error, outcome=outcome, torn=self.torn,
                name=self.name, native_name=self.native_name,
                native_layout=native.layout_id if native is not None else None,
                params_moved=native.params_moved() if native is not None else None,
                memory=self.memory(), prepared=self.prepared, **self._install,
                **self.last).write(self.rank, self.reports)
        except OSError as exc:
            log.warning("cannot write the scheduler status: %s", exc)

    def _mark(self, step: str) -> None:
        """End of `step` of the update in progress (its time goes to the status)."""
        now = time.perf_counter()
        self._steps[step] = round(self._steps.get(step, 0.0) + (now - self._mark_at) * 1e3, 2)
        self._mark_at = now

    def _live_key(self) -> tuple:
        """What the live parameters hold: a sparse plan is valid only for these bytes."""
        return (self.applied, self._writes, self.torn)

    def prepare(self, version: int) -> None:
        """Before the pause (a thread of ours, while SGLang serves): check and verify the
        copy's `version` again (`CheckpointCopy.prepare`) and, for a model whose tensors
        land as blocks of its live parameters, find the words that differ from what they
        hold (`sparse_install.plan`). The swap's install then writes only those."""
        checkpoint, model = self.checkpoint, self.model
        if checkpoint is None or model is None:
            return
        key = self._live_key()
        shared = self.one_copy and _tp_size() > 1

        def then(named):
            if shared or self._live.error is not None or self._applying \
                    or self._live_key() != key:
                return None
            # (a version pulled whole may be a sparse step too: on one host no patch pays,
            # so none is built; a dense change ends the comparison at `MAX_DENSITY`)
            if checkpoint.replica.share_layout not in (None, *self._share_check.passed):
                return None  # (a first load from a share: whole, and checked)
            if not self._learn_blocks(named):
                return None
            return self._live.plan(model, named, version, key)

        started = time.perf_counter()
        self._plan = None
        self._tried = (version, key)
        try:
            self._plan = checkpoint.prepare(version, then)
            if self.native is not None:
                # nobody may read the live parameters once the install writes them: our
                # native hold of the version served ends now, not inside the pause
                self.native.release()
        except Exception as exc:  # the install refuses it again, inside the pause
            log.info("TensorHub: preparing v%d: %s", version, exc)
        self.prepared = version
        self.record(keep_error=True)
        plan = self._plan
        log.info("prepared v%d in %.1f ms (%s)", version,
                 (time.perf_counter() - started) * 1e3,
                 f"sparse: {plan.changed} of {plan.total} elements differ"
                 if plan is not None else "whole")

    def _learn_blocks(self, named) -> bool:
        """Whether a sparse install is possible on this model (learnt once)."""
        return self.model is not None and self._live.learn(self.model, named, _default_loader)

    def _prepare_loop(self) -> None:
        """Prepare each version the checkpoint copy comes to hold, once."""
        yield_to_engine()
        while True:
            time.sleep(0.02)
            try:
                checkpoint = self.checkpoint
                version = checkpoint.version if checkpoint is not None else None
                if version is None or version == self.applied or self._applying \
                        or self._tried == (version, self._live_key()):
                    continue  # (prepared once for these live bytes, or refused: once)
                self.prepare(version)
            except Exception:
                log.exception("TensorHub: preparing a version failed")
                time.sleep(1.0)

    def start_preparing(self) -> None:
        threading.Thread(target=self._prepare_loop, daemon=True,
                         name="tensorhub-prepare").start()

    def _copy(self) -> CheckpointCopy:
        if self.checkpoint is None:
            s = self.settings
            self.checkpoint = CheckpointCopy(
                s.coordinator, s.model, self.name, transport=s.transport,
                follow=s.mode == "follow" and s.checkpoint_copy != "never",
                pull_timeout=s.update_timeout, share=self._share())
        return self.checkpoint

    def _share(self):
        """What this rank's copy pulls of a version in tiles: the tiles of the TP ranks
        that load from it (its node's, with one copy per node; else its own)."""
        tp = _tp_size()
        if tp == 1:
            return None
        if not self.tiled_shares:
            log.info("TensorHub: this engine places layers otherwise than by TP rank (DP "
                     "attention, expert parallelism, or heads padded for its TP size): its "
                     "copy pulls every part of a version in tiles")
            return None
        ranks = node_of(self.rank, tp, self.nodes) if self.one_copy else [self.rank]
        return node_share(ranks, tp, self.kv_heads)

    def _drop_copy(self) -> None:
        """Free the checkpoint copy: withdraw what it holds (its reads end first), then
        leave."""
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is None:
            return
        try:
            if checkpoint.version is not None:
                checkpoint.withdraw()
        except Exception as exc:
            log.warning("withdrawing the checkpoint copy: %s", exc)
        checkpoint.close()

    def _apply_checkpoint(self, model, version: int, agree: Callable[[bool], bool] = alone,
                          fetch: bool = False) -> list[str]:
        """Pull `version` in checkpoint layout (unless the copy has it) and `load_weights`
        it; with `agree` (`tp_vote`), only if every TP rank can, and from rank 0's copy
        when the ranks share one (`shared_copy`; a rank that falls back alone uses a copy
        of its own). Raises `TornLoad` on every rank when a rank's load failed half-way."""
        shared = self.one_copy and agree == self.tp_vote
        sources: list[str] = []
        failure: Exception | None = None
        checkpoint = None
        try:  # whatever fails here, every rank must still reach the vote
            if not shared or self.holds_copy:
                checkpoint = self._copy()
                if checkpoint.loadable is None and checkpoint.applied is None:
                    optional = tied_optional(model.config)
                    checkpoint.loadable = from_checkpoint(
                        getattr(model.config, "_name_or_path", ""), optional) or (
                        checkpoint.loadable_as(self.applied, optional) if self.applied else None)
                if checkpoint.version != version:
                    checkpoint.pull(version)
                    sources = checkpoint.sources()
                self._mark("pull")
            if self.native is not None:
                self.native.release()  # nobody reads the live parameters while we write them
            self._mark("release")
        except Exception as exc:
            failure = exc

        plan = self._plan if not shared else None
        if plan is not None and (plan.version != version or plan.key != self._live_key()
                                 or checkpoint is None or not checkpoint.prepared(version)):
            plan = None  # made for other bytes than the live ones, or another version

        def load(named) -> None:
            self._mark("check")  # the copy's lock, the loadability check, the re-verify
            self.torn = True
            self._writes += 1
            if plan is not None:
                sparse_install.install(plan)
                self._install = {"install": "sparse", "changed": plan.changed}
            else:
                model.load_weights(named)
                self._install = {"install": "whole", "changed": None}
                share_layout = self.reader.share_layout if shared and not self.holds_copy \
                    else checkpoint.replica.share_layout if checkpoint is not None else None
                self._share_check.after_load(model.named_parameters(), share_layout)
            self.torn = False
            self._mark("load_weights")

        if shared:
            try:
                apply_shared(version, load, self._tp_broadcast, self.tp_vote,
                             checkpoint=checkpoint, failure=failure,
                             reader=None if self.holds_copy else self.reader, fetch=fetch)
            finally:
                self.reader.forget()  # the rank that holds the copy may free it (`checkpoint_copy`)
            return sources
        if checkpoint is None or failure is not None:
            agree(False)  # the other ranks learn that this one cannot, and refuse it too
            raise failure or TensorHubError("no checkpoint copy")
        with checkpoint.tensors_of(version, agree, fetch=fetch) as named:
            load(named)
        return sources

    def _pull_native(self, version: int) -> list[str] | None:
        """Sources of a native pull, or None when it failed (logged; `torn` says whether
        the live parameters were touched)."""
        if self.native is None:
            return None
        was_torn, self.torn = self.torn, True
        self._writes += 1
        try:
            sources = self.native.pull(version)
            self.torn = False
            return sources
        except NotStarted as exc:
            self.torn = was_torn
            log.warning("native pull of v%d not possible (%s); taking the checkpoint path",
                        version, exc)
        except Exception as exc:
            log.warning("native pull of v%d failed after it started writing (%s); repairing "
                        "through the checkpoint path", version, exc)
        return None

    def apply(self, model, version: int, path: str = "checkpoint") -> None:
        """Put `version` into the live model by `path` (falling back as the module
        docstring says); raises when the version could not be applied."""
        if version == self.applied and not self.torn and (path != "checkpoint"
                                                          or _tp_size() == 1):
            # Already applied (the driver's earlier request timed out): nothing to do. On
            # the checkpoint path of a TP engine every rank must still take part in the vote.
            self.record()
            return
        self._applying = True
        try:
            if torch.cuda.is_available():
                # `keep_kv` pauses SGLang `in_place`, which leaves the batch its overlap
                # scheduler launched running on the GPU: no weight is written under it.
                torch.cuda.synchronize()
            self._apply(model, version, path)
        finally:
            self._applying = False

    def _apply(self, model, version: int, path: str) -> None:
        settings = self.settings
        started = self._mark_at = time.perf_counter()
        self._steps = {}
        previous = self.applied
        sources = self._pull_native(version) if path == "native" else None
        if path == "native":
            self._mark("native_pull")
        taken = "native" if sources is not None else "checkpoint"
        # Every rank takes the checkpoint path when asked to: they vote. A rank that falls
        # back from the native path does so alone (its peers may not).
        agree = self.tp_vote if path == "checkpoint" else alone
        failure: Exception | None = None
        try:
            if sources is None:
                sources = self._apply_checkpoint(model, version, agree)
        except Exception as exc:
            failure = exc
        if path != "checkpoint" and _tp_size() > 1:
            failure, agree = self._native_outcome(version, failure), self.tp_vote
        if failure is not None:
            if self.checkpoint is not None and self.checkpoint.version is None \
                    and settings.checkpoint_copy != "always":
                self._drop_copy()  # built for this update, holds nothing: free it
            if isinstance(failure, TornLoad) or self.torn:
                self._repair(model, version, previous, agree, failure)
            elif self.native is not None and previous is not None \
                    and self.native.replica.version is None:
                self.native.hold_applied(previous)  # untouched: serve it to peers again
            raise failure
        self._mark("vote")
        self.applied = version
        if taken == "native":
            if settings.checkpoint_copy == "auto":
                self._drop_copy()
            elif self.checkpoint is not None:
                self.checkpoint.applied = version
                self.checkpoint.prefetch(version)
        else:
            if self.native is not None:
                self.native.hold_applied(version)
            if settings.checkpoint_copy == "never" or not self.holds_copy:
                self._drop_copy()  # (a rank that fell back alone built its own copy)
        if self.native is not None and self.native.params_moved():
            log.error("SGLang moved a parameter's storage: the native holder is stale")
        self._mark("hold")
        self.last = {"path": taken, "sources": sources,
                     "apply_ms": round((time.perf_counter() - started) * 1e3, 2),
                     "apply_steps_ms": self._steps}
        self.record()
        mem = self.memory()
        log.info("applied v%d via the %s path from %s in %.1f ms (TensorHub memory: compact "
                 "region %d B, checkpoint copy %d B)", version, taken,
                 ",".join(sources) or ("its node's copy" if not self.holds_copy and
                                       taken == "checkpoint" else "the local copy"),
                 self.last["apply_ms"], mem.compact_bytes, mem.checkpoint_copy_bytes)

    def _rank_votes(self) -> RankVote:
        if self._votes is None:
            self._votes = tp_votes(self.settings)
        return self._votes

    def _native_outcome(self, version: int, failure: Exception | None) -> Exception | None:
        """On the native path each TP rank went its own way (natively, or the checkpoint
        path alone): the engine holds `version` on every rank or on none. If a rank failed
        and any rank's weights changed, every rank gets `TornLoad` (and restores, voting
        together)."""
        if self.tp_vote(failure is None):
            return None
        touched = failure is None or self.torn or isinstance(failure, TornLoad)
        if self.tp_vote(not touched):
            return failure  # every rank failed before touching its weights: nothing to undo
        return failure if isinstance(failure, TornLoad) else TornLoad(version, failure)

    def _tp_broadcast(self, payload: bytes | None) -> bytes:
        """The broadcast among this node's ranks, from the rank that holds its copy: the TP ranks'
        own votes on one node (one round counter per group of ranks)."""
        if self._node_votes is None:
            votes = self._rank_votes()
            mine = node_of(votes.ranks.index(votes.rank), len(votes.ranks), self.nodes)
            self._node_votes = votes if len(mine) == len(votes.ranks) else RankVote(
                [votes.ranks[i] for i in mine], votes.rank, votes.timeout)
        return self._node_votes.broadcast(payload)

    def tp_vote(self, ok: bool) -> bool:
        """Whether every TP rank of this engine is ready: a version is applied on all ranks
        or on none (a rank that does not answer in time counts as a no)."""
        return ok if _tp_size() == 1 else self._rank_votes()(ok)

    def _repair(self, model, version: int, previous: int | None, agree,
                failure: Exception) -> NoReturn:
        """Loading `version` left the live parameters torn (on this rank, or on another:
        `TornLoad`): load the version served before again, from the checkpoint copy or from
        peers (or the checkpoint the engine started from), on every rank that voted. Raises
        what happened (`restore_after`); if the restore failed, `torn` stays set and the
        driver keeps generation paused."""
        self.torn = True
        self._writes += 1
        self._plan = None
        torn = failure if isinstance(failure, TornLoad) else TornLoad(version, failure)
        if self.checkpoint is not None and self.checkpoint.replica.partial:
            # (the ranks learn only that one failed, not why: any torn load from a share
            # ends shares, which costs bytes, never answers; later copies keep to it)
            self.tiled_shares = False
            self.checkpoint.pull_whole_versions(f"loading v{version} from this node's share "
                                                f"failed ({torn})")

        def load_version(v: int) -> None:
            self._apply_checkpoint(model, v, agree, fetch=True)

        def load_disk() -> None:
            loaded: Exception | None = None
            try:
                model.load_weights(checkpoint_tensors(getattr(model.config, "_name_or_path",
                                                              "")))
            except Exception as exc:
                loaded = exc
            if not agree(loaded is None):
                raise loaded or TensorHubError("another rank could not load the checkpoint")

        try:
            restore_after(torn, previous, load_version, load_disk)
        except TensorHubError as exc:
            if exc.code in ("restored", "restored_checkpoint"):
                self.torn = False
                if exc.code == "restored_checkpoint":
                    self.applied = None
                elif self.native is not None and previous is not None:
                    self.native.hold_applied(previous)
            raise

    def refused(self, exc: BaseException) -> None:
        """An update (or the join) failed: record why, and what became of the weights where
        the install said (`InstallFailed`: typed); the driver reads both."""
        outcome = exc.outcome if isinstance(exc, InstallFailed) else None
        self.record(outcome.reason if outcome is not None else str(exc), outcome=outcome)

    def join(self, runner, dummy: bool) -> None:
        """Serve the newest version before SGLang takes requests (natively when a
        same-layout peer holds it)."""
        settings = self.settings
        if settings.checkpoint_copy == "always" and self.holds_copy:
            self._copy()
        self.record()
        latest = FleetView(self.native.replica.session, settings.model).latest()
        if not latest:
            if dummy:
                raise RuntimeError(f"started with --load-format dummy but model "
                                   f"{settings.model!r} has no published version")
            log.info("no version of %s yet; serving the weights from disk", settings.model)
            return
        started = time.perf_counter()
        path = "native" if self.native.peer_holds(latest) else "checkpoint"
        self.apply(runner.model, latest, path)
        log.info("joined at %s v%d from peers in %.2fs (%s path)", settings.model, latest,
                 time.perf_counter() - started, self.last.get("path"))


_scheduler: Scheduler | None = None  # this process's, once SGLang has loaded its model


def splits_by_tp(text_config, server_args) -> bool:
    """Whether each TP rank loads its 1/TP of the tiled projections (`tensorhub.tiles`):
    not with attention split over fewer ranks (DP or context-parallel attention), expert
    parallelism or dense MLPs of another TP size (SGLang's runtime context and server
    arguments, 0.5.23; where they cannot say, no), nor when SGLang re-shaped the model for
    its TP size (`tp_reshaped`)."""
    if tp_reshaped(text_config):
        return False
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return p.attn_tp_size == p.tp_size and p.moe_ep_size == 1 and \
            getattr(server_args, "moe_dense_tp_size", None) in (None, p.tp_size)
    except Exception:
        return False


def kv_heads_of(text_config) -> int | None:
    """The model's K/V heads (None where its config does not say)."""
    heads = getattr(text_config, "num_key_value_heads", None) or \
        getattr(text_config, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def tp_reshaped(text_config) -> bool:
    """Whether SGLang padded the language model's heads or intermediate size so that its
    TP size divides them (on CPU, `adjust_config_with_unaligned_cpu_tp`, which keeps the
    sizes it replaced as `original_*`): its ranks' rows are then not an even split."""
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", heads)
    return (getattr(text_config, "original_num_attention_heads", heads) != heads
            or getattr(text_config, "original_total_num_kv_heads", kv_heads) != kv_heads
            or any(name.startswith("original_") and "intermediate" in name
                   for name in vars(text_config)))


def current() -> Scheduler | None:
    """This scheduler process's TensorHub (None: not configured, or not started yet)."""
    return _scheduler


def _tp_size() -> int:
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        return get_tp_group().world_size
    except Exception:
        return 1


def _tp_rank() -> int:
    """This scheduler's TP rank: SGLang's runtime context (0.5.23), else its TP group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        pass
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised: a single-rank engine
        return 0


def tp_votes(settings: EngineSettings) -> RankVote:
    """The votes of this engine's TP ranks (over the engine's distributed store)."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group

    timeout = settings.update_timeout + env.VOTE_MARGIN_S
    return RankVote(get_tp_group().ranks, dist.get_rank(), timeout)


def engine_instance(settings: EngineSettings, port: int, rank: int,
                    votes: RankVote) -> str:
    """The instance name every rank of an engine on several nodes uses: that of node 0's
    main process (the one that serves HTTP and drives), which TP rank 0 inherited and
    shares with the other ranks over the engine's store. The main process of another node
    names no instance (it does not drive)."""
    shared = votes.broadcast(instance_name(settings, port).encode() if rank == 0 else None)
    if not shared:
        raise RuntimeError("TP rank 0 did not share the engine's instance name in time")
    return shared.decode()


def _node_rank(args) -> int:
    return int(getattr(args, "node_rank", 0) or 0)


def native_params(model, rank: int, tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """The live parameters, named for the native layout. At TP > 1 every rank's shards
    have the same names and shapes but other bytes: the names carry the rank, so rank r's
    layout is shared with rank r of another engine only."""
    params = list(model.named_parameters())
    return params if tp_size == 1 else [(f"tp{rank}:{n}", t) for n, t in params]


def after_load_model(result, runner):
    """AFTER hook on `ModelRunner.load_model`: register the live parameters and join at the
    newest version (natively when a same-layout peer holds it). With `--load-format dummy`
    a failed join stops start-up (random weights must never be served), and so does one that
    tore the weights; otherwise it is logged and the weights from disk are served."""
    global _scheduler
    settings = load_settings(None)
    if settings is None:
        log.warning("TensorHub plugin loaded but TENSORHUB_COORDINATOR is not set: inactive")
        return result
    if getattr(runner, "is_draft_worker", False):
        return result
    args = runner.server_args
    dummy = args.load_format == "dummy"
    scheduler = None
    try:
        rank = _tp_rank()
        nodes = int(getattr(args, "nnodes", 1) or 1)
        votes = reports = None
        instance = None
        if nodes > 1 and _tp_size() > 1:
            # Only node 0's main process drives: every rank takes its instance name and
            # reports through the engine's store, which node 0's driver reads (`reports`).
            votes = tp_votes(settings)
            instance = engine_instance(settings, args.port, rank, votes)
            store = engine_store()
            reports = StoreReports(store, instance)
            if rank == 0 and _node_rank(args) == 0:
                publish_store_address(store)
        scheduler = _scheduler = Scheduler(
            settings, rank, one_copy_per_engine(args),
            instance or instance_name(settings, args.port), votes=votes, reports=reports,
            nodes=nodes, tiled_shares=splits_by_tp(runner.model_config.hf_text_config, args),
            kv_heads=kv_heads_of(runner.model_config.hf_text_config))
        scheduler.native = NativeHolder(
            settings.coordinator, settings.model, scheduler.native_name,
            native_params(runner.model, rank, args.tp_size), transport=settings.transport,
            pull_timeout=settings.update_timeout)
        scheduler.model = runner.model
        scheduler.join(runner, dummy)
        checkpoint = scheduler.checkpoint
        if checkpoint is not None and checkpoint.version is not None \
                and not (scheduler.one_copy and _tp_size() > 1):
            # before the server serves: learn where checkpoint tensors land (a sparse install)
            scheduler._learn_blocks(checkpoint.replica.named_tensors())
        scheduler.start_preparing()
    except Exception as exc:
        if scheduler is not None:
            scheduler.refused(exc)
        if dummy or (scheduler is not None and scheduler.torn):
            log.error("TensorHub: cannot serve without weights: %s", exc)
            raise
        log.exception("TensorHub: join failed; serving the weights from disk")
    return result


def _default_loader():
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    return default_weight_loader
