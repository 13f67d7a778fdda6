"""Exceptions raised by triton-ep.

DeepEP raises plain ``RuntimeError`` for communication failures; callers (vLLM, SGLang) catch that.
Our timeout keeps that contract and is also a ``TimeoutError``, so either ``except`` clause works.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union


class EPError(RuntimeError):
    """Base class of triton-ep's runtime errors (a ``RuntimeError``, as DeepEP raises)."""


class EPTimeoutError(EPError, TimeoutError):
    """A peer did not answer within the configured bound.

    Attributes:
        rank: this rank's index in the EP group.
        peer: the group rank that did not answer (``None`` when unknown; the first one when several did not).
        peers: every group rank that did not answer, where known (a list; ``[peer]`` or ``[]``).
        stage: the step that waited, e.g. ``"dispatch/exchange counts"`` (a host rendezvous) or
            ``"combine/reduce (round 12)"`` (a kernel's wait; the round is the Buffer's round counter).
        channel: the channel or queue pair index, where there is one.
        timeout_s: the bound that was exceeded, in seconds.
    """

    def __init__(self, rank: int, peer: Union[None, int, Sequence[int]], stage: str, timeout_s: float,
                 channel: Optional[int] = None) -> None:
        peers = [] if peer is None else ([int(p) for p in peer] if hasattr(peer, "__iter__") else [int(peer)])
        self.peers = peers
        self.rank, self.peer, self.stage, self.channel, self.timeout_s = rank, (peers[0] if peers else None), \
            stage, channel, timeout_s
        where = f" channel {channel}" if channel is not None else ""
        who = (f"peer {peers[0]}" if len(peers) == 1 else f"peers {', '.join(map(str, peers))}" if peers
               else "a peer (unknown which)")
        super().__init__(f"triton-ep timeout: rank {rank} waited {timeout_s:.3g} s for {who} "
                         f"at stage '{stage}'{where}; the peer stopped answering or never called it")


class EPCapacityError(EPError, ValueError):
    """More rows arrive than the caller declared room for (e.g. ``num_worst_tokens``).

    Raised on every rank of the group, so none is left waiting.
    """


class EPRemoteError(EPError):
    """Another rank of the group failed the same collective call (bad input there); raised here so
    that no rank is left waiting."""
