"""Same-host transport: every rank maps every other rank's communication buffer.

- On GPU the data buffer is device memory shared through CUDA IPC (PyTorch's tensor reduction, i.e.
  ``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``); several ranks may share one GPU.
- On CPU it is a POSIX shared-memory file (``/dev/shm``) mapped by every rank with ``torch.from_file``.

A small host *control block* in POSIX shared memory (for GPU runs too) holds one barrier counter per
rank and per-rank slots for the small exchanges (counts, status words). Its barrier is a bounded wait:
it raises :class:`~triton_ep.errors.EPTimeoutError` naming this rank, the missing peer and the stage,
so nothing hangs. Before a rank arrives at a barrier its device work is synchronised, so a peer that
passes the barrier sees every byte written before it (on CPU, x86 stores are seen in program order).

Files are unlinked as soon as every rank has mapped them: nothing is left in ``/dev/shm`` even if a
process dies. :class:`LocalWorld` gives the same objects for ranks simulated in one process.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import uuid
from typing import List, Optional

import numpy as np
import torch

from ..errors import EPError, EPRemoteError, EPTimeoutError
from ..protocol.call_card import CARD_WORDS
from . import liveness as live
from .bootstrap import Exchange
from .signals import header_bytes

#: int64 words of the header of one rank's exchange slot (the host rendezvous after an error).
SLOT_HEADER = 16
#: int64 words of one rank's exchange slot: the header, then a few words a mode may add (its resync fill).
SLOT_WORDS = SLOT_HEADER + 16


def ctrl_words(size: int, slot_words: int) -> int:
    """int64 words of the host control block of ``size`` ranks (layout: :meth:`Comm.slot`, :meth:`Comm.card`)."""
    return size + 2 * size * slot_words + size * CARD_WORDS


from .shm import SHM_PREFIX, SHM_TAG_ENV, reserve, shm_dir, shm_name, shm_tag  # noqa: E402,F401  (torch-free: the proxy process's)


def _map_file(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """``path`` mapped shared as uint8 ``[nbytes]``; with ``create`` a new file whose bytes are reserved up front
    (:func:`~triton_ep.transport.shm.reserve`: too little room in /dev/shm is an ``OSError`` naming the size here,
    not a SIGBUS at the first transfer that touches the missing pages)."""
    if create:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            reserve(fd, path, nbytes, "the ranks' shared buffers (on a CPU)")
        finally:
            os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8, device="cpu")


class Comm:
    """One rank's view of the shared buffers of its group.

    Attributes:
        rank, size: this rank's index and the group size ``R``.
        min_bytes: the smallest data buffer of the group (what a transfer round may fill).
        device: where the data buffers live.
        data: this rank's data buffer, uint8 ``[num_bytes]`` on ``device``.
        peers: every rank's data buffer as mapped here (``peers[rank] is data``).
        delta_bytes: int64 ``[R]`` on ``device``: ``peers[r].data_ptr() - data.data_ptr()``, in bytes.
        ctrl: int64 numpy view of the control block (shared by all ranks).
    """

    def __init__(self, rank: int, size: int, device: torch.device, peers: List[torch.Tensor], ctrl: torch.Tensor,
                 timeout_s: float, slot_words: int, min_bytes: Optional[int] = None,
                 ranks_on_device: int = 1, concurrent: bool = False) -> None:
        self.rank, self.size, self.device = rank, size, device
        #: ranks of the group whose buffers live on this rank's device (several ranks may share a GPU)
        self.ranks_on_device = max(int(ranks_on_device), 1)
        #: the most programs a waiting launch may occupy: with several ranks on one GPU, their spinning
        #: programs must leave room for the launches they wait for (``None``: no cap)
        self.max_programs = None
        #: the ranks run at the same time (processes: :func:`open_group` says so); False (the default) for ranks
        #: simulated in one process and driven in lock step (:class:`LocalWorld`, or a Comm built over its buffers),
        #: where one rank's whole launch runs before the next rank's
        self.concurrent = bool(concurrent)
        if device.type == "cuda" and self.ranks_on_device > 1:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.max_programs = max(sms // (2 * self.ranks_on_device), 1)
        hb = header_bytes(size)
        self.min_bytes = int(min_bytes if min_bytes is not None else min(p.numel() - hb for p in peers))
        # every buffer: [signal header | data area]; the same header size on every rank, so the distance
        # between two ranks' data areas is that between their buffers
        self.peers = [p[hb:] for p in peers]
        self.peer_headers = [p[:hb].view(torch.int64) for p in peers]
        self.data = self.peers[rank]
        self._data_views = {torch.uint8: self.data}
        self.header = self.peer_headers[rank]
        base = peers[rank].data_ptr()
        deltas = [p.data_ptr() - base for p in peers]
        if any(d % 16 for d in deltas):      # kernels rely on 16-byte aligned peer buffers
            raise EPError(f"rank {rank}: peer buffers are not 16-byte aligned (deltas {deltas})")
        with torch.inference_mode(False):
            self.delta_bytes = torch.tensor(deltas, dtype=torch.int64, device=device)
        self._ctrl_tensor = ctrl
        self.ctrl = ctrl.view(torch.int64).numpy()
        self.timeout_s = float(timeout_s)
        self.slot_words = slot_words
        self._seq = 0
        self.broken: Optional[str] = None
        #: which peers' processes still live (:class:`~triton_ep.transport.liveness.Liveness`): set by
        #: :func:`open_group` once every rank holds its lock; ``None`` for ranks simulated in one process
        self.liveness: Optional[live.Liveness] = None
        #: when a list, each barrier appends (stage, t_arrive_start, t_device_synced, t_all_arrived)
        #: in ``time.perf_counter`` seconds (see benchmarks/profile_phases.py)
        self.profile: Optional[list] = None

    # -- control block layout (ctrl_words): [R barrier counters | 2 parities x R slots of slot_words |
    #    R call cards of CARD_WORDS] --
    def card(self, rank: int) -> np.ndarray:
        """The int64 call card of ``rank`` (:mod:`triton_ep.protocol.call_card`)."""
        start = self.size + 2 * self.size * self.slot_words + rank * CARD_WORDS
        return self.ctrl[start:start + CARD_WORDS]

    def slot(self, parity: int, rank: int) -> np.ndarray:
        """The int64 exchange slot of ``rank`` for exchanges of the given parity (double-buffered)."""
        start = self.size + (parity * self.size + rank) * self.slot_words
        return self.ctrl[start:start + self.slot_words]

    def sync_device(self) -> None:
        """Wait for this rank's queued device work (GPU) so peers see its writes."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def barrier(self, stage: str, gone=None) -> None:
        """Bounded barrier over the group.

        Args:
            stage: what the ranks meet for (named in errors).
            gone: optional callable returning ``{peer: why}`` (a phrase naming the peer and the stage it left
                at) for peers known to have left the group; it is polled while waiting (every 10 ms), and the
                wait ends at once if a missing peer left.

        Raises:
            EPTimeoutError: a peer did not arrive within ``timeout_s`` seconds (the Comm is then marked
                broken: the Buffer must be destroyed and built again).
            EPRemoteError: a missing peer left the group (it timed out or failed elsewhere), or its process is
                gone or (within one host, ``Liveness.closes_leave``) it destroyed its Buffer (its liveness lock,
                looked at every 50 ms; the Comm is then marked broken).
            EPError: the Comm was broken by an earlier timeout.
        """
        if self.broken:
            raise EPError(f"rank {self.rank}: communication buffer unusable after an earlier failure "
                          f"({self.broken}); destroy() the Buffer and build a new one")
        t0 = time.perf_counter()
        self.sync_device()
        t1 = time.perf_counter()
        self._seq += 1
        n = self._seq
        ctr = self.ctrl
        ctr[self.rank] = n
        start = time.monotonic()
        deadline = start + self.timeout_s
        next_look = next_live = start
        for peer in range(self.size):
            while ctr[peer] < n:
                now = time.monotonic()
                if now > deadline:
                    self.broken = f"timeout at '{stage}' waiting for rank {peer}"
                    raise EPTimeoutError(self.rank, peer, stage, self.timeout_s)
                if gone is not None and now >= next_look:
                    next_look = now + 0.01
                    left = gone()
                    if peer in left:
                        self.broken = f"rank {peer} left the group"
                        raise EPRemoteError(f"rank {self.rank}: {left[peer]}, so it will not reach '{stage}'; "
                                            f"destroy() and rebuild the Buffer")
                if self.liveness is not None and now >= next_live:
                    next_live = now + 0.05
                    left = self.liveness.left_peers([peer])
                    if left:
                        self.broken = live.left_phrase(left)
                        raise live.left_error(self.rank, left, stage)
                # Yield the core for the first 5 ms (peers usually arrive within microseconds to a few
                # milliseconds), then back off to 1 ms naps so a long wait costs no CPU.
                time.sleep(0 if now - start < 5e-3 else 1e-3)
        if self.profile is not None:
            self.profile.append((stage, t0, t1, time.perf_counter()))

    def data_view(self, dtype: torch.dtype) -> torch.Tensor:
        """``data`` viewed as ``dtype`` (1-D), made once per dtype: a view costs microseconds of host time per
        call on a GPU machine."""
        v = self._data_views.get(dtype)
        if v is None:
            v = self._data_views[dtype] = self.data.view(dtype)
        return v

    def close(self, how: str = live.CLOSED) -> None:
        """Drop this rank's mappings (the memory is released once no tensor refers to it) and release its liveness
        lock (saying first that it destroyed its Buffer on purpose, and ``how``: :meth:`Liveness.close
        <triton_ep.transport.liveness.Liveness.close>`)."""
        if self.liveness is not None:
            self.liveness.close(how=how)
            self.liveness = None
        self.peers = []
        self.peer_headers = []
        self.data = None
        self._data_views = {}
        self.header = None
        self.ctrl = None
        self._ctrl_tensor = None


