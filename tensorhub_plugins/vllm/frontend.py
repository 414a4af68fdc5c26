"""TensorHub's front end inside vLLM's API server: elastic start-up, follow mode, routes.

The front end decides *when* the engine switches version; the workers' `TensorHubEngine`s
do the pulling and the swap. It learns what its workers hold from the coordinator (they
report every version they hold, which is how other engines find them too), and swaps only
to a version that every rank already holds: pause → swap → reset prefix cache → resume,
so the stall is the swap alone, never the transfer. Every step of a swap has a bound
(`swap_timeout`). A load that fails half-way is undone by the workers (`engines/restore.py`);
if they cannot undo it, generation stays paused until a whole version is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from tensorhub import TensorHubError, metrics
from tensorhub.engines import (
    REFUSED,
    EngineSettings,
    FleetView,
    FollowLoop,
    Update,
    authorized,
    load_settings,
    outcome_in,
    refusal_in,
    versions_to_release,
)
from tensorhub_plugins.vllm.commands import Check, Command, Init, Prefetch, Release
from tensorhub_plugins.vllm.copies import one_copy_per_engine

log = logging.getLogger("tensorhub.vllm")
router = APIRouter()


class UpdateRequest(BaseModel):
    version: int | None = Field(default=None, ge=1, description="default: the latest")
    timeout: float = Field(default=120.0, gt=0, le=3600)


class Frontend:
    def __init__(self, settings: EngineSettings, engine_client, name: str, world_size: int,
                 one_copy: bool = False):
        self.settings = settings
        self.engine = engine_client
        self.name = name
        self.workers = [name] if world_size == 1 else [f"{name}-rank{r}"
                                                       for r in range(world_size)]
        if one_copy:
            self.workers = self.workers[:1]  # rank 0 holds the engine's one copy
        self.fleet = FleetView.connect(settings.coordinator, settings.model, timeout=5.0)
        self.serving: int | None = None
        self.last_update: dict | None = None
        self.updates = 0
        self.last_error: str | None = None
        self.unloadable: dict | None = None  # the last version refused: {version, reason}
        self.torn: dict | None = None  # {version, reason}: generation paused until repaired
        self._swap = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.follow = FollowLoop(self, settings.poll_interval)  # run in follow mode
        self._held_by_rank: dict[str, list[int]] = {}  # worker -> versions, at the last poll
        self._worker_pulls = metrics.WorkerPulls(settings.model)  # on vLLM's /metrics

    # ------------------------------------------------------------------ coordinator
    async def holdings(self) -> tuple[int, int | None]:
        """(latest version known to the coordinator, newest version every rank holds)."""
        holdings = await asyncio.to_thread(self.fleet.holdings, self.workers)
        self._held_by_rank = holdings.held
        self._worker_pulls.count(holdings.pulls)
        return holdings.latest, holdings.common()

    async def _release_stale(self) -> None:
        """Let go of versions a rank holds unapplied while another rank holds a newer one:
        that rank would wait for them forever (`versions_to_release`)."""
        for version in sorted(versions_to_release(self._held_by_rank, self.serving)):
            await self._tell_workers(Release(version=version))

    async def _tell_workers(self, command: Command) -> None:
        """Send `command` to every worker's `TensorHubEngine` (`commands`)."""
        await self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=command.info()))

    async def _init_workers(self) -> None:
        await self._tell_workers(Init(
            coordinator=self.settings.coordinator, model=self.settings.model, name=self.name,
            transport=self.settings.transport, follow=self.settings.mode == "follow",
            pull_timeout=self.settings.update_timeout))

    async def _wait_held(self, version: int, timeout: float) -> None:
        """Wait until every rank holds `version`, asking them to pull it if need be."""
        deadline = time.monotonic() + timeout
        await self._tell_workers(Prefetch(version=version))
        while True:
            _, held = await self.holdings()
            if held is not None and held >= version:
                return
            if time.monotonic() > deadline:
                raise TensorHubError(f"workers did not get v{version} within {timeout:.0f}s",
                                     code="timeout")
            await asyncio.sleep(self.settings.poll_interval)

    # ------------------------------------------------------------------ swapping
    async def _bounded(self, step, what: str):
        """Await one step of a swap for at most `swap_timeout` seconds."""
        try:
            return await asyncio.wait_for(step, self.settings.swap_timeout)
        except TimeoutError:
            raise TensorHubError(f"{what} did not finish within {self.settings.swap_timeout:.0f}"
                                 f" s (a rank may hang: see the workers' log)",
                                 code="timeout") from None

    async def swap(self, version: int, pause: bool = True, fetch: bool = False) -> dict:
        """Make the engine serve `version`, which every rank holds (`fetch`: or pulls from
        its peers first). Returns timings. Generation stays paused after a swap that left
        the weights torn, until one succeeds."""
        async with self._swap:
            if self.serving == version and self.torn is None:
                return {"version": version, "stall_ms": 0.0, "changed": False}
            started = time.perf_counter()
            marks: dict[str, float] = {}
            await self._check(version)
            was_torn = self.torn is not None  # (then generation is paused already)
            try:
                if pause and not was_torn:
                    # clear_cache=False: we reset the prefix cache ourselves after the swap.
                    await self._bounded(self.engine.pause_generation(
                        mode=self.settings.pause, clear_cache=False), "pausing generation")
                    marks["pause"] = time.perf_counter()
                await self._bounded(self.engine.start_weight_update(), "starting the update")
                try:
                    await self._bounded(self.engine.update_weights(WeightTransferUpdateRequest(
                        update_info={"version": version, "fetch": fetch})),
                        f"applying v{version}")
                    marks["swap"] = time.perf_counter()
                except BaseException as exc:
                    self._failed(version, exc)
                    # Close vLLM's update session (it refuses to start the next one
                    # otherwise), keeping the weight version label as it was. (A rank
                    # that raised has closed its own: that answer is not the news.)
                    try:
                        await self._bounded(self.engine.finish_weight_update(),
                                            "closing the update")
                    except Exception as close_exc:
                        log.debug("closing the update session: %s", close_exc)
                    raise
                await self._bounded(self.engine.finish_weight_update(
                    weight_version=str(version)), "closing the update")
                await self._bounded(self.engine.reset_prefix_cache(), "resetting the cache")
                marks["finish"] = time.perf_counter()
                if was_torn:
                    log.warning("TensorHub: v%d loaded whole; generation resumes", version)
                self.torn = None
            finally:
                if (pause or was_torn) and self.torn is None:
                    await self._bounded(self.engine.resume_generation(), "resuming generation")
            marks["resume"] = time.perf_counter()
            steps, last = [], started
            for step, t in marks.items():
                steps.append(f"{step} {(t - last) * 1e3:.1f}")
                last = t
            stall_ms = (time.perf_counter() - started) * 1e3
            self.serving = version
            metrics.switched(self.settings.model, version, stall_ms / 1e3)
            self.updates += 1
            self.last_update = {"version": version, "stall_ms": round(stall_ms, 2),
                                "at": time.time()}
            log.info("now serving %s v%d (stall %.1f ms: %s ms)", self.settings.model, version,
                     stall_ms, ", ".join(steps))
            return {"version": version, "stall_ms": stall_ms, "changed": True}

    def _failed(self, version: int, exc: BaseException) -> None:
        """Record a swap that failed: a version whose load failed half-way (undone, or not)
        is never tried again; torn weights keep generation paused."""
        metrics.UPDATE_FAILURES.labels(self.settings.model).inc()
        # A load that did not finish in time may have stopped half-way: as torn.
        outcome = "torn" if getattr(exc, "code", None) == "timeout" else outcome_in(str(exc))
        if outcome is not None:
            self.follow.never_again(version)
        if outcome == "restored_checkpoint":
            self.serving = None  # the weights it started with, loaded again
        if outcome == "torn":
            self.torn = {"version": version, "reason": str(exc).splitlines()[0][:500]}
            log.error("swap to v%d left the weights torn: generation stays paused until a "
                      "whole version is loaded (%s)", version, self.torn["reason"])
        else:
            log.error("swap to v%d failed; still serving %s%s", version,
                      f"v{self.serving}" if self.serving else "the weights loaded at start",
                      " (restored after a load that failed half-way)"
                      if outcome in ("restored", "restored_checkpoint") else "")

    async def _check(self, version: int) -> None:
        """Refuse `version` before generation pauses if the model cannot load it (its
        tensors' names, shapes or dtypes are unlike the model's): it is never tried again."""
        try:
            await self._bounded(self._tell_workers(Check(version=version)),
                                f"checking v{version}")
        except Exception as exc:
            reason = refusal_in(str(exc))
            if reason is None:
                raise
            if (self.unloadable or {}).get("version") != version:
                metrics.refused_unloadable(self.settings.model)
                log.error("TensorHub: refusing %s; still serving v%s", reason, self.serving)
            self.unloadable = {"version": version, "reason": reason}
            self.follow.never_again(version)
            raise TensorHubError(reason, code="unloadable") from None

    async def update(self, version: int | None, timeout: float) -> dict:
        """Manual update: pull (if needed) then swap; the stall covers the swap only."""
        latest, _ = await self.holdings()
        target = version or latest
        if not target:
            raise TensorHubError(f"model {self.settings.model!r} has no version yet",
                                 code="unknown_model")
        if target > latest:
            raise TensorHubError(f"model {self.settings.model!r} has no version {target} "
                                 f"(latest is {latest})", code="unknown_version")
        await self._wait_held(target, timeout)
        return await self.swap(target)

    # ------------------------------------------------------------------ follow mode
    async def next_update(self) -> Update | None:
        """The newest version every rank holds, if newer than the one served."""
        _, held = await self.holdings()
        await self._release_stale()
        if held is not None and (self.serving is None or held > self.serving):
            return held, "checkpoint"
        return None

    async def swap_to(self, update: Update) -> None:
        await self.swap(update[0])

    async def repair(self) -> None:
        """Load the version served before again, from peers if need be."""
        await self.swap(self.serving, fetch=True)

    async def join(self, dummy_weights: bool) -> None:
        """Elastic start-up: serve the newest version from peers before taking requests."""
        try:
            latest, _ = await self.holdings()
        except TensorHubError as exc:
            if dummy_weights:
                raise RuntimeError(f"TensorHub: started with --load-format dummy but the "
                                   f"coordinator is unreachable ({exc}); nothing to serve"
                                   ) from None
            log.warning("TensorHub: coordinator unreachable at start (%s); serving the weights "
                        "from disk until it answers", exc)
            return
        if latest == 0:
            if dummy_weights:
                raise RuntimeError(f"TensorHub: started with --load-format dummy but model "
                                   f"{self.settings.model!r} has no published version yet")
            log.info("TensorHub: no version of %s yet; serving the weights from disk",
                     self.settings.model)
            return
        started = time.perf_counter()
        await self._wait_held(latest, self.settings.join_timeout)
        await self.swap(latest, pause=False)
        log.info("TensorHub: joined at %s v%d from peers in %.2fs", self.settings.model, latest,
                 time.perf_counter() - started)

    async def status(self) -> dict:
        try:
            latest, held = await self.holdings()
        except TensorHubError as exc:
            latest, held = None, None
            self.last_error = str(exc)
        return {
            "model": self.settings.model, "coordinator": self.settings.coordinator,
            "name": self.name, "workers": self.workers, "mode": self.settings.mode,
            "serving_version": self.serving,
            "vllm_weight_version": await self.engine.get_weight_version(),
            "held_version": held, "latest_version": latest, "updates": self.updates,
            "last_update": self.last_update, "last_error": self.last_error,
            "unloadable": self.unloadable, "torn": self.torn,
        }


