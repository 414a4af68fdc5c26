"""The main-process half: follows new versions and drives SGLang's own update endpoints.

SGLang has no plugin hook for HTTP routes, so the driver is a thread in the server's main
process that talks to the server on its own address, exactly as a trainer-side client
would: pause → begin_weight_update → update_weights_from_tensor (our loader, a small
descriptor) → end_weight_update (with `weight_version`) → continue. It swaps only to a
version every scheduler already holds, so the stall is the swap, not the transfer.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import threading
import time
import urllib.error
import urllib.request

import torch

from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import HoldingsRequest
from tensorhub.core.errors import TensorHubError
from tensorhub.engines.settings import EngineSettings
from tensorhub_plugins.sglang.naming import (
    LOADER,
    driver_status_path,
    status_path,
    worker_name,
)

log = logging.getLogger("tensorhub.sglang")

# SGLang's pause modes; "wait" (finish in-flight requests on the old version) has no
# SGLang equivalent, and "abort" is the one that never mixes two versions in one answer.
PAUSE_MODES = {"wait": "abort", "abort": "abort", "keep": "in_place"}


def descriptor_payload(version: int) -> str:
    """`serialized_named_tensors` entry carrying only our descriptor: the format SGLang
    expects (a pickled list of (name, tensor)); we only ever pickle, never unpickle."""
    item = [("tensorhub:" + json.dumps({"version": version}), torch.empty(0))]
    return base64.b64encode(pickle.dumps(item)).decode()


class Driver:
    def __init__(self, settings: EngineSettings, host: str, port: int, tp_size: int):
        self.settings = settings
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        self.port = port
        self.tp_size = tp_size
        self.names = [worker_name(settings, host, port, r) for r in range(tp_size)]
        self.client = CoordinatorClient(settings.coordinator, timeout=5.0)
        self.serving: int | None = None
        self.last_update: dict | None = None
        self._stop = threading.Event()

    def _post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            return {"text": text.decode(errors="replace")}

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def applied(self) -> list[dict]:
        out = []
        for rank in range(self.tp_size):
            try:
                with open(status_path(self.port, rank)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append({"applied": None, "error": "no status yet"})
        return out

    def held(self) -> int | None:
        reply = self.client.call(HoldingsRequest(model=self.settings.model, names=self.names))
        common = set.intersection(*(set(v) for v in reply.holdings.values()))
        return max(common) if common else None

    def swap(self, version: int) -> float:
        started = time.perf_counter()
        self._post("/pause_generation", {"mode": PAUSE_MODES[self.settings.pause]})
        try:
            self._post("/begin_weight_update", {})
            try:
                self._post("/update_weights_from_tensor", {
                    "serialized_named_tensors": [descriptor_payload(version)] * self.tp_size,
                    "load_format": LOADER, "weight_version": str(version),
                    "flush_cache": True})
            finally:
                self._post("/end_weight_update", {})
        finally:
            self._post("/continue_generation", {})
        stall = time.perf_counter() - started
        states = self.applied()
        if any(s.get("applied") != version for s in states):
            # The loader refused (and left the weights alone): put the label back.
            self._post("/update_weight_version",
                       {"new_version": str(self.serving or "default"),
                        "abort_all_requests": False})
            raise TensorHubError(f"swap to v{version} refused by the scheduler: {states}")
        self.serving = version
        self.last_update = {"version": version, "stall_ms": round(stall * 1e3, 2)}
        self._record()
        log.info("now serving %s v%d (stall %.1f ms)", self.settings.model, version,
                 stall * 1e3)
        return stall

    def _record(self) -> None:
        try:
            with open(driver_status_path(self.port), "w") as f:
                json.dump({"name": self.names[0], "serving_version": self.serving,
                           "last_update": self.last_update}, f)
        except OSError as exc:
            log.warning("cannot write the driver status: %s", exc)

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return False

    def run(self) -> None:
        if not self._wait_ready(self.settings.join_timeout + 900):
            return
        try:
            loaders = self._get("/get_server_info").get("custom_weight_loader") or []
        except Exception:
            loaders = []
        if LOADER not in loaders:
            log.error("TensorHub cannot update this server: start it with "
                      "--custom-weight-loader %s", LOADER)
            return
        applied = {s.get("applied") for s in self.applied()}
        self.serving = applied.pop() if len(applied) == 1 else None
        if self.serving is not None:  # joined at start-up: label what is served
            try:
                self._post("/update_weight_version", {"new_version": str(self.serving),
                                                      "abort_all_requests": False})
            except Exception as exc:
                log.warning("could not set SGLang's weight_version: %s", exc)
        self._record()
        log.info("TensorHub driver following %s for %s (serving v%s)", self.settings.model,
                 ", ".join(self.names), self.serving)
        last_error = None
        while not self._stop.wait(self.settings.poll_interval):
            try:
                held = self.held()
                if held is not None and (self.serving is None or held > self.serving):
                    self.swap(held)
                last_error = None
            except Exception as exc:  # log once, keep serving the old version
                if str(exc) != last_error:
                    log.warning("TensorHub follow: %s (still serving v%s)", exc, self.serving)
                last_error = str(exc)

    def start(self) -> Driver:
        threading.Thread(target=self.run, daemon=True, name="tensorhub-driver").start()
        return self
