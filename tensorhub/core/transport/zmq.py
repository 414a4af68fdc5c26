"""Fallback transport for machines without NIXL: pyzmq, ~1 MiB zero-copy frames.

Each worker runs a small server thread that answers "send me bytes [addr, addr+n)" for
memory it registered (and nothing else: an address outside registered memory is refused),
to a reader that shows a grant the coordinator issued under this worker's key (`grants.py`).
The reader keeps a window of chunk requests in flight and receives every frame straight
into its preallocated destination (`recv_into`), so memory use stays bounded and the
stream stays full. CPU memory only.

Locks: the server thread only needs the registry of buffers (`_buffers_lock`, held for a
lookup), and each peer's client socket has a lock of its own, held for a whole read. So two
workers reading from each other at once never wait on each other, and reads from two
peers (striping) run side by side. The server binds the address this worker advertises
(`host`, see `net.local_address_towards`), so peers on other hosts can reach it.
"""

from __future__ import annotations

import threading
import time
import uuid

import msgpack
import numpy as np
import torch
import zmq
from pydantic import BaseModel, ConfigDict, Field

from tensorhub import settings
from tensorhub.core.data_types import Endpoint
from tensorhub.core.errors import TransferError
from tensorhub.core.schema import MAX_NAME
from tensorhub.core.transport import grants
from tensorhub.core.transport.base import Peer, ReadOp, Transport, check_ops

FRAME = 1 << 20  # bytes per zmq frame: a reply is sent as frames of this size, zero-copy
CHUNK = 16 << 20  # bytes per request at most: a server refuses a larger one (`_ChunkRequest`)
# The largest chunk request a server takes (its seq, address, size and grant: ~100 bytes with
# a grant of the longest name); a larger frame drops the sender's connection.
REQUEST_BYTES = 2048