async def start_frontend(engine_client, args) -> Frontend | None:
    if engine_client is None:
        return None
    config = engine_client.vllm_config
    settings = load_settings((config.additional_config or {}).get("tensorhub"))
    if settings is None:
        log.warning("TensorHub plugin loaded but not configured: set TENSORHUB_COORDINATOR "
                    "or --additional-config '{\"tensorhub\": {\"coordinator\": ...}}'")
        return None
    wt = config.weight_transfer_config
    if wt is None or wt.backend != "tensorhub":
        raise RuntimeError("TensorHub needs --weight-transfer-config '{\"backend\": "
                           "\"tensorhub\"}' (and VLLM_PLUGINS=tensorhub)")
    frontend = Frontend(settings, engine_client, settings.instance_name(
        "vllm", getattr(args, "port", None)), config.parallel_config.world_size,
        one_copy_per_engine(config.parallel_config))
    await frontend._init_workers()
    await frontend.join(dummy_weights=config.load_config.load_format == "dummy")
    if settings.mode == "follow":
        frontend._task = asyncio.get_running_loop().create_task(frontend.follow.run())
    log.info("TensorHub front end %s: model %s, coordinator %s, mode %s", frontend.name,
             settings.model, settings.coordinator, settings.mode)
    return frontend


# ---------------------------------------------------------------------- routes
def _frontend(request: Request) -> Frontend:
    frontend = getattr(request.app.state, "tensorhub", None)
    if frontend is None:
        raise HTTPException(503, "TensorHub is not configured on this server "
                                 "(set TENSORHUB_COORDINATOR)")
    if not authorized(request.headers.get("authorization"),
                      request.client.host if request.client else None):
        raise HTTPException(401, REFUSED)
    return frontend


@router.get("/tensorhub/status")
async def tensorhub_status(request: Request) -> dict:
    return await _frontend(request).status()


@router.post("/tensorhub/update")
async def tensorhub_update(request: Request, body: UpdateRequest | None = None) -> dict:
    frontend = _frontend(request)
    body = body or UpdateRequest()
    try:
        return await frontend.update(body.version, body.timeout)
    except TensorHubError as exc:
        status = {"unknown_model": 404, "unknown_version": 404, "timeout": 504,
                  "unloadable": 422}.get(exc.code, 502)
        raise HTTPException(status, f"update failed ({exc.code}): {exc}; still serving "
                                    f"v{frontend.serving}") from None
    except Exception as exc:
        raise HTTPException(500, f"update failed: {exc}; still serving "
                                 f"v{frontend.serving}") from None
