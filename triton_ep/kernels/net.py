"""The internode network leg's kernels: pack record streams into the RDMA scheduler's send rings, unpack
them from its receive rings (the kernel side of :mod:`triton_ep.scheduler`'s ring protocol).

A host's records (:class:`triton_ep.protocol.records.NetRecord`, the same bytes the host path sends) form
one stream of 32-bit words per destination host, cut into chunks of ``slot_bytes``; a record may straddle
two chunks.  Word ``w`` of a stream is word ``w % rec_w`` of record ``w // rec_w``, which is built from the
token ``tokens[w // rec_w]``'s row, scales, ids, weights and ``is_token_in_rank`` bytes (:func:`_word`).

- :func:`pack_ring`: one program per destination host; for each of its chunks in ``[c_lo, c_hi)``: wait
  (bounded) until the send slot is free (``SENT > k - S``), write the chunk's words, store its length, then
  release ``READY = k + 1`` at system scope.
- :func:`unpack_ring`: one program per source host; for each chunk: acquire ``TAIL > k``, copy the slot's
  words to the host's place in ``out``, release ``HEAD = k + 1`` (the proxy returns the slot as a credit).
- :func:`pack_linear`: this host's own stream into ordinary memory (no ring).

A launch moves at most ``slots`` chunks per peer (one *round*): under the interpreter and in one stream a
program never waits for a later launch, so the caller runs rounds ``pack, unpack, pack, unpack...``.  A wait
that ends badly writes the ring error record (``RingFlags.error``) and its program moves nothing more.
"""
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags as F
from ._util import interpreted
from ..protocol.records import NET_HEADER_WORDS, NET_STATUS_CAPACITY, NET_STATUS_LAYOUT, NetRecord

#: a device-counted stream's header words, and the status codes its receiver notes (kernels' constants)
HEADER_WORDS = NET_HEADER_WORDS
STATUS_CAPACITY: tl.constexpr = tl.constexpr(NET_STATUS_CAPACITY)
STATUS_LAYOUT: tl.constexpr = tl.constexpr(NET_STATUS_LAYOUT)


