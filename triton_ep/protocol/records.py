"""Record layouts and handle tables, written once: each field's offset is a :func:`formula` that kernels
call (with ``tl.constexpr`` widths it folds to a constant) and host code evaluates with ``.host(...)``.

Normal-mode dispatch record (one received row in a receiver's buffer), in 32-bit words::

    [ x row (WX) | scales (S) | global top-k ids (K) | top-k weight bits (K) | source index (1) ]

padded to the tuning table's record alignment (at least 4 words = 16 bytes). A cached dispatch sends no
top-k (``K = 0``) and no source index.

Normal-mode combine record, in 32-bit words: ``[ x row (WX = H / 2 words of bf16) | top-k weights (K) ]``
padded to 4 words.

Low-latency dispatch record, in 32-bit words: ``[ payload (PW) | scales (SW) | t * K + k (1) ]``, padded to
4 words: ``PW = H / 4`` (FP8) or ``H / 2`` (bf16) and ``SW = H / 128`` fp32 scales (FP8) or 0.

Handle tables written by the notify kernel (:mod:`triton_ep.kernels.notify`):

- ``t32`` int32: ``rank_prefix_matrix`` ``[R, R]``, then ``channel_prefix_matrix`` ``[R]`` and
  ``recv_channel_prefix_matrix`` ``[R]`` (DeepEP's, with one channel);
- ``t64`` int64: ``row_base`` ``[R]``, ``comb_base`` ``[R]``, ``send_base`` ``[R]``, ``prefix`` ``[R]``,
  then ``n_recv`` ``[1]``.
"""
import dataclasses

import triton.language as tl  # noqa: F401  (the interpreter needs it visible to jit functions)

from .signal_header import formula


# ---- normal-mode dispatch record ----
@formula
def rec_scales(WX, S, K):
    """Word of the first scale."""
    return WX


@formula
def rec_ids(WX, S, K):
    """Word of the first global top-k id."""
    return WX + S


@formula
def rec_weights(WX, S, K):
    """Word of the first top-k weight (fp32 bits)."""
    return WX + S + K


@formula
def rec_src(WX, S, K):
    """Word of the source token index."""
    return WX + S + 2 * K


def dispatch_record_words(wx: int, s: int, k: int, with_src: bool, align: int = 4) -> int:
    """32-bit words of one dispatch record (``k = 0`` without top-k; ``with_src``: the source index is
    sent), rounded up to ``align`` words."""
    n = rec_src.host(wx, s, k) + (1 if with_src else 0)
    return (n + align - 1) // align * align


# ---- normal-mode combine record ----
@formula
def comb_weights(WX, K):
    """Word of the first top-k weight after the ``WX``-word row."""
    return WX


