"""Normal mode within one host (DeepEP V1's intranode ``dispatch`` / ``combine`` and ``get_dispatch_layout``).

:class:`Intranode` owns this mode's steps; its checked arguments (:class:`DispatchArgs`) and its handle
(:class:`DispatchHandle`) are in :mod:`.intranode_args`, the replay of a call of the last shapes in
:mod:`.intranode_replay`; what it shares with other modes comes from the :class:`~triton_ep.runtime.Runtime`
it is given. Each collective call is a generator of steps (:meth:`Intranode.dispatch_steps`,
:meth:`Intranode.combine_steps`) that ``Runtime.run`` drives for a real rank and
:func:`triton_ep.testing.lockstep` for ranks simulated in one process. The protocol of one call (layout,
notify, rounds of send and receive launches) is in docs/design.md, section 3.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional, Tuple

import torch

from .. import kernels
from ..config import EventOverlap
from ..errors import EPError, EPTimeoutError
from ..kernels import notify as NT
from ..kernels import params as LP
from ..kernels import pdl
from ..kernels.combine import combine_fused
from ..kernels.combine import record_bytes as combine_record_bytes
from ..kernels.dispatch import dispatch_fused
from ..kernels.geometry import as_words, fused_switch, use_fused
from ..kernels.geometry import record_words as dispatch_record_words
from ..protocol import call_card as card
from ..protocol import records
from ..runtime import Runtime, call_signature, steps
from ..runtime.checks import check_config, check_event, isint
from . import intranode_args as args
from . import intranode_replay as replay
from .intranode_args import Counts, DispatchArgs, DispatchHandle, Outputs, card_values, version_of

Tensor = torch.Tensor

#: what the internode calls say within one host
_ONE_HOST = "{name}: this Buffer's ranks are all on one host; call {call}() (it picks the mode)"
_MAX_ROWS = 1 << 62          # "no capacity limit" for the notify of a plain dispatch


class Intranode:
    """Normal mode within one host for one Buffer.

    Args:
        rt: the Buffer's runtime (shared buffers, signals, streams, checks).
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        #: host-visible block of a plain dispatch's notify results, and the last dispatch number sent there
        self._notify_res: Optional[Tensor] = None
        self._notify_np = None
        self._notify_seq = 0
        #: the last get_dispatch_layout: (weak ref to its topk_idx, its version, E, is_token_in_rank's
        #: version, the layout), for the dispatch that passes it back
        self._layout_memo = None
        #: the plan the next get_dispatch_layout of the same shapes replays (:mod:`.intranode_replay`)
        self.replay_layout = None

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False,
                            tokens_per_host: Optional[Callable[[Tensor], Tensor]] = None
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """``Buffer.get_dispatch_layout`` (same arguments and results): the routing layout, kept for the
        dispatch that passes it back. ``tokens_per_host`` (internode mode) computes the second result,
        ``num_tokens_per_rdma_rank``, from ``is_token_in_rank`` on the layout's stream (else ``None``). Within one
        host a layout of the last layout's shapes again is launched by its plan (:mod:`.intranode_replay`)."""
        if tokens_per_host is None and self.replay_layout is not None:
            out = replay.layout(self, topk_idx, num_experts, previous_event, async_finish)
            if out is not None:     # (a layout of the last layout's shapes again: its plan launched it)
                return out
        self.rt.live()
        idx = self.rt.check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (None, None))
        if idx.shape[1] == 0:       # (as dispatch refuses it: no layout of a call that cannot be made)
            raise ValueError("topk_idx must have at least one column")
        self.rt.check_num_experts(num_experts)
        check_event(previous_event)
        self.rt.check()
        self.rt.begin(previous_event, async_finish)
        with self.rt.comm_ctx():
            lay, plan = kernels.routing_layout(idx, num_experts, self.rt.group_size, plan=True)
            per_rank, per_expert, in_rank = lay[:3]
            per_host = tokens_per_host(in_rank) if tokens_per_host is not None else None
        if tokens_per_host is None and isint(num_experts):
            # the next layout of a topk_idx of this shape and dtype replays these launches (.intranode_replay)
            self.replay_layout = replay.LayoutCall(self.rt, idx, int(num_experts), plan)
        self.remember_layout(idx, num_experts, lay)
        return per_rank, per_host, per_expert, in_rank, self.rt.end(async_finish,
                                                                    (idx, per_rank, per_host, per_expert, in_rank))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False,
                 operation=card.DISPATCH):
        """``Buffer.dispatch`` within one host (same arguments and results; ``operation``: the call as its card
        names it, :attr:`DispatchArgs.operation`): a cached dispatch of the handle's last shapes by its plan
        (:mod:`.intranode_replay`), else :meth:`dispatch_steps`."""
        if (handle is not None and num_tokens_per_rank is None and is_token_in_rank is None
                and num_tokens_per_expert is None and topk_idx is None and topk_weights is None
                and expert_alignment.__class__ is int and expert_alignment == 1 and num_worst_tokens.__class__ is int
                and num_worst_tokens == 0 and num_tokens_per_rdma_rank is None and handle.__class__ is DispatchHandle):
            out = replay.cached_dispatch(self.rt, handle, x, config, previous_event, async_finish)
            if out is not None:     # (the call of the handle's last shapes again: its plan launched it)
                return out
        return self.rt.run(self.dispatch_steps(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
            allocate_on_comm_stream, operation))

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """``Buffer.combine`` within one host (same arguments and results): a combine of the handle's last shapes by
        its plan (:mod:`.intranode_replay`), else :meth:`combine_steps`."""
        if bias is None and handle.__class__ is DispatchHandle:
            out = replay.combine(self.rt, handle, x, topk_weights, config, previous_event, async_finish)
            if out is not None:     # (the call of the handle's last shapes again: its plan launched it)
                return out
        return self.rt.run(self.combine_steps(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                              allocate_on_comm_stream))

    def internode_dispatch(self, *args, **kwargs):
        """``Buffer.internode_dispatch`` within one host: ``ValueError`` (call ``dispatch``)."""
        raise ValueError(_ONE_HOST.format(name="internode_dispatch", call="dispatch"))

    def internode_combine(self, *args, **kwargs):
        """``Buffer.internode_combine`` within one host: ``ValueError`` (call ``combine``)."""
        raise ValueError(_ONE_HOST.format(name="internode_combine", call="combine"))

    def remember_layout(self, idx: Tensor, num_experts: int, lay: tuple) -> None:
        """Keep ``lay`` (``routing_layout``'s results for ``idx``) for the dispatch that takes this layout (the same
        ``topk_idx`` and ``is_token_in_rank``, unchanged): it then uses these send positions and counts instead of
        computing the layout again."""
        vi, vr = version_of(idx), version_of(lay[2])
        self._layout_memo = (weakref.ref(idx), vi, int(num_experts), vr, lay) if None not in (vi, vr) else None

    @steps
    def worst_steps(self, a: "DispatchArgs", num_worst_tokens: int):
        """The ``num_worst_tokens`` of every rank of this group for a dispatch of arguments ``a``
        (:func:`~.intranode_args.dispatch_args`), as a call of its own (a generator for :meth:`Runtime.run`, collective: every
        rank makes it): each rank publishes its value in its call card and reads every rank's, a host wait on
        shared memory with no device work. Internode's capture path sizes its staging areas from its host's
        values before the forwarding dispatch starts. Returns a list of ``R`` ints.

        Raises (on every rank):
            ValueError: a rank called something else here. EPRemoteError: a rank failed before this point.
            EPTimeoutError: a rank did not come within ``timeout_s``.
        """
        self.rt.check()
        if self.rt.sig.needs_resync:      # (after a failed call: the worst-value slots restart from there)
            yield from self.rt.resync_steps()
        self.rt.publish(card.DISPATCH_WORST, card_values(a))
        self.rt.publish_worst(num_worst_tokens)
        yield "dispatch/num_worst_tokens"
        return self.rt.every_worst()

    @steps
    def dispatch_steps(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                       is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                       expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                       allocate_on_comm_stream=False, operation=card.DISPATCH):
        """The steps of ``Buffer.dispatch`` (same arguments; its docstring says what they mean; ``operation``: as
        :meth:`dispatch`'s): a generator that yields at each phase boundary and returns the call's results."""
        self.rt.check()
        cached = handle is not None
        if not cached:
            self.rt.dispatch_seq += 1          # the same on every rank: names the handle this call makes
        if self.rt.sig.needs_resync:
            yield from self.rt.resync_steps()
        try:
            check_config(config)
            lp = LP.of_config(config, self.rt.group_size)     # (a num_sms below the minimum: ValueError)
            force = fused_switch()      # a bad TRITON_EP_FUSED is an argument error, before anything runs
            pdl.check(self.rt.device)   # (so is a bad TRITON_EP_PDL, or PDL on a GPU older than Hopper)
            rows, a = args.dispatch_args(self.rt, x, handle, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens, previous_event, operation)
            num_worst_tokens = int(num_worst_tokens)      # (a numpy integer: the kernels take Python ints)
            # outputs of num_worst_tokens rows are known before the call starts: allocated here, running out of
            # memory is a refused call (the Buffer goes on), not a failure in the middle of one
            pre = (self._dispatch_outputs(a, rows.x, rows.scales, num_worst_tokens)
                   if num_worst_tokens > 0 and not cached else None)
        except Exception as e:  # noqa: BLE001 - the peers learn it from this rank's failure word
            raise self.rt.fail_call(e)
        xv, sc = rows.x, rows.scales
        sig = a.signature()
        code, values = a.card(num_worst_tokens)
        self.rt.publish(code, values)
        self.rt.begin(previous_event, async_finish)
        c = Counts.of_handle(a.handle) if cached else (yield from self._count_steps(a, num_worst_tokens, force))
        plan = self._dispatch_plan(a, sig, c.recv_rows_max, lp)
        o = pre if pre is not None else self._dispatch_outputs(a, xv, sc, c.n_out)
        launches = yield from self._dispatch_rounds(a, c, o, plan, force, lp)      # (None: cut short, an error)
        if (launches is not None and cached and self.rt.group is not None and sc is None and o.x_words is xv
                and o.out_words is o.recv_x and xv.numel()):
            # the next cached dispatch of this handle with x of these shapes replays these launches
            a.handle.replay_dispatch = replay.CallPlan(
                self.rt, xv, 0, o.recv_x.shape, code, values,
                tuple(la.replay(args, (xv, o.recv_x)) for la, args in launches), force, params_key=LP.config_key(config))
        return self._dispatch_end(a, c, o, async_finish, (xv, sc))

    def _count_steps(self, a: "DispatchArgs", num_worst_tokens: int, force):
        """A plain dispatch's counts, exchanged on the device (notify): every rank's row of the count matrix, and
        without ``num_worst_tokens`` the per-expert counts, into every rank's header; each rank builds its handle's
        tables from the matrix. A generator (the dispatch's steps) that returns the :class:`Counts`."""
        R = self.rt.group_size
        worst = num_worst_tokens > 0
        El = a.num_experts // R
        with self.rt.comm_ctx():
            lay = self._routing(a)
        if worst:
            self.rt.publish_worst(num_worst_tokens)
        yield "dispatch/notify"
        # each rank's num_worst_tokens (they may differ): the rounds follow from the largest
        worst_all = self.rt.every_worst() if worst else None
        # the count exchange: a send launch and a receive launch, or one launch (kernels.geometry.use_fused)
        one = use_fused(0, self.rt.group, force)
        if not one:
            with self.rt.comm_ctx(), self.rt.sig.watch():
                kernels.notify_send(lay[5], a.num_experts, self.rt.sig_args, experts=not worst,
                                    num_worst_tokens=num_worst_tokens)
            yield "dispatch/notify receive"
        t32_dev, tables = self._notify(lay[5], a.num_experts, num_worst_tokens, one)
        row_base, combine_tables, n_recv_dev = records.split_t64(tables, R)
        c = Counts(lay[2], lay[3], row_base, None, num_worst_tokens, n_recv_dev, 0, 0, [], combine_tables, tables,
                    t32_dev)
        if worst:
            # rank r receives at most its own value; rows returned to one source at most their sum
            c.recv_rows_max, c.area_rows_max = max(worst_all), sum(worst_all)
        else:
            # The one host wait of a plain dispatch: the rows that arrive here, and per local expert.
            c.n_recv, c.recv_rows_max, c.area_rows_max, per_expert = self._wait_notify(El)
            c.n_out = c.n_recv
            al = a.expert_alignment
            c.expert_list = [(n + al - 1) // al * al for n in per_expert]
        return c

    def _notify(self, counts: Tensor, num_experts: int, num_worst_tokens: int, one: bool) -> Tuple[Tensor, Tensor]:
        """The receive of the count exchange (with ``one``, the whole exchange as one launch): the handle's int32
        and int64 tables (``records.t32_words``, ``records.t64_words``), on the device."""
        R, worst = self.rt.group_size, num_worst_tokens > 0
        with self.rt.comm_ctx(), self.rt.sig.watch():
            t32_dev = torch.empty(records.t32_words.host(R), dtype=torch.int32, device=self.rt.device)
            tables = torch.empty(records.t64_words.host(R), dtype=torch.int64, device=self.rt.device)
            res = None
            if not worst:
                res = self._notify_block(num_experts // R)
                self._notify_seq += 1
            if one:
                NT.notify(counts, num_experts, t32_dev, tables, self.rt.sig_args, experts=not worst,
                          num_worst_tokens=num_worst_tokens, res=res, seq=self._notify_seq,
                          num_worst_rx=num_worst_tokens if worst else _MAX_ROWS)
            else:
                kernels.notify_recv(t32_dev, tables, num_worst_tokens if worst else _MAX_ROWS, self.rt.sig_args,
                                    res, self._notify_seq, num_experts // R)
        return t32_dev, tables

    def _dispatch_plan(self, a: "DispatchArgs", sig: list, recv_rows_max: int, lp: Optional[LP.LaunchParams]) -> tuple:
        """``(record words, rows a round takes, rounds, call signature)`` of a dispatch: from the counts, or
        (counts on the device only) from every rank's ``num_worst_tokens``, in rounds of at most what the buffer
        holds and what the Config's launch parameters ``lp`` say; a cached call's is kept on its handle, per
        Config key."""
        cached = a.handle is not None
        pkey = (*sig, lp.key if lp is not None else None)
        plan = a.handle.plans.get(pkey) if cached else None
        if plan is None:
            rec_words = dispatch_record_words(a.row_words, a.scale_words, a.num_topk, with_src=not cached)
            cap = LP.round_cap(self.rt.capacity(rec_words * 4, "dispatch"), lp)
            rounds = max(1, -(-recv_rows_max // cap))
            plan = (rec_words, cap, rounds, call_signature(sig + [rounds, rec_words]))
            if cached:
                a.handle.plans[pkey] = plan
        return plan

    def _dispatch_outputs(self, a: "DispatchArgs", xv: Tensor, sc: Optional[Tensor], n_out: int) -> "Outputs":
        """A dispatch's fresh outputs of ``n_out`` rows, and what its kernels take as 32-bit words of the rows
        ``xv`` ``[T, H]`` and their scales ``sc`` (each view per call costs microseconds of host time on a GPU
        machine: the kernels take their own dtypes)."""
        cached, dev = a.handle is not None, self.rt.device
        recv_x = torch.empty((n_out, xv.shape[1]), dtype=xv.dtype, device=dev)
        # scales come back with their dtype, row-major [N, S] (DeepEP allocates them with x_scales' options)
        recv_sc = torch.empty((n_out, a.scale_words), dtype=sc.dtype, device=dev) if sc is not None else None
        recv_idx = recv_w = recv_src = None
        if not cached:
            recv_src = torch.empty(n_out, dtype=torch.int32, device=dev)
            if a.num_topk:
                recv_idx = torch.empty((n_out, a.num_topk), dtype=a.topk_idx.dtype, device=dev)
                if a.topk_weights is not None:
                    recv_w = torch.empty((n_out, a.num_topk), dtype=torch.float32, device=dev)
        rec = self.rt.comm.data_view(torch.int32)
        x_words = as_words(xv)
        sc_words = sc if (sc is not None and a.scale_words) else None    # S = 0: nothing to move
        return Outputs(recv_x, recv_sc, recv_idx, recv_w, recv_src, rec, x_words, sc_words,
                        a.topk_weights if not cached else None, a.topk_idx if not cached else None, as_words(recv_x),
                        recv_sc if sc_words is not None else None)

    def _dispatch_rounds(self, a: "DispatchArgs", c: "Counts", o: "Outputs", plan: tuple, force,
                         lp: Optional[LP.LaunchParams] = None):
        """A dispatch's launches: rounds, each a send launch then a receive launch (ranks wait for each other on the
        device); a call may run all its rounds as one launch (kernels.geometry.use_fused). A generator (the
        dispatch's steps) that returns ``[(bound launch, its arguments), ...]`` in order: what a later cached call
        may replay, or ``None`` where it stopped between rounds after an error (:meth:`_cut_short`). The receive
        writes ``rows`` rows (with the count on the device, ``num_worst_tokens``: an upper bound, and the kernel also
        writes the padding rows). ``lp``: the call's Config's launch parameters (None: the built-in tables)."""
        R, rank, cached = self.rt.group_size, self.rt.rank, a.handle is not None
        tune = LP.table_of(lp)
        rec_words, cap, rounds, call_sig = plan
        rows = c.n_recv if c.n_recv is not None else c.n_out
        k_rec = a.num_topk if not cached else 0
        n_dev = c.n_recv_dev if c.n_recv is None else None
        # (several rounds in one launch: opt-in until a GPU run)
        fused = (rounds == 1 or force is True) and use_fused(a.num_tokens, self.rt.group, force, "data_max_tokens")
        launches = []
        if fused:
            yield "dispatch/send and receive"
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(dispatch_fused(
                    o.x_words, o.sc_words, o.idx, o.w_words, c.send_pos, c.row_base, self.rt.delta_words, o.rec,
                    a.num_experts, rec_words, not cached, rows, rank, a.num_experts // R, k_rec,
                    o.out_words, o.sc_out, o.recv_idx, o.recv_w, o.recv_src, self.rt.sig_args, call_sig, n_recv=n_dev,
                    cap=cap, tune=tune, rounds=rounds))
        for k in range(0 if fused else rounds):
            lo, hi = k * cap, (k + 1) * cap
            yield f"dispatch/send round {k}"
            if k and self._cut_short():
                return None
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(kernels.dispatch_send(
                    o.x_words, o.sc_words, o.idx, o.w_words, c.send_pos, c.row_base, self.rt.delta_words, o.rec, lo, hi,
                    a.num_experts, rec_words, with_src=not cached, signals=self.rt.sig_args, rnd=k, sig=call_sig,
                    tune=tune))
            yield f"dispatch/receive round {k}"
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(kernels.dispatch_recv(
                    o.rec, min(max(rows - lo, 0), cap), lo, rank, a.num_experts // R, a.row_words, a.scale_words,
                    k_rec, rec_words, o.out_words, o.sc_out, o.recv_idx, o.recv_w, o.recv_src, signals=self.rt.sig_args,
                    rnd=k, sig=call_sig, advance=rounds if k == rounds - 1 else 0, n_recv=n_dev, cap=cap, tune=tune))
        return launches

    def _cut_short(self) -> bool:
        """Between two rounds of a call: whether a kernel of this call recorded an error (a peer failed, left, died
        or timed out; host memory only, no device sync). The later rounds could only move nothing, each a send and
        a receive launch (on the CPU, interpreted; a call of ``num_worst_tokens`` rows may have millions), so the
        call launches no more of them and raises the error at its end as before; the next call re-synchronises
        every rank's round counters (:meth:`~triton_ep.runtime.Runtime.resync_steps`)."""
        return self.rt.sig.record() is not None

    def _dispatch_end(self, a: "DispatchArgs", c: "Counts", o: "Outputs", async_finish: bool, rows: tuple):
        """A dispatch's results after its launches: DeepEP's tuple, with a new handle unless cached. ``rows``: the
        call's ``(x, scales or None)``, kept for the stream."""
        out_x = (o.recv_x, o.recv_sc) if rows[1] is not None else o.recv_x
        inputs = (*rows, o.idx, a.topk_weights, c.send_pos, c.row_base)
        if a.handle is not None:
            event = self.rt.end(async_finish, inputs + (o.recv_x, o.recv_sc))
            self.rt.check()
            return out_x, None, None, None, None, event
        # DeepEP's channel_prefix_matrix and recv_channel_prefix_matrix with one channel (docs/design.md, Handle)
        rpm_t, chan, recv_chan = records.split_t32(c.t32_dev, self.rt.group_size)
        new_handle = DispatchHandle((rpm_t, chan, recv_chan, o.recv_src, c.in_rank, c.send_pos), self.rt.uid,
                                    a.num_tokens, c.n_recv, c.recv_rows_max, c.area_rows_max, self.rt.dispatch_seq,
                                    c.row_base, c.combine_tables, c.n_recv_dev, a.num_topk)
        event = self.rt.end(async_finish, inputs + (o.recv_x, o.recv_sc, o.recv_idx, o.recv_w, o.recv_src, c.tables,
                                                    c.t32_dev))
        self.rt.check()
        return out_x, o.recv_idx, o.recv_w, c.expert_list, new_handle, event

    def _notify_block(self, experts_per_rank: int) -> Tensor:
        """The host-visible block a plain dispatch's notify writes its results into (int64 ``[8 + E_local]``;
        pinned host memory on GPU), grown on demand."""
        n = 8 + experts_per_rank
        if self._notify_res is None or self._notify_res.numel() < n:
            with torch.inference_mode(False):
                self._notify_res = torch.zeros(max(n, 64), dtype=torch.int64, device="cpu",
                                               pin_memory=self.rt.device.type == "cuda")
            self._notify_np = self._notify_res.numpy()
            self._notify_seq = 0
        return self._notify_res

    def _wait_notify(self, experts_per_rank: int) -> Tuple[int, int, int, list]:
        """The host wait of a plain dispatch: poll the notify block until this call's sequence word arrives
        (no stream synchronise), bounded by ``timeout_s`` + 5 s (the kernel bounds its own waits by
        ``timeout_s``). Returns (rows received, the group's largest receive, its largest send, rows per
        local expert).

        Raises:
            what the kernels recorded (bad ids, a peer that failed, left or called another collective, a
            timeout: :meth:`check`); EPTimeoutError: the block never arrived (this rank's device is stalled);
            EPError: the Buffer was destroyed meanwhile (by another thread: the wait stops at once).
        """
        res, want = self._notify_np, self._notify_seq
        self.rt.host_waits["poll"] += 1
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.rt.timeout_s + 5.0
        rt = self.rt
        while res[int(NT.RES_SEQ)] != want and rt.sig.record() is None and rt.comm is not None:
            if time.monotonic() > deadline:
                raise EPTimeoutError(rt.rank, None, "dispatch/notify (the host's wait for its device)",
                                     rt.timeout_s + 5.0)
            time.sleep(0)
        comm = rt.live()        # (destroy() from another thread meanwhile: EPError "this Buffer was destroyed")
        if comm.profile is not None:          # benchmarks/profile_phases.py
            t1 = time.perf_counter()
            comm.profile.append(("dispatch/notify (host wait)", t0, t1, t1))
        self.rt.check()
        if res[int(NT.RES_STATUS)]:
            raise EPError(f"rank {self.rt.rank}: the dispatch's notify stopped on an earlier error; nothing was moved")
        e0 = int(NT.RES_EXPERTS)
        return (int(res[int(NT.RES_N_RECV)]), int(res[int(NT.RES_RECV_MAX)]), int(res[int(NT.RES_SEND_MAX)]),
                res[e0:e0 + experts_per_rank].tolist())

    def _routing(self, a):
        """Layout of this call: the one ``get_dispatch_layout`` computed for this very ``topk_idx`` and
        returned as this ``is_token_in_rank`` (neither changed since), else from ``topk_idx`` by the
        kernel, else from ``is_token_in_rank``."""
        if a.topk_idx is not None:
            m = self._layout_memo
            if (m is not None and m[0]() is a.topk_idx and m[1] == version_of(a.topk_idx) and m[2] == a.num_experts
                    and a.is_token_in_rank is m[4][2] and m[3] == version_of(a.is_token_in_rank)):
                return m[4]
            return kernels.routing_layout(a.topk_idx, a.num_experts, self.rt.group_size)
        in_rank = a.is_token_in_rank
        send_pos = torch.where(in_rank, in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1,
                               torch.full_like(in_rank, -1, dtype=torch.int32))      # send_head: int32, as DeepEP's
        per_rank = in_rank.sum(0, dtype=torch.int32)
        counts = torch.cat([per_rank, a.num_tokens_per_expert.to(torch.int32),
                            torch.zeros(1, dtype=torch.int32, device=per_rank.device)])     # no bad ids
        return per_rank, a.num_tokens_per_expert, in_rank, send_pos, None, counts

    @steps
    def combine_steps(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                      async_finish=False, allocate_on_comm_stream=False):
        """The steps of ``Buffer.combine`` (same arguments; its docstring says what they mean): a generator
        that yields at each phase boundary and returns the call's results."""
        self.rt.check()
        if self.rt.sig.needs_resync:
            yield from self.rt.resync_steps()
        try:
            h, xv, w, biases, force = args.combine_args(self.rt, x, handle, topk_weights, bias, config, previous_event)
            pdl.check(self.rt.device)
            lp = LP.of_config(config, self.rt.group_size)     # (a num_sms below the minimum: ValueError)
        except Exception as e:  # noqa: BLE001 - every rank learns it through the device words
            raise self.rt.fail_call(e)
        H = xv.shape[1]
        K = w.shape[1] if w is not None else 0
        pkey = (card.COMBINE, H, K, lp.key if lp is not None else None)
        plan = h.plans.get(pkey)
        if plan is None:
            rb = combine_record_bytes(H, K)
            cap = LP.round_cap(self.rt.capacity(rb, "combine"), lp)
            rounds = max(1, -(-h.area_rows_max // cap))
            plan = h.plans[pkey] = (rb, cap, rounds, call_signature([card.COMBINE, H, K, h.seq, rounds]))
        self.rt.publish(card.COMBINE, (H, K, h.seq))
        self.rt.begin(previous_event, async_finish)
        T, dev, rounds = h.num_tokens, self.rt.device, plan[2]
        out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        wout = torch.empty((T, K), dtype=torch.float32, device=dev) if w is not None else None
        acc = torch.empty((T, H), dtype=torch.float32, device=dev) if rounds > 1 else None
        wacc = torch.empty((T, K), dtype=torch.float32, device=dev) if (rounds > 1 and K) else None
        launches = yield from self._combine_rounds(h, xv, w, biases, plan, force, (out, wout, acc, wacc), lp)
        if launches is not None and self.rt.group is not None and not biases and xv.numel():
            # the next combine of this handle with x (and weights) of these shapes replays these launches (with
            # fresh fp32 sums for a combine of several rounds, as here)
            vary = tuple(t for t in (xv, w, out, wout, acc, wacc) if t is not None)
            h.replay_combine = replay.CallPlan(self.rt, xv, K, out.shape, card.COMBINE, (H, K, h.seq),
                                               tuple(la.replay(args, vary) for la, args in launches), force,
                                               sums=acc is not None, params_key=LP.config_key(config))
        event = self.rt.end(async_finish, (xv, w, *biases, out, wout, acc, wacc))
        self.rt.check()
        return out, wout, event

    def _combine_rounds(self, h: "DispatchHandle", xv: Tensor, w: Optional[Tensor], biases: list, plan: tuple,
                        force, outs: tuple, lp: Optional[LP.LaunchParams] = None):
        """A combine's launches: rounds, each a send launch then a reduce launch (ranks wait for each other on the
        device); a combine may run all its rounds as one launch (kernels.geometry.use_fused). ``outs``: ``(out,
        wout, acc, wacc)``. A generator (the combine's steps) that returns ``[(bound launch, its arguments), ...]``
        in order: what a later combine may replay (``None``: cut short, as :meth:`_dispatch_rounds`). ``lp``: as in
        :meth:`_dispatch_rounds`."""
        rb, cap, rounds, call_sig = plan
        tune = LP.table_of(lp)
        out, wout, acc, wacc = outs
        H, K = xv.shape[1], (w.shape[1] if w is not None else 0)
        comb_base, send_base, prefix = h.combine_views
        area = self.rt.comm.data
        rows = h.num_recv_tokens if h.num_recv_tokens is not None else h.num_out_rows   # (device count: a bound)
        # (several rounds in one launch: opt-in until a GPU run)
        fused = (rounds == 1 or force is True) and use_fused(h.num_tokens, self.rt.group, force, "data_max_tokens")
        launches = []
        if fused:
            yield "combine/send and reduce"
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(combine_fused(xv, w, rows, prefix, comb_base, self.rt.delta_words, area, h.send_head,
                                              send_base, cap, rb, out, biases, wout, self.rt.sig_args, call_sig,
                                              n_recv=h.n_recv_dev, tune=tune, rounds=rounds, acc=acc, wacc=wacc))
        for k in range(0 if fused else rounds):
            lo, hi = k * cap, (k + 1) * cap
            yield f"combine/send round {k}"
            if k and self._cut_short():
                return None
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(kernels.combine_send(xv, w, rows, prefix, comb_base, self.rt.delta_words,
                                                     area, lo, hi, rb // 4, signals=self.rt.sig_args, rnd=k,
                                                     sig=call_sig, n_recv=h.n_recv_dev, tune=tune))
            yield f"combine/reduce round {k}"
            with self.rt.comm_ctx(), self.rt.sig.watch():
                launches.append(kernels.combine_reduce(
                    area, h.send_head, send_base, lo, hi, H, K, rb, acc, out, biases, wacc, wout, first=k == 0,
                    last=k == rounds - 1, signals=self.rt.sig_args, rnd=k, sig=call_sig,
                    advance=rounds if k == rounds - 1 else 0, tune=tune))
        return launches
