"""Same-host reads out of shared memory: a holder's own buffers live in a sealed memfd, and an
`auto` reader on the same host maps it once and copies, bit exact, refusing anything that is
not the file the holder advertised."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import sys

import pytest
import torch

from tensorhub.core import shared_memory
from tensorhub.core.data_types import Endpoint, MemoryDesc, SharedRegion
from tensorhub.core.errors import TransferError
from tensorhub.core.layout import BoundLayout, manifest_of
from tensorhub.core.shared_memory import regions_of, shared_empty
from tensorhub.core.transport.auto import AutoTransport
from tensorhub.core.transport.base import Peer, ReadOp
from tensorhub.tools.child_process import ChildProcess

NBYTES = 1 << 20


@pytest.fixture
def pair():
    """Two `auto` transports in this process: the holder's for a shared 1 MiB buffer of
    known bytes, the reader's for a zeroed destination."""
    holder, reader = AutoTransport(), AutoTransport()
    src = shared_empty(NBYTES)
    src.copy_(torch.arange(NBYTES // 4, dtype=torch.int32).view(torch.uint8))
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    holder.register([src])
    reader.register([dest])
    try:
        yield holder, reader, src, dest
    finally:
        holder.close()
        reader.close()


def _op(dest: torch.Tensor, src: torch.Tensor, start: int = 0, n: int | None = None) -> ReadOp:
    n = dest.numel() - start if n is None else n
    return ReadOp(dest[start:start + n], MemoryDesc(addr=src.data_ptr() + start, nbytes=n))


def _count_paths(reader: AutoTransport, monkeypatch) -> list[str]:
    paths: list[str] = []
    for name in ("_shm", "_cma", "_nixl"):
        inner = getattr(reader, name)
        real = inner.read
        monkeypatch.setattr(inner, "read", lambda peer, ops, *a, real=real, name=name:
                            (paths.append(name) if ops else None, real(peer, ops, *a))[1])
    return paths


def test_a_shared_buffer_is_zeroed_and_sealed_against_resizing():
    buf = shared_empty(NBYTES)
    (region,) = regions_of([buf[100:200]])  # any view of it is found in it
    assert region.addr == buf.data_ptr() and region.nbytes == NBYTES
    fd = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)
    try:
        assert os.fstat(fd).st_ino == region.inode
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & shared_memory.SEALS == shared_memory.SEALS
    finally:
        os.close(fd)
    assert int(buf.count_nonzero()) == 0


def test_the_file_is_closed_once_the_last_view_is_gone():
    buf = shared_empty(NBYTES)
    view = buf[:10]
    (region,) = regions_of([buf])
    del buf
    gc.collect()
    assert regions_of([view]) == [region]  # a view keeps the memory and its file
    del view
    gc.collect()
    with shared_memory._lock:
        assert region not in shared_memory._regions_now().values()
    assert not os.path.exists(f"/proc/self/fd/{region.fd}") or \
        os.fstat(os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)).st_ino != region.inode


def test_allocated_layouts_live_in_one_shared_buffer():
    state = {"big": torch.randn(512, 1024), "small": torch.randn(7), "empty": torch.zeros(0)}
    layout = BoundLayout.allocate(manifest_of(state.items()))
    (region,) = regions_of(layout.item_bytes)
    assert region.nbytes >= layout.nbytes
    for name, t in layout.named_tensors():
        assert t.shape == state[name].shape and t.dtype == state[name].dtype


def test_auto_copies_a_same_host_shared_buffer_by_mapping_it(pair, monkeypatch):
    holder, reader, src, dest = pair
    ep = holder.endpoint()
    assert [r.addr for r in ep.shared] == [src.data_ptr()]
    paths = _count_paths(reader, monkeypatch)
    reader.read(Peer("near", ep), [_op(dest, src)], 10)
    assert torch.equal(dest, src)
    assert paths == ["_shm"]


def test_the_mapping_is_kept_for_later_reads_and_sees_new_bytes(pair, monkeypatch):
    holder, reader, src, dest = pair
    peer = Peer("near", holder.endpoint())
    reader.read(peer, [_op(dest, src)], 10)
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: (opened.append(a[0]), real(*a, **k))[1])
    src.fill_(9)  # the holder's next version, in place
    reader.read(peer, [_op(dest, src)], 10)
    assert int((dest == 9).sum()) == NBYTES
    assert [p for p in opened if "/fd/" in p] == []  # no file of the holder opened again


def test_a_read_mixing_shared_and_private_buffers_takes_both_paths(pair, monkeypatch):
    holder, reader, src, dest = pair
    private = torch.arange(4096, dtype=torch.uint8)
    holder.register([private])
    dest2 = torch.zeros_like(private)
    reader.register([dest2])
    paths = _count_paths(reader, monkeypatch)
    reader.read(Peer("near", holder.endpoint()), [_op(dest, src), _op(dest2, private)], 10)
    assert torch.equal(dest, src) and torch.equal(dest2, private)
    assert sorted(paths) == ["_cma", "_shm"]


