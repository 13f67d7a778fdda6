"""The signal header, the host-visible error block, the low-latency control block and the scheduler ring's
control block: every word's index, every error kind and stage code, written once. Kernels read them as
``tl.constexpr`` (through :mod:`triton_ep.kernels.flags`, which imports them from here); host code
(:mod:`triton_ep.transport.signals`, the modes, the scheduler) takes ``int()`` of them. The per-peer arrays'
offsets are :func:`formula` functions (``off_*``, ``ring_word``...): kernels call them, host code calls their
``.host``. The protocol these words carry is described in
:mod:`triton_ep.kernels.flags`.
"""
import functools

import triton
import triton.language as tl


def formula(fn):
    """One formula for kernels and host code. ``fn`` computes a word index from ``tl.constexpr`` words and
    its arguments; the result is a ``@triton.jit`` function that kernels call (with ``R: tl.constexpr`` it
    folds to a constant) and whose ``.host(*args)`` evaluates the same source on the host to an ``int``."""
    dev = triton.jit(fn)
    # cached per argument tuple: host code calls these on per-call paths (a plain dispatch slices its handle
    # tables with them), where one evaluation of constexpr arithmetic costs about a microsecond
    dev.host = functools.lru_cache(maxsize=None)(lambda *args: int(fn(*args)))
    return dev


# ---- the signal header (int64 words), per rank; R = group size ----
W_BASE = tl.constexpr(0)          #: rounds this rank has completed (advanced by its kernels)
W_CONSUMED = tl.constexpr(1)      #: last round whose data this rank has moved out of its own area (see ``PENDC``)
W_DONE = tl.constexpr(2)          #: programs of the running launch that have finished (last-program counter)
W_ERR = tl.constexpr(3)           #: nonzero once this rank holds an error record (device-side mirror)
W_DONE2 = tl.constexpr(4)         #: a fused send + receive launch's second last-program counter (its receive)
#: the last round a receive launch without an end-of-launch count moved out of this rank's area; this rank's
#: next send launch (or fused launch) releases it into ``CONSUMED`` before it waits
W_PENDC = tl.constexpr(5)
#: the round a send launch without an end-of-launch count wrote; the receive launch right after it publishes it
W_NEXT = tl.constexpr(6)
W_FIXED = tl.constexpr(8)         #: words before the per-peer arrays


@formula
def off_ready(R):
    """``READY[s]``: last round rank ``s`` has finished writing into this rank's area."""
    return W_FIXED


@formula
def off_sig(R):
    """``SIG[s]``: signature of rank ``s``'s current call (stored before ``READY[s]``)."""
    return W_FIXED + R


@formula
def off_failed(R):
    """``FAILED[s]``: set when rank ``s`` failed a call, to :func:`failure_word` of the round and the kind
    (``E_MISMATCH`` when it found that ranks called different operations, else ``E_FAILED``)."""
    return W_FIXED + 2 * R


@formula
def off_gone(R):
    """``GONE[s]``: stage code + 1 once rank ``s`` gave up after a timeout (permanent)."""
    return W_FIXED + 3 * R


@formula
def off_nflag(R):
    """``NOTIFIED[s]``: first round of the call whose counts rank ``s`` has written into ``NOTIFY``."""
    return W_FIXED + 4 * R


@formula
def off_notify(R):
    """``NOTIFY[s * R + j]``: rows rank ``s`` sends to rank ``j`` in the current call (an ``R x R``
    matrix every rank receives whole: a dispatch with ``num_worst_tokens`` learns its sizes on the device)."""
    return W_FIXED + 5 * R


#: ``NOTIFY_E[s * E_local + e]`` after ``NOTIFY``: rows rank ``s`` sends to this rank's local expert ``e``
#: in the current call (a plain dispatch: the host learns the per-expert counts from them); room for
#: ``NOTIFY_E_WORDS`` experts in all
NOTIFY_E_WORDS = tl.constexpr(16384)


@formula
def off_notify_e(R):
    """``NOTIFY_E``: per-expert counts each rank sends here (see ``NOTIFY_E_WORDS``)."""
    return W_FIXED + 5 * R + R * R


@formula
def header_words(R):
    """int64 words of one rank's signal header."""
    return W_FIXED + 5 * R + R * R + NOTIFY_E_WORDS


