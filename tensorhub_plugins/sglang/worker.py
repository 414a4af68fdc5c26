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
import time
from typing import NoReturn

import torch

from tensorhub import TensorHubError
from tensorhub.engines import (
    CheckpointHolder,
    EngineSettings,
    FleetView,
    RankVote,
    SharedCopyReader,
    TornLoad,
    alone,
    apply_shared,
    checkpoint_tensors,
    from_checkpoint,
    load_settings,
    one_copy_per_engine,
    outcome_in,
    restore_after,
    tied_optional,
)
from tensorhub_plugins.sglang.naming import (
    instance_name,
    native_worker_name,
    status_path,
    worker_name,
    write_json,
)
from tensorhub_plugins.sglang.native import NativeHolder, NotStarted

log = logging.getLogger("tensorhub.sglang")

_settings: EngineSettings | None = None
_names: tuple[str, str] = ("", "")  # (checkpoint copy, native holder) worker names
_checkpoint: CheckpointHolder | None = None
_native: NativeHolder | None = None
_rank = 0  # this scheduler's TP rank
_one_copy = False  # the TP ranks share rank 0's checkpoint copy (`shared_copy`)
_reader = SharedCopyReader()  # ranks other than 0: their view of rank 0's copy
_applied: int | None = None
_torn = False
_votes: RankVote | None = None  # the TP ranks' votes (`tp_vote`)
# Beyond the pull timeout, how long a rank waits for the others at a vote before it goes on
# without them (they are named in its log).
VOTE_MARGIN_S = 60.0
_last: dict = {}


def memory() -> dict[str, int]:
    """Bytes this scheduler spends on TensorHub beside SGLang's own parameters."""
    return {"compact_bytes": _native.compact_bytes if _native is not None else 0,
            "checkpoint_copy_bytes": _checkpoint.nbytes if _checkpoint is not None else 0}


def record(error: str | None = None) -> None:
    """Write what this scheduler serves for the driver (its loader cannot answer the HTTP
    request that called it)."""
    path = status_path(_rank)
    if path is None:  # no server main process (no driver) to read it
        return
    try:
        write_json(path, {
            "applied": _applied, "error": error, "torn": _torn, "at": time.time(),
            "name": _names[0], "native_name": _names[1],
            "native_layout": _native.layout_id if _native is not None else None,
            "params_moved": _native.params_moved() if _native is not None else None,
            "memory": memory(), **_last})
    except OSError as exc:
        log.warning("cannot write the scheduler status: %s", exc)


def _copy() -> CheckpointHolder:
    global _checkpoint
    if _checkpoint is None:
        assert _settings is not None
        _checkpoint = CheckpointHolder(
            _settings.coordinator, _settings.model, _names[0], transport=_settings.transport,
            follow=_settings.mode == "follow" and _settings.checkpoint_copy != "never",
            pull_timeout=_settings.update_timeout)
    return _checkpoint


def _drop_copy() -> None:
    """Free the checkpoint copy: withdraw what it holds (its reads end first), then leave."""
    global _checkpoint
    holder, _checkpoint = _checkpoint, None
    if holder is None:
        return
    try:
        if holder.version is not None:
            holder.withdraw()
    except Exception as exc:
        log.warning("withdrawing the checkpoint copy: %s", exc)
    holder.close()


def _apply_checkpoint(model, version: int, agree=alone, fetch: bool = False) -> list[str]:
    """Pull `version` in checkpoint layout (unless the copy has it) and `load_weights` it;
    with `agree` (`tp_vote`), only if every TP rank can, and from rank 0's copy when the
    ranks share one (`shared_copy`; a rank that falls back alone uses a copy of its own).
    Raises `TornLoad` on every rank when a rank's load failed half-way."""
    shared = _one_copy and agree is tp_vote
    sources: list[str] = []
    failure: Exception | None = None
    holder = None
    try:  # whatever fails here, every rank must still reach the vote
        if not shared or _rank == 0:
            holder = _copy()
            if holder.loadable is None and holder.applied is None:
                optional = tied_optional(model.config)
                holder.loadable = from_checkpoint(
                    getattr(model.config, "_name_or_path", ""), optional) or (
                    holder.loadable_as(_applied, optional) if _applied else None)
            if holder.version != version:
                holder.pull(version)
                sources = holder.sources()
        if _native is not None:
            _native.release()  # nobody reads the live parameters while we write them
    except Exception as exc:
        failure = exc

    def load(named) -> None:
        global _torn
        _torn = True
        model.load_weights(named)
        _torn = False

    if shared:
        try:
            apply_shared(version, load, _tp_broadcast, tp_vote, holder=holder,
                         failure=failure, reader=_reader if _rank != 0 else None,
                         fetch=fetch)
        finally:
            _reader.forget()  # rank 0 may free its copy (`checkpoint_copy`): do not pin it
        return sources
    if holder is None or failure is not None:
        agree(False)  # the other ranks learn that this one cannot, and refuse it too
        raise failure or TensorHubError("no checkpoint copy")
    with holder.tensors_of(version, agree, fetch=fetch) as named:
        load(named)
    return sources


