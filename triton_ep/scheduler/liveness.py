"""The proxy's liveness probes (:class:`Liveness`): when the next round goes, which peers have a probe in flight, and
how a failed request on a data QP is told apart from a peer that is gone (the package's docstring, "Liveness
probes")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, Optional, Set

from .faults import ProxyError

#: wr_id tag of a liveness probe (:meth:`Scheduler._probe`; the low bits hold the peer)
TAG_PROBE = 1 << 59
#: seconds between two liveness probes to a peer (one at a time per peer)
PROBE_S = 0.2
#: the completion status of a request that the peer's QP never acknowledged (retries exhausted): the peer is gone
STATUS_GONE = "IBV_WC_RETRY_EXC_ERR"
#: the completion status of the requests a QP in the error state still held (after that QP's first error)
STATUS_FLUSHED = "IBV_WC_WR_FLUSH_ERR"
#: the prepared liveness probe's key (QP 0 of each peer)
PROBE_KEY = "probe"


def probe_request(peer: int) -> tuple:
    """The work requests of one liveness probe to ``peer``, as ``Transport.post_prepared(peer, 0, ...)`` takes them:
    the prepared probe (:data:`PROBE_KEY`: this rank's 8-byte fault word into the peer's ``FAULT`` word), signalled,
    ``wr_id`` :data:`TAG_PROBE` | ``peer``. The sweep's probes and the close words (which ride on it) post it."""
    return ((PROBE_KEY, 8, 0, TAG_PROBE | peer, True),)


@dataclass
class Liveness:
    """The state of one scheduler's liveness probes, and their rules. The scheduler posts the probes
    (:meth:`Scheduler._probe`: one signalled 8-byte WRITE on QP 0 of a peer) and hands their completions here.

    Attributes:
        next_at: when the next round of probes goes (monotonic seconds; 0: at the next sweep).
        probing: the peers with a probe in flight (one at a time per peer).
        suspects: peers one of whose work requests completed with ``IBV_WC_RETRY_EXC_ERR`` on a data QP, each with
            the :class:`ProxyError` that names that QP: a probe posted after it (``confirming``) tells a QP that
            failed (the probe is acknowledged: that error is raised) from a peer that is gone (it fails too:
            ``PeerGoneError``).
        confirming: the suspects with such a probe in flight.
    """
    next_at: float = 0.0
    probing: Set[int] = field(default_factory=set)
    suspects: Dict[int, ProxyError] = field(default_factory=dict)
    confirming: Set[int] = field(default_factory=set)

    def round(self, now: float, peers: Iterable[int], masked: Callable[[int], bool]) -> Iterator[int]:
        """Start a round at ``now`` (the next one :data:`PROBE_S` later): the peers to probe, in ``peers``' order,
        each looked at as it comes: those with no probe in flight and not ``masked``."""
        self.next_at = now + PROBE_S
        return (p for p in peers if p not in self.probing and not masked(p))

    def posted(self, peer: int) -> None:
        """A probe to ``peer`` was posted: it is in flight, and confirms a suspicion on ``peer`` if there is one."""
        self.probing.add(peer)
        if peer in self.suspects:
            self.confirming.add(peer)

    def answered(self, peer: int, ok: bool) -> Optional[ProxyError]:
        """The probe to ``peer`` completed, acknowledged (``ok``) or not. Where ``peer`` is a suspect the next round
        goes at once; returns its data QP's :class:`ProxyError` where a confirming probe was acknowledged (the peer
        lives: that QP failed), for the caller to raise; else ``None`` (an error completion is the caller's)."""
        self.probing.discard(peer)
        if peer in self.suspects:
            self.next_at = 0.0            # (confirm at the next sweep)
            if ok and peer in self.confirming:
                return self.suspects[peer]
        return None

    def suspect(self, peer: int, error: ProxyError) -> None:
        """A work request to ``peer`` on a data QP completed with :data:`STATUS_GONE`: that QP failed, or the whole
        peer is gone; the next probe, posted at once, tells (the first ``error`` of a peer is kept)."""
        if peer not in self.suspects:
            self.suspects[peer] = error
            self.next_at = 0.0