# ---- the host-visible block (int64 words): pinned host memory on GPU, plain memory on CPU ----
H_ABORT = tl.constexpr(0)         #: set by the host watchdog (interpreter): every wait gives up
H_LOCK = tl.constexpr(1)          #: first error wins this word
H_KIND = tl.constexpr(2)          #: error kind, written last (release)
H_PEER = tl.constexpr(3)
H_STAGE = tl.constexpr(4)
H_CALL = tl.constexpr(5)          #: the round the error happened in
H_INFO = tl.constexpr(6)          #: a number the error names (``E_CAPACITY``: the rows the rank receives;
                                  #: ``E_BADIDS``: the bad ids)
H_INFO2 = tl.constexpr(7)         #: a second one (``E_BADIDS``: the number of experts)
H_WORDS = tl.constexpr(8)         #: the fixed words; then one ``DEAD`` word per rank:
H_DEAD = tl.constexpr(8)          #: ``DEAD[p]`` (``H_DEAD + p``): 1 once the host saw rank ``p``'s process gone,
                                  #: 2-4 once (within one host) it saw rank ``p`` destroy its Buffer, by how it closed
                                  #: (``transport.liveness``, ``transport.signals.LEFT_WORDS``; the kernels read any
                                  #: non-zero value alike); the block holds ``H_WORDS + R`` words

# error kinds
E_TIMEOUT = tl.constexpr(1)       #: a wait for ``peer`` ran out of time
E_GONE = tl.constexpr(2)          #: ``peer`` gave up after a timeout of its own
E_FAILED = tl.constexpr(3)        #: ``peer`` failed the call (bad arguments there, or an error of its own)
E_MISMATCH = tl.constexpr(4)      #: ``peer`` called another operation, handle or sizes
E_BADIDS = tl.constexpr(5)        #: this rank's ``topk_idx`` holds ids outside ``[-1, E)`` (``peer``: this rank)
E_CAPACITY = tl.constexpr(6)      #: rank ``peer`` receives more rows than ``num_worst_tokens``
E_BADCOUNTS = tl.constexpr(7)     #: this rank's ``num_tokens_per_expert`` holds negative counts (``peer``: this rank)


def failure_word_of(call: int, kind) -> int:
    """Host form of the kernels' ``flags.failure_word``: the ``FAILED`` word saying that a rank failed round
    ``call`` with error kind ``kind`` (kinds are < 8)."""
    return int(call) * 8 + int(kind)


#: a low-latency failure word (``LFAILED``, :func:`ll_failure_word_of`) holds, above its kind (3 bits), the rank
#: that failed the call first (``LL_ROOT_BITS`` bits: a rank that fails because a peer's word told it passes that
#: word's root on), then the call number (from bit ``LL_CALL_SHIFT``)
LL_ROOT_BITS = tl.constexpr(16)
LL_ROOT_MASK = tl.constexpr((1 << 16) - 1)
LL_CALL_SHIFT = tl.constexpr(19)


def ll_failure_word_of(call: int, kind, root: int) -> int:
    """Host form of the kernels' ``flags.ll_failure_word``: the ``LFAILED`` word saying that low-latency call
    ``call`` failed with kind ``kind`` (< 8), first on rank ``root`` (< 2**16; its low 16 bits otherwise)."""
    return ((int(call) << int(LL_ROOT_BITS)) | (int(root) & int(LL_ROOT_MASK))) * 8 + int(kind)


def ll_failure_call(word):
    """The call number of an ``LFAILED`` word (an int, or an int64 tensor of words)."""
    return word >> int(LL_CALL_SHIFT)


def ll_failure_root(word):
    """The rank that failed first, of an ``LFAILED`` word (an int, or an int64 tensor of words)."""
    return (word >> 3) & int(LL_ROOT_MASK)


# stages (error records name them; 0 = unknown)
STAGE_DISPATCH_SEND = tl.constexpr(1)
STAGE_DISPATCH_RECV = tl.constexpr(2)
STAGE_COMBINE_SEND = tl.constexpr(3)
STAGE_COMBINE_RECV = tl.constexpr(4)
STAGE_NOTIFY = tl.constexpr(5)
STAGE_HOST = tl.constexpr(6)      #: a host rendezvous (the counts exchange, a re-synchronisation)
STAGE_FAILED = tl.constexpr(7)    #: a failure of the rank's own in the middle of a call
STAGE_LL_DISPATCH_SEND = tl.constexpr(8)
STAGE_LL_DISPATCH_RECV = tl.constexpr(9)
STAGE_LL_COMBINE_SEND = tl.constexpr(10)
STAGE_LL_COMBINE_RECV = tl.constexpr(11)

