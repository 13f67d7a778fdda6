"""The low-latency area's layout, the same on every rank: where its control block, its two halves (counts
and records) and the zero-copy combine input sit. The modes size and slice the area with it; the kernels take
its sizes (in 32-bit words)."""
import dataclasses
import functools

from . import records
from .signal_header import ll_ctl_words

_ALIGN = 256


def _up(n: int, a: int = _ALIGN) -> int:
    return (int(n) + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte layout of the low-latency area for ``N`` tokens per rank, hidden ``H``, ``R`` ranks and ``E``
    experts (the same on every rank). Sizes in bytes; the ``*_words`` properties in 32-bit words.

    - control block: ``ll_ctl_words(R)`` int64 words (:mod:`triton_ep.protocol.signal_header`);
    - each half: counts int32 ``[R][E/R]``, then ``E * N`` dispatch records (the bf16 record, the larger)
      or, in a combine, ``N * K`` returned rows: bf16 (``H / 2`` words), or with ``use_logfmt`` LogFMT-10
      records of :attr:`logfmt_row_words` (:func:`logfmt_record_words`);
    - the zero-copy combine input, bf16 ``[E/R, R*N, H]`` (local only).
    """
    num_ranks: int
    n_max: int
    hidden: int
    num_experts: int

    @functools.cached_property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @functools.cached_property
    def ctl_bytes(self) -> int:
        return _up(ll_ctl_words.host(self.num_ranks) * 8)

    @functools.cached_property
    def count_bytes(self) -> int:
        return _up(self.num_experts * 4)

    def record_words(self, fp8: bool) -> int:
        """32-bit words of one dispatch record (:mod:`triton_ep.protocol.records`)."""
        return self._record_words[bool(fp8)]

    @functools.cached_property
    def _record_words(self) -> tuple:
        return records.ll_record_words(self.hidden, False), records.ll_record_words(self.hidden, True)

    @functools.cached_property
    def half_bytes(self) -> int:
        return _up(self.count_bytes + self.num_experts * self.n_max * self.record_words(False) * 4)

    @functools.cached_property
    def zero_copy_bytes(self) -> int:
        return _up(self.num_experts * self.n_max * self.hidden * 2)

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.ctl_bytes + 2 * self.half_bytes + self.zero_copy_bytes

    @functools.cached_property
    def logfmt_row_words(self) -> int:
        """32-bit words between two returned rows of a combine with ``use_logfmt``: the LogFMT-10 record
        (:func:`logfmt_record_words`) rounded up to 4 words, so that every row starts on a 16-byte boundary as
        the bf16 rows do (exact for ``H % 512 == 0``: 2296 words, 9184 bytes, at ``H`` 7168)."""
        return (logfmt_record_words(self.hidden) + 3) // 4 * 4

    ctl_words = functools.cached_property(lambda self: self.ctl_bytes // 4)
    half_words = functools.cached_property(lambda self: self.half_bytes // 4)
    count_words = functools.cached_property(lambda self: self.count_bytes // 4)

    # ---- the network leg (ranks on other hosts): one chunk per peer and call in the RDMA scheduler's ring
    @functools.cached_property
    def net_count_words(self) -> int:
        """int32 words of a dispatch chunk's counts (``E/R``, rounded up to 4)."""
        return (self.experts_per_rank + 3) // 4 * 4

    @functools.cached_property
    def net_row_words(self) -> int:
        """Words of one returned row in a combine chunk: ``t * K + k``, 3 pad words, the bf16 row."""
        return 4 + self.hidden // 2

    @functools.cached_property
    def net_logfmt_row_words(self) -> int:
        """Words of one returned row in a combine chunk with ``use_logfmt``: ``t * K + k``, 3 pad words, the
        LogFMT-10 record (:attr:`logfmt_row_words`)."""
        return 4 + self.logfmt_row_words

    def net_chunk_bytes(self, num_topk: int) -> int:
        """Bytes of the largest chunk a call with ``num_topk`` sends one peer: a source sends a peer at most
        ``N * min(K, E/R)`` rows (:data:`~triton_ep.protocol.records.NET_HEADER_WORDS` header words first;
        dispatch: the counts, then records; combine: rows of :attr:`net_row_words`)."""
        rows = self.n_max * min(int(num_topk), self.experts_per_rank)
        body = max(self.net_count_words + rows * self.record_words(False), rows * self.net_row_words)
        return 4 * (records.NET_HEADER_WORDS + body)


#: channels per LogFMT-10 block (one scale pair each)
LOGFMT_BLOCK = 128
#: int32 words of one block's encoded values: 128 low bytes of the 9-bit codes (32 words), then the codes' ninth
#: bits (4 words, channel ``c`` at bit ``c % 32`` of word ``c // 32``), then the sign bits (4 words, the same way)
LOGFMT_BLOCK_WORDS = 40


def logfmt_record_words(hidden: int) -> int:
    """32-bit words of one LogFMT-10 row of ``hidden`` channels (``hidden % 128 == 0``), the encoding of a
    low-latency combine with ``use_logfmt`` (DeepEP's LogFMT-10, its size): one scale word per block of 128
    channels (bf16 bits of the block's largest magnitude in the low half, of its smallest in the high half),
    then :data:`LOGFMT_BLOCK_WORDS` words per block (10 bits a channel: a 9-bit code and a sign). That is
    DeepEP's ``hidden * 10 / 8 + hidden / 128 * 4`` bytes (its test's ``num_logfmt10_bytes``); the encoding
    itself is :mod:`triton_ep.kernels.logfmt`'s."""
    blocks = int(hidden) // LOGFMT_BLOCK
    return blocks * (1 + LOGFMT_BLOCK_WORDS)


#: a network chunk's header: :data:`~triton_ep.protocol.records.NET_HEADER_WORDS` int32 words, int64 ``[call
#: number, call signature, status, rows]``; status 0, or ``flags.E_FAILED`` when the sender failed the call
#: (nothing follows)


def net_slot_bytes(area_bytes: int, num_ranks: int) -> int:
    """Bytes of each ring slot (one chunk) of a Buffer's network leg in low-latency mode, from its
    ``num_rdma_bytes`` (``area_bytes``): the ring holds 2 slots per peer and direction, so the leg takes about
    twice the area in registered host memory. With ``num_rdma_bytes`` from
    ``get_low_latency_rdma_size_hint`` a slot holds any call's chunk (:meth:`Layout.net_chunk_bytes`)."""
    return max(64, int(area_bytes) // (2 * int(num_ranks)) // 64 * 64)
