"""The coordinator's Prometheus series (`tensorhub coordinator --metrics-port PORT`).

They live in a registry of their own, so a coordinator embedded in another process (a test,
the simulator, a Ray actor) neither clashes with that process's series nor exports them.
Event series (publishes, plans, busy replies, evictions, bytes) are counted where the event
is handled; the fleet's shape (holders per version, reads in flight, workers) is measured
on the coordinator's expiry walk, once a second and only while the metrics are served, so a
scrape never reads the table while the loop changes it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# A plan takes microseconds on an idle coordinator and milliseconds in a fleet of thousands.
PLAN_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)
# Where the bytes a reader pulled came from, by the planner's distance (`planner.distance`).
PATHS = ("same_node", "same_dc", "remote_dc")


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter("tensorhub_versions_published", "Versions published (whole, "
                                 "all parts in)", ["model"], registry=r)
        self.latest = Gauge("tensorhub_latest_version", "Newest published version",
                            ["model"], registry=r)
        self.holders = Gauge("tensorhub_version_holders", "Workers holding the version "
                             "completely (of every part, for a sharded one)",
                             ["model", "version"], registry=r)
        self.plans = Counter("tensorhub_plans", "Read plans handed out", ["model"], registry=r)
        self.busy = Counter("tensorhub_busy_replies", "Plan requests answered 'busy' (every "
                            "holder serving; the reader asks again)", ["model"], registry=r)
        self.plan_latency = Histogram("tensorhub_plan_latency_seconds", "Time to answer a "
                                      "plan request", buckets=PLAN_BUCKETS, registry=r)
        self.evictions = Counter("tensorhub_evictions", "Workers or references dropped, by "
                                 "reason: heartbeat (silent past the TTL), unregistered, "
                                 "failed_reads (credible readers agree it fails)",
                                 ["reason"], registry=r)
        self.bytes_served = Counter("tensorhub_bytes_served", "Bytes readers pulled, by the "
                                    "source's role and where it is from the reader",
                                    ["source", "path"], registry=r)
        self.reads_in_flight = Gauge("tensorhub_reads_in_flight", "Read leases open",
                                     registry=r)
        self.workers = Gauge("tensorhub_workers", "Registered workers", ["role"], registry=r)
        self.connections_refused = Counter(
            "tensorhub_connections_refused", "Connections shut down at once: their address "
            "held its budget of open connections already", registry=r)
        self.standby = Gauge("tensorhub_standby_readers", "Readers placed ahead in the forest "
                             "of a model's first version, waiting for it", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve `/metrics` on `port` from a thread; returns the server (`.shutdown()`)."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server

    def served(self, source_role: str, distance: int, nbytes: int) -> None:
        self.bytes_served.labels("trainer" if source_role == "trainer" else "replica",
                                 PATHS[min(distance, 2)]).inc(nbytes)

    def fleet(self, holders: dict[tuple[str, int], int], latest: dict[str, int],
              leases: int, workers: dict[str, int], standby: int = 0) -> None:
        """The fleet's shape now: holders per (model, version) of the versions kept."""
        self.holders.clear()
        for (model, version), n in holders.items():
            self.holders.labels(model, str(version)).set(n)
        for model, version in latest.items():
            self.latest.labels(model).set(version)
        self.reads_in_flight.set(leases)
        self.standby.set(standby)
        for role in ("trainer", "replica"):
            self.workers.labels(role).set(workers.get(role, 0))
