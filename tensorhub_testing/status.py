"""What the coordinator at an address says of its fleet, asked once (tests, benchmarks)."""

from __future__ import annotations

from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusReply, StatusRequest


def coordinator_status(address: str) -> StatusReply:
    client = CoordinatorClient(address)
    try:
        return client.call(StatusRequest())
    finally:
        client.close()