class _ChunkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq: int = Field(ge=0)
    addr: int = Field(ge=0, lt=2**64)
    nbytes: int = Field(ge=0, le=CHUNK)
    grant: str | None = Field(default=None, max_length=MAX_NAME + 64)


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, host: str = "127.0.0.1"):
        self.grant_key = grants.new_key()
        self.refused = 0  # requests refused for want of a grant
        self._ctx = zmq.Context.instance()
        self._buffers_lock = threading.Lock()
        self._buffers: dict[int, torch.Tensor] = {}  # addr -> uint8 buffer
        self._clients_lock = threading.Lock()
        # worker id -> (socket, its lock, the address it is connected to)
        self._clients: dict[str, tuple[zmq.Socket, threading.Lock, str]] = {}
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        # A stranger may connect (the port is open to the network): a frame larger than a
        # real chunk request drops its connection before any of it is buffered, and a
        # connection that completes no handshake is closed soon.
        self._server.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)
        self._server.setsockopt(zmq.HANDSHAKE_IVL, settings.HANDSHAKE_MS)
        host = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._server.setsockopt(zmq.IPV6, 1)
        port = self._server.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tensorhub-zmq-serve",
                                        daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- holder side
    def register(self, buffers: list[torch.Tensor]) -> None:
        with self._buffers_lock:
            for b in buffers:
                if b.device.type != "cpu":
                    raise ValueError("the zmq fallback transport serves CPU memory only")
                self._buffers[b.data_ptr()] = b.view(torch.uint8).reshape(-1)

    def deregister(self, buffers: list[torch.Tensor]) -> None:
        with self._buffers_lock:
            for b in buffers:
                self._buffers.pop(b.data_ptr(), None)

    def endpoint(self) -> Endpoint:
        return Endpoint(transport="zmq", address=self.address)

    def _lookup(self, addr: int, nbytes: int) -> np.ndarray | None:
        with self._buffers_lock:
            for base, buf in self._buffers.items():
                if base <= addr and addr + nbytes <= base + buf.numel():
                    return buf.numpy()[addr - base : addr - base + nbytes]
        return None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._server.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:
                continue
            ident, body = frames
            try:
                req = _ChunkRequest.model_validate(msgpack.unpackb(body, raw=False))
            except Exception as exc:
                self._reply_error(ident, -1, f"bad chunk request: {exc}")
                continue
            if not grants.valid(self.grant_key, req.grant):
                self.refused += 1
                self._reply_error(ident, req.seq, "no grant from the coordinator to read here "
                                                  "(read by the plan's sources only)")
                continue
            view = self._lookup(req.addr, req.nbytes)
            if view is None:
                self._reply_error(ident, req.seq, "range is not in registered memory")
                continue
            header = msgpack.packb({"seq": req.seq, "ok": True})
            parts = [memoryview(view[o : o + FRAME]) for o in range(0, req.nbytes, FRAME)]
            try:
                self._server.send_multipart([ident, header, *parts], copy=False)
            except zmq.ZMQError:
                pass

    def _reply_error(self, ident: bytes, seq: int, message: str) -> None:
        header = msgpack.packb({"seq": seq, "ok": False, "error": message})
        try:
            self._server.send_multipart([ident, header])
        except zmq.ZMQError:
            pass

    # ----------------------------------------------------------------- reader side
    def _client(self, peer: Peer) -> tuple[zmq.Socket, threading.Lock]:
        """The peer's client socket and its lock (made on first use, or anew when the
        peer's address changed; the old one is closed under its own lock, never while
        `_clients_lock` is held)."""
        address = peer.endpoint.address
        if peer.endpoint.transport != "zmq" or not address:
            raise TransferError(f"holder {peer.worker_id} has no zmq endpoint", peer.worker_id)
        stale = None
        with self._clients_lock:
            entry = self._clients.get(peer.worker_id)
            if entry is None or entry[2] != address:
                stale = entry
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                # (a reply is frames of at most FRAME bytes, and a small header)
                sock.setsockopt(zmq.MAXMSGSIZE, FRAME + REQUEST_BYTES)
                sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
                sock.connect(address)
                entry = self._clients[peer.worker_id] = (sock, threading.Lock(), address)
        if stale is not None:
            with stale[1]:
                stale[0].close(0)
        return entry[0], entry[1]

    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        check_ops(ops)
        chunks: list[tuple[int, np.ndarray]] = []  # (remote addr, local destination)
        for op in ops:
            if op.local.device.type != "cpu":
                raise TransferError("the zmq fallback transport reads into CPU memory only")
            dest = op.local.view(torch.uint8).reshape(-1).numpy()
            for off in range(0, op.remote.nbytes, CHUNK):
                n = min(CHUNK, op.remote.nbytes - off)
                chunks.append((op.remote.addr + off, dest[off : off + n]))
        while True:
            sock, lock = self._client(peer)
            with lock:
                if sock.closed:  # forgotten meanwhile: take the fresh socket
                    continue
                try:
                    return self._pump(sock, peer, chunks, timeout)
                except TransferError:
                    # A half-read reply would confuse the next read: a new socket next time.
                    self._drop_client(peer.worker_id, sock)
                    raise

    def _pump(self, sock: zmq.Socket, peer: Peer, chunks: list, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        sent = done = 0
        while done < len(chunks):
            while sent < len(chunks) and sent - done < settings.ZMQ_WINDOW:
                addr, dest = chunks[sent]
                sock.send(msgpack.packb({"seq": sent, "addr": addr, "nbytes": dest.size,
                                         "grant": peer.grant}))
                sent += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                raise TransferError(
                    f"zmq read from {peer.worker_id} made no progress within {timeout:.1f}s",
                    peer.worker_id,
                )
            header = msgpack.unpackb(sock.recv(), raw=False)
            if not header.get("ok") or header.get("seq") != done:
                while sock.getsockopt(zmq.RCVMORE):
                    sock.recv()
                raise TransferError(
                    f"zmq read from {peer.worker_id} refused: {header.get('error', 'bad reply')}",
                    peer.worker_id,
                )
            dest = chunks[done][1]
            off = 0
            while sock.getsockopt(zmq.RCVMORE):
                off += sock.recv_into(memoryview(dest[off:]))
            if off != dest.size:
                raise TransferError(f"zmq read from {peer.worker_id} came short", peer.worker_id)
            done += 1

    def _drop_client(self, worker_id: str, sock: zmq.Socket) -> None:
        """Close `sock` (its lock is held by the caller) and forget it, if still current."""
        with self._clients_lock:
            if self._clients.get(worker_id, (None,))[0] is sock:
                del self._clients[worker_id]
        sock.close(0)  # (`_clients_lock` is never held while waiting for a peer lock)

    def forget_peer(self, worker_id: str) -> None:
        with self._clients_lock:
            entry = self._clients.pop(worker_id, None)
        if entry is not None:
            with entry[1]:  # never close a socket under a read in flight
                entry[0].close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for worker_id in list(self._clients):
            self.forget_peer(worker_id)
        self._server.close(0)
