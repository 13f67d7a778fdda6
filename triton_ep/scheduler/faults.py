"""Where the RDMA proxy fails: the stages it names, the fault word it writes into each peer's ``FAULT`` slot, and
its errors (:class:`ProxyError`, :class:`ProxyRemoteError`, :class:`PeerGoneError`, :class:`RootCauseError`)."""
from __future__ import annotations

from typing import Optional, Tuple

from triton_ep.errors import EPError, EPRemoteError
from triton_ep.protocol import signal_header as F

#: stages a proxy error names (also carried in fault words): codes and names from the protocol's one table
STAGE_POST, STAGE_SEND_CQE, STAGE_RECV_CQE = F.STAGE_PROXY_POST, F.STAGE_PROXY_SEND_CQE, F.STAGE_PROXY_RECV_CQE
STAGE_CREDIT, STAGE_SEND_WAIT, STAGE_INTERNAL = F.STAGE_PROXY_CREDIT, F.STAGE_PROXY_SEND_WAIT, F.STAGE_PROXY
STAGE_NAMES = F.STAGE_NAMES


def stage_code(ex: Optional[BaseException]) -> int:
    """The stage code (``STAGE_*``) a fault word carries for error ``ex``: the code whose name its ``stage`` starts
    with, else :data:`STAGE_INTERNAL`."""
    stage = getattr(ex, "stage", None) or STAGE_NAMES[STAGE_INTERNAL]
    return next((k for k, v in STAGE_NAMES.items() if stage.startswith(v)), STAGE_INTERNAL)


def fault_word(stage: int, channel: Optional[int], qp: Optional[int], gone: Optional[int] = None,
               root: Optional[Tuple[int, str]] = None) -> int:
    """The 64-bit word a failed proxy writes into each peer's ``FAULT`` slot: bit 62 set, the stage in
    bits 40..47, channel + 1 in 24..39 and QP + 1 in 8..23 (0: none); where it failed because a peer is gone
    (:class:`PeerGoneError`), that peer's rank + 1 in bits 48..61 (:func:`fault_gone`). Where it failed because of a
    rank the scheduler has no number for (``root``: ``(rank, how)``, :data:`ROOT_GONE` or :data:`ROOT_FAILED`, the rank
    in the numbering of the mode that failed it, e.g. a global rank on this rank's host in internode normal mode,
    whose network leg numbers one rank per host: :func:`root_cause`), that rank + 1 in bits 48..61 instead, with
    :data:`MODE_ROOT` set and ``how`` in bit 1 (:func:`mode_root`).

    Raises:
        ValueError: both ``gone`` and ``root``, ``root``'s rank past bits 48..61, or ``how`` another value.
    """
    ch = 0 if channel is None else channel + 1
    q = 0 if qp is None else qp + 1
    g = 0 if gone is None else gone + 1
    word = (1 << 62) | (stage << 40) | (ch << 24) | (q << 8)
    if root is None:
        return word | (g << 48)
    rank, how = root
    if gone is not None or how not in (ROOT_GONE, ROOT_FAILED) or not 0 <= rank < _ROOT_MAX:
        raise ValueError(f"a fault word names a gone peer or a root of the mode's numbering (a rank below "
                         f"{_ROOT_MAX}, gone or failed), not gone={gone!r} and root={root!r}")
    return word | ((rank + 1) << 48) | MODE_ROOT | _ROOT_BITS[how]


def fault_gone(word: int) -> Optional[int]:
    """The rank (the scheduler's) a :func:`fault_word` says is gone, or ``None`` (none; or its root is of the mode's
    numbering, :data:`MODE_ROOT`: :func:`mode_root`)."""
    g = (word >> 48) & 0x3FFF
    return g - 1 if g and not word & MODE_ROOT else None


#: bit 0 of a fault word: a close word, written by a proxy whose rank destroys its Buffer (:func:`close_word`)
CLOSED = 1
#: how the rank a close word names (its root, bits 48..61) left: its proxy failed (bit 1 of the word), it is gone
#: (neither bit), or it destroyed its Buffer first (a clean close, bit 2) and the closing rank failed because of that
ROOT_FAILED, ROOT_GONE, ROOT_CLOSED = "failed", "gone", "closed"
_ROOT_BITS = {ROOT_FAILED: 2, ROOT_GONE: 0, ROOT_CLOSED: 4}
#: bit 3 of a fault word: bits 48..61 hold a root of the mode's numbering, not a rank of the scheduler's
#: (:func:`fault_word`'s ``root``, :func:`mode_root`); how it left in bit 1, as a close word's
MODE_ROOT = 8
#: the ranks a root of the mode's numbering may name (bits 48..61 hold the rank + 1)
_ROOT_MAX = 0x3FFF


