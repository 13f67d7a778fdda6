"""Host side of the device signalling: one rank's signal header, its error records and their errors.

The kernels release and acquire flags in each rank's signal header (the word layout is in
:mod:`triton_ep.protocol.signal_header`, the device side in :mod:`triton_ep.kernels.flags`); this module
gives :class:`~triton_ep.Buffer` a small typed API over that state:

- :class:`Signals` holds the header views, the peers' header offsets and the host-visible block that
  kernels write error records into (pinned host memory on GPU, read without any device
  synchronisation; plain memory on CPU);
- :meth:`Signals.watch` bounds the interpreter's waits (it has no clock): a watchdog thread sets the
  abort word after ``timeout_s``;
- :meth:`Signals.error` turns a record into the exception to raise;
- :meth:`Signals.post_local_failure` tells every peer that this rank failed the current call (bad
  arguments found before launch, an error of its own mid-call), so they raise at once instead of
  waiting out their timeout;
- :meth:`Signals.resync` re-aligns the round counters of the group after an error, at a host
  rendezvous where every rank's device work has finished;
- :meth:`Signals.dead_marker` is what the liveness watcher (:mod:`triton_ep.transport.liveness`) does when a
  peer's process is gone, or (a Buffer within one host) the peer destroyed its Buffer: the peer's ``DEAD`` word,
  which every wait for that peer reads, so the group's waits for it end within a fraction of a second and raise
  ``EPRemoteError`` naming it (as dead, or as having destroyed its Buffer).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ..errors import EPCapacityError, EPRemoteError, EPTimeoutError
from ..protocol import signal_header as F
from .liveness import CLOSED, CLOSED_BROKEN, CLOSED_FAILED, DEAD, closed_error, dead_error
from .ring_flags import ErrorRecord, RingFlags  # noqa: F401  (they live where the proxy process can import them)

#: names of the stages error records carry (one table, in the protocol)
STAGE_NAMES = F.STAGE_NAMES
#: a ``DEAD`` word's value (``H_DEAD + p``) for each way a peer left (:mod:`triton_ep.transport.liveness`; the kernels
#: read any non-zero value alike)
LEFT_WORDS = {DEAD: 1, CLOSED: 2, CLOSED_FAILED: 3, CLOSED_BROKEN: 4}
_LEFT_OF = {w: how for how, w in LEFT_WORDS.items()}


def _left(peer: int, stage: int) -> str:
    """Why rank ``peer`` left the group, from the stage code in its ``GONE`` word."""
    if stage == int(F.STAGE_FAILED):
        return f"rank {peer} failed in the middle of a call and left the group"
    if stage == F.STAGE_CAPACITY:
        return f"rank {peer} found more rows than num_worst_tokens in this call and left the group"
    return f"rank {peer} timed out at stage '{STAGE_NAMES.get(stage, 'unknown')}' and left the group"


def header_bytes(num_ranks: int) -> int:
    """Bytes reserved at the start of every rank's shared buffer for its signal header (a multiple of
    256 bytes, so the data area keeps the buffer's alignment)."""
    return (F.header_words.host(num_ranks) * 8 + 255) // 256 * 256


def call_signature(words: Sequence[int]) -> int:
    """A nonzero int64 digest of a call's signature words (operation, sizes, handle, rounds...): what a
    receiving kernel compares with what each sender stored."""
    return _signature(tuple(map(int, words)))


@functools.lru_cache(maxsize=4096)
def _signature(words: tuple) -> int:
    h = hashlib.blake2b(repr(words).encode(), digest_size=7).digest()
    return int.from_bytes(h, "little") | (1 << 56)


_NO_WATCH = contextlib.nullcontext()


