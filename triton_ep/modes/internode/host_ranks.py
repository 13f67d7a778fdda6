"""This host's part of an internode normal-mode call: the forwarding leg, an intranode call of the host's ranks
over their shared buffers (:class:`HostRanks`). Its errors number the host's ranks from 0; here they get global
rank numbers, and a disagreement the host's ranks found is raised as the ``ValueError`` naming it."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from ...errors import EPCapacityError, EPError
from ...kernels import flags as F
from ...protocol import call_card
from ...protocol.signal_header import STAGE_CAPACITY
from ...runtime import Runtime
from ...runtime import hosts as hosts_mod
from ...scheduler.faults import ROOT_FAILED, ROOT_GONE, root_cause
from ..intranode import Intranode

#: the handle of a local call a rank takes only to fail it (:meth:`HostRanks.skip`)
_SKIP = object()
#: the forwarding leg's dispatches (of records) as disagreements name them (:data:`hosts.FORWARDED_DISPATCH`)
_FORWARDED_CODES = {call_card.DISPATCH: hosts_mod.FORWARDED_DISPATCH,
                    call_card.DISPATCH_WORST: hosts_mod.FORWARDED_DISPATCH,
                    call_card.CACHED_DISPATCH: hosts_mod.FORWARDED_CACHED}


class HostRanks:
    """This host's ranks as one internode call's forwarding leg sees them.

    Args:
        local_rt: this host's runtime (its ranks' shared buffers; closed by :meth:`close`).
        hosts: the group's :class:`~triton_ep.runtime.hosts.Hosts`. host, local_index: this rank's.
        calls: the Buffer's internode call count so far (equal on ranks in step): it stamps the disagreements
            posted in the call cards.
    """

    def __init__(self, local_rt: Runtime, hosts: hosts_mod.Hosts, host: int, local_index: int,
                 calls: Callable[[], int]) -> None:
        self.local_rt: Optional[Runtime] = local_rt
        self.hosts, self.host, self.local_index, self.calls = hosts, host, local_index, calls
        self.ranks = list(hosts.ranks(host))        # the global rank of each local index
        self.local = Intranode(local_rt)
        #: what broke this host's forwarding leg for good, as :func:`~triton_ep.scheduler.root_cause` takes it: the
        #: global rank whose process is gone (``"gone"``) or whose failure word (``"failed"``) the first error
        #: :meth:`annotate` saw after the leg broke named (``None``: none, or not broken; set once)
        self.root: Optional[Tuple[int, str]] = None
        self._root_set = False

    def close(self) -> None:
        """Release the host's shared buffers. Idempotent."""
        local_rt, self.local_rt = self.local_rt, None
        if local_rt is not None:
            local_rt.close()

    def run(self, gen, forwarded: bool = False):
        """Run an intranode call of this host's ranks (``forwarded``: the forwarding leg's dispatch of records,
        whose call-card fields are then named as the records', :data:`hosts.FORWARDED_DISPATCH`). Its errors
        number the host's ranks from 0: they get global rank numbers. A disagreement the
        host's ranks found, or one a rank of the host found with its RDMA peer and posted before it failed its
        part of this call (:meth:`skip`), is raised as a ``ValueError`` naming it (with ``ex.disagreement``,
        which the header exchange passes on)."""
        try:
            return self.local_rt.run(gen)
        except (EPError, ValueError) as ex:     # (a disagreement of the host's ranks is a ValueError)
            d = self.disagreement(forwarded)
            if d is not None:
                raise d.error(self.ranks[self.local_index]) from ex
            self.annotate(ex)
            raise

    def disagreement(self, forwarded: bool = False) -> Optional[hosts_mod.Disagreement]:
        """What this host's ranks disagree on in the running call: one they posted (:meth:`skip`), else
        the first difference between their call cards of this call (local rank 0's against the others', in
        rank order: the same on every rank of the host), else ``None``."""
        comm = self.local_rt.comm if self.local_rt is not None else None
        if comm is None or comm.ctrl is None:
            return None
        ranks = self.ranks
        cards = [comm.card(i) for i in range(len(ranks))]
        for c in cards:
            d = hosts_mod.Disagreement.posted(c, self.calls())
            if d is not None:
                return d
        base = cards[0]
        for i in range(1, len(ranks)):
            c = cards[i]
            if int(c[0]) != int(base[0]):       # (not at the same call: a rank that failed before its card)
                continue
            vals = [[int(v) for v in card_[1:call_card.FAILED_WORD]] for card_ in (base, c)]
            if forwarded:       # (the forwarding leg's dispatches move records: their fields say so)
                vals = [[_FORWARDED_CODES.get(v[0], v[0])] + v[1:] for v in vals]
            d = hosts_mod.Disagreement.of_cards(vals[0], vals[1], ranks[0], ranks[i])
            if d is not None:
                return d
        return None

    def annotate(self, ex: EPError) -> None:
        """Give an error of this host's intranode runtime, which numbers the host's ranks from 0, global rank
        numbers: in its message, its ``rank`` / ``peer`` / ``peers`` (``EPTimeoutError``), ``failed_rank`` /
        ``dead_ranks`` (a failure word, a dead peer: :func:`triton_ep.transport.liveness.dead_error`) and, for a
        failure word or a dead peer, ``ex.culprit`` (the global rank that posted it or died, passed on in the status
        header); the first such error after the leg broke for good sets :attr:`root`. Once per error."""
        if getattr(ex, "_ep_global", False):
            return
        ex._ep_global = True
        ranks = self.ranks

        def glob(r):
            return ranks[r] if isinstance(r, int) and 0 <= r < len(ranks) else r
        failed = getattr(ex, "failed_rank", None)
        if failed is not None and 0 <= failed < len(ranks) and not hasattr(ex, "culprit"):
            ex.culprit = ranks[failed]
        for name in ("rank", "peer", "failed_rank"):
            if isinstance(getattr(ex, name, None), int):
                setattr(ex, name, glob(getattr(ex, name)))
        for name in ("peers", "dead_ranks"):
            if isinstance(getattr(ex, name, None), list):
                setattr(ex, name, [glob(r) for r in getattr(ex, name)])
        comm = self.local_rt.comm if self.local_rt is not None else None
        if not self._root_set and comm is not None and comm.broken:
            self._root_set = True
            dead, culprit = getattr(ex, "dead_ranks", None), getattr(ex, "culprit", None)
            if dead:
                self.root = (dead[0], ROOT_GONE)
            elif isinstance(culprit, int) and culprit >= 0 and culprit != ranks[self.local_index]:
                self.root = (culprit, ROOT_FAILED)
        if ex.args and isinstance(ex.args[0], str):
            ex.args = (f"{hosts_mod.global_ranks(ex.args[0], ranks)} (in the forwarding leg of host {self.host}: "
                       f"ranks {ranks})",) + ex.args[1:]

    def rooted(self, ex: BaseException) -> BaseException:
        """``ex``, an error that fails the network leg because this host's forwarding leg failed, marked with
        :attr:`root` where there is one (:func:`~triton_ep.scheduler.root_cause`): its fault word then names that
        rank (a host mate, which the network leg does not number), so the RDMA peers name it too, not this rank."""
        return ex if self.root is None else root_cause(ex, *self.root)

    def leave(self, err: Optional[BaseException] = None) -> None:
        """The network leg failed for good (the scheduler's error is sticky): leave this host's group, so
        its ranks' later calls and re-synchronisations raise at once instead of waiting for this rank.
        ``err`` an ``EPCapacityError``: the ``GONE`` word says so, and a rank of the host that hears of it
        before finding it itself raises ``EPCapacityError`` as well."""
        if self.local_rt is not None and self.local_rt.sig is not None:
            stage = STAGE_CAPACITY if isinstance(err, EPCapacityError) else int(F.STAGE_FAILED)
            self.local_rt.sig.leave(stage)

    def skip(self, kind: str, err: Optional[BaseException] = None) -> None:
        """This rank leaves the running call before its host's intranode leg (``kind``: ``"dispatch"``,
        ``"cached"`` or ``"combine"``): it still takes that call's steps and fails at their argument check,
        as a rank of one host that rejects its arguments does, so the ranks of its host that wait for it stop
        at once (its failure word: they raise ``EPRemoteError``) and every rank's call counters stay in step.
        What that local call raises is dropped: the caller raises this rank's own error ``err``. Where ``err`` is
        a disagreement (``err.disagreement``), it is first posted in this rank's call card, so the host's ranks
        raise it too (:meth:`run`), not ``EPRemoteError``."""
        if self.local_rt is None or self.local_rt.comm is None:
            return
        d = getattr(err, "disagreement", None)
        if d is not None and self.local_rt.comm.ctrl is not None:
            d.post(self.local_rt.comm.card(self.local_index), self.calls())
        steps = {"dispatch": lambda: self.local.dispatch_steps(None),
                 "cached": lambda: self.local.dispatch_steps(None, handle=_SKIP),
                 "combine": lambda: self.local.combine_steps(None, _SKIP)}[kind]
        try:
            self.local_rt.run(steps())
        except Exception:   # noqa: BLE001 - the expected argument error, or the host's earlier failure
            pass