def _pull_native(version: int) -> list[str] | None:
    """Sources of a native pull, or None when it failed (logged; `_torn` says whether the
    live parameters were touched)."""
    global _torn
    if _native is None:
        return None
    was_torn, _torn = _torn, True
    try:
        sources = _native.pull(version)
        _torn = False
        return sources
    except NotStarted as exc:
        _torn = was_torn
        log.warning("native pull of v%d not possible (%s); taking the checkpoint path",
                    version, exc)
    except Exception as exc:
        log.warning("native pull of v%d failed after it started writing (%s); repairing "
                    "through the checkpoint path", version, exc)
    return None


def apply(model, version: int, path: str = "checkpoint") -> None:
    """Put `version` into the live model by `path` (falling back as the module docstring
    says); raises when the version could not be applied."""
    global _applied
    if _settings is None:
        raise RuntimeError("TensorHub is not running in this scheduler")
    if version == _applied and not _torn and (path != "checkpoint" or _tp_size() == 1):
        # Already applied (the driver's earlier request timed out): nothing to do. On the
        # checkpoint path of a TP engine every rank must still take part in the vote.
        record()
        return
    started = time.perf_counter()
    previous = _applied
    sources = _pull_native(version) if path == "native" else None
    taken = "native" if sources is not None else "checkpoint"
    # Every rank takes the checkpoint path when asked to: they vote. A rank that falls back
    # from the native path does so alone (its peers may not).
    agree = tp_vote if path == "checkpoint" else alone
    failure: Exception | None = None
    try:
        if sources is None:
            sources = _apply_checkpoint(model, version, agree)
    except Exception as exc:
        failure = exc
    if path != "checkpoint" and _tp_size() > 1:
        failure, agree = _native_outcome(version, failure), tp_vote
    if failure is not None:
        if _checkpoint is not None and _checkpoint.version is None \
                and _settings.checkpoint_copy != "always":
            _drop_copy()  # built for this update, holds nothing: free it
        if isinstance(failure, TornLoad) or _torn:
            _repair(model, version, previous, agree, failure)
        elif _native is not None and previous is not None and _native.replica.version is None:
            _native.hold_applied(previous)  # untouched: serve it to peers again
        raise failure
    _applied = version
    if taken == "native":
        if _settings is not None and _settings.checkpoint_copy == "auto":
            _drop_copy()
        elif _checkpoint is not None:
            _checkpoint.applied = version
            _checkpoint.prefetch(version)
    else:
        if _native is not None:
            _native.hold_applied(version)
        if _settings is not None and (_settings.checkpoint_copy == "never"
                                      or (_one_copy and _rank != 0)):
            _drop_copy()  # (a rank that fell back alone built its own copy: rank 0 keeps one)
    if _native is not None and _native.params_moved():
        log.error("SGLang moved a parameter's storage: the native holder is stale")
    _last.update(path=taken, sources=sources,
                 apply_ms=round((time.perf_counter() - started) * 1e3, 2))
    record()
    mem = memory()
    log.info("applied v%d via the %s path from %s in %.1f ms (TensorHub memory: compact "
             "region %d B, checkpoint copy %d B)", version, taken,
             ",".join(sources) or ("rank 0's copy" if _one_copy and _rank and taken ==
                                   "checkpoint" else "the local copy"),
             _last["apply_ms"], mem["compact_bytes"],
             mem["checkpoint_copy_bytes"])


