"""Disagreements on internode normal mode's capture path (docs/design.md, "Error model"): the ranks' call cards in
the group's key-value store, on the error path only.

A rank finds that ranks disagree on a capture-path call where a peer host's stream has another record layout (its
header's key) or where its host's forwarding leg compares call cards; the others only see the network leg end. So,
on this error path only, each failing rank posts its call card in the group's store and the rank that found a
disagreement names it from the two cards and tells it there, before the failure can reach anyone (the fault word,
the GONE word): every rank then raises the same ``ValueError``, naming the field and two ranks' values.
"""
from __future__ import annotations

import pickle
import time
from typing import Optional

from ...runtime.hosts import Disagreement

#: seconds a rank that found a disagreement waits at most for the other rank's call card (``timeout_s`` if less)
CARD_WAIT_S = 10.0


class CaptureCards:
    """This rank's capture-path call card and the store where ranks that disagree exchange theirs.

    Args:
        rt: the Buffer's group-wide runtime (``rank``, ``timeout_s``).

    Attributes:
        card: this rank's running capture-path call as disagreements name it: ``(call-card code, value, ...)``
            (:mod:`triton_ep.protocol.call_card`; ``()`` until its arguments passed their checks).
        raised: this rank raised the disagreement that ended the network leg (later calls raise the leg's own
            error).
    """

    def __init__(self, rt) -> None:
        self.rt = rt
        self.card: tuple = ()
        self.raised = False
        #: the group's key-value store and this Buffer's prefix there (:meth:`open`)
        self.store, self.prefix = None, ""

    def open(self, store, prefix: str) -> None:
        """Use ``store`` (the group's; ``None``: none, the messages are then plainer) under keys of ``prefix`` (the
        same on every rank)."""
        self.store, self.prefix = store, prefix

    def post(self) -> None:
        """Post this rank's call card (``()`` where its call failed its own checks). Never raises."""
        try:
            if self.store is not None:
                self.store.set(f"{self.prefix}card/{self.rt.rank}", pickle.dumps(tuple(self.card)))
        except Exception:   # noqa: BLE001 - an error path: the peers' messages are then plainer
            pass

    def card_of(self, rank: int) -> Optional[tuple]:
        """Rank ``rank``'s call card as it posted it (:meth:`post`), waiting at most ``min(timeout_s,
        CARD_WAIT_S)``; ``None`` where it did not come."""
        store, key = self.store, f"{self.prefix}card/{rank}"
        if store is None:
            return None
        deadline = time.monotonic() + min(self.rt.timeout_s, CARD_WAIT_S)
        try:
            while not store.check([key]):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.002)
            return pickle.loads(store.get(key))
        except Exception:   # noqa: BLE001 - an error path
            return None

    def compare(self, peer: int) -> Optional[Disagreement]:
        """The first difference between this rank's call and rank ``peer``'s (this rank's card posted first, so
        ``peer`` can do the same), or ``None``."""
        self.post()
        mine, theirs = tuple(self.card), self.card_of(peer)
        if not mine or not theirs:
            return None
        return Disagreement.of_cards(mine, theirs, self.rt.rank, peer)

    def tell(self, ex: BaseException) -> None:
        """Post the disagreement ``ex`` names (or its text) where every rank looks when the network leg fails
        (:meth:`told`). Never raises."""
        try:
            d = getattr(ex, "disagreement", None)
            if self.store is not None and not self.store.check([self.prefix + "disagreement"]):
                self.store.set(self.prefix + "disagreement",
                               pickle.dumps(("d", d.words()) if d is not None else ("t", str(ex))))
        except Exception:   # noqa: BLE001 - an error path
            pass

    def told(self) -> Optional[ValueError]:
        """The ``ValueError`` of a disagreement a rank told (:meth:`tell`), for this rank to raise in place of the
        network leg's failure it heard of; ``None``: none was told (a look at the store, no wait)."""
        try:
            key = self.prefix + "disagreement"
            if self.store is None or not self.store.check([key]):
                return None
            kind, what = pickle.loads(self.store.get(key))
        except Exception:   # noqa: BLE001 - an error path
            return None
        d = Disagreement.of_words(what) if kind == "d" else None
        ex = d.error(self.rt.rank) if d is not None else ValueError(
            f"rank {self.rt.rank}: ranks disagree on a num_worst_tokens call across hosts: {what}")
        ex._ep_mismatch = True
        return ex

    def as_disagreement(self, ex: BaseException) -> BaseException:
        """The error this rank raises for ``ex``, a failure of its capture-path call: a disagreement its host's
        forwarding leg found named by the two ranks' own call cards (not the forwarded records'); a failure it
        heard of as the disagreement a rank told (:meth:`told`); else ``ex``."""
        if self.raised:
            return ex
        d = getattr(ex, "disagreement", None)
        me = self.rt.rank
        if d is not None and isinstance(ex, ValueError):
            other = d.rank_b if d.rank_a == me else d.rank_a if d.rank_b == me else None
            better = self.compare(other) if other is not None else None
            told = better.error(me) if better is not None else ex
            told._ep_mismatch = True
            return told
        if isinstance(ex, (ValueError, TypeError)):
            return ex           # (this rank's own rejection)
        return self.told() or ex
