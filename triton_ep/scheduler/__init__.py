"""The RDMA scheduler: a per-rank proxy that moves chunks between hosts over multi-channel, multi-QP RDMA.

Each rank has one registered region (:class:`RingLayout`): a control block of int64 chunk counters
(``flags.RING_*``; host side :class:`~triton_ep.transport.signals.RingFlags`), a send ring and a receive
ring of ``slots`` slots of ``slot_bytes`` per peer.  Chunk ``k`` for peer ``p`` lives in send slot
``k % slots`` here and lands in receive slot ``k % slots`` (of this rank's ring) at ``p``.

- A **producer** (a Triton kernel, or host code) waits until ``SENT[p] > k - slots`` (the slot's earlier
  chunk is placed at the peer), writes chunk ``k`` and its length (``LEN``), then releases
  ``READY[p] = k + 1``.
- The **proxy** (one or more threads, each owning some channels) polls ``READY``.  A chunk may go once the
  peer has room for it (``k - CREDIT[p] < slots``).  It picks the port with the fewest bytes posted so far
  (then the least outstanding bytes on the port and on the QP), among its channels' QPs to ``p`` (the
  transport placed them over ports and ECMP paths by the topology plan), and posts the chunk's RDMA WRITEs and then its signal, a
  WRITE_WITH_IMM carrying ``k`` in the immediate, **on the same QP**: RC ordering places the data before the
  receive completion of the signal, with no fence. The signal is the chunk's last WRITE itself (a
  WRITE_WITH_IMM carries data), so a chunk of one WRITE is one work request.  Chunks that are ready together go
  in runs of consecutive chunks, one run per QP (as many per QP as one chunk per pick would give it): the run's
  full chunks go as one WRITE with the chunk after them (consecutive slots; a partial chunk, the ring's end or
  :data:`~.posting.MAX_WRITE_BYTES` ends a WRITE), and the run's last WRITE_WITH_IMM signals the whole run (its
  immediate: ``k mod 2**24`` and the run's length less one, :func:`~.posting.chunk_imm`), one receive completion per
  run.  A
  QP's chunks are posted as one chain per sweep; only every ``signal_every``-th chunk, and the last of a chain,
  is signalled; a completion retires every earlier chunk of that QP.  Retired chunks advance ``SENT``.
- The receiving proxy turns receive completions (WRITE_WITH_IMM) into ``TAIL[p]``, the count of chunks
  arrived in order (chunks on different QPs may arrive out of order; the tail waits for the gap), which a
  consumer (kernel or host) acquires.  A consumer frees slots by releasing ``HEAD[p]``; the proxy writes
  the head into the peer's ``CREDIT`` word lazily (when half a ring is freed, or the consumer caught up),
  always on QP 0 of that peer so credits land in order.
- With **arrival words** (``arrival_words=True``; low-latency mode across hosts) a chunk's signal is a plain RDMA
  WRITE of the word ``k + 1`` into the peer's ``ARRIVE`` word of the chunk's receive slot, posted after the
  chunk's data on the same QP (in-QP ordering places the data first): a consumer polls that word, so the
  receiving proxy is not on the chunk's path (no receive completion, no receive to post again). The receiving
  proxy still moves ``TAIL`` from the arrival words it sees (host consumers, credits and masking use it).
- **Masked peers** (``MASKED[p]``, low-latency rank masking): their chunks are dropped (counted as placed), the
  slots of their chunks go back on arrival, and where this rank's kernels gave up on ``p`` (``GSRC[p]``: the call,
  stored before ``MASKED[p]``) the sweep WRITEs that word once (QP 0) into ``p``'s ``GAVE[me]``, which ``p``'s
  kernels read so that they mask this rank at once (:meth:`~.posting.ChunkPosting._tell_gave_up`).

**Liveness probes.** Every :data:`PROBE_S` the proxy posts to each peer (not masked) one signalled 8-byte RDMA WRITE
on QP 0: this rank's fault word (0 while it is healthy) into the peer's ``FAULT[me]`` word, where a failing proxy
writes it anyway (:meth:`Scheduler.fail`). The peer's NIC acknowledges it without the peer's CPU, so a peer busy
compiling or starved of the GIL is never taken for dead. A peer whose process is gone has no QPs left (the kernel
destroys them with the process; a NIC drops packets for a QP that does not exist), so the probe, like any request
to it, completes with ``IBV_WC_RETRY_EXC_ERR`` after the QP's retries (``retry_cnt`` + 1 local ACK timeouts: 0.54 s
at ``timeout`` 14, ``retry_cnt`` 7); the same status comes when its host or the path to it is down. A probe (or any
request on QP 0) that completes so is a :class:`PeerGoneError` naming that peer, which this proxy's fault word
carries to its other peers (they raise ``PeerGoneError`` naming the same rank). A request on another QP that
completes so may mean that only that QP failed (a responder QP in the error state drops packets too): the next
probe, posted at once, decides: acknowledged, it is a :class:`ProxyError` naming that QP; not, ``PeerGoneError``. Where a peer is alive but stuck, nothing fails
here: ``timeout_s`` stays the bound.

Every wait is bounded by ``timeout_s``.  A proxy that fails (a QP in the error state, an error completion,
a chunk not completed within the bound, a peer that stops consuming) records a :class:`ProxyError` naming
rank, peer, channel, QP and stage, sets the abort word (kernels' waits end), and writes a fault word into
every peer's ``FAULT`` slot over RDMA, so the peers raise :class:`ProxyRemoteError` at once.  A peer that
stops producing is seen by the consumers' waits (:class:`~triton_ep.errors.EPTimeoutError`). A mode that fails the
scheduler because of a rank the scheduler does not number (internode normal mode's network leg numbers one rank per
host: a host mate that died) marks its error with that rank (:func:`root_cause`, the mode's numbering): the fault word
carries it (:data:`~.faults.MODE_ROOT`), the peers raise :class:`RootCauseError`, and their mode names that rank, not
the rank that passed it on.

**Close words.** A rank that destroys its Buffer is alive, not gone: before its QPs go, its proxy (stopped) writes a
close word (:func:`close_word`) into each peer's ``FAULT`` slot, unless it wrote a fault word there before, and waits
(at most :data:`~triton_ep.scheduler.core.CLOSE_WORD_S`) for those writes to complete. Where it closes after an
error it heard of (a peer's failure, a gone rank), the word names that rank, the root cause: a peer raises
:class:`ProxyRemoteError` (or :class:`PeerGoneError`) naming it at once. After a clean close the peer's proxy goes on
(what was published has been placed there); once its probes find the closed rank's QPs gone it raises
:class:`PeerClosedError` naming that rank, not :class:`PeerGoneError`. A rank that closes after such an error names
the rank that closed first in its close word (:data:`~.faults.ROOT_CLOSED`): its peers go on as after a clean close
and, once its QPs go, raise :class:`PeerClosedError` naming that first rank, not the one in between (in low-latency mode
across hosts the closed rank's host mate, which has no QP to it, learns of it so).

The scheduler talks only to :class:`triton_ep.transport.rdma.Transport`: the pyverbs backend and the
emulated fabric are interchangeable.  Verbs names: QP (queue pair), CQ (completion queue), MR (memory
region), PD (protection domain), rkey (the remote key in :class:`~triton_ep.transport.rdma.RemoteRegion`).

Its modules: :mod:`.core` (:class:`Scheduler`: set-up, end, :func:`bootstrap`), :mod:`.rings` (the rings' host side),
:mod:`.sweep` (the proxy threads: sweeps, completions, failure), :mod:`.posting` (the QP picker, chunks' work
requests, credits), :mod:`.liveness` (the probes' state and rules), :mod:`.stats` (counters), :mod:`.faults`
(stages, fault words, errors), :mod:`.layout` (the region's bytes, the proxy's per-QP and per-peer state) and
:mod:`.alltoall` (:func:`host_alltoall`).
"""
from __future__ import annotations