def close_word(stage: int, root: Optional[int] = None, how: Optional[str] = ROOT_FAILED) -> int:
    """The fault word a proxy writes into each peer's ``FAULT`` slot as its rank destroys its Buffer, where it has
    written no fault word before: bit :data:`CLOSED` set; ``root``, where it closes after an error, the rank that error
    named (bits 48..61, as :func:`fault_gone`'s) and ``how`` that rank left (:data:`ROOT_FAILED`, :data:`ROOT_GONE`,
    :data:`ROOT_CLOSED`: :func:`close_root`). A peer then reads the root cause (:func:`parse_close`) instead of taking
    the closing rank for dead once its QPs go, or for the rank that left first.

    Raises:
        ValueError: ``root`` given and ``how`` none of the three.
    """
    if root is not None and how not in _ROOT_BITS:
        raise ValueError(f"how must be one of {sorted(_ROOT_BITS)}, got {how!r}")
    return fault_word(stage, None, None, root) | CLOSED | (0 if root is None else _ROOT_BITS[how])


def _how(word: int) -> str:
    """How the root a word names left: :data:`ROOT_FAILED` (bit 1), :data:`ROOT_CLOSED` (bit 2), else
    :data:`ROOT_GONE`."""
    return (ROOT_FAILED if word & _ROOT_BITS[ROOT_FAILED] else
            ROOT_CLOSED if word & _ROOT_BITS[ROOT_CLOSED] else ROOT_GONE)


def parse_close(word: int) -> Tuple[Optional[int], Optional[str]]:
    """``(root, how)`` of a :func:`close_word`: ``(None, None)`` for a clean close, else the rank it names and how that
    rank left (:data:`ROOT_FAILED`, :data:`ROOT_GONE` or :data:`ROOT_CLOSED`)."""
    root = fault_gone(word)
    if root is None:
        return None, None
    return root, _how(word)


def mode_root(word: int) -> Optional[Tuple[int, str]]:
    """``(rank, how)`` of the root of the mode's numbering that a :func:`fault_word` names (:data:`MODE_ROOT`), or
    ``None``."""
    if not word & MODE_ROOT:
        return None
    return ((word >> 48) & 0x3FFF) - 1, _how(word)


def root_cause(ex: BaseException, rank: int, how: str) -> BaseException:
    """``ex``, which a mode passes to :meth:`Scheduler.fail <triton_ep.scheduler.Scheduler.fail>`, marked with the rank
    (the mode's numbering, one the scheduler has no number for) whose death (:data:`ROOT_GONE`) or own failure
    (:data:`ROOT_FAILED`) it passes on: the fault word names it (:data:`MODE_ROOT`), and the peers raise
    :class:`RootCauseError` carrying it, for their mode to name. The mark (``ex.root_cause``) crosses to a proxy
    process with the error."""
    ex.root_cause = (int(rank), how)
    return ex


def fails_at_once(word: int) -> bool:
    """Whether ``FAULT`` word ``word`` (non-zero) fails the proxy that reads it at its next sweep: a fault word, or a
    close word naming a root that failed or is gone; not a clean close, nor a close after a peer's clean close (its
    reader goes on until its probes find QPs gone: what was published has been placed)."""
    return not word & CLOSED or parse_close(word)[1] in (ROOT_FAILED, ROOT_GONE)


def parse_fault(word: int) -> Tuple[int, Optional[int], Optional[int]]:
    """``(stage, channel, qp)`` of a :func:`fault_word` (channel / QP ``None`` where it named none)."""
    ch, q = (word >> 24) & 0xFFFF, (word >> 8) & 0xFFFF
    return (word >> 40) & 0xFF, (ch - 1 if ch else None), (q - 1 if q else None)


class ProxyError(EPError):
    """The RDMA proxy of ``rank`` failed: the peer, channel and QP index (towards that peer) concerned, the
    stage, and why (a completion status, a verbs error, a bound that passed).  Each may be ``None``."""

    def __init__(self, rank: int, peer: Optional[int], channel: Optional[int], qp: Optional[int], stage: str,
                 why: str) -> None:
        self.rank, self.peer, self.channel, self.qp, self.stage, self.why = rank, peer, channel, qp, stage, why
        where = ", ".join(f"{k} {v}" for k, v in (("peer", peer), ("channel", channel), ("QP", qp)) if v is not None)
        super().__init__(f"triton-ep scheduler: rank {rank} failed at stage '{stage}' ({where or 'no peer'}): {why}")


class ProxyRemoteError(ProxyError, EPRemoteError):
    """A peer's proxy failed and said so (its fault word); ``peer``/``channel``/``qp``/``stage`` are its."""