class Sources(NamedTuple):
    """What a record stream is built from (every tensor on the kernels' device, contiguous).

    Attributes:
        x32: int32 ``[T, row_w]``, the rows' bytes.  sc32: int32 ``[T, sc_w]`` (scales' bits) or a dummy.
        id32: int32 ``[T, id_w]`` (int64 ids as word pairs) or a dummy.  wt32: int32 ``[T, wt_w]`` (fp32
        weights' bits) or a dummy.  loc8: uint8 ``[T, loc_stride]`` (``is_token_in_rank``) or a dummy.
        cols: int32 ``[num_hosts, per_host]``, the ``loc8`` column of each host's local rank ``j``, or a dummy.
        src_rank: the meta block's first word.  per_host: ``is_token_in_rank`` bytes per record (0: none).
        offs: word offsets of row, scales, ids, weights and local in a record, and the record's words.
    """
    x32: torch.Tensor
    sc32: torch.Tensor
    id32: torch.Tensor
    wt32: torch.Tensor
    loc8: torch.Tensor
    loc_stride: int
    cols: torch.Tensor
    src_rank: int
    row_w: int
    sc_w: int
    id_w: int
    wt_w: int
    per_host: int
    off_row: int
    off_sc: int
    off_id: int
    off_wt: int
    off_loc: int
    rec_w: int

    @classmethod
    def of(cls, rec: NetRecord, x32: torch.Tensor, sc32: torch.Tensor, id32: torch.Tensor, wt32: torch.Tensor,
           loc8: torch.Tensor, loc_stride: int, cols: torch.Tensor, src_rank: int) -> "Sources":
        """The sources of records laid out as ``rec``: field widths and word offsets from the record layout
        (the one place they are computed), the tensors as given (the kernels' arguments, in this order)."""
        off = {f: rec.span(f)[0] // 4 for f in ("row", "scales", "ids", "weights", "local")}
        return cls(x32, sc32, id32, wt32, loc8, loc_stride, cols, src_rank, rec.row // 4, rec.scales // 4, 2 * rec.ids,
                   rec.weights, rec.local, off["row"], off["scales"], off["ids"], off["weights"], off["local"],
                   rec.nbytes // 4)


    @classmethod
    def of_rows(cls, rec: NetRecord, n: int, x: torch.Tensor, cols: torch.Tensor, rank: int, dev,
                sc: Optional[torch.Tensor] = None, ids: Optional[torch.Tensor] = None,
                w: Optional[torch.Tensor] = None, in_rank: Optional[torch.Tensor] = None) -> "Sources":
        """The sources of ``n`` rows: ``x`` (``[n, ...]``, ``rec.row`` bytes a row), scales, int64 ids, fp32
        weights and bool ``is_token_in_rank`` ``[n, R]`` (each ``None`` where ``rec`` has no such field), as the
        kernels' words (:func:`words`); ``cols``: int32 ``[num_hosts, per_host]``, the global rank of each host's
        local ranks; ``rank``: the meta block's source rank; ``dev``: the device."""
        loc = torch.zeros(1, dtype=torch.uint8, device=dev) if in_rank is None else \
            in_rank.contiguous().view(torch.uint8)
        return cls.of(rec, words(x, n, dev), words(sc, n, dev), words(ids, n, dev), words(w, n, dev), loc,
                      0 if in_rank is None else in_rank.shape[1], cols, rank)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, a view where it has them. ``Tensor.contiguous()`` is not enough before a dtype
    view: a size-1 dimension may keep any stride (a column-major ``[n, 1]`` scale tensor, a single row), and
    ``view(dtype)`` of another element size needs the last stride to be 1."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def words(t: Optional[torch.Tensor], n: int, dev) -> torch.Tensor:
    """``t`` (``[n, ...]``, any strides) as int32 ``[n, words]``; a one-word dummy for ``None``."""
    if t is None:
        return torch.zeros(1, dtype=torch.int32, device=dev)
    return dense(t).view(torch.uint8).view(n, t.element_size() * math.prod(t.shape[1:])).view(torch.int32)


#: the integer fields of :class:`Sources` (the kernels do not specialise on them)
_SRC_NAMES = [f for f in Sources._fields if Sources.__annotations__[f] is int]


@triton.jit
def _field(v, o, valid, n, src, tok):
    """``v`` with the lanes whose field word ``o`` lies in ``[0, n)`` replaced by ``src[tok, o]``."""
    m = valid & (o >= 0) & (o < n)
    return tl.where(m, tl.load(src + tok * n + o, mask=m, other=0), v)


@triton.jit
def _word(w, valid, tokens, host, x32, sc32, id32, wt32, loc8, loc_stride, cols, src_rank, row_w, sc_w, id_w, wt_w,
          per_host, off_row, off_sc, off_id, off_wt, off_loc, rec_w):
    """Words ``w`` (int64 ``[BLOCK]``, masked by ``valid``) of the record stream of ``tokens`` for ``host``."""
    r = w // rec_w
    j = w - r * rec_w
    tok = tl.load(tokens + r, mask=valid, other=0).to(tl.int64)
    v = tl.zeros_like(j).to(tl.int32)
    v = tl.where(valid & (j == 0), src_rank, v)
    v = tl.where(valid & (j == 1), tok.to(tl.int32), v)
    v = _field(v, j - off_row, valid, row_w, x32, tok)
    v = _field(v, j - off_sc, valid, sc_w, sc32, tok)
    v = _field(v, j - off_id, valid, id_w, id32, tok)
    v = _field(v, j - off_wt, valid, wt_w, wt32, tok)
    o = j - off_loc
    m = valid & (o >= 0) & (o * 4 < per_host)
    acc = tl.zeros_like(v)
    for b in tl.static_range(4):
        bi = o * 4 + b
        mb = m & (bi < per_host)
        col = tl.load(cols + host * per_host + bi, mask=mb, other=0).to(tl.int64)
        byte = tl.load(loc8 + tok * loc_stride + col, mask=mb, other=0).to(tl.int32)
        acc = acc | (byte << (8 * b))
    return tl.where(m, acc, v)


@triton.jit
def _stream(ctrl, n_words, h, c_hi, SW):
    """Peer ``h``'s stream: its words, the end of this launch's chunks, and whether an earlier wait already
    gave up (the abort word)."""
    nw = tl.load(n_words + h)
    bad = (tl.load(ctrl + F.RING_ABORT, volatile=True) != 0).to(tl.int32)
    return nw, _end(nw, c_hi, SW), bad


@triton.jit
def _end(nw, c_hi, SW):
    """The end of this launch's chunks of a stream of ``nw`` words (at most ``c_hi``)."""
    return tl.minimum((nw + SW - 1) // SW, c_hi)


@triton.jit
def _claim(ctrl, array, want, h, stage, k, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr):
    """Wait (bounded) until ``array[h] >= want`` for chunk ``k``; on failure write the ring error record.
    Returns the wait's status (0: go)."""
    st = F.wait_ge(ctrl + F.ring_word(array, R, h), want, ctrl + F.RING_ABORT, timeout_ns, USE_CLOCK)
    if st != 0:
        F.post_ring_error(ctrl, st, h, stage, k)
        # end every later ring wait at once (a capture-path call's later rounds and calls are queued already;
        # the host raises the record at its next check)
        F.release(ctrl + F.RING_ABORT, tl.full([], 3, tl.int64))
    return st


@triton.jit
def _publish(ctrl, array, h, k, R: tl.constexpr, USE_CLOCK: tl.constexpr):
    """Chunk ``k`` is done: release ``array[h] = k + 1`` after every thread's stores (system scope)."""
    F.fence_all_threads(USE_CLOCK)
    tl.debug_barrier()
    F.release(ctrl + F.ring_word(array, R, h), k + 1)


@triton.jit
def _slot(ring, h, k, c, nw, S, SW):
    """Chunk ``c`` (the scheduler's chunk ``k``) of peer ``h``'s stream of ``nw`` words: its slot in
    ``ring``, its first stream word and its words."""
    w0 = (tl.full([], 0, tl.int64) + c) * SW
    return ring + (h * S + k % S) * SW, w0, tl.minimum(nw - w0, SW)


@triton.jit
def _bases(ctrl, array, first_seq, h, c_lo, R: tl.constexpr, DEV: tl.constexpr):
    """Peer ``h``'s first chunk number: given (``first_seq``), or (``DEV``) the counter ``array[h]`` when the
    call's first round starts, saved in ``first_seq`` for its later rounds (every earlier chunk was produced
    and consumed: stream order)."""
    if DEV:
        if c_lo == 0:
            seq0 = tl.load(ctrl + F.ring_word(array, R, h), volatile=True)
            tl.store(first_seq + h, seq0)
        else:
            seq0 = tl.load(first_seq + h)
    else:
        seq0 = tl.load(first_seq + h)
    return seq0


@names.jit('intranode', 'notify', do_not_specialize=['c_lo', 'c_hi', 'me_host', 'timeout_ns', 'HW'] + _SRC_NAMES)
def _pack_ring(ctrl, send, tokens, tok_start, n_words, first_seq, hdr, HW, status, peer_words, c_lo, c_hi, me_host, S,
               SW, timeout_ns,
               x32, sc32, id32, wt32, loc8, loc_stride, cols, src_rank, row_w, sc_w, id_w, wt_w, per_host,
               off_row, off_sc, off_id, off_wt, off_loc, rec_w,
               R: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr, DEV: tl.constexpr):
    h = tl.program_id(0)
    if DEV:
        if (h == me_host) & (c_lo == 0):     # this rank's own status: its header's code and reason words
            code = tl.load(hdr + h * HW + 2)
            if code != 0:                    # (a status stays until the host read it)
                tl.store(status + 2 * h, code)
                tl.store(status + 2 * h + 1, tl.load(hdr + h * HW + 5))
    if h != me_host:
        offs = tl.arange(0, BLOCK).to(tl.int64)
        nw, hi, bad = _stream(ctrl, n_words, h, c_hi, SW)
        if DEV:
            if c_lo > 0:   # more records than the peer takes: the stream ends with the first round's chunks
                over = tl.load(hdr + h * HW + 1).to(tl.int64) > tl.load(peer_words + 2 * R + h)
                nw = tl.where(over, tl.minimum(nw, S * SW), nw)
                hi = _end(nw, c_hi, SW)
        seq0 = _bases(ctrl, F.RING_READY, first_seq, h, c_lo, R, DEV)
        toks = tokens + tl.load(tok_start + h)
        for c in range(c_lo, hi):
            if bad == 0:
                k = seq0 + c
                bad = _claim(ctrl, F.RING_SENT, k + 1 - S, h, F.STAGE_RING_PRODUCE, k, timeout_ns, R, USE_CLOCK)
                if bad == 0:
                    base, w0, n = _slot(send, h, k, c, nw, S, SW)
                    for o in range(0, n, BLOCK):
                        idx = o + offs
                        valid = idx < n
                        sw = w0 + idx           # the stream's word: the header's first HW, then the records'
                        v = _word(sw - HW, valid & (sw >= HW), toks, h, x32, sc32, id32, wt32, loc8, loc_stride,
                                  cols, src_rank, row_w, sc_w, id_w, wt_w, per_host, off_row, off_sc, off_id, off_wt,
                                  off_loc, rec_w)
                        mh = valid & (sw < HW)
                        v = tl.where(mh, tl.load(hdr + h * HW + sw, mask=mh, other=0), v)
                        tl.store(base + idx, v, mask=valid)
                    tl.store(ctrl + F.ring_len_word(R, S, h, k % S), n * 4)
                    _publish(ctrl, F.RING_READY, h, k, R, USE_CLOCK)


@names.jit('internode', 'forward',
           do_not_specialize=['c_lo', 'c_hi', 'me_host', 'timeout_ns', 'HW', 'cap_words', 'key', 'rec_w'])
def _unpack_ring(ctrl, recv, out, out_start, n_words, first_seq, c_lo, c_hi, me_host, S, SW, timeout_ns,
                 rx_count, status, HW, cap_words, key, rec_w,
                 R: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr, DEV: tl.constexpr):
    h = tl.program_id(0)
    if h != me_host:
        offs = tl.arange(0, BLOCK).to(tl.int64)
        nw, hi, bad = _stream(ctrl, n_words, h, c_hi, SW)
        seq0 = _bases(ctrl, F.RING_HEAD, first_seq, h, c_lo, R, DEV)
        lim = nw
        if DEV:
            # the stream's length is in its header (first chunk): until it arrived, assume one chunk
            if c_lo == 0:
                nw = (tl.zeros([], tl.int64) + SW)
                lim = nw * 0
            else:
                lim = tl.load(n_words + R + h)
            hi = c_hi
        dst = out + tl.load(out_start + h)
        for c in range(c_lo, hi):
            if (bad == 0) & ((tl.full([], 0, tl.int64) + c) * SW < nw):
                k = seq0 + c
                bad = _claim(ctrl, F.RING_TAIL, k + 1, h, F.STAGE_RING_CONSUME, k, timeout_ns, R, USE_CLOCK)
                if bad == 0:
                    base, w0, n = _slot(recv, h, k, c, nw, S, SW)
                    if DEV:
                        if c == 0:
                            nw, lim = _header(base, h, rx_count, status, cap_words, key, rec_w, HW, n_words, S, SW, R)
                            n = tl.minimum(nw - w0, SW)
                    for o in range(0, n, BLOCK):
                        idx = o + offs
                        sw = w0 + idx
                        valid = (idx < n) & (sw < lim)
                        tl.store(dst + sw, tl.load(base + idx, mask=valid, other=0, volatile=True), mask=valid)
                    _publish(ctrl, F.RING_HEAD, h, k, R, USE_CLOCK)


@triton.jit
def _header(base, h, rx_count, status, cap_words, key, rec_w, HW, n_words, S, SW, R: tl.constexpr):
    """A device-counted stream's header (:data:`HEADER_WORDS` words: its words, records, status code, the rank
    whose error started a failure, layout key, the records the sender's own staging area takes from each
    peer): note the records that may be copied (``rx_count[h]``; 0 unless the status is 0, the layout matches
    and they fit ``cap_words``), the status (``status[h]``: code, culprit) and the sender's room
    (``n_words[2R + h]``, which this rank's later send rounds read; -1 for another layout). A stream of more
    records than fit, or of another layout, ends with its first round's chunks (``S``), on both sides.
    Returns the stream's words (so clamped) and the end of the words copied (the header always; the records
    where they may be)."""
    nw = tl.load(base + 0, volatile=True).to(tl.int64)
    cnt = tl.load(base + 1, volatile=True).to(tl.int64)
    code = tl.load(base + 2, volatile=True)
    culprit = tl.load(base + 3, volatile=True)
    same = tl.load(base + 4, volatile=True) == key
    # (another layout: the room is -1, so the other side cuts its stream too; the keys differ alike both ways)
    tl.store(n_words + 2 * R + h, tl.where(same, tl.load(base + 6, volatile=True).to(tl.int64), -1))
    fits = cnt <= cap_words // rec_w
    nw = tl.where(fits & same, nw, tl.minimum(nw, S * SW))
    code = tl.where(code != 0, code, tl.where(same, tl.where(fits, 0, STATUS_CAPACITY), STATUS_LAYOUT))
    ok = code == 0
    lim = tl.where(ok, HW + cnt * rec_w, HW)
    tl.store(rx_count + h, tl.where(ok, cnt, 0).to(tl.int32))
    if code != 0:                            # (a status stays until the host read it)
        tl.store(status + 2 * h, code)
        tl.store(status + 2 * h + 1, culprit)
    tl.store(n_words + h, nw)
    tl.store(n_words + R + h, lim)
    return nw, lim


@names.jit('internode', 'forward', do_not_specialize=['nw', 'host'] + _SRC_NAMES)
def _pack_linear(out, tokens, nw, count, host, x32, sc32, id32, wt32, loc8, loc_stride, cols, src_rank, row_w, sc_w,
                 id_w, wt_w, per_host, off_row, off_sc, off_id, off_wt, off_loc, rec_w, BLOCK: tl.constexpr,
                 COUNTED: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < nw
    if COUNTED:
        valid = valid & (idx < tl.load(count).to(tl.int64) * rec_w)
    v = _word(idx, valid, tokens, host, x32, sc32, id32, wt32, loc8, loc_stride, cols, src_rank, row_w, sc_w, id_w,
              wt_w, per_host, off_row, off_sc, off_id, off_wt, off_loc, rec_w)
    tl.store(out + idx, v, mask=valid)


def _block() -> int:
    return 4096 if interpreted() else 1024


class DeviceCounts(NamedTuple):
    """The device-counted form of a call's streams (the capture path: the host learns no count).

    Attributes:
        hdr: int32 ``[num_hosts, hw]``, each stream's header (:data:`HEADER_WORDS` words, then extra words),
            built on the device.  hw: header words (a multiple of 4).
        rx_count: int32 ``[num_hosts]`` (out): records received from each peer host (0 where its status is
            not 0).  rx_words: the int64 ``[3 * num_hosts]`` scratch :func:`unpack_ring` takes as ``n_words``
            (:func:`pack_ring` reads each peer's room there).  status: int32 ``[num_hosts, 2]`` (out; pinned
            host memory on GPU, so the host reads it without a synchronisation): each peer's status code and
            culprit rank; this host's row: this rank's own code and reason.
        cap_words: words of each peer's staging area (records beyond it are a capacity error).  key: this
            rank's layout key (:meth:`NetRecord.key32`).  rec_w: words of a received record.
    """
    hdr: torch.Tensor
    hw: int
    rx_count: torch.Tensor
    rx_words: torch.Tensor
    status: torch.Tensor
    cap_words: int
    key: int
    rec_w: int


def pack_ring(ctrl: torch.Tensor, send: torch.Tensor, src: Sources, tokens: torch.Tensor, tok_start: torch.Tensor,
              n_words: torch.Tensor, first_seq: torch.Tensor, c_lo: int, c_hi: int, me_host: int, num_hosts: int,
              slots: int, slot_bytes: int, timeout_s: float, dev: "DeviceCounts" = None) -> None:
    """Write chunks ``[c_lo, c_hi)`` of each peer host's record stream into the send ring and release them.

    Args:
        ctrl: int64 ``[flags.ring_ctrl_words.host(num_hosts, slots)]``, the scheduler's control block.
        send: int32 view of its send ring, ``[num_hosts * slots * slot_bytes / 4]``.
        src: the streams' sources (:class:`Sources`).  tokens: int64, every host's tokens (source rows) one
            after another; tok_start: int64 ``[num_hosts]``, where each host's start.
        n_words: int64 ``[num_hosts]``, words of each host's stream (its header included).
        first_seq: int64 ``[num_hosts]``: the scheduler's chunk number of each stream's first chunk; with
            ``dev``, scratch: the first round reads ``READY`` there.
        me_host: this host (its program does nothing).  slot_bytes: the chunk size (a multiple of 64).
        timeout_s: bound of each wait for a free slot (GPU clock; under the interpreter the caller's watchdog
            on ``ctrl[RING_ABORT]``).
        dev: a device-counted call (:class:`DeviceCounts`): each stream starts with its header ``dev.hdr``;
            this host's row of it gives this rank's own status (its words 2 and 5: code and reason). From the
            second round on, a stream of more records than its receiver takes (its header's word 6, noted by
            :func:`unpack_ring`'s first round), or to a receiver of another layout, ends with the first round's
            chunks.
    Errors end in the ring error record, never in a hang.
    """
    if dev is None:
        hdr = status = torch.zeros(1, dtype=torch.int32, device=tokens.device)   # (the kernels' device)
        hw, peer_words = 0, n_words
    else:
        hdr, hw, status, peer_words = dev.hdr, dev.hw, dev.status, dev.rx_words
    _pack_ring[(num_hosts,)](ctrl, send, tokens, tok_start, n_words, first_seq, hdr, hw, status, peer_words, c_lo, c_hi,
                             me_host, slots, slot_bytes // 4, int(timeout_s * 1e9), *src, R=num_hosts, BLOCK=_block(),
                             USE_CLOCK=not interpreted(), DEV=dev is not None, num_warps=4)


def unpack_ring(ctrl: torch.Tensor, recv: torch.Tensor, out: torch.Tensor, out_start: torch.Tensor,
                n_words: torch.Tensor, first_seq: torch.Tensor, c_lo: int, c_hi: int, me_host: int, num_hosts: int,
                slots: int, slot_bytes: int, timeout_s: float, dev: "DeviceCounts" = None) -> None:
    """Copy chunks ``[c_lo, c_hi)`` of each peer host's stream from the receive ring into ``out`` (int32, at
    word ``out_start[h]``, int64 ``[num_hosts]``) and free their slots.  ``n_words``: int64 ``[num_hosts]``,
    words of each stream; with ``dev`` (:class:`DeviceCounts`), int64 ``[3 * num_hosts]`` scratch
    (``dev.rx_words``): each stream's length comes in its header, which is copied, and so are its records
    where they may be (status 0, the same layout, within ``dev.cap_words``; a stream of more records ends
    with its first round's chunks);
    ``first_seq`` as :func:`pack_ring`."""
    if dev is None:
        dummy = torch.zeros(2, dtype=torch.int32, device=out.device)     # (the kernels' device)
        extra = (dummy, dummy, 0, 0, 0, 1)
    else:
        extra = (dev.rx_count, dev.status, dev.hw, dev.cap_words, dev.key, dev.rec_w)
    _unpack_ring[(num_hosts,)](ctrl, recv, out, out_start, n_words, first_seq, c_lo, c_hi, me_host, slots,
                               slot_bytes // 4, int(timeout_s * 1e9), *extra, R=num_hosts, BLOCK=_block(),
                               USE_CLOCK=not interpreted(), DEV=dev is not None, num_warps=4)


def pack_linear(out: torch.Tensor, src: Sources, tokens: torch.Tensor, host: int,
                count: torch.Tensor = None) -> None:
    """Write the record stream of ``tokens`` (int64 ``[n]``) for ``host`` into ``out`` (int32
    ``[n * src.rec_w]``); with ``count`` (int32 / int64 ``[1]`` on the device), only its first ``count[0]``
    records (the host never learns how many)."""
    nw = tokens.numel() * src.rec_w
    if nw == 0:
        return
    blk = _block()
    cnt = tokens if count is None else count
    _pack_linear[(triton.cdiv(nw, blk),)](out, tokens, nw, cnt, host, *src, BLOCK=blk, COUNTED=count is not None,
                                          num_warps=4)


def reference_stream(src: Sources, tokens: torch.Tensor, host: int) -> torch.Tensor:
    """The record stream :func:`pack_linear` writes, built with torch (int32 ``[n * rec_w]``; tests)."""
    n, t = tokens.numel(), tokens.long().cpu()
    out = torch.zeros(n, src.rec_w, dtype=torch.int32, device="cpu")
    out[:, 0] = src.src_rank
    out[:, 1] = t.to(torch.int32)
    for off, w, ten in ((src.off_row, src.row_w, src.x32), (src.off_sc, src.sc_w, src.sc32),
                        (src.off_id, src.id_w, src.id32), (src.off_wt, src.wt_w, src.wt32)):
        if w:
            out[:, off:off + w] = ten.cpu()[t]
    if src.per_host:
        cols = src.cols.cpu()[host].long()
        loc = torch.zeros(n, (src.per_host + 3) // 4 * 4, dtype=torch.uint8, device="cpu")
        loc[:, :src.per_host] = src.loc8.cpu()[t][:, cols]
        out[:, src.off_loc:src.off_loc + loc.shape[1] // 4] = loc.view(torch.int32)
    return out.view(-1)
