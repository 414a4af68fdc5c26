"""Transports, one module each; `make_transport` picks one by name (NIXL by default)."""

from __future__ import annotations

import os

from tensorhub.core.transport.base import Peer, ReadOp, Transport

TRANSPORTS = ("nixl", "zmq")


def default_transport() -> str:
    return os.environ.get("TENSORHUB_TRANSPORT", "nixl")


def make_transport(name: str | None = None, worker_name: str | None = None) -> Transport:
    name = name or default_transport()
    if name == "nixl":
        from tensorhub.core.transport.nixl import NixlTransport

        return NixlTransport(agent_name=worker_name)
    if name == "zmq":
        from tensorhub.core.transport.zmq import ZmqTransport

        return ZmqTransport()
    raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")


__all__ = ["TRANSPORTS", "Peer", "ReadOp", "Transport", "default_transport", "make_transport"]
