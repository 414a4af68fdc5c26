"""The scheduler-side half: a checkpoint-layout holder beside SGLang's model.

Created right after SGLang loads its model (a hook on `ModelRunner.load_model`); pulls new
versions in the background while SGLang serves, serves them to other engines, and applies
a version with the model's own `load_weights` when the driver asks through the custom
loader. Nothing here may raise into SGLang after start-up: an exception in the scheduler
kills the whole server.
"""

from __future__ import annotations

import json
import logging
import time

from tensorhub.core.data_types import GetManifest
from tensorhub.core.errors import CoordinatorError
from tensorhub.engines.holder import CheckpointHolder
from tensorhub.engines.settings import load_settings
from tensorhub_plugins.sglang.naming import status_path, worker_name

log = logging.getLogger("tensorhub.sglang")

_holder: CheckpointHolder | None = None
_where: tuple[int, int] = (0, 0)  # (port, tp_rank)


def record(applied: int | None, error: str | None = None) -> None:
    with open(status_path(*_where), "w") as f:
        json.dump({"applied": applied, "error": error, "at": time.time()}, f)


def apply(model, version: int) -> None:
    """Load `version` from the holder into the live model (raises if we do not hold it)."""
    if _holder is None:
        raise RuntimeError("TensorHub holder not running in this scheduler")
    started = time.perf_counter()
    with _holder.tensors_of(version) as named:
        model.load_weights(named)
    record(version)
    log.info("applied v%d in %.1f ms", version, (time.perf_counter() - started) * 1e3)


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised: a single-rank engine
        return 0


def after_load_model(result, runner):
    """AFTER hook on `ModelRunner.load_model`: start the holder and join at the newest
    version. With `--load-format dummy` a failed join stops start-up (random weights must
    never be served); otherwise it is logged and the weights from disk are served."""
    global _holder, _where
    settings = load_settings(None)
    if settings is None:
        log.warning("TensorHub plugin loaded but TENSORHUB_COORDINATOR is not set: inactive")
        return result
    if getattr(runner, "is_draft_worker", False):
        return result
    args = runner.server_args
    dummy = args.load_format == "dummy"
    try:
        rank = _tp_rank()
        _where = (args.port, rank)
        record(None)
        _holder = CheckpointHolder(
            settings.coordinator, settings.model,
            worker_name(settings, args.host, args.port, rank),
            transport=settings.transport, follow=settings.mode == "follow",
            pull_timeout=settings.update_timeout)
        try:
            latest = _holder.replica.session.client.call(GetManifest(model=settings.model)).version
        except CoordinatorError as exc:
            if exc.code not in ("unknown_model", "unknown_version"):
                raise
            latest = None
        if latest is None:
            if dummy:
                raise RuntimeError(f"started with --load-format dummy but model "
                                   f"{settings.model!r} has no published version")
            log.info("no version of %s yet; serving the weights from disk", settings.model)
            return result
        started = time.perf_counter()
        _holder.pull(latest)
        apply(runner.model, latest)
        log.info("joined at %s v%d from peers in %.2fs", settings.model, latest,
                 time.perf_counter() - started)
    except Exception as exc:
        if dummy:
            log.error("TensorHub: cannot serve without weights: %s", exc)
            raise
        log.exception("TensorHub: join failed; serving the weights from disk")
    return result