class PeerGoneError(ProxyError, EPRemoteError):
    """Rank ``peer`` is gone: a work request to it completed with ``IBV_WC_RETRY_EXC_ERR`` (its QP never
    acknowledged it within the QP's retries: its process ended and its QPs with it, or its host or the path to it
    is down), seen by this proxy (``told_by`` None; ``channel``/``qp``: the QP) or by peer ``told_by``, whose fault
    word named it. ``stage``: where this rank waited when it learnt of it (:meth:`Scheduler.check` fills it in
    from the ring's record or the host wait; until then the proxy's stage). ``failed_rank`` and ``dead_ranks``
    (``[peer]``) name the gone rank as :func:`triton_ep.transport.liveness.dead_error` does within a host. Ranks are
    the scheduler's (its transport's) until the mode renames them (:meth:`renamed`)."""

    def __init__(self, rank: int, peer: int, channel: Optional[int], qp: Optional[int], stage: str, why: str,
                 told_by: Optional[int] = None, placed: bool = False) -> None:
        self.rank, self.peer, self.channel, self.qp, self.stage, self.why = rank, peer, channel, qp, stage, why
        self.failed_rank, self.dead_ranks, self.told_by, self.placed = peer, [peer], told_by, placed
        heard = "" if told_by is None else f"; rank {told_by} found it and told this rank"
        EPError.__init__(self, f"triton-ep: rank {rank}: rank {peer}'s process is gone or its host is unreachable "
                               f"({why}{heard}) while this rank waited at stage '{stage}'; this call's outputs here "
                               f"are not valid; destroy() and rebuild the Buffer")

    def renamed(self, rank: int, peer: int, told_by: Optional[int], where: str = "",
                stage: Optional[str] = None) -> "PeerGoneError":
        """The same error with other rank numbers (the mode's: global ranks), ``where`` added to the reason and
        (given) another ``stage``."""
        return PeerGoneError(rank, peer, self.channel, self.qp, self.stage if stage is None else stage,
                             f"{self.why}; {where}" if where else self.why, told_by, self.placed)


class RootCauseError(ProxyRemoteError):
    """Peer ``peer``'s proxy failed because of rank ``root``, a rank of the mode's numbering (not the scheduler's: its
    fault word carried it, :data:`MODE_ROOT`), whose process is gone (``how`` :data:`ROOT_GONE`) or that failed on its
    own (:data:`ROOT_FAILED`); e.g. in internode normal mode a host mate of ``peer``, which the network leg, one rank
    per host, does not number. ``stage``: where this rank waited when it learnt of it (:meth:`Scheduler.check`
    fills it in, as for :class:`PeerGoneError`; until then the peer's stage). The mode names ``root``
    (:meth:`triton_ep.modes.internode.rings.Rings.global_error`)."""

    def __init__(self, rank: int, peer: int, channel: Optional[int], qp: Optional[int], stage: str, why: str,
                 root: int, how: str, placed: bool = False) -> None:
        super().__init__(rank, peer, channel, qp, stage, why)
        self.root, self.how, self.placed = root, how, placed


class PeerClosedError(ProxyRemoteError):
    """Rank ``peer`` destroyed its Buffer (its close word, :func:`close_word`, came before its QPs went; or a peer that
    closed after it, because of it, named it in its own close word, :data:`ROOT_CLOSED`) while this rank's network
    leg still needed it: its process lives, it is not gone (:class:`PeerGoneError`)."""


def placed_error(ex: BaseException, stage: Optional[str]) -> BaseException:
    """``ex``, where it is a :class:`PeerGoneError` or :class:`RootCauseError` not yet placed, at the stage this rank
    waited at (``stage``: :meth:`Scheduler.wait_stage`; ``None``: the proxy's stage stays)."""
    if isinstance(ex, RootCauseError) and not ex.placed:
        return RootCauseError(ex.rank, ex.peer, ex.channel, ex.qp, ex.stage if stage is None else stage, ex.why,
                              ex.root, ex.how, placed=True)
    if not isinstance(ex, PeerGoneError) or ex.placed:
        return ex
    out = ex.renamed(ex.rank, ex.peer, ex.told_by, stage=stage)
    out.placed = True
    return out


def close_root(ex: Optional[BaseException], rank: int) -> Tuple[Optional[int], Optional[str]]:
    """``(root, how)`` a proxy of ``rank`` that closes after error ``ex`` (``None``: none) names in its close word
    (:func:`close_word`): ``(None, None)`` after no error; the closed peer (:data:`ROOT_CLOSED`) after a
    :class:`PeerClosedError` (which names the rank that left first); the gone peer (:data:`ROOT_GONE`) after a
    :class:`PeerGoneError`; the failed peer (:data:`ROOT_FAILED`) after another :class:`ProxyRemoteError`; else
    ``rank`` itself (:data:`ROOT_FAILED`: its own proxy failed)."""
    if ex is None:
        return None, None
    peer = getattr(ex, "peer", None)
    if isinstance(ex, PeerClosedError) and peer is not None:
        return peer, ROOT_CLOSED
    if isinstance(ex, PeerGoneError):
        return peer, ROOT_GONE
    if isinstance(ex, ProxyRemoteError) and peer is not None:
        return peer, ROOT_FAILED
    return rank, ROOT_FAILED
