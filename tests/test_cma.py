"""The same-host transports: cma reads another process's memory, and says clearly why not.

`auto` must take the cma path for same-host peers and NIXL for the rest."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from tensorhub import settings
from tensorhub.core.data_types import Endpoint, MemoryDesc
from tensorhub.core.errors import TransferError
from tensorhub.core.transport import parallel_copy
from tensorhub.core.transport.auto import AutoTransport
from tensorhub.core.transport.base import Peer, ReadOp
from tensorhub.core.transport.cma import CmaNotPermitted, CmaTransport
from tensorhub.tools.child_process import ChildProcess

pytestmark = pytest.mark.slow  # (a holder process per test: not in the fast loop)

HOLDER = """
import json, time, torch
from tensorhub.core.transport.cma import CmaTransport
t = CmaTransport()
buf = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)  # 4 MiB, known bytes
t.register([buf])
print(json.dumps({"endpoint": t.endpoint().model_dump(mode="json"),
                  "addr": buf.data_ptr(), "nbytes": buf.numel()}), flush=True)
time.sleep(600)  # until the test stops us (SIGTERM) or kills us
"""

EXPECTED = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)


@pytest.fixture
def holder():
    proc = ChildProcess([sys.executable, "-c", HOLDER], name="cma-holder")
    try:
        info = proc.next_json(timeout=60)
        yield proc, Peer("holder", Endpoint.model_validate(info["endpoint"])), info
    finally:
        proc.stop()


@pytest.fixture
def reader():
    t = CmaTransport()
    yield t
    t.close()


def _whole(info: dict) -> tuple[torch.Tensor, ReadOp]:
    dest = torch.zeros(info["nbytes"], dtype=torch.uint8)
    return dest, ReadOp(dest, MemoryDesc(addr=info["addr"], nbytes=info["nbytes"]))


def test_a_reader_copies_another_process_memory_bit_exact(holder, reader):
    _, peer, info = holder
    dest, op = _whole(info)
    reader.read(peer, [op], timeout=10)
    assert torch.equal(dest, EXPECTED)
    assert peer.endpoint.transport == "cma" and peer.endpoint.host == reader.host


def test_many_small_ops_span_several_iovec_batches(holder, reader, monkeypatch):
    _, peer, info = holder
    monkeypatch.setattr(settings, "COPY_CALL_BYTES", 1 << 20)  # several calls, two threads
    dest = torch.zeros(info["nbytes"], dtype=torch.uint8)
    piece = 1024  # 4096 ops: more than IOV_MAX per call
    ops = [ReadOp(dest[o:o + piece], MemoryDesc(addr=info["addr"] + o, nbytes=piece))
           for o in range(0, info["nbytes"], piece)]
    calls = parallel_copy.split_calls(
        [(op.local.data_ptr(), op.remote.addr, op.remote.nbytes) for op in ops], 1 << 20)
    assert max(len(c) for c in calls) <= parallel_copy.IOV_MAX
    assert max(sum(n for *_, n in c) for c in calls) <= 1 << 20
    reader.read(peer, ops, timeout=10)
    assert torch.equal(dest, EXPECTED)


def test_short_reads_are_resumed_where_they_stopped(holder, reader, monkeypatch):
    _, peer, info = holder
    real = reader._libc.process_vm_readv
    sizes = []

    class ShortLibc:  # the kernel may copy less than asked: at most 100,000 bytes a call here
        @staticmethod
        def process_vm_readv(pid, local, nlocal, remote, nremote, flags):
            first = local[0]
            local[0] = (first.iov_base, min(first.iov_len, 100_000))
            got = real(pid, local, 1, remote, nremote, flags)
            sizes.append(got)
            return got

    monkeypatch.setattr(reader, "_libc", ShortLibc)
    dest, op = _whole(info)
    reader.read(peer, [op], timeout=10)
    assert torch.equal(dest, EXPECTED)
    assert len(sizes) > 1 and sum(sizes) == info["nbytes"]


def test_a_range_running_into_unmapped_memory_fails_naming_the_source(reader):
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    region[:page] = b"\x07" * page
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # PROT_NONE
    try:
        dest = torch.zeros(2 * page, dtype=torch.uint8)
        peer = Peer("self", reader.endpoint())
        with pytest.raises(TransferError, match="not mapped") as err:
            reader.read(peer, [ReadOp(dest, MemoryDesc(addr=base, nbytes=2 * page))], 10)
        assert err.value.source == "self"
        assert bool((dest[:page] == 7).all())  # the readable part arrived before the fault
    finally:
        libc.mprotect(ctypes.c_void_p(base + page), page, 3)  # PROT_READ | PROT_WRITE
        region.close()


def test_a_dead_holder_is_named_in_the_error(holder, reader):
    proc, peer, info = holder
    dest, op = _whole(info)
    reader.read(peer, [op], timeout=10)
    assert torch.equal(dest, EXPECTED)
    proc.kill()
    with pytest.raises(TransferError, match=r"holder holder \(pid \d+\) has exited") as err:
        reader.read(peer, [op], timeout=10)
    assert err.value.source == "holder"


def test_a_dead_holder_mid_read_is_named_in_the_error(holder, reader, monkeypatch):
    proc, peer, info = holder
    monkeypatch.setenv("TENSORHUB_COPY_THREADS", "1")
    monkeypatch.setattr(settings, "COPY_CALL_BYTES", 1 << 20)
    real = reader._libc.process_vm_readv
    calls = []

    class DyingLibc:  # SIGKILL after the first call, as a crash would
        @staticmethod
        def process_vm_readv(*args):
            calls.append(1)
            if len(calls) == 2:
                proc.kill()
            return real(*args)

    monkeypatch.setattr(reader, "_libc", DyingLibc)
    dest, op = _whole(info)
    with pytest.raises(TransferError, match="has exited") as err:
        reader.read(peer, [op], timeout=10)
    assert err.value.source == "holder"
    assert torch.equal(dest[: 1 << 20], EXPECTED[: 1 << 20])


def test_a_reused_pid_is_not_mistaken_for_the_holder(reader):
    stale = reader.endpoint().model_copy(update={"pid_started": reader.pid_started - 1})
    dest = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TransferError, match="has exited"):
        reader.read(Peer("old", stale), [ReadOp(dest, MemoryDesc(addr=dest.data_ptr(),
                                                                 nbytes=8))], 10)


def test_a_holder_on_another_host_is_refused_clearly(reader):
    elsewhere = reader.endpoint().model_copy(update={"host": "another-boot-id/4026531836"})
    dest = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TransferError, match="another host or pid namespace") as err:
        reader.read(Peer("far", elsewhere), [ReadOp(dest, MemoryDesc(addr=dest.data_ptr(),
                                                                     nbytes=8))], 10)
    assert err.value.source == "far"
    assert not reader.reaches(elsewhere)


def test_a_holder_without_a_pid_is_refused_clearly(reader):
    zmq_holder = Endpoint(transport="zmq", address="tcp://127.0.0.1:1")
    dest = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TransferError, match="advertises no process id"):
        reader.read(Peer("z", zmq_holder), [ReadOp(dest, MemoryDesc(addr=1, nbytes=8))], 10)


@pytest.fixture
def auto_pair():
    """Two `auto` transports in this process: a holder of 4 KiB and a reader with a zeroed
    buffer of the same size, both registered."""
    holder, reader = AutoTransport(), AutoTransport()
    try:
        src = torch.arange(4096, dtype=torch.uint8)
        dest = torch.zeros_like(src)
        holder.register([src])
        reader.register([dest])
        yield holder, reader, src, dest
    finally:
        holder.close()
        reader.close()


def test_auto_reads_same_host_peers_by_cma_and_others_by_nixl(auto_pair, monkeypatch):
    holder, reader, src, dest = auto_pair
    ep = holder.endpoint()
    assert ep.transport == "nixl" and ep.agent_metadata and ep.pid and ep.host
    op = ReadOp(dest, MemoryDesc(addr=src.data_ptr(), nbytes=src.numel()))
    paths = []
    for path in ("_cma", "_nixl"):
        inner = getattr(reader, path)
        real = inner.read
        monkeypatch.setattr(inner, "read", lambda *a, real=real, path=path:
                            (paths.append(path), real(*a))[1])

    reader.read(Peer("near", ep), [op], 10)
    as_plain_nixl = ep.model_copy(update={"pid": None, "pid_started": None, "host": None})
    reader.read(Peer("plain", as_plain_nixl), [op], 10)
    elsewhere = ep.model_copy(update={"host": "another-boot-id/1"})
    reader.read(Peer("far", elsewhere), [op], 10)
    assert paths == ["_cma", "_nixl", "_nixl"]
    assert torch.equal(dest, src)


def test_auto_falls_back_to_nixl_for_a_holder_it_may_not_read(auto_pair, monkeypatch):
    holder, reader, src, dest = auto_pair

    def refuse(peer, ops, timeout):
        raise CmaNotPermitted("not permitted", peer.worker_id)

    monkeypatch.setattr(reader._cma, "read", refuse)
    peer = Peer("guarded", holder.endpoint())
    op = ReadOp(dest, MemoryDesc(addr=src.data_ptr(), nbytes=src.numel()))
    reader.read(peer, [op], 10)
    assert torch.equal(dest, src)
    assert not reader.same_host(peer, [op])  # remembered: NIXL from now on
