"""The main-process half: follows new versions and drives SGLang's own update endpoints.

The driver is a thread in the server's main process that talks to the server on its own
address, exactly as a trainer-side client would: pause → begin_weight_update →
update_weights_from_tensor (our loader, a small descriptor) → end_weight_update (with
`weight_version`) → continue.

Which path an update takes (see `worker`): the checkpoint path when every scheduler's
checkpoint copy already holds the version (pulled in the background: the stall is
`load_weights` only); else the native path when a peer of the same layout holds it (the
stall is the pull straight into the live parameters); else the checkpoint path pulling
inside the pause: at once when no other engine shares our native layout, and after
`NATIVE_WAIT` seconds when one does (it may soon hold the version natively). A scheduler
that reports torn parameters keeps generation paused until an update succeeds.

What the driver knows (`status`) is served on the server's own port as
`GET /tensorhub/status` (see `routes`), with the fields vLLM's route has.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import pickle
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import torch

from tensorhub import metrics
from tensorhub.engines import (
    EngineSettings,
    FleetView,
    FollowLoop,
    InstallFailed,
    PendingPulls,
    StepClock,
    SwapController,
    Update,
    copy_holders,
    worst_outcome,
)
from tensorhub_plugins.sglang.naming import LOADER, native_worker_name, worker_name
from tensorhub_plugins.sglang.reports import (
    DirectoryReports,
    Reports,
    connect_store_reports,
)
from tensorhub_plugins.sglang.status import NO_STATUS, SchedulerStatus

# How long a new version may wait for a same-layout peer (native path) when no checkpoint
# copy holds it yet; then the checkpoint path pulls it inside the pause.
NATIVE_WAIT = 10.0
# How long a new version may wait, beyond the longest pull (`update_timeout`), for every
# scheduler that keeps a checkpoint copy to pull it in the background and prepare it
# (verify, plan a sparse install: `worker.Scheduler.prepare`) before the swap goes ahead
# without (then the pull and those checks run inside the pause).
PREPARE_WAIT = 5.0

log = logging.getLogger("tensorhub.sglang")

# TensorHub's pause modes as SGLang's `/pause_generation` modes. `keep` (the default):
# `retract`: requests in flight go back to the waiting queue with the tokens they have and
# continue after the install, their KV recomputed with the new weights (`in_place` would
# keep KV computed with the old weights under tokens generated with the new ones, and leaves
# SGLang unable to flush its prefix cache: see docs/sglang.md). `keep_kv`: `in_place`, the
# requests and their KV stay where they are, the prefix cache is not flushed and requests
# are salted by swap epoch instead (`salt`). `abort`: SGLang aborts them
# (and its abort polls every 1 s until they are gone). `wait`: SGLang has no drain; the
# driver waits (at most `swap_timeout`) until no request is in flight, then pauses as `keep`.
PAUSE_MODES = {"keep": "retract", "keep_kv": "in_place", "wait": "retract", "abort": "abort"}


def descriptor_payload(version: int, path: str = "checkpoint") -> str:
    """`serialized_named_tensors` entry carrying only our descriptor: the format SGLang
    expects (a pickled list of (name, tensor)); we only ever pickle, never unpickle."""
    item = [("tensorhub:" + json.dumps({"version": version, "path": path}), torch.empty(0))]
    return base64.b64encode(pickle.dumps(item)).decode()


def _streams_every_step(request, default: int) -> bool:
    """Whether SGLang sends `request` (a `GenerateReqInput`) its tokens after every step:
    streamed, at an interval of 1."""
    params = getattr(request, "sampling_params", None)
    interval = (params.get("stream_interval") if isinstance(params, dict) else None) or default
    return getattr(request, "stream", False) is True and interval == 1


class Driver:
    """Follows `settings.model` for the server at `host:port` whose schedulers are named
    after `instance` (see `naming.start_instance`)."""

    def __init__(self, settings: EngineSettings, host: str, port: int, tp_size: int,
                 instance: str, one_copy: bool = False, api_key: str | None = None,
                 nodes: int = 1, tokenizer_workers: int = 1):
        """`api_key`: the server's `--api-key`, which SGLang requires of every call to it;
        `nodes`: the engine's nodes (on several, the ranks report through the engine's
        store, `reports`; this driver runs on node 0); `tokenizer_workers`: the server's
        `--tokenizer-worker-num` (over 1, requests live in processes this one cannot see)."""
        self.tokenizer_workers = tokenizer_workers
        self.settings = settings
        self.nodes = nodes
        self._reports: Reports | None = DirectoryReports() if nodes == 1 else None
        self.api_key = api_key or None
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        self.port = port
        self.tp_size = tp_size
        self.instance = instance
        # The checkpoint copies: each node's lowest rank's when the ranks share (`shared_copy`).
        self.names = [worker_name(instance, r) for r in
                      (copy_holders(tp_size, nodes) if one_copy else range(tp_size))]
        self.fleet = FleetView.connect(settings.coordinator, settings.model, timeout=5.0)
        self.following = False
        self.latest: int | None = None  # as of the last poll
        self.held_version: int | None = None  # newest every checkpoint copy held then
        self.last_error: str | None = None
        self._first_seen: dict[int, float] = {}
        self.pending = False
        self._pulls = PendingPulls()
        self.follow = FollowLoop(self, settings.poll_interval, news=self.fleet.news)
        self.swaps = SwapController(settings.model, self, self.follow, settings.swap_timeout)
        self._drained: tuple[bool, float] | None = None  # `wait`: (drained, seconds)
        self._session_open = False  # SGLang's weight-update session, opened by the pause
        self._stop = threading.Event()

    # what the controller keeps (follow mode and the status read them here)
    serving = property(lambda self: self.swaps.serving,
                       lambda self, v: setattr(self.swaps, "serving", v))
    torn = property(lambda self: self.swaps.torn)
    unloadable = property(lambda self: self.swaps.unloadable)
    updates = property(lambda self: self.swaps.updates)
    last_update = property(lambda self: self.swaps.last_update)

    def _post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **self._auth})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            return {"text": text.decode(errors="replace")}

    def _get(self, path: str, timeout: float = 10.0) -> dict:
        req = urllib.request.Request(self.url + path, headers=self._auth)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def applied(self) -> list[SchedulerStatus]:
        """What each rank's scheduler last reported (`status.SchedulerStatus`); "no status
        yet" for every rank while the engine's store is not known (several nodes)."""
        if self._reports is None:
            self._reports = connect_store_reports(self.instance)
            if self._reports is None:
                return [SchedulerStatus(error=NO_STATUS) for _ in range(self.tp_size)]
        return [SchedulerStatus.read(rank, self._reports) for rank in range(self.tp_size)]

    def held(self) -> tuple[int, int | None]:
        """(the model's latest version, the newest version every checkpoint copy holds)."""
        holdings = self.fleet.holdings(self.names)
        self.latest, self.held_version = holdings.latest, holdings.common()
        return self.latest, self.held_version

    def native_peers(self, version: int, states: list[SchedulerStatus]) -> tuple[bool, bool]:
        """(whether, for every rank, a worker other than us holds `version` in that rank's
        native layout; whether another engine could soon: in each of those layouts another
        worker holds some version, or registered as serving it (one that is applying a
        version holds none for that moment))."""
        ours = {s.native_name for s in states}
        layouts = [s.native_layout for s in states]
        if None in layouts:
            return False, False
        peers = [self.fleet.in_layout(lid) for lid in dict.fromkeys(layouts)]
        return (all(p.held_by_others(version, ours) for p in peers),
                all(p.others(ours) for p in peers))

    def next_update(self) -> Update | None:
        """The version to swap to and the path to take, or None (nothing new, or wait)."""
        latest, copied = self.held()
        # (the follow loop looks again soon while a newer version is on its way here)
        self.pending = self._pulls.pending(latest, self.serving) and \
            not self.follow.backing_off(latest)
        if not latest or (self.serving is not None and latest <= self.serving):
            return None
        if copied == latest:
            return (latest, "checkpoint") if self._prepared(latest) else None
        states = self.applied()
        if all(s.applied == latest for s in states):
            return latest, "checkpoint"  # already applied (a join): only the label is missing
        native_now, native_peer = self.native_peers(latest, states)
        if native_now:
            return latest, "native"
        if not native_peer:  # no engine shares our layout: no native peer to wait for
            # (a copy that follows pulls it in the background: wait for it, bounded)
            return (latest, "checkpoint") if self._prepared(latest) else None
        first = self._first_seen.setdefault(latest, time.monotonic())
        if time.monotonic() - first > NATIVE_WAIT:
            return latest, "checkpoint"
        return None

    def _prepared(self, version: int) -> bool:
        """Whether every scheduler that keeps a checkpoint copy has pulled and prepared
        `version` (checked and planned before the pause), or has had the time to."""
        states = self.applied()
        if all(s.prepared == version for s in states if s.memory.checkpoint_copy_bytes):
            return True
        first = self._first_seen.setdefault(version, time.monotonic())
        return time.monotonic() - first > self.settings.update_timeout + PREPARE_WAIT

    def _served_label(self, states: list[SchedulerStatus]) -> str:
        """SGLang's weight_version for what the ranks hold after an update that did not
        apply: the version they all report applied, else the one served before."""
        if any(s.outcome is not None and s.outcome.kind == "restored_checkpoint"
               for s in states):
            return "default"  # the weights it started with, loaded again
        applied = {s.applied for s in states}
        if len(applied) == 1 and None not in applied:
            return str(applied.pop())
        return str(self.serving or "default")

    # --- the swap, step by step (each a call of its own, for a shared controller) --------

    def _front_end(self):
        """SGLang's front end (its tokenizer manager) in this process; None where it is not
        the only one (several tokenizer workers) or cannot be found."""
        if self.tokenizer_workers > 1:
            return None
        try:
            from sglang.srt.entrypoints.http_server import get_global_state

            return get_global_state().tokenizer_manager
        except Exception:
            return None

    def in_flight(self) -> int | None:
        """Requests SGLang's front end holds now (None: not known here)."""
        manager = self._front_end()
        return None if manager is None else len(manager.rid_to_state)

    def drain(self, bound: float) -> bool:
        """`wait`: until no request is in flight, at most `bound` seconds (new requests are
        still admitted meanwhile: under steady load it may never drain). Whether it did."""
        deadline = time.monotonic() + bound
        while (n := self.in_flight()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if n:
            log.warning("TensorHub: %d requests still in flight after %.0f s of waiting; "
                        "pausing with them kept (retract)", n, bound)
        return not n

    # (the steps `SwapController` runs, in this order; it bounds and times them)
    async def check(self, version: int) -> None:
        """Before the pause: a version a rank's copy refused while preparing it is refused
        here (its model cannot load it); with `wait`, requests in flight finish first."""
        for state in self.applied():
            outcome = state.outcome
            if outcome is not None and outcome.kind == "unloadable" \
                    and outcome.version == version:
                raise InstallFailed(outcome)
        self._drained = None
        if self.settings.pause == "wait":  # requests are still served meanwhile
            started = time.perf_counter()
            drained = self.drain(self.settings.swap_timeout)
            self._drained = (drained, time.perf_counter() - started)

    async def pause(self) -> float | None:
        """SGLang answers the pause before its scheduler takes it (at the top of its next
        loop turn, once the step in flight is done). The weight-update session the install
        needs is opened next (`/begin_weight_update`): the scheduler answers it after taking
        the pause, so it returns once generation has stopped, and the stall is timed from
        there without a round trip of its own (its own work, restoring weights SGLang
        packed in place, is timed with the wait for the step in flight: `pause_ms`).
        `abort` waits for the aborts to end, and new requests wait from the call on."""
        asked = time.perf_counter()
        self._post("/pause_generation", {"mode": PAUSE_MODES[self.settings.pause]},
                   self.settings.swap_timeout)
        if self.settings.pause == "abort":  # (timed from the call: a bound of its own)
            self._begin(self.settings.swap_timeout)
            return asked
        # (both calls within one `swap_timeout`: they block this thread's loop, so the
        # controller's bound cannot cut them short)
        left = self.settings.swap_timeout - (time.perf_counter() - asked)
        if left <= 0:
            raise TimeoutError("the pause took the whole swap timeout")
        self._begin(left)
        return None

    def _begin(self, timeout: float) -> None:
        """Open SGLang's weight-update session (the install closes it, whatever happens).
        One left open (a begin whose answer we did not wait for: the scheduler may still
        have opened it) is closed and opened again; a begin that fails is followed by an
        end, so that no session outlives this swap."""
        if self._session_open:
            return
        try:
            try:
                self._post("/begin_weight_update", {}, timeout)
            except urllib.error.HTTPError as exc:
                if exc.code != 400:  # (400: "a weight-update session is already open")
                    raise
                self._end_session(timeout)
                self._post("/begin_weight_update", {}, timeout)
        except BaseException:
            self._end_session(timeout)
            raise
        self._session_open = True

    def _end_session(self, timeout: float) -> None:
        """Close an update session that may be open; never raises (none open: SGLang
        answers 400)."""
        self._session_open = False
        try:
            self._post("/end_weight_update", {}, timeout)
        except (urllib.error.URLError, OSError) as exc:
            log.debug("closing a weight-update session: %s", exc)

    async def install(self, version: int, path: str, fetch: bool) -> dict:
        """begin → update (our loader: the schedulers apply `version`) → end, then what the
        ranks report. SGLang labels the weights `version` when the update returns; where
        the loader did not apply it the label is put back before anything is answered."""
        bound = self.settings.swap_timeout
        clock, since = StepClock(), time.time()
        sent = answered = False  # an update sent and not answered: its outcome is unknown
        try:
            if not self._session_open:  # (no pause before it: torn weights repaired)
                self._begin(bound)
                clock.mark("begin")
            try:
                sent = True
                self._post("/update_weights_from_tensor", {
                    "serialized_named_tensors": [descriptor_payload(version, path)]
                    * self.tp_size,
                    "load_format": LOADER, "weight_version": str(version),
                    "flush_cache": self.settings.pause != "keep_kv"}, bound)
                answered = True
                clock.mark("update")
            finally:
                self._session_open = False
                self._post("/end_weight_update", {}, bound)
                clock.mark("end")
        finally:
            states = self.applied()
        # A scheduler that has not reported since the update began may have stopped
        # half-way: as torn. Torn weights are never served: stay paused, repair later.
        if any(s.torn or (sent and not answered and s.at < since) for s in states):
            raise InstallFailed.of("torn", version, next(
                (s.error for s in states if s.error), "a rank did not report") + " " +
                "(the weights are torn)")
        if any(s.applied != version for s in states):
            self._post("/update_weight_version", {"new_version": self._served_label(states),
                                                  "abort_all_requests": False}, bound)
            worst = worst_outcome(s.outcome for s in states)
            if worst is not None and worst.kind != "refused":
                raise InstallFailed(worst)
            raise InstallFailed.of("refused", version,
                                   f"swap to v{version} refused by the scheduler: {states}")
        clock.mark("check")
        extra = {"path": states[0].path, "asked_path": path,
                 "install": states[0].install,
                 "sources": sorted({src for s in states for src in s.sources}),
                 "apply_ms": max(s.apply_ms or 0.0 for s in states),
                 "pause_mode": self.settings.pause,
                 "steps_ms": clock.ms,
                 "apply_steps_ms": _max_steps([s.apply_steps_ms for s in states])}
        if self._drained is not None:
            extra["drained"] = self._drained[0]
            extra["drain_ms"] = round(self._drained[1] * 1e3, 2)  # (before the pause)
        memory = _memory(states)
        log.info("v%d installed via the %s path%s from %s (TensorHub memory: compact region "
                 "%d B, checkpoint copy %d B)", version, extra["path"],
                 f" ({extra['install']})" if extra["install"] else "",
                 ",".join(extra["sources"]) or "the local copy", memory["compact_bytes"],
                 memory["checkpoint_copy_bytes"])
        return extra

    async def resume(self) -> None:
        """The stall ends where clients get tokens again: once the front end receives the
        first output after the resume (the first step following it, in which retracted
        requests recompute their KV), where a request in flight streams every step. Else
        (no such request: SGLang sends the others their tokens every 50 steps or at the
        end; or the front end cannot be watched) two round trips to the scheduler: it
        takes requests at the top of each loop turn, before that turn's step, so the
        second returns after at least one step has run since the resume."""
        asked = time.time()
        if self._session_open:  # (the install never ran: its session must not outlive it)
            self._end_session(self.settings.swap_timeout)
        self._post("/continue_generation", {}, self.settings.swap_timeout)
        if self.in_flight() == 0:
            return  # no client is waiting for a token: the stall ends here
        received = self._front_end_received()
        if received is not None:
            deadline = time.monotonic() + self.settings.swap_timeout
            while (received() or 0.0) <= asked and self.in_flight() \
                    and time.monotonic() < deadline:
                time.sleep(0.002)
            return
        for _ in range(2):
            self._get("/server_info", timeout=self.settings.swap_timeout)

    def _front_end_received(self) -> Callable[[], float | None] | None:
        """When SGLang's front end last received a message from the scheduler (its
        `last_receive_tstamp`, wall clock), where a request in flight streams a token
        every step, so that its next output is the next step's; None where no request
        does, or it cannot be read here (several tokenizer workers, another SGLang)."""
        manager = self._front_end()
        try:
            default = getattr(manager.server_args, "stream_interval", None) or 1
            if not isinstance(getattr(manager, "last_receive_tstamp", None), float) or \
                    not any(_streams_every_step(state.obj, default)
                            for state in list(manager.rid_to_state.values())):
                return None
        except Exception:  # (no front end, or another SGLang's)
            return None
        return lambda: getattr(manager, "last_receive_tstamp", None)

    def status(self) -> dict:
        """What `GET /tensorhub/status` answers: vLLM's field names where they mean the same
        (`latest_version` and `held_version` as of the driver's last poll, so the route never
        waits on the coordinator), plus SGLang's own: the native holders, the memory
        TensorHub spends, and each rank's own report (`ranks`)."""
        states = self.applied()
        serving = self.serving
        if not self.following:  # manual: the trainer drives the endpoints; ask the ranks
            applied = {s.applied for s in states}
            serving = applied.pop() if len(applied) == 1 else None
        return {
            "model": self.settings.model, "coordinator": self.settings.coordinator,
            "name": self.instance, "workers": self.names,
            "native_workers": [native_worker_name(self.instance, r)
                               for r in range(self.tp_size)],
            "mode": self.settings.mode, "serving_version": serving,
            "held_version": self.held_version, "latest_version": self.latest,
            "updates": self.updates, "last_update": self.last_update,
            "last_error": self.last_error, "unloadable": self.unloadable, "torn": self.torn,
            "memory": _memory(states),
            "params_moved": any(s.params_moved for s in states),
            "ranks": [s.model_dump() for s in states],
        }

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        self.url + "/health", headers=self._auth), timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return False

    def run(self) -> None:
        if not self._wait_ready(self.settings.join_timeout + 900):
            return
        # SGLang's /metrics serves multiprocess files only: our switches go there too (the
        # schedulers' pulls already do: they start with SGLang's directory set)
        metrics.use_multiprocess_files()
        try:
            loaders = self._get("/get_server_info").get("custom_weight_loader") or []
        except Exception:
            loaders = []
        if LOADER not in loaders:
            self.last_error = (f"TensorHub cannot update this server: start it with "
                               f"--custom-weight-loader {LOADER}")
            log.error("%s", self.last_error)
            return
        applied = {s.applied for s in self.applied()}
        self.serving = applied.pop() if len(applied) == 1 else None
        if self.serving is not None:  # joined at start-up: label what is served
            metrics.SERVING_VERSION.labels(self.settings.model).set(self.serving)
            try:
                self._post("/update_weight_version", {"new_version": str(self.serving),
                                                      "abort_all_requests": False})
            except Exception as exc:
                log.warning("could not set SGLang's weight_version: %s", exc)
        log.info("TensorHub driver following %s for %s (serving v%s)", self.settings.model,
                 ", ".join(self.names), self.serving)
        # (this thread's own event loop: the steps below block it, and nothing else runs on it)
        asyncio.run(self.follow.run(self._stop.is_set))

    def swap_to(self, update: Update):
        return self.swaps.swap(*update)

    def repair(self):
        """Load the version served before again, whole (from peers if need be)."""
        return self.swaps.swap(self.serving, "checkpoint", fetch=True)

    def start(self) -> Driver:
        """Follow new versions in a thread of SGLang's main process."""
        self.following = True
        threading.Thread(target=self.run, daemon=True, name="tensorhub-driver").start()
        return self


def _max_steps(per_rank: list[dict | None]) -> dict[str, float]:
    """Each step's time on the slowest rank."""
    out: dict[str, float] = {}
    for steps in per_rank:
        for k, v in (steps or {}).items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def _memory(states: list[SchedulerStatus]) -> dict[str, int]:
    """Bytes TensorHub spends beside SGLang's parameters, summed over the ranks."""
    return {key: sum(getattr(s.memory, key) for s in states)
            for key in ("compact_bytes", "checkpoint_copy_bytes")}