# ---- the low-latency control block (int64 words) at the start of each rank's low-latency area ----
# Low-latency calls (dispatch or combine) are numbered 1, 2, ... on every rank alike; call ``n`` uses
# half ``n & 1`` of the area. The numbers live here, in device memory, advanced by the kernels.
L_SEQ = tl.constexpr(0)           #: the last call this rank has sent (advanced by its send launches; see ``NEXT``)
L_DONE = tl.constexpr(1)          #: programs of the running low-latency launch that have finished
L_CONS = tl.constexpr(2)          #: ``CONS[h]`` (2 words): last call this rank has received out of half h
#: ``UNPACKED[h]`` (2 words, internode): last call whose network chunks this rank has unpacked into half h
L_UNPACKED = tl.constexpr(4)
#: ``PEND[h]`` (2 words): last call this rank's receive launch took out of half h; the rank's next low-latency
#: launch, which starts once that receive has completed, releases it into ``CONS[h]`` (a receive launch has no
#: end-of-launch count)
L_PEND = tl.constexpr(6)
#: ``NEXT``: the call a send launch without its end-of-launch count sent (a call without a receive hook, within one
#: host): the receive launch right after it in the stream takes its number from here and publishes it
L_NEXT = tl.constexpr(8)
#: a one-launch low-latency call's programs that have reached its gate (last-program counter; the route part of a
#: dispatch finishes in every program before any program's send part starts)
L_DONE2 = tl.constexpr(9)
#: ``GATE``: the gates the one-launch calls' programs have passed (advanced by the last program to reach one)
L_GATE = tl.constexpr(10)
L_FIXED = tl.constexpr(16)        #: words before the per-peer arrays


@formula
def off_ll_ready(R):
    """``READY[h * R + s]``: the last call whose data rank ``s`` has finished writing into half ``h`` here."""
    return L_FIXED


@formula
def off_ll_sig(R):
    """``SIG[h * R + s]``: the signature of rank ``s``'s call in half ``h`` (stored before ``READY``)."""
    return L_FIXED + 2 * R


@formula
def off_ll_mask(R):
    """``MASK[s]``: nonzero when this rank no longer sends to or waits for rank ``s`` (rank masking):
    ``LL_MASK_HAND`` or ``LL_MASK_WAIT``."""
    return L_FIXED + 4 * R


@formula
def off_ll_failed(R):
    """``LFAILED[s]``: ``ll_failure_word(call, kind, root)`` of the low-latency call rank ``s`` failed
    (``E_FAILED``: it rejected its arguments, or failed; ``E_MISMATCH``: it found ranks disagree; ``root``: the
    rank that failed first, as far as ``s`` knows): waits of that call for rank ``s`` end at once, naming ``root``;
    its other calls are not affected."""
    return L_FIXED + 5 * R


@formula
def off_ll_tx(R):
    """``TXOFF[p]`` (internode): call ``n``'s chunk to rank ``p`` is chunk ``n - 1 + TXOFF[p]`` of the ring
    (0 until a re-synchronisation after an error restarts the call numbers)."""
    return L_FIXED + 6 * R


@formula
def off_ll_rx(R):
    """``RXOFF[p]`` (internode): call ``n``'s chunk from rank ``p`` is chunk ``n - 1 + RXOFF[p]``."""
    return L_FIXED + 7 * R


@formula
def off_ll_gaveup(R):
    """``GAVEUP[s]`` (rank masking, ``enable_shrink``): nonzero once rank ``s`` gave up on this rank (its wait for
    this rank timed out, or found this rank gone or given up on it, and it masked this rank): the low-latency call
    of ``s``'s in which it did. ``s`` neither sent this rank that call nor pairs any later call with this rank's, so
    every wait of this rank's, from that call on, for ``s`` masks ``s`` at once instead (no timeout, none of ``s``'s
    rows taken). Written by ``s`` with a release, as failure words are; cleared here when this rank unmasks ``s``."""
    return L_FIXED + 8 * R