def combine_record_bytes(hidden: int, k: int) -> int:
    """Bytes of one combine record: ``hidden`` bf16 values and ``k`` fp32 weights, rounded up to 16."""
    return ((comb_weights.host(hidden // 2, k) + k) * 4 + 15) // 16 * 16


# ---- low-latency dispatch record ----
@formula
def ll_payload_words(H, FP8):
    """Words of a row's payload: ``H`` FP8 bytes or ``H`` bf16 values."""
    return H // 4 if FP8 else H // 2


@formula
def ll_scale_words(H, FP8):
    """Words of a row's fp32 scales (one per 128 values; none without FP8)."""
    return H // 128 if FP8 else 0


@formula
def ll_rec_slot(PW, SW):
    """Word holding ``t * K + k`` (the entry combine returns the row to), after ``PW`` payload and ``SW``
    scale words."""
    return PW + SW


def ll_record_words(hidden: int, fp8: bool) -> int:
    """32-bit words of one low-latency dispatch record, rounded up to 4."""
    slot = ll_rec_slot.host(ll_payload_words.host(hidden, fp8), ll_scale_words.host(hidden, fp8))
    return (slot + 1 + 3) // 4 * 4


# ---- the handle tables the notify kernel writes ----
@formula
def t32_channel(R):
    """``channel_prefix_matrix[:, 0]`` in ``t32``."""
    return R * R


@formula
def t32_recv_channel(R):
    """``recv_channel_prefix_matrix[:, 0]`` in ``t32``."""
    return R * R + R


@formula
def t32_words(R):
    return R * R + 2 * R


@formula
def t64_comb_base(R):
    """``comb_base[i]``: where rank ``i``'s rows returned by this rank start in its combine area."""
    return R


@formula
def t64_send_base(R):
    """``send_base[j]``: rows this rank sends to ranks before ``j`` (exclusive prefix)."""
    return 2 * R


@formula
def t64_prefix(R):
    """``prefix[i]``: ``rank_prefix_matrix[i][me]``."""
    return 3 * R


@formula
def t64_n_recv(R):
    """``n_recv``: rows this rank receives."""
    return 4 * R


@formula
def t64_words(R):
    return 4 * R + 1


def split_t32(t32, R: int):
    """Views of ``t32``: ``rank_prefix_matrix`` ``[R, R]``, ``channel_prefix_matrix`` ``[R, 1]``,
    ``recv_channel_prefix_matrix`` ``[R, 1]``."""
    c, rc, end = t32_channel.host(R), t32_recv_channel.host(R), t32_words.host(R)
    rpm, chan, recv_chan = _split(t32, (c, rc - c, end - rc))
    return rpm.view(R, R), chan.view(R, 1), recv_chan.view(R, 1)


def _split(t, sizes):
    """``t``'s first ``sum(sizes)`` elements as consecutive views of ``sizes`` (one ``split``: on a GPU machine
    each view costs microseconds of host time, and a plain dispatch makes a handle of such views)."""
    end = sum(sizes)
    return (t if t.numel() == end else t[:end]).split_with_sizes(sizes)    # (Tensor.split: a Python wrapper)


def split_t64(t64, R: int):
    """Views of ``t64``: ``row_base`` ``[R]``, combine's tables ``[3R]`` (``comb_base``, ``send_base``,
    ``prefix``: what a combine reads) and ``n_recv`` ``[1]``."""
    cb, nr = t64_comb_base.host(R), t64_n_recv.host(R)
    return _split(t64, (cb, nr - cb, t64_words.host(R) - nr))


def split_combine_tables(tables, R: int):
    """Views of the combine tables of :func:`split_t64`: ``comb_base``, ``send_base``, ``prefix``, ``[R]`` each."""
    return _split(tables, (R, R, R))        # (three consecutive blocks: checked below, at import)


assert all((t64_send_base.host(r), t64_prefix.host(r)) == (t64_comb_base.host(r) + r, t64_comb_base.host(r) + 2 * r)
           for r in range(1, 65))


# ---- internode network-leg record ----
#: fields of a network-leg record, in order (:class:`NetRecord`)
NET_FIELDS = ("meta", "row", "scales", "ids", "weights", "local")
NET_META_BYTES = 16     #: the meta block: 4 int32 (global source rank, source token, 0, 0)
#: int32 words of the header a network leg's unit starts with (the one definition of its size; kernels and host
#: read it here). Internode normal mode: a device-counted stream (the capture path: no host exchange) starts
#: with ``[stream words (header included), records, status, culprit rank (-1: none), layout key, reason (the
#: sender's own status), the records the sender's staging area takes from each peer host, 0]``, then (a
#: dispatch without top-k ids) the sender's counts of the destination host's experts, padded to 4 words.
#: Low-latency mode: each chunk starts with int64 ``[call number, call signature, status, rows]``
#: (:mod:`triton_ep.protocol.ll_area`).
NET_HEADER_WORDS = 8
#: header status codes: 0 ok; the sender failed this call (the culprit rank's own error says why); the
#: records did not fit the receiver's staging area (num_worst_tokens too small); the layouts differ
NET_STATUS_FAILED, NET_STATUS_CAPACITY, NET_STATUS_LAYOUT = 1, 2, 3

# ---- internode host path's header ----
#: The host path (internode normal mode's calls that exchange through host memory) sends each peer host a
#: header of int64 words before its streams: ``[status, records, culprit rank (-1: none) | the record layout's
#: key (HOST_KEY_WORDS) | this rank's call card: the operation's code and up to 7 values (HOST_CARD_WORDS) | a
#: disagreement (HOST_DISAGREEMENT_WORDS; status HOST_MISMATCH)]``
HOST_KEY_WORDS, HOST_CARD_WORDS, HOST_DISAGREEMENT_WORDS = 6, 8, 6
HOST_HEADER_WORDS = 3 + HOST_KEY_WORDS + HOST_CARD_WORDS + HOST_DISAGREEMENT_WORDS
#: host header status codes: the call went on, this rank (or one it heard of) failed, found more rows than
#: num_worst_tokens, found ranks that disagree (the disagreement follows), or failed because the culprit rank's
#: process is gone (found by this rank, or heard of)
HOST_OK, HOST_FAILED, HOST_CAPACITY, HOST_MISMATCH, HOST_GONE = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class HostHeader:
    """One host-path header (:data:`HOST_HEADER_WORDS` int64 words, laid out as above), as a rank sends it to an
    RDMA peer and reads the peer's."""

    status: int                             # HOST_OK, HOST_FAILED, HOST_CAPACITY, HOST_MISMATCH or HOST_GONE
    records: int                            # records that follow (0 with a status alone or a failure)
    culprit: int                            # the rank whose own error started a failure (-1: none or unknown)
    key: tuple                              # HOST_KEY_WORDS ints: the record layout's key (zeros: a status alone)
    card: tuple                             # HOST_CARD_WORDS ints: the sender's call card (zeros: none)
    disagreement: tuple                     # HOST_DISAGREEMENT_WORDS ints (status HOST_MISMATCH; else zeros)

    def words(self) -> list:
        """The header as :data:`HOST_HEADER_WORDS` ints (card and disagreement padded with zeros)."""
        return [self.status, self.records, self.culprit, *self.key, *self.card,
                *[0] * (HOST_CARD_WORDS - len(self.card)), *self.disagreement,
                *[0] * (HOST_DISAGREEMENT_WORDS - len(self.disagreement))]

    @classmethod
    def of_words(cls, w) -> "HostHeader":
        """The header ``w`` (:data:`HOST_HEADER_WORDS` ints) holds."""
        w = [int(v) for v in w]
        c = 3 + HOST_KEY_WORDS
        return cls(w[0], w[1], w[2], tuple(w[3:c]), tuple(w[c:c + HOST_CARD_WORDS]),
                   tuple(w[c + HOST_CARD_WORDS:HOST_HEADER_WORDS]))

    def readable(self, group_size: int) -> bool:
        """Whether these words can be a header of this group (a capture-path stream read as one cannot)."""
        return HOST_OK <= self.status <= HOST_GONE and self.records >= 0 and -1 <= self.culprit < group_size


@dataclasses.dataclass(frozen=True)
class NetRecord:
    """Byte layout of one internode network-leg record (every rank alike: checked at each exchange)::

        [ meta (16) | row | scales | top-k ids (int64) | top-k weights (fp32) | is_token_in_rank (1 byte per rank
          of the destination host) ]

    padded to 16 bytes.  A host's records travel as one byte stream cut into the RDMA scheduler's chunks (a
    record may straddle two chunks).  Each field's offset is computed here only (:meth:`span`).

    Attributes:
        row: bytes of an x row (a combine: the bf16 partial sum).  scales: bytes of a row's scales.
        ids: top-k ids (0 for a cached dispatch and a combine).  weights: top-k weights (as many as the ids,
        or 0; a combine: their sums).  local: ranks per host (0 for a cached dispatch and a combine).
    """
    row: int
    scales: int
    ids: int
    weights: int
    local: int

    def _sizes(self):
        return (NET_META_BYTES, self.row, self.scales, 8 * self.ids, 4 * self.weights, self.local)

    @property
    def nbytes(self) -> int:
        """Bytes of one record (a multiple of 16)."""
        return (sum(self._sizes()) + 15) // 16 * 16

    def span(self, field: str):
        """Bytes ``[lo, hi)`` of ``field`` (one of :data:`NET_FIELDS`) in a record."""
        i = NET_FIELDS.index(field)
        lo = sum(self._sizes()[:i])
        return lo, lo + self._sizes()[i]

    def key(self):
        """The layout as a tuple (what two ranks compare)."""
        return (self.row, self.scales, self.ids, self.weights, self.local)

    def key32(self, *extra: int) -> int:
        """The layout (and ``extra`` ints) folded into one non-negative int32: a device-counted stream's
        header carries it, and the receiver compares it with its own."""
        h = 17
        for v in self.key() + tuple(extra):
            h = (h * 1000003 + int(v) + 1) & 0x7FFFFFFF
        return h
