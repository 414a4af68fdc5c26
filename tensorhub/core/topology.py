"""Where a worker runs, as labels the planner reads (same node < same datacenter < remote).

Every entry point labels its worker by default, so a fleet is topology-aware with no
settings: `node` is this host's name. `dc` has no default (a missing label counts as
equal: one datacenter). `TENSORHUB_LABELS="dc=us-east,rack=r12"` adds or overrides labels
for every worker of the process; labels passed in code override both.
"""

from __future__ import annotations

import socket

from tensorhub import settings


def parse_labels(text: str) -> dict[str, str]:
    """`"dc=a,node=h1"` -> {"dc": "a", "node": "h1"}; a malformed entry is refused."""
    labels: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{settings.LABELS.name}: {entry!r} is not key=value "
                             f"(e.g. dc=us-east)")
        labels[key.strip()] = value.strip()
    return labels


def default_labels() -> dict[str, str]:
    return {"node": socket.gethostname(), **parse_labels(settings.LABELS.get())}


def worker_labels(labels: dict[str, str] | None = None) -> dict[str, str]:
    """The labels a worker registers with: defaults, then `TENSORHUB_LABELS`, then `labels`."""
    return {**default_labels(), **(labels or {})}