#: ``MASK[s]`` values: masked by hand (``low_latency_update_mask_buffer``), or by a wait (a timeout, a gone peer, a
#: peer's ``GAVEUP`` word), after which the two ranks' call numbers may differ (an unmask then restarts them)
LL_MASK_HAND = tl.constexpr(1)
LL_MASK_WAIT = tl.constexpr(2)
#: the ``SIG`` a rank stores, with its ``READY``, in a peer of its host that it masks by hand: "this call is made
#: without you" (never a call signature: those have bit 56 set and none above it, transport.signals.call_signature)
LL_SIG_MASKED = tl.constexpr(1 << 60)


@formula
def ll_ctl_words(R):
    """int64 words of one rank's low-latency control block."""
    return L_FIXED + 9 * R


# ---- scheduler rings (triton_ep/scheduler/): a rank's ring control block, int64 words ----
# Chunk counters per peer ``p`` (each counts chunks, and only grows):
#   READY[p]  producer -> proxy: chunks for ``p`` written into the send ring (released after the data)
#   SENT[p]   proxy -> producer: chunks for ``p`` placed at ``p`` (their send slots may be rewritten)
#   TAIL[p]   proxy -> consumer: chunks from ``p`` that arrived, in order (released after placement)
#   HEAD[p]   consumer -> proxy: chunks from ``p`` consumed (their receive slots are free again)
#   CREDIT[p] written by ``p`` over RDMA: chunks of ours that ``p`` has consumed
#   FAULT[p]  written by ``p`` over RDMA when its proxy failed (see scheduler.fault_word)
#   SRC[p]    the 8-byte source of this rank's own credit writes to ``p``
#   LEN[p * S + slot]  bytes of the chunk in send slot ``slot`` for ``p`` (written before READY)
#   MASKED[p] nonzero once ``p`` is masked (low-latency rank masking): the proxy drops its chunks and credits
#   ARRIVE[p * S + slot]  with arrival words (``Scheduler(arrival_words=True)``, low-latency mode across hosts):
#             written by ``p`` over RDMA after the chunk's data, on the same QP: ``k + 1`` once chunk ``k`` from
#             ``p`` (in receive slot ``slot = k % S``) is placed here; consumers poll it instead of TAIL
#   ASRC[p * S + slot]  the 8-byte source of this rank's arrival word for its chunk in send slot ``slot`` for ``p``
#   GAVE[p]   written by ``p``'s proxy over RDMA: the low-latency call in which ``p`` gave up on this rank (masking)
#   GSRC[p]   the call in which this rank gave up on ``p`` (the source of that write)
RING_ABORT = tl.constexpr(0)      #: nonzero: every ring wait gives up (1 watchdog / timeout, 2 proxy failed)
RING_ERR_KIND = tl.constexpr(1)   #: a kernel's error record: kind (first error wins), peer, stage, chunk
RING_ERR_PEER = tl.constexpr(2)
RING_ERR_STAGE = tl.constexpr(3)
RING_ERR_SEQ = tl.constexpr(4)
#: the proxy's heartbeat (host only): each sweep stores its clock there; a proxy process's rank reads it to tell a
#: proxy that stopped making progress (SIGSTOP, starved: triton_ep/proxy_process/heartbeat.py)
RING_BEAT = tl.constexpr(5)
RING_FIXED = tl.constexpr(8)
RING_READY = tl.constexpr(0)      #: per-peer arrays, in units of R words after RING_FIXED
RING_SENT = tl.constexpr(1)
RING_TAIL = tl.constexpr(2)
RING_HEAD = tl.constexpr(3)
RING_CREDIT = tl.constexpr(4)
RING_FAULT = tl.constexpr(5)
RING_SRC = tl.constexpr(6)
RING_LEN = tl.constexpr(7)
STAGE_RING_PRODUCE = tl.constexpr(12)   #: a producer waiting for a free send slot
STAGE_RING_CONSUME = tl.constexpr(13)   #: a consumer waiting for a chunk (the tail)
# the RDMA proxy's stages (host only; a failed proxy's fault word carries them to its peers)
STAGE_PROXY_POST = 14
STAGE_PROXY_SEND_CQE = 15
STAGE_PROXY_RECV_CQE = 16
STAGE_PROXY_CREDIT = 17
STAGE_PROXY_SEND_WAIT = 18
STAGE_PROXY = 19                        #: anything else inside the proxy
#: a rank whose call found num_worst_tokens too small left the group (its GONE word; host only): every rank
#: of the group finds that alike, so a peer that hears of it first raises EPCapacityError too
STAGE_CAPACITY = 20