def _device_handle(t: torch.Tensor):
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(t)


def _check_peer_access(device: torch.device, peer_devices) -> None:
    """Raise ``ValueError`` when ``device`` cannot reach one of ``peer_devices`` directly (no P2P path)."""
    for d in peer_devices:
        if d.type == "cuda" and d.index != device.index and not torch.cuda.can_device_access_peer(device.index, d.index):
            raise ValueError(f"GPU {device.index} cannot access GPU {d.index} directly (no P2P); triton_ep "
                             f"intranode buffers need peer access between every pair of the group's GPUs")


def _open_device_handle(blob: bytes, device: torch.device) -> torch.Tensor:
    """Map a peer's CUDA buffer from its pickled ``reduce_tensor`` share, opened in *our* device's context.

    PyTorch would open it under the producer's device; a kernel on our GPU could then not touch it when
    the peer sits on another GPU. Opened under ours, the driver enables peer access as needed
    (``cudaIpcMemLazyEnablePeerAccess``), as DeepEP does.
    """
    import inspect
    fn, args = pickle.loads(blob)
    bound = inspect.signature(fn).bind(*args)
    if "storage_device" in bound.arguments:
        bound.arguments["storage_device"] = device.index
    return fn(*bound.args, **bound.kwargs).view(torch.uint8)


