"""Low-latency calls as one launch each (within one host): the parts of :mod:`.ll_dispatch` and :mod:`.ll_combine`
run back to back in one grid whose programs meet between the parts.

A low-latency dispatch without a receive hook is three launches when split (:func:`.ll_dispatch.ll_route`, the
send, the receive) and a combine two (the send, the reduce). Each launch costs host time (on an H200 machine some
15-25 µs with these kernels' 25-35 arguments), so a call here is one launch:

- :func:`ll_dispatch_fused`: the route part (each program its expert blocks), a gate (:func:`.ll_flags.ll_gate`:
  every program's slots and counts are written before any program reads them), the send part, its end-of-send
  count (:func:`.ll_flags.ll_finish_send_fused`: the last program publishes ``READY`` in every peer), then with
  ``recv`` a wait for this rank's own ``READY`` (:func:`.ll_flags.ll_wait_own`: every program's records into this
  rank's own area are in place) and the receive part. Without ``recv`` (a call with a receive hook) it is the
  send launch, route included, and the hook launches :func:`.ll_dispatch.ll_dispatch_recv` as before.
- :func:`ll_combine_fused`: the send part, its end-of-send count, the wait for the own ``READY``, the reduce part.

Programs wait for each other inside the launch, so every program must be resident at once: the grid is at most
the tuning table's ``ll_fused`` programs per multiprocessor, no more than fit there at once for the compiled kernel
(:func:`.launch.resident_per_sm`), within the shared-GPU cap (:func:`.geometry.fused_programs`); one program under
the interpreter. Each part loops over its items as its split launch's programs would (the same blocks; the split
launches' second grid axis becomes the parts' slices ``S``), and every record, count, table and output is the same
as the split launches', bit for bit. Calls over the network (internode) stay split: their sends end with the
network leg's own count. On a GPU the one launch costs more GPU time than the split launches (its programs loop
over what the split launches spread over more programs; benchmarks/README.md): a call captured into a CUDA graph,
where host time does not count, takes the split launches unless ``TRITON_EP_FUSED=1``.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags, ll_flags, pdl
from ..protocol import records
from ._util import cdiv, interpreted, pow2, tuning
from .geometry import fused_programs, row_words
from .launch import Launcher, bound, resident_per_sm
from . import logfmt
from .ll_combine import combine_send_part, logfmt_blocks, reduce_block_h, reduce_part
from .ll_dispatch import recv_part, route_part, send_part, typed_area, wait_recv, wait_send


@triton.jit
def _as_grid2(p, P, S: tl.constexpr, rows):
    """Program ``p`` of a one-dimensional grid of ``P`` as program ``(p0, p1)`` of a ``(P // S, S)`` grid, as a
    part's split launch has its programs (``P >= S``, :func:`_slices`); the programs past ``(P // S) * S`` get
    ``p0 = max(rows, 1)``, past the part's last row (and not program (0, 0)): nothing to do."""
    P0 = P // S
    p0 = tl.where(p < P0 * S, p // S, tl.maximum(rows, 1))
    return p0, P0, p % S, S


@names.jit('low_latency', 'dispatch', do_not_specialize=['T', 'sig', 'me', 'timeout_ns'])
def _ll_dispatch_fused_kernel(x_ptr, xw_ptr, idx_ptr, slot_ptr, cnt_ptr, area_w, area_q, area_f, delta_w, ctl,
                              out_w, out_s, src_info, ret_slot, layout, count, stats_ptr, cost_ptr,
                              T, num_experts, experts_per_rank, n_max, ctl_w, half_w, cnt_w,
                              hdr, hdr_delta, host, sig, me, timeout_ns,
                              R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, PW: tl.constexpr, SW: tl.constexpr,
                              REC: tl.constexpr, FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr,
                              UE8M0: tl.constexpr, STATS: tl.constexpr, COST: tl.constexpr, SHRINK: tl.constexpr,
                              USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr, RECV: tl.constexpr,
                              ROUTE_T: tl.constexpr, ROUTE_E: tl.constexpr, SEND_S: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                              RECV_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
    pdl.pdl_start()
    xw_ptr = xw_ptr.to(tl.pointer_type(tl.int32), bitcast=True)      # (x as words)
    area_w, area_q, area_f = typed_area(area_w, area_q, area_f, NATIVE)
    out_w = out_w.to(tl.pointer_type(tl.int32), bitcast=True)        # (the rows and their scales as words)
    out_s = out_s.to(tl.pointer_type(tl.int32), bitcast=True)
    ll_flags.ll_release_cons(ctl)      # (the last receive's CONS, before anything waits)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    n = tl.load(ctl + flags.L_SEQ) + 1        # (every program reads it before the end-of-send count moves it)
    half = n & 1
    hb = ctl_w + half * half_w
    route_part(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me, p, P,
               R, K, ROUTE_T, BLOCK_K, ROUTE_E, False)
    ll_flags.ll_gate(ctl, hdr, hdr_delta, host, me, flags.STAGE_LL_DISPATCH_SEND, n, timeout_ns, R, USE_CLOCK, USE_ASM)
    go = wait_send(ctl, hdr, hdr_delta, host, n, me, timeout_ns, ctl, ctl, flags.STAGE_LL_DISPATCH_SEND, R, False,
                   SHRINK, USE_CLOCK)
    s0, S0, s1, S1 = _as_grid2(p, P, SEND_S, tl.cdiv(tl.where(go, T, 0), BLOCK_T))
    send_part(x_ptr, xw_ptr, idx_ptr, slot_ptr, cnt_ptr, area_w, area_q, area_f, delta_w, ctl, T, num_experts,
              experts_per_rank, n_max, hb, cnt_w, n, go, me, 0, 0, ctl, s0, S0, s1, S1, False, 1, 1, R, K, H, PW, SW,
              REC, FP8, ROUND_SCALE, NATIVE, BLOCK_T, BLOCK_H, BLOCK_K, 1024)
    ll_flags.ll_finish_send_fused(ctl, hdr, hdr_delta, half, n, sig, R, me, USE_ASM)
    if RECV:
        go = ll_flags.ll_wait_own(ctl, hdr, hdr_delta, host, ctl + flags.off_ll_ready(R) + half * R + me, n, me,
                               flags.STAGE_LL_DISPATCH_RECV, n, timeout_ns, R, USE_CLOCK)
        go = go & wait_recv(ctl, hdr, hdr_delta, host, n, sig, me, timeout_ns, cost_ptr, p == 0,
                            flags.STAGE_LL_DISPATCH_RECV, R, SHRINK, USE_CLOCK, COST)
        r0, R0, r1, R1 = _as_grid2(p, P, RECV_S, experts_per_rank)
        recv_part(area_w, ctl, out_w, out_s, src_info, ret_slot, layout, count, stats_ptr, n_max, hb, cnt_w,
                  experts_per_rank, go, r0, R0, r1, R1, R, K, PW, SW, REC, UE8M0, STATS, BLOCK_R, BLOCK_W, BLOCK_S,
                  BLOCK_F)
        # Program 0 records the call; the rank's next low-latency launch frees the half for call n + 2.
        ll_flags.ll_finish_recv(ctl, half, n)


_ll_dispatch_fused_launch = Launcher(_ll_dispatch_fused_kernel, **pdl.options())


def ll_dispatch_fused(x: torch.Tensor, topk_idx: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                      area: torch.Tensor, delta_words: torch.Tensor, ctl: torch.Tensor, lay, sig: int, use_fp8: bool,
                      round_scale: bool, use_ue8m0: bool, shrink: bool, signals: dict, native_fp8: bool,
                      out_words: Optional[torch.Tensor] = None, out_scales: Optional[torch.Tensor] = None,
                      src_info: Optional[torch.Tensor] = None, ret_slot: Optional[torch.Tensor] = None,
                      layout_range: Optional[torch.Tensor] = None, count: Optional[torch.Tensor] = None,
                      stats: Optional[torch.Tensor] = None, cost: Optional[torch.Tensor] = None) -> tuple:
    """A low-latency dispatch within one host as one launch: :func:`.ll_dispatch.ll_route`, then
    :func:`.ll_dispatch.ll_dispatch_send` (with its end-of-launch count), then, given ``out_words``,
    :func:`.ll_dispatch.ll_dispatch_recv` of the same call; same arguments and results as those (``x`` bf16
    ``[T, H]``; ``topk_idx`` int32/int64 ``[T, K]``; ``slots`` int32 ``[T, K]`` and ``counts`` int32 ``[E]``,
    scratch; ``out_words`` ``[E_local, R*N, H]`` FP8 or bf16; ``out_scales`` fp32 or int32 column-major or None;
    ``src_info`` / ``ret_slot`` int32 ``[E_local, R*N]``; ``layout_range`` int64 ``[E_local, R]``; ``count`` int32
    ``[E_local]``; ``stats`` int32 ``[E_local]`` or None; ``cost`` int64 ``[R]`` or None). Without ``out_words``
    it is the send launch of a call with a receive hook (route and send; the hook's
    :func:`.ll_dispatch.ll_dispatch_recv` receives). Raises ``ValueError`` when the receive's tensors are given
    in part (``out_scales`` goes with FP8 and only with it), or without ``out_words``. Returns the bound launch
    and its arguments (for :meth:`triton_ep.kernels.launch.BoundLaunch.replay`)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    recv = out_words is not None
    tables = (src_info, ret_slot, layout_range, count)
    if recv and (any(t is None for t in tables) or use_fp8 != (out_scales is not None)):
        raise ValueError("ll_dispatch_fused receives with out_words, src_info, ret_slot, layout_range, count and, "
                         "for FP8 (only), out_scales")
    if not recv and (any(t is not None for t in tables) or out_scales is not None or stats is not None):
        raise ValueError("ll_dispatch_fused without out_words sends only: it takes no receive tensors")
    El, R, E = lay.experts_per_rank, lay.num_ranks, lay.num_experts
    tr, ts, tv = tuning("ll_route"), tuning("ll_send"), tuning("ll_recv")
    PW = records.ll_payload_words.host(H, use_fp8)
    if recv and row_words(out_words) != PW:
        raise ValueError(f"out_words holds rows of {row_words(out_words)} words, the records {PW}")
    tf = tuning("ll_fused")
    key = (T, H, K, lay, use_fp8, round_scale, use_ue8m0, native_fp8, shrink, recv, stats is not None,
           cost is not None, signals["use_clock"], signals.get("max_programs"), tuple(tr.items()),
           tuple(ts.items()), tuple(tv.items()), tuple(tf.items()), _variant(x, topk_idx, stats, cost))
    rx = out_words if recv else ctl
    args = (x, x, topk_idx, slots, counts, area, area, area, delta_words, ctl,      # (typed by the kernel)
            rx, out_scales if out_scales is not None else rx, src_info if recv else ctl, ret_slot if recv else ctl,
            layout_range if recv else ctl, count if recv else ctl, stats if stats is not None else rx,
            cost if cost is not None else rx,
            T, E, El, lay.n_max, lay.ctl_words, lay.half_words, lay.count_words,
            signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"], signals["timeout_ns"])
    launch = bound(_DISPATCH_BOUND, key, lambda: _bind_dispatch(*key[:-5], signals, tr, ts, tv, tf, args))
    launch(*args)
    return launch, args


_DISPATCH_BOUND: dict = {}


def _variant(*tensors) -> tuple:
    """What of the caller's tensors may make Triton compile another variant of a one-launch kernel (dtype,
    16-byte alignment; the library's own tensors are always alike): part of the wrappers' cache keys, so that
    each variant's grid is sized for its own registers (:func:`_grid`)."""
    return tuple((t.dtype, not t.data_ptr() & 15) if t is not None else None for t in tensors)


def _send_blocks(H: int, tune: dict) -> int:
    """The hidden block of the low-latency send (and of the reduce): a power of two dividing ``H``, at most the
    tuning entry's ``block_h``."""
    bh = 1 << (min(H, tune["block_h"]).bit_length() - 1)
    while H % bh:
        bh //= 2
    return bh


def _slices(cols: int, signals: dict) -> int:
    """The slices ``S`` of a part whose split launch has ``cols`` programs on its second grid axis (1 where ranks
    share a GPU, as :func:`.geometry.grid2`, and under the interpreter, which runs one program: a grid of ``P``
    programs plays a ``(P // S, S)`` grid, so ``S`` must not exceed it)."""
    return 1 if (signals.get("max_programs") or interpreted()) else max(cols, 1)


def _grid(launcher: Launcher, items: int, num_warps: int, meta: dict, signals: dict, tf: dict, args: tuple) -> tuple:
    """The one-launch grid: a program per item, at most ``tf["programs_per_sm"]`` per multiprocessor and no more
    than fit there at once for these arguments (:func:`.launch.resident_per_sm`; the interpreter runs one)."""
    device = signals["hdr"].device
    per_sm = int(tf["programs_per_sm"])
    if not interpreted():
        fit = resident_per_sm(launcher, args, num_warps, meta, device)
        if fit < 1:
            raise RuntimeError(f"{launcher.fn.__name__}: not one program fits on a multiprocessor of {device}")
        per_sm = min(per_sm, fit)
    return (fused_programs(items, device, signals, per_sm),)


def _bind_dispatch(T, H, K, lay, use_fp8, round_scale, use_ue8m0, native_fp8, shrink, recv, has_stats, has_cost,
                   use_clock, _cap, signals, tr, ts, tv, tf, args):
    R, E, El = lay.num_ranks, lay.num_experts, lay.experts_per_rank
    route_t = pow2(max(1, tr["block_t"] * 8 // pow2(K, 8)))
    route_e = pow2(tr["experts"])
    bh = _send_blocks(H, ts)
    send_s = _slices(H // bh, signals)
    recv_s = _slices(tv["programs_per_expert"], signals)
    # (at least S programs: each part's grid is (P // S, S))
    items = max(cdiv(E, route_e), cdiv(T, ts["block_t"]) * send_s, El * recv_s if recv else 1, send_s, recv_s)
    SW = records.ll_scale_words.host(H, use_fp8)
    PW = records.ll_payload_words.host(H, use_fp8)
    meta = dict(R=R, K=K, H=H, PW=PW, SW=SW, REC=lay.record_words(use_fp8), FP8=use_fp8, ROUND_SCALE=round_scale,
                NATIVE=native_fp8, UE8M0=use_ue8m0, STATS=has_stats, COST=has_cost, SHRINK=shrink, USE_CLOCK=use_clock,
                USE_ASM=use_clock, RECV=recv, ROUTE_T=route_t, ROUTE_E=route_e, SEND_S=send_s, BLOCK_T=ts["block_t"],
                BLOCK_H=bh, BLOCK_K=pow2(K), RECV_S=recv_s, BLOCK_R=tv["block_r"], BLOCK_W=pow2(min(PW, tv["block_w"])),
                BLOCK_S=pow2(max(SW, 4)), BLOCK_F=min(pow2(R * lay.n_max), tv["block_f"]))
    nw = ts["num_warps"]
    return _ll_dispatch_fused_launch.bind(_grid(_ll_dispatch_fused_launch, items, nw, meta, signals, tf, args),
                                          num_warps=nw, **meta)


@names.jit('low_latency', 'combine', do_not_specialize=['T', 'sig', 'me', 'timeout_ns'])
def _ll_combine_fused_kernel(xw_ptr, ret_slot, count, layout, area_w, area_h, delta_w, ctl, idx_ptr, w_ptr, out_ptr,
                             cost_ptr, T, num_experts, experts_per_rank, n_max, ctl_w, half_w, cnt_w,
                             hdr, hdr_delta, host, sig, me, timeout_ns, ltab,
                             R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, COST: tl.constexpr,
                             SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                             SEND_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                             REDUCE_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                             LOGFMT: tl.constexpr, LW: tl.constexpr, LB: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl.pdl_start()
    xw_ptr = xw_ptr.to(tl.pointer_type(tl.int32), bitcast=True)        # (x bf16, moved as words)
    area_w = area_w.to(tl.pointer_type(tl.int32), bitcast=True)
    area_h = area_h.to(tl.pointer_type(tl.bfloat16), bitcast=True)     # (the returned rows, out as bf16 bits)
    out_ptr = out_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    ll_flags.ll_release_cons(ctl)      # (the last receive's CONS, before anything waits)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    n = tl.load(ctl + flags.L_SEQ) + 1        # (every program reads it before the end-of-send count moves it)
    half = n & 1
    hb = ctl_w + half * half_w + cnt_w
    go = wait_send(ctl, hdr, hdr_delta, host, n, me, timeout_ns, ctl, ctl, flags.STAGE_LL_COMBINE_SEND, R, False,
                   SHRINK, USE_CLOCK)
    s0, S0, s1, S1 = _as_grid2(p, P, SEND_S, experts_per_rank)
    combine_send_part(xw_ptr, ret_slot, count, layout, area_w, delta_w, ctl, n_max, hb, experts_per_rank, n, go, 0,
                      0, ctl, ltab, s0, S0, s1, S1, False, 1, 1, R, K, H, BLOCK_R, BLOCK_W, LOGFMT, LW, LB)
    ll_flags.ll_finish_send_fused(ctl, hdr, hdr_delta, half, n, sig, R, me, USE_ASM)
    go = ll_flags.ll_wait_own(ctl, hdr, hdr_delta, host, ctl + flags.off_ll_ready(R) + half * R + me, n, me,
                           flags.STAGE_LL_COMBINE_RECV, n, timeout_ns, R, USE_CLOCK)
    go = go & wait_recv(ctl, hdr, hdr_delta, host, n, sig, me, timeout_ns, cost_ptr, p == 0,
                        flags.STAGE_LL_COMBINE_RECV, R, SHRINK, USE_CLOCK, COST)
    T = tl.where(go, T, 0)
    r0, R0, r1, R1 = _as_grid2(p, P, REDUCE_S, tl.cdiv(T, BLOCK_T))
    reduce_part(area_h, ctl, idx_ptr, w_ptr, out_ptr, T, num_experts, experts_per_rank, hb * 2, ltab, r0, R0, r1, R1, R,
                K, H, BLOCK_T, BLOCK_H, LOGFMT, LW, BLOCK_K)
    # Program 0 records the call; the rank's next low-latency launch frees the half for call n + 2.
    ll_flags.ll_finish_recv(ctl, half, n)


def _all_registers() -> dict:
    """The compile option that lets ptxas give a program up to 255 registers a thread (Triton's ``maxnreg``), on
    NVIDIA GPUs where the installed Triton has it; else none. Without it ptxas aimed the LogFMT one-launch combine
    at 168 registers (3 programs a multiprocessor) and spilled up to 20 bytes a thread (96 reloaded) at hidden 1024
    and 7168; with it, 186-195 registers and no spill (sm_90, Triton 3.9; benchmarks/logfmt_compile.py)."""
    if getattr(torch.version, "hip", None):
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:         # pragma: no cover - a Triton without the NVIDIA backend
        return {}
    return {"maxnreg": 255} if "maxnreg" in getattr(CUDAOptions, "__dataclass_fields__", {}) else {}


# no fused multiply-add: w * v is rounded, then added, as in the reference (and the split reduce)
_ll_combine_fused_launch = Launcher(_ll_combine_fused_kernel, enable_fp_fusion=False, **pdl.options())
#: the same kernel with use_logfmt (LOGFMT): no register target below 255 (:func:`_all_registers`); the grid is
#: sized by the registers it then takes (:func:`_grid`)
_ll_combine_fused_logfmt_launch = Launcher(_ll_combine_fused_kernel, enable_fp_fusion=False, **_all_registers(),
                                           **pdl.options())


def ll_combine_fused(x: torch.Tensor, ret_slot: torch.Tensor, count: torch.Tensor, layout_range: torch.Tensor,
                     topk_idx: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, cost: Optional[torch.Tensor],
                     area: torch.Tensor, delta_words: torch.Tensor, ctl: torch.Tensor, lay, sig: int, shrink: bool,
                     signals: dict, use_logfmt: bool = False) -> tuple:
    """A low-latency combine within one host as one launch: :func:`.ll_combine.ll_combine_send` (with its
    end-of-launch count), then :func:`.ll_combine.ll_combine_reduce` of the same call; same arguments and results
    (``x`` bf16 ``[E_local, R*N, H]``; ``ret_slot`` int32 ``[E_local, R*N]``; ``count`` int32 ``[E_local]``;
    ``layout_range`` int64 ``[E_local, R]``; ``topk_idx`` int32/int64 ``[T, K]``; ``topk_weights`` fp32 ``[T, K]``;
    ``out`` bf16 ``[T, H]``; ``cost`` int64 ``[R]`` or None; ``use_logfmt``: rows travel as LogFMT-10 records, as
    the split launches' with ``use_logfmt``). Returns the bound launch and its arguments (for
    :meth:`triton_ep.kernels.launch.BoundLaunch.replay`)."""
    El, _, H = x.shape
    T, K = topk_idx.shape
    ts, tr, tf = tuning("ll_combine_send"), tuning("ll_reduce"), tuning("ll_fused")
    key = (T, K, H, lay, shrink, cost is not None, signals["use_clock"], signals.get("max_programs"), bool(use_logfmt),
           tuple(ts.items()), tuple(tr.items()), tuple(tf.items()), _variant(x, topk_idx, topk_weights, out, cost))
    args = (x, ret_slot, count, layout_range, area, area, delta_words, ctl, topk_idx, topk_weights, out,
            cost if cost is not None else ctl, T, lay.num_experts, lay.experts_per_rank, lay.n_max, lay.ctl_words,
            lay.half_words, lay.count_words, signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"],
            signals["timeout_ns"], logfmt.table_arg(use_logfmt, ctl))
    launch = bound(_COMBINE_BOUND, key, lambda: _bind_combine(*key[:-4], signals, ts, tr, tf, args))
    launch(*args)
    return launch, args


_COMBINE_BOUND: dict = {}


def _bind_combine(T, K, H, lay, shrink, has_cost, use_clock, _cap, use_logfmt, signals, ts, tr, tf, args):
    bt = tr["block_t"]
    bh = reduce_block_h(H, tr, use_logfmt)
    send_s = _slices(ts["programs_per_expert"], signals)
    reduce_s = _slices(H // bh, signals)
    items = max(lay.experts_per_rank * send_s, cdiv(T, bt) * reduce_s, send_s, reduce_s)    # (at least S programs)
    meta = dict(R=lay.num_ranks, K=K, H=H, COST=has_cost, SHRINK=shrink, USE_CLOCK=use_clock, USE_ASM=use_clock,
                SEND_S=send_s, BLOCK_R=ts["block_r"], BLOCK_W=pow2(min(H // 2, ts["block_w"])), REDUCE_S=reduce_s,
                BLOCK_T=bt, BLOCK_H=bh, LOGFMT=use_logfmt, LW=lay.logfmt_row_words, LB=logfmt_blocks(H),
                BLOCK_K=pow2(K))
    nw = ts["num_warps"]
    launcher = _ll_combine_fused_logfmt_launch if use_logfmt else _ll_combine_fused_launch
    return launcher.bind(_grid(launcher, items, nw, meta, signals, tf, args), num_warps=nw, **meta)
