"""A worker's Prometheus series, in the process's default registry: what an engine's own
`/metrics` already serves (vLLM's front end; SGLang with `--enable-metrics`), and what
`prometheus_client.start_http_server` serves for a standalone replica or trainer.

Labelled by model only: a worker's name is per process and would make a new series at
every restart (Prometheus's `instance` label tells processes apart).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

from tensorhub.core.data_types import TransferRecord

# A pull of a small model on one host takes milliseconds; of a large one across datacenters,
# minutes. An engine's stall is a reload: tens of milliseconds to seconds.
PULL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

PULL_SECONDS = Histogram("tensorhub_pull_seconds", "Time to pull one version (or part) "
                         "into a replica", ["model"], buckets=PULL_BUCKETS)
PULL_BYTES = Counter("tensorhub_pull_bytes", "Bytes pulled into replicas", ["model"])
# "livemax": where several processes write multiprocess files (SGLang's schedulers and
# front end), one series, the newest version among the living processes
VERSION_HELD = Gauge("tensorhub_version_held", "Newest version a replica of this process "
                     "holds completely", ["model"], multiprocess_mode="livemax")
STALL_SECONDS = Histogram("tensorhub_engine_stall_seconds", "Time an engine paused "
                          "generation to switch versions", ["model"], buckets=STALL_BUCKETS)
SERVING_VERSION = Gauge("tensorhub_engine_serving_version", "Version the engine serves",
                        ["model"], multiprocess_mode="livemax")
UPDATES = Counter("tensorhub_engine_updates", "Versions the engine switched to", ["model"])
UPDATE_FAILURES = Counter("tensorhub_engine_update_failures", "Switches that failed (the "
                          "engine kept its weights)", ["model"])
UNLOADABLE = Counter("tensorhub_engine_unloadable_versions", "Versions refused before the "
                     "model was touched: their tensors' names, shapes or dtypes are unlike "
                     "the engine's model (the engine kept serving its version)", ["model"])


def use_multiprocess_files() -> bool:
    """Series created from now on go to prometheus_client's multiprocess files, where a
    server that serves /metrics from them will find them (SGLang with `--enable-metrics`
    sets PROMETHEUS_MULTIPROC_DIR as it starts, after its main process, and this plugin in
    it, imported prometheus_client; its scheduler processes start with it set). False where
    no such directory is set."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    return True


def pulled(model: str, version: int, nbytes: int, seconds: float) -> None:
    PULL_SECONDS.labels(model).observe(seconds)
    PULL_BYTES.labels(model).inc(nbytes)
    VERSION_HELD.labels(model).set(version)


def switched(model: str, version: int, stall_seconds: float) -> None:
    STALL_SECONDS.labels(model).observe(stall_seconds)
    SERVING_VERSION.labels(model).set(version)
    UPDATES.labels(model).inc()


def refused_unloadable(model: str) -> None:
    UNLOADABLE.labels(model).inc()


class WorkerPulls:
    """An engine's front end counts its workers' pulls here, once each, from what the
    coordinator's holdings reply says of them: the pulls happen in worker processes, whose
    series the engine's own /metrics (served by the front end's process) does not see."""

    def __init__(self, model: str):
        self.model = model
        self._counted: dict[str, tuple[int, int, float]] = {}  # worker -> its last pull

    def count(self, pulls: Mapping[str, TransferRecord]) -> None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return  # the workers' own series reach /metrics through the files (vLLM with
            # several API servers): counting them here would count them twice
        for name, pull in pulls.items():
            key = (pull.version, pull.nbytes, pull.seconds)
            if self._counted.get(name) != key:
                self._counted[name] = key
                pulled(self.model, pull.version, pull.nbytes, pull.seconds)
