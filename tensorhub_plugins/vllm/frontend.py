"""TensorHub's front end inside vLLM's API server: elastic start-up, follow mode, routes.

The front end decides *when* the engine switches version; the workers' `TensorHubEngine`s
do the pulling and the swap. It learns what its workers hold from the coordinator (they
report every version they hold, which is how other engines find them too), and swaps only
to a version that every rank already holds: pause → swap → reset prefix cache → resume,
so the stall is the install alone, never the transfer. The sequence (check, pause, install,
resume) is `engines.SwapController`'s; this module gives it vLLM's calls. In the default
pause mode `keep`, requests in flight freeze for the install and go on with the new weights
(their KV recomputed; `keep_kv`: kept, the prefix cache salted by swap epoch instead of
reset), and every answer's tokens carry the version that produced them
(`versions.py`). A load that fails half-way is undone by the workers (`engines/restore.py`);
if they cannot undo it, generation stays paused until a whole version is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from tensorhub import TensorHubError, metrics, settings
from tensorhub.engines import (
    REFUSED,
    CheckAnswer,
    EngineSettings,
    FleetView,
    FollowLoop,
    InstallFailed,
    LayoutLag,
    PendingPulls,
    StepClock,
    SwapController,
    Update,
    all_ready,
    authorized,
    followed_model,
    load_settings,
    refusal_in,
    salted,
    versions_to_release,
)
from tensorhub_plugins.vllm import versions
from tensorhub_plugins.vllm.commands import (
    CanInstall,
    CanInstallAnswer,
    Check,
    Command,
    Init,
    Installed,
    Prefetch,
    Release,
    failed_as,
    installed_as,
)
from tensorhub_plugins.vllm.copies import copy_holders

log = logging.getLogger("tensorhub.vllm")
router = APIRouter()
# The worker attribute `collective_rpc` calls to ask the ranks a question: our engine
# (`TensorHubEngine.__call__`).
ANSWERING_CALL = "weight_transfer_engine"


async def ask_every_rank(engine_client, question: dict) -> list:
    """Every rank's answer to `question` (`TensorHubEngine.__call__`), of every engine
    behind a front end (vLLM's data-parallel client answers a `collective_rpc` with its
    first engine's ranks only)."""
    core = getattr(engine_client, "engine_core", None)
    every = getattr(core, "call_utility_all_async", None)
    if every is None:
        return await engine_client.collective_rpc(ANSWERING_CALL, args=(question,))
    per_engine = await every("collective_rpc", ANSWERING_CALL, None, (question,), None)
    return [answer for answers in per_engine for answer in answers]


class UpdateRequest(BaseModel):
    version: int | None = Field(default=None, ge=1, description="default: the latest")
    timeout: float = Field(default=120.0, gt=0, le=3600)


class Frontend:
    def __init__(self, settings: EngineSettings, engine_client, name: str, world_size: int,
                 holders: list[int] | None = None):
        """`holders`: the ranks that hold a checkpoint copy (`copies.copy_holders`; default
        every rank)."""
        self.settings = settings
        self.engine = engine_client
        self.name = name
        self.workers = [name] if world_size == 1 else [f"{name}-rank{r}"
                                                       for r in range(world_size)]
        if holders is not None and world_size > 1:
            self.workers = [self.workers[r] for r in holders]  # each node's copy holder
        self.fleet = FleetView.connect(settings.coordinator, settings.model, timeout=5.0)
        self.last_error: str | None = None
        self.pending = False  # the copy is pulling a version newer than it holds
        self.pulls = PendingPulls()
        self._task: asyncio.Task | None = None
        self.follow = FollowLoop(self, settings.poll_interval,  # run in follow mode
                                 news=self.fleet.news)
        self.swaps = SwapController(settings.model, self, self.follow, settings.swap_timeout)
        self._opening: asyncio.Future | None = None  # vLLM's update session (`check`)
        self._asker = uuid.uuid4().hex[:12]  # this front end, to its workers' checks
        self._check_attempts = 0  # each swap's check is an attempt of its own
        self._held_by_rank: dict[str, list[int]] = {}  # worker -> versions, at the last poll
        self._worker_pulls = metrics.WorkerPulls(settings.model)  # on vLLM's /metrics
        # (following the trainer's quantized layout: whether the trainer still publishes it)
        self.layout_lag = LayoutLag.following(settings.model)
        self._model_view: FleetView | None = None

    # what the controller keeps (follow mode and the status read them here)
    serving = property(lambda self: self.swaps.serving)
    torn = property(lambda self: self.swaps.torn)
    unloadable = property(lambda self: self.swaps.unloadable)
    updates = property(lambda self: self.swaps.updates)
    last_update = property(lambda self: self.swaps.last_update)

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
    # (the steps `SwapController` runs, in this order; it bounds and times them)
    async def check(self, version: int) -> None:
        """Before the pause: every rank checks that its model can load `version` and
        verifies the copy it will load from, in a thread of its own while the engine keeps
        generating (`engines.BackgroundCheck`); each question is a round trip between two
        of the engine's steps."""
        self._check_attempts += 1
        ask = Check(version=version, asker=self._asker, attempt=self._check_attempts).info()
        while True:
            answers = [CheckAnswer.model_validate(a) for a in await self._ask_every_rank(ask)]
            refusal = refusal_in(answers)
            if refusal is not None:
                raise refusal
            if all_ready(answers):
                break
            await asyncio.sleep(settings.CHECK_POLL)
        await self._open_update()

    async def _ask_every_rank(self, question: dict) -> list:
        return await ask_every_rank(self.engine, question)

    async def _open_update(self) -> None:
        """Open vLLM's weight-update session before the pause: it is a flag on each worker
        (our engine prepares nothing for it), so this call, answered between two of the
        engine's steps, costs the clients a round trip and no pause. A swap that stops
        before its install leaves it open for the next one; a call cut by the swap's bound
        goes on, and the next check waits for it instead of opening a second session,
        which every worker would refuse."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self.engine.start_weight_update())
        try:
            await asyncio.shield(self._opening)
        except Exception:  # (not a cancellation: the call goes on)
            self._opening = None  # not opened: the next check tries again
            raise

    async def pause(self) -> float | None:
        if self.settings.pause in ("keep", "keep_kv") and hasattr(self.engine, "engine_core"):
            # The scheduler's own pause: requests freeze where they are. (`pause_generation`
            # would add a fixed sleep meant for requests that finish or abort.) It is
            # answered between two steps: once it returns, the engine has stopped.
            await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            return None
        # clear_cache=False: the prefix cache is reset after the install. New requests
        # wait from the call on, while the requests in flight finish or are aborted.
        asked = time.perf_counter()
        await self.engine.pause_generation(mode=self.settings.pause, clear_cache=False)
        return asked

    async def install(self, version: int, path: str, fetch: bool) -> dict:
        clock = StepClock()
        self._opening = None  # the session opened in `check` ends here, whatever happens
        try:
            await self.engine.update_weights(WeightTransferUpdateRequest(
                update_info={"version": version, "fetch": fetch}))
        except BaseException as exc:
            # Close vLLM's update session (it refuses to start the next one otherwise),
            # keeping the weight version label as it was (a rank that raised has closed
            # its own: that answer is not the news), and ask the ranks what became of it.
            closing = asyncio.gather(self.engine.finish_weight_update(),
                                     self._ask_every_rank(Installed().info()),
                                     return_exceptions=True)
            if not isinstance(exc, Exception):  # (cancelled: the close goes on alone)
                raise
            closed, answers = await closing
            if isinstance(closed, BaseException):
                log.debug("closing the update session: %s", closed)
            outcome = failed_as(answers, version)
            if outcome is not None:
                if outcome.kind == "restored_checkpoint":
                    # the weights it started with, not the version its cache was made on
                    await self.engine.update_weight_version("default")
                    await self._reset_cache()
                raise InstallFailed(outcome) from None
            raise
        clock.mark("update")
        # Sent together: nothing runs while generation is paused, so the order of the
        # session's close (and the version label it sets) and the cache's reset does not
        # matter; the reset goes out with them, not after them. Both are awaited whatever
        # either does, and the first failure is raised.
        # With them goes the question of how each rank installed it (what it did, not what
        # it planned in the check).
        *results, installed = await asyncio.gather(
            self.engine.finish_weight_update(weight_version=str(version)),
            self._reset_cache(), self._ask_every_rank(Installed().info()),
            return_exceptions=True)
        for failure in results:
            if isinstance(failure, BaseException):
                raise failure
        clock.mark("finish")
        return {"pause_mode": self.settings.pause, "install": installed_as(installed, version),
                "steps_ms": clock.ms}

    async def _reset_cache(self) -> None:
        """KV computed with the old weights must not serve the new ones: requests kept
        through the pause recompute theirs (on resume, with the new weights), and the
        prefix cache starts empty. (`keep_kv`: they keep theirs, and the cache is salted
        by swap epoch instead: `salt_requests`.)"""
        if self.settings.pause != "keep_kv":
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    async def resume(self) -> None:
        await self.engine.resume_generation()
        # The engine core answers a call between two of its steps, so this returns once
        # the first step after the resume is done: the one in which the kept requests
        # recompute their KV and make their next token. The stall ends there, as the
        # clients feel it.
        await self.engine.is_paused()

    async def swap(self, version: int, pause: bool = True, fetch: bool = False) -> dict:
        """Make the engine serve `version`, which every rank holds (`fetch`: or pulls from
        its peers first). Returns timings."""
        return await self.swaps.swap(version, pause=pause, fetch=fetch)

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
        latest, held = await self.holdings()
        self.pending = self.pulls.pending(latest, held)  # (the follow loop looks sooner)
        await self._release_stale()
        update = (held, "checkpoint") if held is not None and (
            self.serving is None or held > self.serving) else None
        if update is None and self.layout_lag is not None \
                and self.layout_lag.due(time.monotonic()):
            await self._watch_layout(latest)
        return update

    async def _watch_layout(self, layout_latest: int) -> None:
        """Compare the quantized layout followed with its model (`LayoutLag`), between two
        swaps; what goes wrong asking is logged, never raised into follow mode."""
        try:
            if self._model_view is None:
                self._model_view = FleetView.connect(self.settings.coordinator,
                                                     self.layout_lag.model, timeout=5.0)
            model_latest = await asyncio.to_thread(self._model_view.latest)
        except Exception as exc:
            log.debug("asking for %s's newest version: %s", self.layout_lag.model, exc)
            return
        said = self.layout_lag.observe(model_latest, layout_latest, time.monotonic())
        if said:
            (log.warning if self.layout_lag.behind else log.info)("%s", said)

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
            "layout_behind": self.layout_lag.behind if self.layout_lag else None,
        }


def salt_requests(engine_client, epoch: Callable[[], int]) -> None:
    """Pause mode `keep_kv`: every request the engine core is given carries, in its
    prefix-cache salt, the swap epoch it arrived in (`engines.kv_salt`), so a prompt cached
    under one set of weights never serves a request that arrived under another."""
    core = getattr(engine_client, "engine_core", None)
    add = getattr(core, "add_request_async", None)
    if add is None:
        raise RuntimeError("TensorHub: TENSORHUB_PAUSE=keep_kv needs vLLM's engine core "
                           "client (add_request_async), which this vLLM lacks; use keep")

    async def add_salted(request, *args, **kwargs):
        request.cache_salt = salted(request.cache_salt, epoch())
        return await add(request, *args, **kwargs)

    core.add_request_async = add_salted


async def _ranks_cannot_take(engine_client, recipe: str) -> str | None:
    """What the ranks say keeps them from installing the trainer's layout by `recipe`
    (`TensorHubEngine._why_not_layout`: the first rank's reason; None: every rank can)."""
    answers = await ask_every_rank(engine_client, CanInstall(recipe=recipe).info())
    reasons = [CanInstallAnswer.model_validate(a).cannot for a in answers]
    return next((r for r in reasons if r is not None), None)


async def start_frontend(engine_client, args) -> Frontend | None:
    if engine_client is None:
        return None
    config = engine_client.vllm_config
    engine_settings = load_settings((config.additional_config or {}).get("tensorhub"))
    if engine_settings is None:
        log.warning("TensorHub plugin loaded but not configured: set TENSORHUB_COORDINATOR "
                    "or --additional-config '{\"tensorhub\": {\"coordinator\": ...}}'")
        return None
    wt = config.weight_transfer_config
    if wt is None or wt.backend != "tensorhub":
        raise RuntimeError("TensorHub needs --weight-transfer-config '{\"backend\": "
                           "\"tensorhub\"}' (and VLLM_PLUGINS=tensorhub)")
    versions.install()
    loop = asyncio.get_running_loop()

    def cannot_take_layout() -> str | None:  # (run in `followed_model`'s thread)
        try:
            return asyncio.run_coroutine_threadsafe(
                _ranks_cannot_take(engine_client, config.model_config.quantization),
                loop).result(timeout=600)
        except Exception as exc:
            return f"its ranks could not be asked ({exc})"

    engine_settings = engine_settings.model_copy(update={"model": await asyncio.to_thread(
        followed_model, engine_settings, config.model_config.quantization,
        cannot_take_layout)})
    frontend = Frontend(engine_settings, engine_client, engine_settings.instance_name(
        "vllm", getattr(args, "port", None)), config.parallel_config.world_size,
        copy_holders(config.parallel_config))
    if engine_settings.pause == "keep_kv":
        if (getattr(args, "api_server_count", None) or 1) > 1:
            raise RuntimeError("TensorHub: TENSORHUB_PAUSE=keep_kv needs one API server "
                               "(--api-server-count 1): each would count swaps on its own "
                               "and salt requests unlike the others; or use keep")
        salt_requests(engine_client, lambda: frontend.swaps.epoch)
    await frontend._init_workers()
    await frontend.join(dummy_weights=config.load_config.load_format == "dummy")
    if engine_settings.mode == "follow":
        frontend._task = asyncio.get_running_loop().create_task(frontend.follow.run())
    log.info("TensorHub front end %s: model %s, coordinator %s, mode %s", frontend.name,
             engine_settings.model, engine_settings.coordinator, engine_settings.mode)
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
