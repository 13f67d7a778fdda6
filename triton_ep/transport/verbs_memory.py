"""Memory registration of the verbs backend (:mod:`triton_ep.transport.verbs`): a :class:`Region` registered with
every opened device (host memory, numpy arrays, torch tensors; GPU memory through dma-buf where it can)."""
from __future__ import annotations

import ctypes
from typing import Any, List, Optional

from triton_ep.transport.rdma import RdmaError, RemoteRegion, Transport
from triton_ep.transport.verbs_api import _call


class Region:
    """Memory registered with every opened device.

    Attributes:
        addr: start address (host virtual, or GPU virtual for CUDA tensors); length: bytes.
        mrs: one pyverbs MR per device slot; lkeys/rkeys: their keys.  owner: keeps the memory alive.
    """

    def __init__(self, addr: int, length: int, mrs: List[Any], owner: Any, host: bool) -> None:
        self.addr, self.length, self.mrs, self.owner, self.host = addr, length, mrs, owner, host
        self.lkeys = [m.lkey for m in mrs]
        self.rkeys = tuple(m.rkey for m in mrs)

    @property
    def lkey(self) -> int:
        """The lkey on the first device."""
        return self.lkeys[0]

    @property
    def rkey(self) -> int:
        """The rkey on the first device."""
        return self.rkeys[0]

    def remote(self) -> RemoteRegion:
        """What a peer needs to write here (send it with :func:`rdma.exchange_regions`)."""
        return RemoteRegion(self.addr, self.length, self.rkeys)

    def view(self):
        """A ``numpy.uint8`` array over the region (host memory only)."""
        import numpy as np
        if not self.host:
            raise RdmaError("view() of GPU memory: copy it to the host first")
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.addr))



class _VerbsMemory(Transport):
    """:class:`VerbsTransport`'s memory registration, on the protection domains (``self.pds``, one per device of
    ``self.devices``) that its constructor opens."""

    def _access(self, remote_write: bool = True, remote_atomic: bool = True) -> int:
        e = self.e
        return (e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
                | (e.IBV_ACCESS_REMOTE_ATOMIC if remote_atomic else 0))

    def _mr(self, slot: int, owner: Any, length: int, addr: Optional[int] = None, acc: Optional[int] = None):
        acc = self._access() if acc is None else acc
        a = ctypes.addressof(owner) if addr is None else addr
        return _call(self.api, f"register {length} bytes at 0x{a:x}",
                     lambda: self.api.MR(self.pds[slot], length, acc, address=a), device=self.devices[slot].name)

    def register(self, nbytes_or_tensor: Any, *, remote_write: bool = True, remote_atomic: bool = True) -> Region:
        """Register memory with every opened device; see :meth:`rdma.Transport.register`.

        Accepts an int (allocates page-aligned host memory), a contiguous numpy array, or a contiguous torch
        tensor.  CUDA tensors are registered through dma-buf where ``DmaBufMR`` and the CUDA driver allow it,
        else as plain addresses (needs a peer-memory driver such as nvidia-peermem).  Never run on a GPU host.
        """
        host = True
        if isinstance(nbytes_or_tensor, int):
            import numpy as np
            raw = np.zeros(nbytes_or_tensor + 4096, dtype=np.uint8)
            off = (-raw.ctypes.data) % 4096
            owner, addr, length = raw, raw.ctypes.data + off, nbytes_or_tensor
        elif hasattr(nbytes_or_tensor, "data_ptr"):
            t = nbytes_or_tensor
            if not t.is_contiguous():
                raise RdmaError("register(): tensor must be contiguous")
            owner, addr, length, host = t, t.data_ptr(), t.numel() * t.element_size(), not t.is_cuda
        else:
            a = nbytes_or_tensor
            if not a.flags["C_CONTIGUOUS"]:
                raise RdmaError("register(): array must be C-contiguous")
            owner, addr, length = a, a.ctypes.data, a.nbytes
        acc = self._access(remote_write, remote_atomic)
        mrs = []
        for slot in range(len(self.devices)):
            if host:
                mrs.append(self._mr(slot, owner, length, addr, acc))
            else:
                mrs.append(self._gpu_mr(slot, addr, length, acc))
        reg = Region(addr, length, mrs, owner, host)
        self.regions.append(reg)
        return reg

    def _gpu_mr(self, slot: int, addr: int, length: int, acc: int) -> Any:
        """dma-buf registration of GPU memory (CUDA driver ``cuMemGetHandleForAddressRange``), else plain."""
        if self.api.DmaBufMR is not None:
            try:
                cuda = ctypes.CDLL("libcuda.so.1")
                fd = ctypes.c_int(-1)
                page = 1 << 16
                base = addr - addr % page
                size = -(-(addr + length - base) // page) * page
                if cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(size),
                                                      1, ctypes.c_ulonglong(0)) == 0:
                    return self.api.DmaBufMR(self.pds[slot], size, acc, dmabuf=fd.value, offset=addr - base)
            except (OSError, AttributeError, self.api.PyverbsError):
                pass
        return self._mr(slot, None, length, addr, acc)
