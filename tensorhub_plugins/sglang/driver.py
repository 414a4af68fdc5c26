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

import torch

from tensorhub import TensorHubError, metrics
from tensorhub.engines import (
    EngineSettings,
    FleetView,
    FollowLoop,
    Update,
    outcome_in,
    refusal_in,
)
from tensorhub_plugins.sglang.naming import LOADER, native_worker_name, worker_name
from tensorhub_plugins.sglang.status import SchedulerStatus

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
# SGLang unable to flush its prefix cache: see docs/sglang.md). `abort`: SGLang aborts them
# (and its abort polls every 1 s until they are gone). `wait`: SGLang has no drain; the
# driver waits (at most `swap_timeout`) until no request is in flight, then pauses as `keep`.
PAUSE_MODES = {"keep": "retract", "wait": "retract", "abort": "abort"}


def descriptor_payload(version: int, path: str = "checkpoint") -> str:
    """`serialized_named_tensors` entry carrying only our descriptor: the format SGLang
    expects (a pickled list of (name, tensor)); we only ever pickle, never unpickle."""
    item = [("tensorhub:" + json.dumps({"version": version, "path": path}), torch.empty(0))]
    return base64.b64encode(pickle.dumps(item)).decode()


class Driver:
    """Follows `settings.model` for the server at `host:port` whose schedulers are named
    after `instance` (see `naming.start_instance`)."""

    def __init__(self, settings: EngineSettings, host: str, port: int, tp_size: int,
                 instance: str, one_copy: bool = False, api_key: str | None = None):
        """`api_key`: the server's `--api-key`, which SGLang requires of every call to it."""
        self.settings = settings
        self.api_key = api_key or None
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        self.port = port
        self.tp_size = tp_size
        self.instance = instance
        # The checkpoint copies: rank 0's alone when the ranks share it (`shared_copy`).
        self.names = [worker_name(instance, r) for r in range(1 if one_copy else tp_size)]
        self.fleet = FleetView.connect(settings.coordinator, settings.model, timeout=5.0)
        self.following = False
        self.serving: int | None = None
        self.latest: int | None = None  # as of the last poll
        self.held_version: int | None = None  # newest every checkpoint copy held then
        self.updates = 0
        self.last_update: dict | None = None
        self.last_error: str | None = None
        self.unloadable: dict | None = None  # the last version refused: {version, reason}
        self.torn: dict | None = None  # {version, reason}: generation paused until repaired
        self._first_seen: dict[int, float] = {}
        self.follow = FollowLoop(self, settings.poll_interval)
        self._stop = threading.Event()

    def _post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **self._auth})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            return {"text": text.decode(errors="replace")}

    def _get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self._auth)
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def applied(self) -> list[SchedulerStatus]:
        """What each rank's scheduler last reported (`status.SchedulerStatus`)."""
        return [SchedulerStatus.read(rank) for rank in range(self.tp_size)]

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
        if any(outcome_in(s.error or "") == "restored_checkpoint" for s in states):
            return "default"  # the weights it started with, loaded again
        applied = {s.applied for s in states}
        if len(applied) == 1 and None not in applied:
            return str(applied.pop())
        return str(self.serving or "default")

    # --- the swap, step by step (each a call of its own, for a shared controller) --------

    def in_flight(self) -> int | None:
        """Requests SGLang's front end holds now (None: not known here)."""
        try:
            from sglang.srt.entrypoints.http_server import get_global_state

            return len(get_global_state().tokenizer_manager.rid_to_state)
        except Exception:
            return None

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

    def pause(self, bound: float) -> None:
        self._post("/pause_generation", {"mode": PAUSE_MODES[self.settings.pause]}, bound)

    def install(self, version: int, path: str, bound: float,
                marks: dict[str, float] | None = None) -> None:
        """begin → update (our loader: the schedulers apply `version`) → end. SGLang labels
        the weights `version` when the update returns (its per-request version spans start
        there); `restore_label` puts the label back when the loader did not apply it."""
        marks = {} if marks is None else marks
        self._post("/begin_weight_update", {}, bound)
        marks["begin"] = time.perf_counter()
        try:
            self._sent = True
            self._post("/update_weights_from_tensor", {
                "serialized_named_tensors": [descriptor_payload(version, path)]
                * self.tp_size,
                "load_format": LOADER, "weight_version": str(version),
                "flush_cache": True}, bound)
            self._answered = True
            marks["update"] = time.perf_counter()
        finally:
            self._post("/end_weight_update", {}, bound)
            marks["end"] = time.perf_counter()

    def restore_label(self, states: list[SchedulerStatus], bound: float) -> None:
        self._post("/update_weight_version", {"new_version": self._served_label(states),
                                              "abort_all_requests": False}, bound)

    def resume(self, bound: float) -> None:
        self._post("/continue_generation", {}, bound)

    def swap(self, version: int, path: str = "checkpoint") -> float:
        bound = self.settings.swap_timeout  # each step's; the workers' votes name a hung rank
        marks: dict[str, float] = {}
        drained, drain_s = None, 0.0
        if self.settings.pause == "wait":  # before the pause: requests are still served
            drain_s = time.perf_counter()
            drained = self.drain(bound)
            drain_s = time.perf_counter() - drain_s
        started, since = time.perf_counter(), time.time()
        torn = False
        # an update sent and not answered: its outcome is unknown
        self._sent = self._answered = False
        try:
            self.pause(bound)
            marks["pause"] = time.perf_counter()
            self.install(version, path, bound, marks)
        finally:
            states = self.applied()
            # A scheduler that has not reported since the update began may have stopped
            # half-way: as torn. Torn weights are never served: stay paused, repair later.
            unknown = self._sent and not self._answered
            torn = any(s.torn or (unknown and s.at < since)
                       for s in states)
            if not torn:
                if any(s.applied != version for s in states):
                    # SGLang labelled the weights `version` when our loader returned; the
                    # loader refused it or restored another: the label must say what is
                    # served before a request is answered under it.
                    self.restore_label(states, bound)
                marks["check"] = time.perf_counter()
                self.resume(bound)
                marks["resume"] = time.perf_counter()
        stall = time.perf_counter() - started
        states = self.applied()
        outcomes = {outcome_in(s.error or "") for s in states} - {None}
        if outcomes:
            self.follow.never_again(version)  # its load failed half-way: a bug
        if "restored_checkpoint" in outcomes:
            self.serving = None  # the weights it started with, loaded again
        if torn:
            self.torn = {"version": version, "reason": next(
                (s.error for s in states if s.error), "")[:500]}
            raise TensorHubError(f"swap to v{version} left the weights torn; generation "
                                 f"stays paused until a whole version is loaded: {states}")
        if self.torn is not None:
            log.warning("TensorHub: a whole version is loaded; generation resumes")
        self.torn = None
        if any(s.applied != version for s in states):
            # (the label was put back before generation resumed)
            reasons = [r for s in states if (r := refusal_in(s.error or ""))]
            if reasons:  # the model cannot load it: never tried again
                if (self.unloadable or {}).get("version") != version:
                    metrics.refused_unloadable(self.settings.model)
                    log.error("TensorHub: refusing %s; still serving v%s", reasons[0],
                              self.serving)
                self.unloadable = {"version": version, "reason": reasons[0]}
                self.follow.never_again(version)
                raise TensorHubError(reasons[0], code="unloadable")
            raise TensorHubError(f"swap to v{version} refused by the scheduler: {states}")
        self.serving = version
        self.updates += 1
        metrics.switched(self.settings.model, version, stall)
        self.last_update = {
            "version": version, "stall_ms": round(stall * 1e3, 2), "at": time.time(),
            "path": states[0].path, "asked_path": path,
            "sources": sorted({src for s in states for src in s.sources}),
            "apply_ms": max(s.apply_ms or 0.0 for s in states),
            "pause_mode": self.settings.pause, "drained": drained,
            "steps_ms": {**({"drain": round(drain_s * 1e3, 2)} if drained is not None
                            else {}), **_steps(started, marks)},
            "apply_steps_ms": _max_steps([s.apply_steps_ms for s in states])}
        memory = _memory(states)
        log.info("now serving %s v%d via the %s path from %s (stall %.1f ms; TensorHub "
                 "memory: compact region %d B, checkpoint copy %d B)", self.settings.model,
                 version, self.last_update["path"],
                 ",".join(self.last_update["sources"]) or "the local copy", stall * 1e3,
                 memory["compact_bytes"], memory["checkpoint_copy_bytes"])
        return stall

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

    def swap_to(self, update: Update) -> None:
        try:
            self.swap(*update)
        except Exception:
            metrics.UPDATE_FAILURES.labels(self.settings.model).inc()
            raise

    def repair(self) -> None:
        """Load the version served before again, from peers if need be."""
        self.swap(self.serving, "checkpoint")

    def start(self) -> Driver:
        """Follow new versions in a thread of SGLang's main process."""
        self.following = True
        threading.Thread(target=self.run, daemon=True, name="tensorhub-driver").start()
        return self


def _steps(started: float, marks: dict[str, float]) -> dict[str, float]:
    """Milliseconds of each step of a swap (pause, begin, update, end, check: the ranks'
    reports read and the label put back if need be, resume), from the marks
    taken at each step's end."""
    out, at = {}, started
    for step in ("pause", "begin", "update", "end", "check", "resume"):
        if step in marks:
            out[step] = round((marks[step] - at) * 1e3, 2)
            at = marks[step]
    return out


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
