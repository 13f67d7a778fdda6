"""The wire of the emulated fabric (:mod:`triton_ep.transport.emulated`): every QP's inbound ring, a byte ring in a
file under /dev/shm, and the records (requests, ACKs and NAKs) that travel in it. The QP's process holds a lock on
the ring's file while the QP exists (:mod:`triton_ep.transport.liveness`), so a requester sees a dead responder."""
from __future__ import annotations

import atexit
import errno as _errno
import mmap
import os
import struct
import threading
import time
import weakref
from typing import List, Optional

from triton_ep.transport import liveness, shm
from triton_ep.transport.emulated_api import PyverbsRDMAError


_HDR = struct.Struct("<BBHIIQIQIIIIQIBBH")   # see _pack
_REQ, _ACK = 1, 2
_F_LAST = 1


def _pack(kind, opcode, flags, src, dst, seq, rkey=0, raddr=0, total=0, off=0, flen=0, imm=0, add=0,
          status=0, rnr_retry=0, timer=0, payload=b""):
    return _HDR.pack(kind, opcode, flags, src, dst, seq, rkey, raddr, total, off, flen, imm, add, status,
                     rnr_retry, timer, 0) + payload


class _Ring:
    """Single-producer single-consumer byte ring in a shared file; 8-byte head/tail counters. The consumer's
    process (the QP's, ``create``) holds a lock on the file's first byte while the QP exists; a producer keeps a
    descriptor of the file to ask whether that lock is still held (:meth:`consumer_alive`)."""
    DATA = 64

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path, self.cap, self.own = path, capacity, create
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                shm.reserve(fd, path, self.DATA + capacity, "the emulated fabric's rings")
                if liveness.supported():
                    liveness.lock_byte(fd, 0)
            self.mm = mmap.mmap(fd, self.DATA + capacity)
        except BaseException:
            os.close(fd)
            raise
        #: the file's descriptor (the consumer's holds the lock); None once closed
        self.fd: Optional[int] = fd
        self.wlock = threading.Lock()
        _open_rings.add(self)

    def consumer_alive(self) -> bool:
        """Whether the QP reading this ring still exists: its process holds the file's lock (always true for a
        ring of this process's own QP, or where locks are not supported)."""
        fd = self.fd
        if self.own or fd is None or not liveness.supported():
            return True
        try:
            return liveness.byte_locked(fd, 0)
        except OSError:
            return True

    def _get(self, off: int) -> int:
        return struct.unpack_from("<Q", self.mm, off)[0]

    def put(self, rec: bytes, assist, deadline: float) -> bool:
        """Append one record; while full, call ``assist()`` and retry until ``deadline`` (monotonic). Returns False
        where the ring's QP is gone (full, and its process's lock released): the record is dropped."""
        need = 8 + ((len(rec) + 7) & ~7)
        if need > self.cap // 2:
            raise PyverbsRDMAError("record larger than half the ring", _errno.EMSGSIZE)
        with self.wlock:
            while True:
                head, tail = self._get(0), self._get(8)
                pos = head % self.cap
                pad = self.cap - pos if pos + need > self.cap else 0
                if self.cap - (head - tail) >= need + pad:
                    break
                if not self.consumer_alive():
                    return False        # (its QP is gone: the packets are lost, as on a wire)
                if time.monotonic() > deadline:
                    raise PyverbsRDMAError(f"emulated link stalled: ring {self.path} full", _errno.ETIMEDOUT)
                assist()
                time.sleep(0.0001)
            if pad:
                struct.pack_into("<I", self.mm, self.DATA + pos, 0xFFFFFFFF)
                head += pad
                pos = 0
            struct.pack_into("<I", self.mm, self.DATA + pos + 4, 0)
            self.mm[self.DATA + pos + 8:self.DATA + pos + 8 + len(rec)] = rec
            struct.pack_into("<I", self.mm, self.DATA + pos, len(rec))
            struct.pack_into("<Q", self.mm, 0, head + need)
        return True

    def drain(self) -> List[bytes]:
        """Every complete record now in the ring, oldest first (consumer side)."""
        out = []
        head, tail = self._get(0), self._get(8)
        while tail < head:
            pos = tail % self.cap
            n = struct.unpack_from("<I", self.mm, self.DATA + pos)[0]
            if n == 0xFFFFFFFF:
                tail += self.cap - pos
                continue
            out.append(bytes(self.mm[self.DATA + pos + 8:self.DATA + pos + 8 + n]))
            tail += 8 + ((n + 7) & ~7)
        struct.pack_into("<Q", self.mm, 8, tail)
        return out

    def close(self, unlink: bool) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass
        liveness.drop_descriptor(self)
        _open_rings.discard(self)
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


#: rings whose file this process holds open (a forked child closes its copies: it must not keep a dead parent's
#: QPs alive through their locks)
_open_rings: "weakref.WeakSet[_Ring]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ring in list(_open_rings):
        liveness.drop_descriptor(ring)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: ring files this process created and has not removed yet (:meth:`Fabric.unlink_rings`, ``QP.close``, and at
#: the process's exit)
_created_rings: set = set()


@atexit.register
def _unlink_rings() -> None:
    """Remove the ring files of QPs this process created and never closed."""
    for path in list(_created_rings):
        try:
            os.unlink(path)
        except OSError:
            pass