def _rank_votes() -> RankVote:
    global _votes
    if _votes is None:
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_tp_group

        timeout = (_settings.update_timeout if _settings else 120.0) + VOTE_MARGIN_S
        _votes = RankVote(get_tp_group().ranks, dist.get_rank(), timeout)
    return _votes


def _native_outcome(version: int, failure: Exception | None) -> Exception | None:
    """On the native path each TP rank went its own way (natively, or the checkpoint path
    alone): the engine holds `version` on every rank or on none. If a rank failed and any
    rank's weights changed, every rank gets `TornLoad` (and restores, voting together)."""
    if tp_vote(failure is None):
        return None
    touched = failure is None or _torn or isinstance(failure, TornLoad)
    if tp_vote(not touched):
        return failure  # every rank failed before touching its weights: nothing to undo
    return failure if isinstance(failure, TornLoad) else TornLoad(version, failure)


def _tp_broadcast(payload: bytes | None) -> bytes:
    return _rank_votes().broadcast(payload)


def tp_vote(ok: bool) -> bool:
    """Whether every TP rank of this engine is ready: a version is applied on all ranks or
    on none (a rank that does not answer in time counts as a no)."""
    return ok if _tp_size() == 1 else _rank_votes()(ok)


def _repair(model, version: int, previous: int | None, agree, failure: Exception
            ) -> NoReturn:
    """Loading `version` left the live parameters torn (on this rank, or on another:
    `TornLoad`): load the version served before again, from the checkpoint copy or from
    peers (or the checkpoint the engine started from), on every rank that voted. Raises
    what happened (`restore_after`); if the restore failed, `_torn` stays set and the driver
    keeps generation paused."""
    global _torn, _applied
    _torn = True
    torn = failure if isinstance(failure, TornLoad) else TornLoad(version, failure)

    def load_version(v: int) -> None:
        _apply_checkpoint(model, v, agree, fetch=True)

    def load_disk() -> None:
        loaded: Exception | None = None
        try:
            model.load_weights(checkpoint_tensors(getattr(model.config, "_name_or_path", "")))
        except Exception as exc:
            loaded = exc
        if not agree(loaded is None):
            raise loaded or TensorHubError("another rank could not load the checkpoint")

    try:
        restore_after(torn, previous, load_version, load_disk)
    except TensorHubError as exc:
        if exc.code == "restored":
            _torn = False
            if outcome_in(str(exc)) == "restored_checkpoint":
                _applied = None
            elif _native is not None and previous is not None:
                _native.hold_applied(previous)
        raise


def refused(error: str) -> None:
    """The loader refused an update: record why (the driver reads it)."""
    record(error)


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
    global _settings, _names, _native, _rank, _one_copy
    settings = load_settings(None)
    if settings is None:
        log.warning("TensorHub plugin loaded but TENSORHUB_COORDINATOR is not set: inactive")
        return result
    if getattr(runner, "is_draft_worker", False):
        return result
    args = runner.server_args
    dummy = args.load_format == "dummy"
    try:
        _rank = _tp_rank()
        _settings = settings
        _one_copy = one_copy_per_engine(args.tp_size, getattr(args, "pp_size", 1),
                                        getattr(args, "nnodes", 1))
        instance = instance_name(settings, args.port)
        _names = (worker_name(instance, _rank), native_worker_name(instance, _rank))
        _native = NativeHolder(settings.coordinator, settings.model, _names[1],
                               native_params(runner.model, _rank, args.tp_size),
                               transport=settings.transport, pull_timeout=settings.update_timeout)
        if settings.checkpoint_copy == "always" and (_rank == 0 or not _one_copy):
            _copy()
        record()
        latest = FleetView(_native.replica.session, settings.model).latest()
        if not latest:
            if dummy:
                raise RuntimeError(f"started with --load-format dummy but model "
                                   f"{settings.model!r} has no published version")
            log.info("no version of %s yet; serving the weights from disk", settings.model)
            return result
        started = time.perf_counter()
        path = "native" if _native.peer_holds(latest) else "checkpoint"
        apply(runner.model, latest, path)
        log.info("joined at %s v%d from peers in %.2fs (%s path)", settings.model, latest,
                 time.perf_counter() - started, _last.get("path"))
    except Exception as exc:
        record(str(exc))
        if dummy or _torn:
            log.error("TensorHub: cannot serve without weights: %s", exc)
            raise
        log.exception("TensorHub: join failed; serving the weights from disk")
    return result
