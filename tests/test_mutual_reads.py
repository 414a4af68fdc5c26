"""Two workers reading from each other at the same moment both finish: a transport's serving
side never waits on its own reads."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorhub.core.data_types import MemoryDesc
from tensorhub.core.transport import Peer, ReadOp, grants, make_transport

NBYTES = 48 << 20  # several of the zmq fallback's 16 MiB requests each way


@pytest.mark.parametrize("name", ["zmq", "nixl"])
def test_two_workers_reading_from_each_other_at_once_both_finish(name):
    a, b = make_transport(name, "mutual-a"), make_transport(name, "mutual-b")
    try:
        src = {t: torch.randint(0, 255, (NBYTES,), dtype=torch.uint8) for t in (a, b)}
        dst = {t: torch.zeros(NBYTES, dtype=torch.uint8) for t in (a, b)}
        for t in (a, b):
            t.register([src[t], dst[t]])
        errors: list[BaseException] = []

        def read(reader, holder, holder_id):
            peer = Peer(holder_id, holder.endpoint(), grants.issue(holder.grant_key, "reader"))
            remote = MemoryDesc(addr=src[holder].data_ptr(), nbytes=NBYTES)
            try:
                reader.read(peer, [ReadOp(dst[reader], remote)], timeout=60)
            except BaseException as exc:  # reported below, with the other side's
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(a, b, "b")),
                   threading.Thread(target=read, args=(b, a, "a"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert torch.equal(dst[a], src[b]) and torch.equal(dst[b], src[a])
    finally:
        a.close()
        b.close()