@formula
def ring_word(array, R, peer):
    """Word index of ``array[peer]`` (``array``: one of the ``RING_*`` per-peer arrays) for group size ``R``."""
    return RING_FIXED + array * R + peer


@formula
def ring_len_word(R, S, peer, slot):
    """Word index of ``LEN[peer * S + slot]``: the bytes of the chunk in send slot ``slot`` for ``peer``."""
    return RING_FIXED + RING_LEN * R + peer * S + slot


@formula
def ring_masked_word(R, S, peer):
    """Word index of ``MASKED[peer]`` (after the ``LEN`` words)."""
    return RING_FIXED + RING_LEN * R + R * S + peer


@formula
def ring_arrive_word(R, S, peer, slot):
    """Word index of ``ARRIVE[peer * S + slot]`` (after the ``MASKED`` words): the arrival word of receive slot
    ``slot`` from ``peer``."""
    return RING_FIXED + RING_LEN * R + R * S + R + peer * S + slot


@formula
def ring_asrc_word(R, S, peer, slot):
    """Word index of ``ASRC[peer * S + slot]`` (after the ``ARRIVE`` words): the source of the arrival word of send
    slot ``slot`` for ``peer``."""
    return RING_FIXED + RING_LEN * R + 2 * R * S + R + peer * S + slot


@formula
def ring_gave_word(R, S, peer):
    """Word index of ``GAVE[peer]`` (after the ``ASRC`` words; low-latency rank masking across hosts): written by
    ``peer``'s proxy over RDMA, the low-latency call in which ``peer`` gave up on this rank (0: it did not). The
    unpack's wait for ``peer``'s chunk reads it as the within-host waits read ``GAVEUP`` (``off_ll_gaveup``)."""
    return RING_FIXED + RING_LEN * R + 3 * R * S + R + peer


@formula
def ring_gsrc_word(R, S, peer):
    """Word index of ``GSRC[peer]`` (after the ``GAVE`` words): the low-latency call in which this rank's kernels
    gave up on ``peer`` (stored before ``MASKED[peer]``); the proxy writes it into ``peer``'s ``GAVE[me]``."""
    return RING_FIXED + RING_LEN * R + 3 * R * S + 2 * R + peer


@formula
def ring_ctrl_words(R, S):
    """int64 words of a ring control block for ``R`` ranks and ``S`` slots per peer."""
    return RING_FIXED + RING_LEN * R + 3 * R * S + 3 * R


#: every stage code (error records and ring records name them), in one table with its name
STAGE_NAMES = {0: "unknown", int(STAGE_DISPATCH_SEND): "dispatch/send", int(STAGE_DISPATCH_RECV): "dispatch/receive",
               int(STAGE_COMBINE_SEND): "combine/send", int(STAGE_COMBINE_RECV): "combine/reduce",
               int(STAGE_NOTIFY): "dispatch/notify counts", int(STAGE_HOST): "a host rendezvous",
               int(STAGE_FAILED): "an error of its own in the middle of a call",
               int(STAGE_LL_DISPATCH_SEND): "low_latency_dispatch/send",
               int(STAGE_LL_DISPATCH_RECV): "low_latency_dispatch/receive",
               int(STAGE_LL_COMBINE_SEND): "low_latency_combine/send",
               int(STAGE_LL_COMBINE_RECV): "low_latency_combine/reduce",
               int(STAGE_RING_PRODUCE): "rdma ring/producer: free send slot",
               int(STAGE_RING_CONSUME): "rdma ring/consumer: tail",
               STAGE_PROXY_POST: "rdma proxy/post", STAGE_PROXY_SEND_CQE: "rdma proxy/send completion",
               STAGE_PROXY_RECV_CQE: "rdma proxy/receive completion",
               STAGE_PROXY_CREDIT: "rdma proxy/credits (the peer stopped consuming)",
               STAGE_PROXY_SEND_WAIT: "rdma proxy/completion wait",
               STAGE_CAPACITY: "num_worst_tokens too small",
               STAGE_PROXY: "rdma proxy"}      # last: a prefix of the proxy names above
assert len(STAGE_NAMES) == 21, "stage codes must be unique"