from .alltoall import host_alltoall
from .core import DRAIN_S, Scheduler, bootstrap
from .faults import (ROOT_CLOSED, ROOT_FAILED, ROOT_GONE, STAGE_CREDIT, STAGE_INTERNAL, STAGE_NAMES, STAGE_POST,
                     STAGE_RECV_CQE, STAGE_SEND_CQE, STAGE_SEND_WAIT, PeerClosedError, PeerGoneError, ProxyError,
                     ProxyRemoteError, RootCauseError, close_word, fault_gone, fault_word, mode_root, parse_close,
                     parse_fault, placed_error, root_cause)
from .layout import RingLayout
from .liveness import PROBE_S, STATUS_GONE, TAG_PROBE, Liveness
# (_fold_signal: the ordering tests')
from .posting import TAG_CHUNK, _fold_signal, is_chunk_signal  # noqa: F401

__all__ = ["Scheduler", "RingLayout", "ProxyError", "ProxyRemoteError", "PeerGoneError", "PeerClosedError", "placed_error", "host_alltoall",
           "RootCauseError", "root_cause", "mode_root", "ROOT_GONE", "ROOT_FAILED", "ROOT_CLOSED", "bootstrap",
           "fault_word", "parse_fault", "fault_gone", "close_word", "parse_close", "is_chunk_signal", "TAG_CHUNK", "TAG_PROBE", "STAGE_NAMES",
           "Liveness", "DRAIN_S", "PROBE_S", "STATUS_GONE", "STAGE_POST", "STAGE_SEND_CQE", "STAGE_RECV_CQE",
           "STAGE_CREDIT", "STAGE_SEND_WAIT", "STAGE_INTERNAL"]