def open_group(group, num_bytes: int, device: torch.device, timeout_s: float, slot_words: int = SLOT_WORDS,
               exchange: Optional[Exchange] = None) -> Comm:
    """Allocate this rank's buffer and map every peer's, exchanging handles through ``group``.

    Collective over ``group`` (any backend: one bounded exchange through the group's store,
    :class:`~triton_ep.transport.bootstrap.Exchange`; pass ``exchange`` when the caller made it before
    checking its own arguments). All ranks must be on one host: raises ``ValueError`` otherwise,
    ``EPTimeoutError`` naming the ranks that did not join within ``timeout_s``, ``EPRemoteError`` when a
    peer gave up first. ``num_bytes`` is rounded up to 4 KiB.
    """
    if exchange is None:
        exchange = Exchange(group, timeout_s, "bootstrap: exchange buffer handles")
    rank, size = group.rank(), group.size()
    num_bytes = max(4096, (int(num_bytes) + 4095) // 4096 * 4096)
    hb = header_bytes(size)
    ctrl_bytes = 8 * ctrl_words(size, slot_words)
    tag = uuid.uuid4().hex[:16]
    d = shm_dir()
    ctrl_path = data_path = live_path = liveness = None
    # Every file this rank creates is unlinked on the way out, whatever happens: after a successful
    # bootstrap every rank holds its mappings, and after a failure (a peer that never joins, bad hosts,
    # an interrupt, a bad TRITON_EP_SHM_TAG) nothing may stay behind in /dev/shm, and the peers are told.
    try:
        ctrl_path = os.path.join(d, shm_name(f"{tag}.ctrl")) if rank == 0 else None
        data_path = os.path.join(d, shm_name(f"{tag}.r{rank}")) if device.type != "cuda" else None
        ctrl = _map_file(ctrl_path, ctrl_bytes, create=True) if rank == 0 else None
        if rank == 0 and size > 1 and live.supported():     # each rank locks its byte (transport.liveness)
            live_path = os.path.join(d, shm_name(f"{tag}.live"))
            liveness = live.Liveness(live_path, rank, size, create=True)
        data, mine = _own_buffer(device, data_path, hb + num_bytes, rank, size)
        info = exchange.gather((socket.gethostname(), ctrl_path, mine, num_bytes, device.index, live_path))
        hosts = {i[0] for i in info}
        if len(hosts) != 1:
            raise ValueError(f"triton_ep intranode buffers need every rank on one host; got hosts {sorted(hosts)}")
        if ctrl is None:
            ctrl = _map_file(info[0][1], ctrl_bytes, create=False)
        if liveness is None and info[0][5] is not None:
            liveness = live.Liveness(info[0][5], rank, size, create=False)
        peers = _map_peers(info, rank, data, device, hb)
        if device.type == "cuda":
            _check_peer_access(device, {torch.device("cuda", i[4]) for i in info})
        comm = Comm(rank, size, device, peers, ctrl, timeout_s, slot_words, min(i[3] for i in info),
                    ranks_on_device=sum(1 for i in info if i[4] == device.index), concurrent=True)
        comm.barrier("bootstrap/map buffers")
        # every rank took its lock before the barrier: from now on a free byte means a gone process
        comm.liveness, liveness = liveness, None
    except BaseException as e:
        # peers still waiting in the exchange raise at once (a no-op once it is complete); peers past it see this
        # rank leave after an error of its own, not a destroy()
        exchange.fail(f"failed to build its Buffer ({type(e).__name__}: {e})")
        if liveness is not None:
            liveness.close(how=live.CLOSED_FAILED)
            liveness = None
        raise
    finally:
        if liveness is not None:
            liveness.close()
        _unlink(data_path, ctrl_path, live_path)
    return comm


def _own_buffer(device: torch.device, data_path: Optional[str], nbytes: int, rank: int, size: int):
    """This rank's shared buffer of ``nbytes`` (uint8: the signal header, then the data area), zeroed: device
    memory on a GPU, else the new file ``data_path``. Returns ``(buffer, what the peers need to map it)``: one
    IPC handle per peer on a GPU, else the file's path."""
    if device.type == "cuda":
        data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        data[:header_bytes(size)].zero_()   # the signal header starts at zero (peers look after the bootstrap barrier)
        # One share per consumer: PyTorch counts the consumers of each share and expects exactly one.
        return data, ("cuda", [pickle.dumps(_device_handle(data)) if r != rank else None for r in range(size)])
    return _map_file(data_path, nbytes, create=True), ("file", data_path)     # (a new file reads zero)


def _map_peers(info: list, rank: int, data: torch.Tensor, device: torch.device, hb: int) -> List[torch.Tensor]:
    """Every rank's buffer in rank order, from the exchanged ``info`` (:func:`open_group`'s records): this rank's
    own ``data``, a peer's by its IPC handle for this rank or by mapping its file (``hb`` header bytes + its size)."""
    peers = []
    for r, (_, _, (kind, h), nb, _, _) in enumerate(info):
        if r == rank:
            peers.append(data)
        elif kind == "cuda":
            peers.append(_open_device_handle(h[rank], device))
        else:
            peers.append(_map_file(h, hb + nb, create=False))
    return peers


def _unlink(*paths: Optional[str]) -> None:
    """Remove the named files (``None``: none; one already gone is fine)."""
    for path in paths:
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class LocalWorld:
    """``R`` ranks simulated in one process (plain CPU tensors), for lock-step tests.

    ``comm(r)`` gives rank ``r`` a :class:`Comm` over the shared in-process buffers; its barriers are
    driven by the caller (see :func:`triton_ep.testing.lockstep`), never waited on.
    """

    def __init__(self, size: int, num_bytes: int, slot_words: int = SLOT_WORDS, device: str = "cpu") -> None:
        num_bytes = max(4096, (int(num_bytes) + 4095) // 4096 * 4096)
        self.size = size
        hb = header_bytes(size)
        #: each rank's whole buffer (signal header, then data area) and its data area alone
        self.buffers = [torch.empty(hb + num_bytes, dtype=torch.uint8, device=device) for _ in range(size)]
        for b in self.buffers:
            b[:hb].zero_()
        self.data = [b[hb:] for b in self.buffers]
        self.ctrl = torch.zeros(8 * ctrl_words(size, slot_words), dtype=torch.uint8, device="cpu")
        self.slot_words = slot_words
        self.device = torch.device(device)

    def comm(self, rank: int) -> Comm:
        return Comm(rank, self.size, self.device, self.buffers, self.ctrl, timeout_s=0.0, slot_words=self.slot_words,
                    ranks_on_device=self.size)