def test_a_replaced_buffer_is_mapped_afresh(pair):
    holder, reader, src, dest = pair
    reader.read(Peer("near", holder.endpoint()), [_op(dest, src)], 10)
    holder.deregister([src])
    fresh = shared_empty(NBYTES).fill_(3)
    holder.register([fresh])
    peer = Peer("near", holder.endpoint())
    reader.read(peer, [_op(dest, fresh)], 10)
    assert int((dest == 3).sum()) == NBYTES
    assert len(reader._shm._maps["near"]) == 1  # the old mapping was dropped


def test_a_region_that_is_not_the_advertised_file_is_refused(pair):
    holder, reader, src, dest = pair
    ep = holder.endpoint()
    wrong_inode = ep.model_copy(update={"shared": [
        ep.shared[0].model_copy(update={"inode": ep.shared[0].inode + 1})]})
    with pytest.raises(TransferError, match="no longer the buffer it advertised") as err:
        reader.read(Peer("liar", wrong_inode), [_op(dest, src)], 10)
    assert err.value.source == "liar"


def test_an_unsealed_file_is_not_mapped(pair):
    _, reader, _, dest = pair
    fd = os.memfd_create("unsealed")  # could shrink under a mapping: SIGBUS in the reader
    os.ftruncate(fd, NBYTES)
    plain = mmap.mmap(fd, NBYTES)
    src = torch.frombuffer(plain, dtype=torch.uint8)
    try:
        holder_ep = reader.endpoint().model_copy(update={"shared": [SharedRegion(
            fd=fd, inode=os.fstat(fd).st_ino, addr=src.data_ptr(), nbytes=NBYTES)]})
        with pytest.raises(TransferError, match="not sealed"):
            reader.read(Peer("unsealed", holder_ep), [_op(dest, src)], 10)
    finally:
        del src
        os.close(fd)


def test_with_shared_memory_off_buffers_are_private_and_read_by_cma(monkeypatch):
    monkeypatch.setenv("TENSORHUB_SHARED_MEMORY", "0")
    buf = shared_empty(NBYTES)
    assert regions_of([buf]) == []
    holder = AutoTransport()
    try:
        holder.register([buf])
        assert holder.endpoint().shared == []
    finally:
        holder.close()


HOLDER = """
import json, time, torch
from tensorhub.core.shared_memory import shared_empty
from tensorhub.core.transport.auto import AutoTransport
t = AutoTransport()
buf = shared_empty(1 << 20)
buf.copy_(torch.arange(1 << 18, dtype=torch.int32).view(torch.uint8))
t.register([buf])
ep = t.endpoint().model_copy(update={"agent_metadata": None})  # bytes; same-host needs none
print(json.dumps({"endpoint": ep.model_dump(mode="json"), "addr": buf.data_ptr()}), flush=True)
time.sleep(600)  # until the test stops us (SIGTERM) or kills us
"""


def test_another_process_is_read_and_its_death_is_named(pair):
    _, reader, _, dest = pair
    proc = ChildProcess([sys.executable, "-c", HOLDER], name="shm-holder")
    try:
        info = proc.next_json(timeout=60)
        peer = Peer("holder", Endpoint.model_validate(info["endpoint"]))
        op = ReadOp(dest, MemoryDesc(addr=info["addr"], nbytes=NBYTES))
        reader.read(peer, [op], 10)
        assert torch.equal(dest, torch.arange(NBYTES // 4, dtype=torch.int32).view(torch.uint8))
        proc.kill()
        with pytest.raises(TransferError, match=r"\(pid \d+\) has exited") as err:
            reader.read(peer, [op], 10)  # the mapping is still ours, the holder is not
        assert err.value.source == "holder"
    finally:
        proc.stop()


def test_mappings_of_holders_that_exited_are_let_go(pair):
    holder, reader, src, dest = pair
    reader.read(Peer("near", holder.endpoint()), [_op(dest, src)], 10)
    gone = ("gone", {(2**31 - 1, None, 3, 4): torch.zeros(1)})  # a pid no process has
    reader._shm._maps[gone[0]] = gone[1]
    reader._shm._pruned = 0.0  # (checked at most once a second)
    reader.read(Peer("near", holder.endpoint()), [_op(dest, src)], 10)
    assert set(reader._shm._maps) == {"near"}


def test_a_buffer_freed_inside_the_registrys_lock_does_not_wait_on_itself():
    """The garbage collector may free a shared buffer on a thread that holds the registry's
    lock (an allocation there): its finalizer must not wait for that lock (it once waited
    until pytest-timeout's alarm broke it)."""
    import threading

    from tensorhub.core import shared_memory

    buffer = [shared_memory.shared_empty(4096)]
    addr = buffer[0].data_ptr()

    def free_inside_the_lock() -> None:
        with shared_memory._lock:
            buffer.clear()  # the last reference: the mapping's finalizer runs here

    thread = threading.Thread(target=free_inside_the_lock, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "the finalizer waited for a lock its own thread holds"
    with shared_memory._lock:
        assert addr not in shared_memory._regions_now()