@contextlib.contextmanager
def stall_watchdog(words, index: int, timeout_s: float, progress: Callable[[], int], value: int = 1):
    """Bound the interpreter's waits inside the block by stalls, not by the block's length (the GPU's
    per-wait clock bound, seen from the host): a watchdog thread sets ``words[index] = value`` once
    ``progress()`` (a counter the waits advance, e.g. the sum of a ring's chunk counters) has not changed for
    ``timeout_s`` seconds. On exit it is stopped and joined, and the word cleared unless someone else set
    another value meanwhile. ``words``: an int64 numpy array."""
    stop = threading.Event()

    def run():
        last, since = progress(), time.monotonic()
        while not stop.wait(min(0.05, timeout_s / 4)):
            now = progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > timeout_s:
                if words[index] == 0:
                    words[index] = value
                return

    t = threading.Thread(target=run, name="triton-ep-stall-watchdog", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        if words[index] == value:
            words[index] = 0


def watchdog(words, index: int, timeout_s: float, value: int = 1):
    """Bound the interpreter's waits inside the block (it has no clock): a watchdog thread sets
    ``words[index] = value`` after ``timeout_s`` seconds; on exit it is stopped, joined, and the word
    cleared unless someone else set another value meanwhile. ``words``: an int64 numpy array."""
    return stall_watchdog(words, index, timeout_s, lambda: 0, value)


def closing_state(host_block, broken: bool, pending: bool) -> str:
    """How a rank's liveness byte says it destroyed its Buffer (:meth:`Liveness.close
    <triton_ep.transport.liveness.Liveness.close>`): ``"closed broken"`` where its Buffer is ``broken`` or its host
    block (int64 numpy, ``Signals.host``) holds a timeout's or a departure's record; ``"closed after an error"`` where
    an error of its last call is ``pending`` (raised: the peers were told) or recorded; else ``"closed"``."""
    kind = int(host_block[int(F.H_KIND)])
    if broken or kind in (int(F.E_TIMEOUT), int(F.E_GONE)):
        return CLOSED_BROKEN
    return CLOSED_FAILED if pending or kind else CLOSED


class Signals:
    """One rank's signalling state.

    Args:
        rank, size: this rank and the group size ``R``.
        header: int64 ``[header_words(R)]`` view of this rank's signal header (on the buffers' device).
        peer_headers: per rank, the same view of that rank's header as mapped here.
        delta_bytes: int64 ``[R]`` on the device: peer buffer minus this rank's buffer, in bytes.
        device: the buffers' device; timeout_s: the bound on every wait, in seconds.
        interpreted: whether kernels run under Triton's interpreter (CPU): waits are then bounded by a
            watchdog thread instead of the GPU clock.
    """

    def __init__(self, rank: int, size: int, header: torch.Tensor, peer_headers: Sequence[torch.Tensor],
                 delta_bytes: torch.Tensor, device: torch.device, timeout_s: float, interpreted: bool) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.header = header
        self.peer_headers = list(peer_headers)
        with torch.inference_mode(False):
            self.hdr_delta = (delta_bytes // 8).to(torch.int64)
            self.host = torch.zeros(int(F.H_WORDS) + size, dtype=torch.int64, device="cpu",
                                    pin_memory=device.type == "cuda")
        self._host_np = self.host.numpy()
        self.timeout_s = float(timeout_s)
        self.interpreted = interpreted
        self.use_clock = device.type == "cuda" and not interpreted
        #: ``[needs_resync]``: a list the Runtime's drop finaliser also holds (it must not hold this object, which
        #: refers back to the Runtime), so that a Buffer dropped at its process's exit after a raised error says so
        self.resync_box = [False]
        self._reported = False
        #: ``explain_mismatch(peer)``: what differs between this rank's call and ``peer``'s (a phrase naming
        #: the field and both values), or ``None``; set by the Buffer (call cards)
        self.explain_mismatch: Optional[Callable[[int], Optional[str]]] = None
        #: called when this rank leaves the group (:meth:`leave`), before its peers are told; set by the Runtime
        self.on_leave: Optional[Callable[[], None]] = None
        #: ``dead_peers()``: ``{peer: how}`` of the peers whose process is gone (``"dead"``) or, within one host, that
        #: destroyed their Buffer (``"closed"`` and its kin), looked at now
        #: (:meth:`~triton_ep.transport.liveness.Liveness.left_peers`); set by the Runtime where ranks are processes
        self.dead_peers: Optional[Callable[[], dict]] = None

    def release(self) -> None:
        """Drop the views of the shared buffers (this rank's header and the peers'): ``Buffer.destroy`` calls it
        once the Comm closed, so that an object the caller still holds (an event, whose check reaches the Runtime)
        keeps none of that memory mapped. The host block stays (the liveness watcher may still write it); nothing
        may read a header afterwards (every call checks the Buffer is alive first)."""
        self.header = None
        self.peer_headers = []

    # ---- what kernels take
    def kernel_args(self, max_programs: Optional[int] = None) -> dict:
        """What every signalling kernel launcher takes (``signals=``); ``max_programs``: the grid cap of a
        waiting launch where ranks share a GPU (``Comm.max_programs``), ``None`` for none."""
        return dict(hdr=self.header, hdr_delta=self.hdr_delta, host=self.host, me=self.rank,
                    timeout_ns=int(self.timeout_s * 1e9), use_clock=self.use_clock, max_programs=max_programs)

    def watch(self):
        """Bound the waits of the launches inside (interpreter only: the GPU bounds them by its clock). A
        watchdog thread sets the abort word after ``timeout_s``; it is stopped and joined on exit. On GPU
        a shared no-op context (nothing to do on the launch path)."""
        return self._watch() if self.interpreted else _NO_WATCH

    @contextlib.contextmanager
    def _watch(self):
        with watchdog(self._host_np, int(F.H_ABORT), self.timeout_s):
            yield

    def dead_marker(self) -> Callable[..., None]:
        """``mark(peer, how="dead")``: rank ``peer``'s process is gone, or (``how``: ``"closed"`` and its kin,
        :mod:`triton_ep.transport.liveness`) it destroyed its Buffer: set its ``DEAD`` word in the host block to
        :data:`LEFT_WORDS` ``[how]`` (a plain store, no device work: the liveness watcher's thread calls it while
        kernels may spin; a dead peer's word stays dead). Every wait for ``peer`` that is still short then ends with
        ``E_GONE`` (:func:`triton_ep.kernels.flags.wait_at_least`). The function holds the host block only (a thread
        that holds it keeps nothing else of the Buffer alive)."""
        words, base, dead = self._host_np, int(F.H_DEAD), LEFT_WORDS[DEAD]

        def mark(peer: int, how: str = DEAD) -> None:
            if words[base + int(peer)] != dead:
                words[base + int(peer)] = LEFT_WORDS[how]
        return mark

    # ---- errors
    def record(self) -> Optional[ErrorRecord]:
        """The error record kernels wrote, or ``None`` (reads host memory only: no device sync)."""
        kind = int(self._host_np[int(F.H_KIND)])
        if not kind:
            return None
        h = self._host_np
        return ErrorRecord(kind, int(h[int(F.H_PEER)]), int(h[int(F.H_STAGE)]), int(h[int(F.H_CALL)]))

    def error(self) -> Optional[BaseException]:
        """The exception a new error record stands for (``None`` without one, or once it was returned:
        each record is raised once). Timeouts are permanent (the Buffer must be rebuilt: the caller
        marks it broken); other errors are cleared by the next call's re-synchronisation."""
        rec = self.record()
        if rec is None or self._reported:
            return None
        self._reported = True
        self.needs_resync = True
        me, peer, stage = self.rank, rec.peer, STAGE_NAMES.get(rec.stage, "unknown")
        left = self._dead() if rec.kind in (int(F.E_TIMEOUT), int(F.E_GONE), int(F.E_FAILED)) else {}
        dead = [p for p, how in left.items() if how == DEAD]
        if dead:
            # a wait that ended because a peer's process is gone, or because a peer gave up or failed on it
            # (that peer waited for the dead one): the dead rank is the one to name
            return dead_error(me, dead, f"{stage} (round {rec.call})")
        # peers that destroyed their Buffer (within one host): the record's peer, where it closed cleanly, or after
        # an error it raised and told of where that did not end this wait (its failure word: named below), not where
        # it broke (its GONE word is named below); else, where a peer that lives or broke failed the call (it waited
        # for one that closed: a broken peer failed on a dead or closed one), those that closed cleanly. A live
        # peer's timeout stays a timeout.
        own, clean = left.get(peer), {p for p, how in left.items() if how == CLOSED}
        direct = own == CLOSED or (own == CLOSED_FAILED and rec.kind != int(F.E_FAILED))
        if rec.stage != F.STAGE_CAPACITY and (direct or (own in (None, CLOSED_BROKEN) and clean and
                                                         rec.kind == int(F.E_FAILED))):
            return closed_error(me, clean | {peer} if direct else clean, f"{stage} (round {rec.call})", peer)
        if rec.kind == int(F.E_TIMEOUT):
            return EPTimeoutError(me, peer, f"{stage} (round {rec.call})", self.timeout_s)
        if rec.kind == int(F.E_GONE):
            # a peer that left over num_worst_tokens: that error is this call's on every rank (the same
            # counts), whichever rank saw it first
            cls = EPCapacityError if rec.stage == F.STAGE_CAPACITY else EPRemoteError
            return cls(f"rank {me}: {_left(peer, rec.stage)}; destroy() and rebuild the Buffer")
        if rec.kind == int(F.E_BADIDS):
            h = self._host_np
            return ValueError(f"topk_idx holds {int(h[int(F.H_INFO)])} ids outside [-1, {int(h[int(F.H_INFO2)])}) "
                              f"on rank {me}; they were masked and nothing was sent")
        if rec.kind == int(F.E_BADCOUNTS):
            return ValueError(f"num_tokens_per_expert holds negative counts on rank {me} (without topk_idx the "
                              f"given counts are used as they are); nothing was sent")
        if rec.kind == int(F.E_CAPACITY):
            return EPCapacityError(f"rank {me}: rank {peer} receives {int(self._host_np[int(F.H_INFO)])} rows, more "
                                   f"than its num_worst_tokens={int(self._host_np[int(F.H_INFO2)])}; no data was moved")
        if rec.kind == int(F.E_MISMATCH):
            what = self.explain_mismatch(peer) if self.explain_mismatch is not None else None
            what = what or (f"ranks {me} and {peer} called different operations or passed different arguments, "
                            f"such as Configs that take the call in different rounds (their calls no longer pair up)")
            return ValueError(f"ranks disagree at '{stage}': {what}; all ranks must agree (the same call with the "
                              f"same sizes, dtypes and handle); nothing was moved")
        ex = EPRemoteError(f"rank {me}: rank {peer} failed the call at '{stage}' (rank {peer} raised the "
                           f"details); this call's outputs here are not valid")
        ex.failed_rank = peer           # the rank (of this group) whose failure word ended the wait
        return ex

    def permanent(self) -> bool:
        """Whether the record is a timeout (ours or a peer's), or a peer's process is gone: the group cannot go on."""
        rec = self.record()
        return rec is not None and (rec.kind in (int(F.E_TIMEOUT), int(F.E_GONE)) or bool(self._dead()))

    def _dead(self) -> dict:
        """``{peer: how}`` of the peers whose process is gone (``"dead"``) or, within one host, that destroyed their
        Buffer (``"closed"`` and its kin): the watcher's ``DEAD`` words and a look at their locks now (a dead peer the
        watcher has not marked yet is named before one that closed)."""
        h, base = self._host_np, int(F.H_DEAD)
        left = {p: _LEFT_OF.get(int(h[base + p]), DEAD) for p in range(self.size) if h[base + p]}
        if self.dead_peers is not None and DEAD not in left.values():
            left.update(self.dead_peers())
        return left

    @property
    def needs_resync(self) -> bool:
        """Set once an error has been raised (or this rank failed): the next call re-synchronises first."""
        return self.resync_box[0]

    @needs_resync.setter
    def needs_resync(self, value: bool) -> None:
        self.resync_box[0] = bool(value)

    def closing_state(self, broken: bool) -> str:
        """How this rank's liveness byte says it destroyed its Buffer (:func:`closing_state`; ``broken``: its Comm
        is)."""
        return closing_state(self._host_np, broken, self.needs_resync)

    def post_local_failure(self, kind=F.E_FAILED) -> None:
        """This rank fails the current call before (or while) its kernels run: mark its header and tell
        every peer through ``FAILED[rank]`` in theirs, so their waits of this call end at once with
        ``EPRemoteError`` (``kind`` ``E_FAILED``), or ``ValueError`` naming the disagreement (``E_MISMATCH``: this
        rank found on the host that the ranks called different operations). Later kernels of this rank move
        nothing until the next re-synchronisation. (A low-latency call tells its peers through its own words
        instead.)"""
        R, me = self.size, self.rank
        # the call's first round: this rank's completed rounds + 1 (a device read: an error path)
        word = F.failure_word_of(int(self.header[int(F.W_BASE)].item()) + 1, kind)
        with torch.inference_mode():          # also updates buffers made in inference mode
            for r, h in enumerate(self.peer_headers):
                if r != me:
                    h[F.off_failed.host(R) + me].fill_(word)
            self.header[int(F.W_ERR)].fill_(int(F.E_FAILED))
        self.needs_resync = True
        self._reported = True

    def leave(self, stage: int) -> None:
        """This rank can no longer keep step with the group (it timed out at a host rendezvous, or failed in
        the middle of a call): write ``GONE[rank]`` (``stage`` + 1) into every peer's header, so their
        kernels and rendezvous stop waiting for it at once and raise that it left the group."""
        R, me = self.size, self.rank
        if self.on_leave is not None:
            self.on_leave()
        with torch.inference_mode():
            for r, h in enumerate(self.peer_headers):
                if r != me:
                    h[F.off_gone.host(R) + me].fill_(int(stage) + 1)
            self.header[int(F.W_ERR)].fill_(int(F.E_GONE))

    def gone_peers(self) -> dict:
        """``{peer: why}`` of the peers that left the group (their ``GONE`` words in this rank's
        header); a small device read on GPU."""
        R = self.size
        words = self.header[F.off_gone.host(R):F.off_gone.host(R) + R].tolist()
        return {r: _left(r, int(w) - 1) for r, w in enumerate(words) if w}

    # ---- re-synchronisation (at a host rendezvous, with this rank's device work finished)
    def local_state(self, base: Optional[int] = None) -> tuple:
        """``(rounds completed, holds an error)`` of this rank, for the rendezvous: ``base`` when the caller
        read ``W_BASE`` already (with its device work finished), else one small device read."""
        if base is None:
            base = int(self.header[int(F.W_BASE)].item())
        return base, int(self.needs_resync or self.record() is not None)

    def resync(self, new_base: int) -> None:
        """After a rendezvous: start the group afresh at round ``new_base`` (above every round any rank has
        used) and clear this rank's error state."""
        with torch.inference_mode():
            h = self.header
            h[int(F.W_BASE)].fill_(new_base)
            h[int(F.W_CONSUMED)].fill_(new_base)
            h[int(F.W_PENDC)].fill_(new_base)       # (nothing left for the next send to release)
            h[int(F.W_DONE)].fill_(0)
            h[int(F.W_DONE2)].fill_(0)
            h[int(F.W_ERR)].fill_(0)
        self._host_np[:int(F.H_WORDS)] = 0       # (not the DEAD words: a process stays gone)
        self.needs_resync = False
        self._reported = False
