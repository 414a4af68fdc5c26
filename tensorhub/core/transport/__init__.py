"""Transports, one module each; `make_transport` picks one by name.

  auto  the default: nixl for every peer, cma for peers on this host
  nixl  one-sided READ over UCX, any host
  zmq   fallback for machines without NIXL
  cma   same-host only: copy out of the holder process (process_vm_readv)
"""

from __future__ import annotations

import logging
import typing

from tensorhub import settings
from tensorhub.core.transport.base import Peer, ReadOp, Transport

log = logging.getLogger("tensorhub.transport")
TRANSPORTS: tuple[str, ...] = typing.get_args(settings.TRANSPORT.kind)


def make_transport(name: str | None = None, worker_name: str | None = None,
                   host: str = "127.0.0.1") -> Transport:
    """`name`: default `TENSORHUB_TRANSPORT`, else `auto` (a NIXL endpoint that any NIXL
    worker can read, and same-host reads by shared memory or cma). `host`: the address this
    worker advertises to peers (the zmq fallback binds it; see `net.local_address_towards`)."""
    name = name or settings.TRANSPORT.get()
    if name == "nixl":
        from tensorhub.core.transport.nixl import NixlTransport

        return NixlTransport(agent_name=worker_name, host=host)
    if name == "zmq":
        from tensorhub.core.net import is_loopback, network_interfaces
        from tensorhub.core.transport.zmq import ZmqTransport

        if is_loopback(host) and network_interfaces():
            log.info("the zmq fallback serves on %s: only workers on this host can read from "
                     "it. For peers on other hosts, reach the coordinator at a routable "
                     "address or set TENSORHUB_HOST_ADDRESS", host)
        return ZmqTransport(host=host)
    if name == "cma":
        from tensorhub.core.transport.cma import CmaTransport

        return CmaTransport()
    if name == "auto":
        from tensorhub.core.transport.auto import AutoTransport

        return AutoTransport(agent_name=worker_name, host=host)
    raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")


__all__ = ["TRANSPORTS", "Peer", "ReadOp", "Transport", "make_transport"]
