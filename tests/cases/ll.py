"""Rank bodies of the low-latency tests (module-level, so spawned processes can import them), and the
plain-PyTorch oracle of low-latency dispatch and combine."""
import os
import time

import torch

import triton_ep
from triton_ep import reference
from triton_ep.kernels.fp8 import quantize_reference, unpack_ue8m0


def ll_inputs(seed, R, E, K, H, Ts, skew=0.0, p_invalid=0.15, p_dup=0.1):
    """Per-rank inputs, identical in every process: x bf16 [T, H] (normal draws times 3), topk_idx int64
    [T, K] with -1 entries, duplicates within a token and (with ``skew``) hot experts, weights fp32 [T, K]
    (``helpers.make_inputs``)."""
    from tests.cases.helpers import make_inputs
    return make_inputs(seed, E, K, H, Ts, skew=skew, p_invalid=p_invalid, p_dup=p_dup, x_scale=3.0)


def expected_rows(idxs, R, E, me, masked=()):
    """Per local expert of rank ``me``: the (source rank, token) pairs it receives, in DeepEP's packed
    order (source rank ascending, then token); a token goes once to each distinct valid expert."""
    El = E // R
    rows = [[] for _ in range(El)]
    for s, idx in enumerate(idxs):
        if s in masked:
            continue
        for t in range(idx.shape[0]):
            seen = set()
            for e in idx[t].tolist():
                if 0 <= e < E and e // El == me and e not in seen:
                    seen.add(e)
                    rows[e - me * El].append((s, t))
    return rows


def expert_fn(kind, e, y):
    """The stand-in experts: identity, or a per-expert affine map (computed in fp32, rounded to bf16)."""
    if kind == "identity":
        return y
    return (y.float() * (0.5 + 0.25 * e) + (e - 3) * 0.125).to(torch.bfloat16)


def expected_combine(x, idx, w, E, R, kind, masked=(), logfmt=False):
    """sum_k w[t, k] * f_e(x_t) in fp32 in ascending k (invalid, masked entries add nothing), rounded once;
    ``logfmt``: f_e(x_t) after the LogFMT-10 round trip (``use_logfmt=True``, triton_ep.reference)."""
    El = E // R
    T, H = x.shape
    acc = torch.zeros(T, H, dtype=torch.float32)
    for k in range(idx.shape[1]):
        for t in range(T):
            e = int(idx[t, k])
            if 0 <= e < E and e // El not in masked:
                row = expert_fn(kind, e, x[t:t + 1])
                acc[t] = acc[t] + (reference.logfmt_round_trip(row) if logfmt else row.float())[0] * w[t, k]
    return acc.to(torch.bfloat16)


def _dequant_rows(recv_x, scales, use_ue8m0):
    El, RN, H = recv_x.shape
    s = unpack_ue8m0(scales.contiguous()) if use_ue8m0 else scales.contiguous()
    return recv_x.float() * s.repeat_interleave(128, dim=-1)


def check_dispatch(out, count, handle, xs, idxs, R, E, me, use_fp8, round_scale, use_ue8m0, masked=()):
    """Counts, layout, source indices and every row against the oracle (bf16 bit-exact; FP8: the bytes
    and scales of the reference quantisation, so within the e4m3 bound of its block)."""
    El = E // R
    rows = expected_rows(idxs, R, E, me, masked)
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    assert count.cpu().tolist() == [len(r) for r in rows], (count.cpu().tolist(), [len(r) for r in rows])
    for le in range(El):
        beg = 0
        for s in range(R):
            c = sum(1 for (ss, _) in rows[le] if ss == s)
            assert int(layout_range[le, s]) == (beg << 32) | c
            beg += c
        toks = [t for (_, t) in rows[le]]
        assert src_info[le, :len(toks)].tolist() == toks
        assert (src_info[le, len(toks):] == -1).all()
        if not toks:
            continue
        src = torch.stack([xs[s][t] for (s, t) in rows[le]])
        if not use_fp8:
            got = out[le, :len(toks)].cpu()
            assert torch.equal(got.view(torch.int16), src.view(torch.int16)), f"expert {le} rows"
            continue
        q, sc = out[0][le, :len(toks)].cpu(), out[1][le, :len(toks)].cpu()
        assert out[1].stride(-2) == 1, "scales must be column-major"
        qr, sr = quantize_reference(src, round_scale)
        if use_ue8m0:
            assert torch.equal(unpack_ue8m0(sc.contiguous()), sr), f"expert {le} UE8M0 scales"
            s_full = unpack_ue8m0(sc.contiguous())
        else:
            assert torch.equal(sc.contiguous(), sr), f"expert {le} scales"
            s_full = sc.contiguous()
        if round_scale:
            m, _ = torch.frexp(s_full)
            assert (m == 0.5).all(), "scales must be powers of two"
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), f"expert {le} fp8 bytes"
        deq = q.float() * s_full.repeat_interleave(128, dim=-1)
        amax = src.float().reshape(len(toks), -1, 128).abs().amax(-1).clamp_min(1e-4)
        bound = (amax / 16).repeat_interleave(128, dim=-1) * (1 + 1e-6)
        assert ((deq - src.float()).abs() <= bound).all(), f"expert {le}: beyond the e4m3 bound"


def round_trip(rank, world, seed, E, K, H, Ts, N, cases, allow_nvlink=True, inputs=None):
    """Each case (use_fp8, round_scale, use_ue8m0, expert kind, hook, zero_copy): dispatch, check against
    the oracle, run the stand-in experts, combine, check; the stats tensor accumulates the counts.
    ``inputs``: ``(xs, idxs, ws)`` instead of :func:`ll_inputs`."""
    xs, idxs, ws = inputs or ll_inputs(seed, world, E, K, H, Ts, skew=0.5 if seed % 2 else 0.0)
    R, me, El = world, rank, E // world
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=El, timeout_s=60,
                           allow_nvlink_for_low_latency_mode=allow_nvlink)
    stats = torch.zeros(El, dtype=torch.int32)
    cost = torch.zeros(R, dtype=torch.int64)
    total = 0
    try:
        for use_fp8, round_scale, use_ue8m0, kind, hook, zero_copy in cases:
            out, count, handle, _, h = buf.low_latency_dispatch(
                xs[me], idxs[me], N, E, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=cost,
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook)
            if hook:
                h()
            check_dispatch(out, count, handle, xs, idxs, R, E, me, use_fp8, round_scale, use_ue8m0)
            total += int(count.sum())
            rx = _dequant_rows(out[0], out[1], use_ue8m0).to(torch.bfloat16) if use_fp8 else out
            y = buf.get_next_low_latency_combine_buffer(handle) if zero_copy else torch.empty_like(rx)
            for le in range(El):
                y[le] = expert_fn(kind, me * El + le, rx[le])
            # zero-copy as DeepEP's programs use it: the outputs were written into the buffer, and x is
            # another tensor of the right shape and dtype (garbage here: it must not be read)
            x_arg = torch.full((El, R * N, H), float("nan"), dtype=torch.bfloat16) if zero_copy else y
            comb, _, h = buf.low_latency_combine(x_arg, idxs[me], ws[me], handle, zero_copy=zero_copy,
                                                 return_recv_hook=hook)
            if hook:
                h()
            # the oracle's expert input: the row as received (FP8: dequantised)
            xin = xs[me]
            if use_fp8:
                q, s = quantize_reference(xin, round_scale)
                xin = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16) if xin.shape[0] else xin
            want = expected_combine(xin, idxs[me], ws[me], E, R, kind)
            assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine"
        assert int(stats.sum()) == total
        assert int(cost.abs().sum()) == 0          # no clock under the interpreter
        return total
    finally:
        buf.destroy()


def _buffer(R, N, H, E, **kw):
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    return triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=E // R, **kw)


def two_live_hooks(rank, world, seed, E, K, H, Ts, N, third=True):
    """Two dispatches outstanding at once (two hooks, the two halves), received in reverse order, then two
    outstanding combines: each result equals its own oracle; with ``third`` a third outstanding call is
    refused."""
    R, me = world, rank
    El = E // R
    a = ll_inputs(seed, R, E, K, H, Ts)
    b = ll_inputs(seed + 1, R, E, K, H, Ts)
    buf = _buffer(R, N, H, E, timeout_s=60)
    try:
        oa, ca, ha, _, hook_a = buf.low_latency_dispatch(a[0][me], a[1][me], N, E, use_fp8=False, return_recv_hook=True)
        ob, cb, hb, _, hook_b = buf.low_latency_dispatch(b[0][me], b[1][me], N, E, use_fp8=False, return_recv_hook=True)
        refused = False
        try:
            if third:
                buf.low_latency_dispatch(a[0][me], a[1][me], N, E, use_fp8=False, return_recv_hook=True)
        except ValueError as e:
            refused = "outstanding" in str(e)
        hook_b()
        hook_a()
        # the refused call told the peers it failed: every rank raises once, then the group re-synchronises
        try:
            buf.check()
        except Exception:       # noqa: BLE001 - EPRemoteError on the peers
            pass
        check_dispatch(oa, ca, ha, a[0], a[1], R, E, me, False, False, False)
        check_dispatch(ob, cb, hb, b[0], b[1], R, E, me, False, False, False)
        ya = torch.stack([expert_fn("affine", me * El + le, oa[le]) for le in range(El)])
        yb = oa.new_zeros(ob.shape).copy_(ob)
        outa, _, hook_ca = buf.low_latency_combine(ya, a[1][me], a[2][me], ha, return_recv_hook=True)
        outb, _, hook_cb = buf.low_latency_combine(yb, b[1][me], b[2][me], hb, return_recv_hook=True)
        hook_ca()
        hook_cb()
        assert torch.equal(outa.view(torch.int16), expected_combine(a[0][me], a[1][me], a[2][me], E, R, "affine").view(torch.int16))
        assert torch.equal(outb.view(torch.int16), expected_combine(b[0][me], b[1][me], b[2][me], E, R, "identity").view(torch.int16))
        return refused
    finally:
        buf.destroy()


def masked_rank(rank, world, seed, E, K, H, Ts, N, victim, by_timeout):
    """Rank ``victim`` takes no part. The others mask it (explicitly, or with ``by_timeout`` by the
    timeout of enable_shrink): exactly its tokens and its experts' entries are dropped, and the mask
    query reports it; the next call does not wait again."""
    import time
    from tests.cases.helpers import all_live_ranks_reach
    R, me = world, rank
    xs, idxs, ws = ll_inputs(seed, R, E, K, H, Ts)
    # (masked by hand, a long timeout: under load a 2 s one could mask a slow live peer too)
    buf = _buffer(R, N, H, E, timeout_s=2.0 if by_timeout else 30.0, enable_shrink=True)
    try:
        if me == victim:
            return None
        if not by_timeout:
            buf.low_latency_update_mask_buffer(victim, True)
        waits = []
        for _ in range(2):
            t0 = time.monotonic()
            out, count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], N, E, use_fp8=False)
            check_dispatch(out, count, handle, xs, idxs, R, E, me, False, False, False, masked=(victim,))
            comb, _, _ = buf.low_latency_combine(out, idxs[me], ws[me], handle)
            waits.append(time.monotonic() - t0)
            want = expected_combine(xs[me], idxs[me], ws[me], E, R, "identity", masked=(victim,))
            assert torch.equal(comb.view(torch.int16), want.view(torch.int16))
        status = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        buf.low_latency_clean_mask_buffer()
        after = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(after)
        return status.tolist(), after.tolist(), waits
    finally:
        # the victim stays mapped (alive but silent) while the others run: until they are done, at most 8 s (1 s)
        all_live_ranks_reach(R, bound_s=8.0 if by_timeout else 1.0)
        buf.destroy()


def one_sided_hand_mask(rank, world, seed, E, K, H, Ts, N, hook):
    """Rank 0 masks rank 1 by hand; rank 1 masks nobody (new user's find: rank 1's round trip returned at once
    without rank 0's entries, raised nothing, and its mask stayed empty). Rank 0's call tells rank 1 that it is made
    without it (``LL_SIG_MASKED``), so rank 1 masks rank 0 by hand at once (no wait: ``timeout_s`` is 30 s),
    visibly, and drops exactly rank 0's tokens and experts' entries; rank 0's round trip drops rank 1's. After both
    clean their masks a round trip is whole again. Other ranks (``world`` > 2: with ``TRITON_EP_RANKS_PER_HOST``,
    ranks 0 and 1 on one host and the rest on others) mask nobody and lose nothing. ``hook``: the dispatches' receive
    hooks (the split launches), else one launch a call. Returns ``(mask status after the call, its seconds, mask status after the clean)``."""
    import time
    R, me = world, rank
    xs, idxs, ws = ll_inputs(seed, R, E, K, H, Ts)
    buf = _buffer(R, N, H, E, timeout_s=30.0, enable_shrink=True)
    try:
        if me == 0:
            buf.low_latency_update_mask_buffer(1, True)
        t0 = time.monotonic()
        _masked_round_trip(buf, me, R, xs, idxs, ws, E, N, False, hook, {0: (1,), 1: (0,)}.get(me, ()))
        took = time.monotonic() - t0
        status = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        buf.low_latency_clean_mask_buffer()
        after = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(after)
        _masked_round_trip(buf, me, R, xs, idxs, ws, E, N, False, hook, ())
        return status.tolist(), took, after.tolist()
    finally:
        buf.destroy()


def _source_of_rows(out, count, handle, sets, me, R, E):
    """Per (local expert, source rank): which input set the rows received from that rank are, by bit equality:
    the names in ``sets`` (``{name: xs}``) whose source rows (``src_info``'s tokens) all match, e.g. ``["B"]``."""
    El = E // R
    src_info, layout = handle[0].cpu(), handle[1].cpu()
    got = {}
    for le in range(El):
        for s in range(R):
            beg, c = int(layout[le, s]) >> 32, int(layout[le, s]) & 0xFFFFFFFF
            if c == 0:
                continue
            rows = out[le, beg:beg + c].cpu().view(torch.int16)
            toks = src_info[le, beg:beg + c].tolist()
            got[(le, s)] = [name for name, xs in sets.items()
                            if all(0 <= t < xs[s].shape[0] and torch.equal(rows[i], xs[s][t].view(torch.int16))
                                   for i, t in enumerate(toks))]
    return got


def skipped_call(rank, world, seed, E, K, H, Ts, N, skipper, form, late=False, timeout_s=3.0):
    """Rank ``skipper`` skips a low-latency dispatch (A) that its peers make: with ``enable_shrink`` (a short
    ``timeout_s``) they time out on it, mask it and return. After a barrier every rank dispatches new inputs (B),
    then combines. The skipper's dispatch B takes no row of its peers' call A (rows compared against both input
    sets) nor of their B (they sent it none): it masks them at once, from their give-up words, without waiting out
    ``timeout_s``, and its mask shows them; the peers' B drops exactly the skipper's rows. Then every rank unmasks
    (``low_latency_clean_mask_buffer``) and a round trip of fresh inputs (C) is whole and correct on every rank.
    ``form``: ``"split"`` (two launches a call), ``"hook"`` (the skipper's dispatch B with a receive hook),
    ``"fused"`` (one launch a call, ``TRITON_EP_FUSED=1``). With ``late`` the skipper makes call A too, after its
    peers gave up on it (a round trip W first, so that both halves of the area hold an earlier call's counts): it
    masks them at once in that call (none of their rows: they were given up with it) and in B. Returns ``(mask
    after B, mask after the unmask, seconds of the skipper's dispatch B, sources of the rows it got in B, and with
    ``late`` of those it got in its late A)``. Across hosts (:func:`across_hosts`) the unmask is the collective
    re-synchronisation, and a peer on another host tells the skipper through its proxy (the ``GAVE`` ring word)."""
    import torch.distributed as dist
    os.environ["TRITON_EP_FUSED"] = "1" if form == "fused" else "0"
    R, me = world, rank
    A = ll_inputs(seed, R, E, K, H, Ts)
    B = ll_inputs(seed + 1, R, E, K, H, Ts)
    C = ll_inputs(seed + 2, R, E, K, H, Ts)
    # (3 s: a live peer slower than that under load would be masked too; barriers before the calls every rank
    # makes at once)
    buf = _buffer(R, N, H, E, timeout_s=timeout_s, enable_shrink=True)
    try:
        peers = tuple(r for r in range(R) if r != skipper)
        if late:
            dist.barrier()
            W = ll_inputs(seed + 3, R, E, K, H, Ts)
            out, count, handle, _, _ = buf.low_latency_dispatch(W[0][me], W[1][me], N, E, use_fp8=False)
            check_dispatch(out, count, handle, W[0], W[1], R, E, me, False, False, False)
            buf.low_latency_combine(out, W[1][me], W[2][me], handle)
        if me != skipper:
            buf.low_latency_dispatch(A[0][me], A[1][me], N, E, use_fp8=False)     # times out on the skipper
        dist.barrier()
        if late and me == skipper:      # the same call A, after the peers gave up on it
            out, count, handle, _, _ = buf.low_latency_dispatch(A[0][me], A[1][me], N, E, use_fp8=False)
            late_a = _source_of_rows(out, count, handle, {"A": A[0]}, me, R, E)
            check_dispatch(out, count, handle, A[0], A[1], R, E, me, False, False, False, masked=peers)
        t0 = time.monotonic()
        hook = form == "hook" and me == skipper
        out, count, handle, _, recv = buf.low_latency_dispatch(B[0][me], B[1][me], N, E, use_fp8=False,
                                                               return_recv_hook=hook)
        if recv is not None:
            recv()
        took = time.monotonic() - t0
        dist.barrier()      # (rows checked before any peer's next call: the old fault showed then, with no error)
        sources = _source_of_rows(out, count, handle, {"A": A[0], "B": B[0]}, me, R, E)
        masked = peers if me == skipper else (skipper,)
        assert all(src == ["B"] for (_, s), src in sources.items() if s == me), sources
        assert not [k for k in sources if k[1] != me and me == skipper], f"rows of a peer's call A or B: {sources}"
        check_dispatch(out, count, handle, B[0], B[1], R, E, me, False, False, False, masked=masked)
        comb, _, _ = buf.low_latency_combine(out, B[1][me], B[2][me], handle)
        want = expected_combine(B[0][me], B[1][me], B[2][me], E, R, "identity", masked=masked)
        assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine B"
        status = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        dist.barrier()
        buf.low_latency_clean_mask_buffer()
        after = torch.zeros(R, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(after)
        dist.barrier()
        out, count, handle, _, _ = buf.low_latency_dispatch(C[0][me], C[1][me], N, E, use_fp8=False)
        check_dispatch(out, count, handle, C[0], C[1], R, E, me, False, False, False)
        comb, _, _ = buf.low_latency_combine(out, C[1][me], C[2][me], handle)
        want = expected_combine(C[0][me], C[1][me], C[2][me], E, R, "identity")
        assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine C after the unmask"
        return status.tolist(), after.tolist(), took, sources, (late_a if late and me == skipper else None)
    finally:
        buf.destroy()


def absent_without_shrink(rank, world, N, H, E):
    """Without enable_shrink a silent peer gives EPTimeoutError naming it. The peer (rank 1) lives on, silent,
    until the others have their errors (at most 6 s)."""
    from tests.cases.helpers import all_live_ranks_reach
    buf = _buffer(world, N, H, E, timeout_s=2.0)
    try:
        if rank == 1:
            return None
        x = torch.ones(3, H, dtype=torch.bfloat16)
        idx = torch.tensor([[0, E - 1]] * 3)
        try:
            buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        except triton_ep.EPTimeoutError as e:
            return type(e).__name__, e.peer, str(e)
        return "no error"
    finally:
        all_live_ranks_reach(world, bound_s=6.0)
        buf.destroy()


def bad_ids_then_recover(rank, world, N, H, E):
    """Rank 1 passes two ids outside [-1, E) (one above, one below): it raises ValueError counting both, the peers
    EPRemoteError; the next call re-synchronises and is correct. Bad argument shapes, handles (a float entry,
    too few entries, a tuple rebuilt from a handle), outs and non-contiguous stats tensors raise before launch."""
    R, me = world, rank
    xs, idxs, ws = ll_inputs(7, R, E, 2, H, [4] * R)
    buf = _buffer(R, N, H, E, timeout_s=30)
    got = []
    try:
        for bad_n in ("abc", 0):        # (raised on every rank before anything: no peer waits)
            try:
                buf.low_latency_dispatch(xs[me], idxs[me], bad_n, E)
            except (TypeError, ValueError) as e:
                got.append(f"N: {type(e).__name__}" if "num_max_dispatch_tokens_per_rank" in str(e) else str(e))
        try:
            buf.low_latency_dispatch(xs[me][:, :64], idxs[me], N, E)
        except ValueError as e:
            got.append("shape" if "hidden" in str(e) else str(e))
        bad = idxs[me].clone()
        if me == 1:
            bad[0, 0] = E + 5
            bad[1, 1] = -2
        try:
            buf.low_latency_dispatch(xs[me], bad, N, E, use_fp8=False)
            got.append("none")
        except Exception as e:  # noqa: BLE001
            got.append(type(e).__name__ + (" (2 ids)" if "holds 2 ids outside" in str(e) else ""))
        try:
            buf.check()
        except Exception as e:  # noqa: BLE001
            got.append(type(e).__name__)
        out, count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], N, E, use_fp8=False)
        check_dispatch(out, count, handle, xs, idxs, R, E, me, False, False, False)
        T = xs[me].shape[0]
        h = list(handle)
        for bad_handle in (tuple(h[:3] + [float(H)] + h[4:]), h[:4], tuple(h)):   # (raised on every rank)
            try:
                buf.low_latency_combine(out, idxs[me], ws[me], bad_handle)
            except (TypeError, ValueError) as e:
                got.append(f"handle: {type(e).__name__}: {e}")
        for bad_out in (torch.empty(T, H, dtype=torch.float32), torch.empty(T + 1, H, dtype=torch.bfloat16),
                        torch.empty(H, T, dtype=torch.bfloat16).t()):      # (the last: [T, H], non-contiguous)
            try:        # (raised on every rank before anything)
                buf.low_latency_combine(out, idxs[me], ws[me], handle, out=bad_out)
            except (TypeError, ValueError) as e:
                layout = " (non-contiguous)" if "got a non-contiguous torch.bfloat16" in str(e) else ""
                got.append(f"out: {type(e).__name__}{layout}" if str(e).startswith("out must be") else str(e))
        El = E // R     # (a new user's find: a non-contiguous stats tensor was told "got (El,)", as required)
        for stats in (dict(cumulative_local_expert_recv_stats=torch.zeros(2 * El, dtype=torch.int32)[::2]),
                      dict(dispatch_wait_recv_cost_stats=torch.zeros(R, 2, dtype=torch.int64)[:, 0])):
            try:        # (raised on every rank before anything)
                buf.low_latency_dispatch(xs[me], idxs[me], N, E, use_fp8=False, **stats)
                got.append("none")
            except ValueError as e:
                got.append(f"{type(e).__name__}: {e}")
        return got
    finally:
        buf.destroy()


def disagree_then_recover(rank, world, N, H, E, late_card_s=0.0, late_call_s=0.0):
    """Rank 1 calls with use_fp8=False where the others pass True, then with another
    num_max_dispatch_tokens_per_rank: every rank raises ValueError naming the field and both values (one
    exception type for a disagreement on every rank); the next agreeing call is correct. ``late_card_s``
    (across hosts): rank 1 posts its call card in the group's store that many seconds late
    (``NetLeg.explain_mismatch``), as a loaded machine may: a rank told of the disagreement by a rank that
    agrees with it then finds rank 1's card only after that rank's. ``late_call_s``: rank 2 starts each
    disagreeing call that many seconds late (its host mate, rank 3, has then found the disagreement and told it)."""
    R, me = world, rank
    if late_card_s and me == 1:
        from triton_ep.modes.internode.low_latency import NetLeg
        real = NetLeg.explain_mismatch

        def late(self, rt, peer):
            time.sleep(late_card_s)
            return real(self, rt, peer)
        NetLeg.explain_mismatch = late      # (this rank's process only; before its Buffer binds it)
    xs, idxs, ws = ll_inputs(9, R, E, 2, H, [4] * R)
    buf = _buffer(R, N, H, E, timeout_s=30)
    got = []
    try:
        for kw in (dict(use_fp8=me != 1), dict(use_fp8=False, n=N if me != 1 else N // 2)):
            n = kw.pop("n", N)
            if late_call_s and me == 2:
                time.sleep(late_call_s)
            try:
                buf.low_latency_dispatch(xs[me], idxs[me], n, E, **kw)
                buf.check()
                got.append(("none", ""))
            except Exception as e:  # noqa: BLE001
                got.append((type(e).__name__, str(e)))
        out, count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], N, E, use_fp8=False)
        check_dispatch(out, count, handle, xs, idxs, R, E, me, False, False, False)
        return got
    finally:
        buf.destroy()


# ---------------------------------------------------------------------------- GPU (marker ``gpu``)
def _stand_in_expert(rx, scales, El, me, use_fp8):
    """The affine stand-in expert of :func:`expert_fn`, in torch ops on the device (capturable)."""
    if use_fp8:
        rx = (rx.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    e = (me * El + torch.arange(El, device=rx.device, dtype=torch.float32)).view(El, 1, 1)
    return (rx.float() * (0.5 + 0.25 * e) + (e - 3) * 0.125).to(torch.bfloat16)


def _expected_after_fp8(x, use_fp8):
    if not use_fp8 or x.shape[0] == 0:
        return x
    q, s = quantize_reference(x, True)
    return (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def gpu_graph_replay(rank, world, use_fp8, replays, E, K, H, T, N, logfmt=False):
    """Two processes on one GPU: capture dispatch + affine stand-in expert + combine (``logfmt``: with
    ``use_logfmt=True``) in a CUDA graph (eager warm-up first, under sync debug mode "error"), then replay it with
    fresh routing and data copied into the static inputs; every replay's output equals the oracle bit for bit."""
    torch.cuda.set_device(0)
    R, me, El = world, rank, E // world
    buf = _buffer(R, N, H, E, timeout_s=60, device="cuda")
    try:
        xs, idxs, ws = ll_inputs(1000, R, E, K, H, [T] * R)
        x_s, idx_s, w_s = xs[me].cuda(), idxs[me].cuda(), ws[me].cuda()

        def step():
            out, _, handle, _, _ = buf.low_latency_dispatch(x_s, idx_s, N, E, use_fp8=use_fp8, round_scale=use_fp8)
            rx, sc = (out[0], out[1]) if use_fp8 else (out, None)
            y = _stand_in_expert(rx, sc, El, me, use_fp8)
            return buf.low_latency_combine(y, idx_s, w_s, handle, use_logfmt=logfmt)[0]

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()                  # warm-up: compiles every kernel; no host synchronisation allowed
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        torch.cuda.synchronize()
        ok = 0
        for i in range(replays):
            xs, idxs, ws = ll_inputs(2000 + i, R, E, K, H, [T] * R, skew=0.5 if i % 3 == 0 else 0.0)
            x_s.copy_(xs[me])
            idx_s.copy_(idxs[me])
            w_s.copy_(ws[me])
            g.replay()
            torch.cuda.synchronize()
            buf.check()
            want = expected_combine(_expected_after_fp8(xs[me], use_fp8), idxs[me], ws[me], E, R, "affine",
                                    logfmt=logfmt)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), f"replay {i}"
            ok += 1
        return ok
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def gpu_hook_overlap(rank, world, E, K, H, T, N):
    """The hook path on GPU: dispatch sends only, a compute kernel runs on the caller's stream, then the
    hook receives; the same for combine. Results equal the oracle; no host synchronisation in the calls."""
    torch.cuda.set_device(0)
    R, me, El = world, rank, E // world
    buf = _buffer(R, N, H, E, timeout_s=60, device="cuda")
    try:
        xs, idxs, ws = ll_inputs(77, R, E, K, H, [T] * R)
        x, idx, w = xs[me].cuda(), idxs[me].cuda(), ws[me].cuda()
        a = torch.randn(2048, 2048, device="cuda")
        for it in range(2):         # the first round compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out, count, handle, _, hook = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, return_recv_hook=True)
                c = a @ a                       # compute between send and receive
                hook()
                y = _stand_in_expert(out, None, El, me, False)
                comb, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
                c = c @ a
                hook()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            check_dispatch(out.cpu(), count, handle, xs, idxs, R, E, me, False, False, False)
            want = expected_combine(xs[me], idxs[me], ws[me], E, R, "affine")
            assert torch.equal(comb.cpu().view(torch.int16), want.view(torch.int16))
        return True
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def bad_call_after_valid(rank, world, N, H, E):
    """Rank 1 runs the receive hook of a valid call late, after rank 0 has already rejected the next call
    (fp32 x, rejected on every rank): the late receive is not failed by that; every valid call returns
    the right rows, every invalid one raises TypeError."""
    import time
    buf = _buffer(world, N, H, E, timeout_s=20)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    log = []

    def step(name, fn):
        try:
            fn()
            log.append((name, "ok"))
        except Exception as e:  # noqa: BLE001
            log.append((name, type(e).__name__))

    for _ in range(2):
        if rank == 0:
            step("valid", lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False))
        else:
            hook = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, return_recv_hook=True)[4]
            time.sleep(0.6)
            step("valid hook", hook)
        step("bad", lambda: buf.low_latency_dispatch(x.float(), idx, N, E, use_fp8=False))
    got = []
    step("final", lambda: got.append(buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)))
    if got:
        log.append(("final rows", [int(c) for c in got[0][1].tolist()]))
    buf.destroy()
    return log


def rejection_then_normal_mode(rank, world, N, H, E, who):
    """One Buffer of both modes within one host: a low-latency dispatch that the ranks ``who`` ("all" or "one":
    rank 1 only) reject (fp32 x; the others make it valid and hear of it; "badid": rank 1's kernel finds an id
    out of range), then a normal-mode round trip, then two valid low-latency round trips. Returns ``[(step, outcome)]`` with the last dispatch's counts. (A new
    user's find: the normal-mode call's re-synchronisation cleared the error state the modes share without
    restarting the low-latency call numbers, so the next low-latency call met the rejection's failure words
    and failed on every rank.)"""
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 1 << 20, hint, low_latency_mode=True, num_qps_per_rank=E // world, timeout_s=20)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    log = []

    def step(name, fn):
        try:
            out = fn()
            log.append((name, "ok"))
            return out
        except Exception as e:  # noqa: BLE001
            log.append((name, type(e).__name__))
            return None

    try:
        step("valid", lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False))
        bad = who == "all" or rank == 1
        if who == "badid":      # found by rank 1's kernel (an id of E): a record of a low-latency stage
            bad_idx = idx.clone() if rank != 1 else torch.tensor([[0, E]] * 3)
            step("rejected", lambda: buf.low_latency_dispatch(x, bad_idx, N, E, use_fp8=False))
        else:
            step("rejected", lambda: buf.low_latency_dispatch(x.float() if bad else x, idx, N, E, use_fp8=False))

        def normal():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx)
            combined = buf.combine(rx, handle)[0]
            # each token reaches 2 ranks (experts 0 and E - 1): the sum of its two copies
            assert torch.equal(combined.float(), x.float() * 2), "normal-mode combine"
        step("normal", normal)
        for i in range(2):
            out = step(f"low-latency {i}", lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False))
            if out is not None:
                recv, count, handle = out[0], out[1], out[2]
                comb = buf.low_latency_combine(recv, idx, torch.ones(3, 2), handle)[0]
                assert torch.equal(comb.float(), x.float() * 2), "low-latency combine"
                log.append((f"counts {i}", [int(c) for c in count.tolist()]))
    finally:
        buf.destroy()
    return log


def modes_disagree(rank, world, N, H, E, what):
    """Ranks build their Buffers with different low-latency layouts (``what``: one rank without
    low_latency_mode, or another num_nvl_bytes in low-latency mode): every rank raises ValueError at
    construction, at once, naming the other rank. Returns (error type, seconds, text)."""
    import time
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    ll = not (what == "mode" and rank == 1)
    nvl = (1 << 16) if (what == "nvl" and rank == 1) else 0
    t0 = time.monotonic()
    try:
        buf = triton_ep.Buffer(None, nvl, hint, low_latency_mode=ll, num_qps_per_rank=E // world, timeout_s=20)
        buf.destroy()
        return ("built", 0.0, "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, round(time.monotonic() - t0, 2), str(e))


def hook_then_rejection(rank, world, N, H, E, kind):
    """A hook of call A is pending while call B is rejected somewhere. ``kind`` "dtype": rank 1 passes fp32
    x in B (rank 0's B is valid), then both run A's hook. "badid": rank 1 runs A's hook at once and passes
    an id >= E in B; rank 0 runs A's hook late, after rank 1's B failed. Then both make a valid call C.
    Returns a log of (step, outcome) with A's receive counts where A's hook returned."""
    import time
    buf = _buffer(world, N, H, E, timeout_s=20)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 5 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    bad_idx = torch.tensor([[0, E + 3]] * 3)
    log = []

    def step(name, fn):
        try:
            r = fn()
            log.append((name, "ok" if r is None else r))
        except Exception as e:  # noqa: BLE001
            log.append((name, type(e).__name__))

    def run_hook(hook, count):
        hook()
        return [int(c) for c in count.tolist()]

    _, cnt_a, _, _, hook_a = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, return_recv_hook=True)
    if kind == "dtype":
        xb = x.float() if rank == 1 else x
        step("B", lambda: buf.low_latency_dispatch(xb, idx, N, E, use_fp8=False) and None)
        step("hook A", lambda: run_hook(hook_a, cnt_a))
    else:
        if rank == 1:
            step("hook A", lambda: run_hook(hook_a, cnt_a))
            step("B", lambda: buf.low_latency_dispatch(x, bad_idx, N, E, use_fp8=False) and None)
        else:
            time.sleep(1.0)
            step("hook A", lambda: run_hook(hook_a, cnt_a))
            step("B", lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False) and None)
    step("C", lambda: [int(c) for c in buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)[1].tolist()])
    buf.destroy()
    return log


def across_hosts(rank, world, env, case, *args):
    """Run the case named ``case`` of this module with ``env`` set first (``TRITON_EP_RANKS_PER_HOST``,
    ``TRITON_EP_RDMA=emulated``: ranks standing in for several hosts; or ``TRITON_EP_FUSED``)."""
    os.environ.update(env)
    return globals()[case](rank, world, *args)


#: the low-latency mode's kernel launchers (triton_ep.modes.low_latency.calls' names), counted by :func:`launches_per_call`
LL_LAUNCHERS = ("ll_fence", "ll_route", "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send", "ll_combine_reduce",
                "ll_dispatch_fused", "ll_combine_fused")


def launches_per_call(rank, world, N=8, H=128, E=4, K=2):
    """With ``TRITON_EP_FUSED=1`` (one program a launch under the interpreter): the launches each low-latency call
    makes (its launchers' names, in order), without and with hooks, after a first call of these sizes (which also
    launches the fence), each result checked against its oracle; then the control block's one-launch words
    (``DONE``, ``DONE2``, ``GATE``). Returns ``(launches by step, words)``."""
    os.environ["TRITON_EP_FUSED"] = "1"
    from triton_ep.kernels import flags as F
    import triton_ep.modes.low_latency.calls as LL
    R, me, El = world, rank, E // world
    a = ll_inputs(5, R, E, K, H, [5, 7][:R] + [3] * max(0, R - 2))
    log = []
    for name in LL_LAUNCHERS:
        real = getattr(LL, name)

        def counted(*args, _real=real, _name=name, **kw):
            log.append(_name)
            return _real(*args, **kw)
        setattr(LL, name, counted)
    # a call of the last call's sizes replays its launch (modes/low_latency/replay.py): counted by its kernel
    from triton_ep.kernels import launch as L
    real_replay = L.Replay.__call__

    def replayed(self, *args):
        log.append(self.bound.launcher.name)
        return real_replay(self, *args)
    L.Replay.__call__ = replayed
    buf = _buffer(R, N, H, E, timeout_s=60)
    steps = {}

    def step(tag, fn):
        del log[:]
        r = fn()
        steps[tag] = list(log)
        return r

    try:
        buf.low_latency_dispatch(a[0][me], a[1][me], N, E, use_fp8=False)       # the first call: its fence
        for use_fp8 in (False, True):
            o, c, h, _, _ = step(f"dispatch fp8={use_fp8}", lambda: buf.low_latency_dispatch(
                a[0][me], a[1][me], N, E, use_fp8=use_fp8, round_scale=use_fp8, use_ue8m0=False))
            check_dispatch(o, c, h, a[0], a[1], R, E, me, use_fp8, use_fp8, False)
        o, c, h, _, hook = step("dispatch with hook", lambda: buf.low_latency_dispatch(
            a[0][me], a[1][me], N, E, use_fp8=False, return_recv_hook=True))
        step("dispatch hook", hook)
        check_dispatch(o, c, h, a[0], a[1], R, E, me, False, False, False)
        y = torch.stack([expert_fn("affine", me * El + le, o[le]) for le in range(El)])
        want = expected_combine(a[0][me], a[1][me], a[2][me], E, R, "affine").view(torch.int16)
        out, _, _ = step("combine", lambda: buf.low_latency_combine(y, a[1][me], a[2][me], h))
        assert torch.equal(out.view(torch.int16), want), "combine"
        out, _, hook = step("combine with hook", lambda: buf.low_latency_combine(y, a[1][me], a[2][me], h,
                                                                                 return_recv_hook=True))
        step("combine hook", hook)
        assert torch.equal(out.view(torch.int16), want), "combine with hook"
        w = buf._ll.ctl.tolist()
        return steps, (w[int(F.L_DONE)], w[int(F.L_DONE2)], w[int(F.L_GATE)])
    finally:
        L.Replay.__call__ = real_replay
        buf.destroy()


def skew_to_remote(rank, world, E, K, H, T, N):
    """Every token of every rank goes to the last expert (on the last rank: another host for the first
    ones), its other entries -1 or duplicates of it: a round trip in bf16 and FP8, checked as
    :func:`round_trip` checks."""
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(world)]
    idxs = []
    for r in range(world):
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = E - 1
        idx[::2, K - 1] = E - 1          # a duplicate in every other token
        idxs.append(idx)
    ws = [torch.rand(T, K, generator=gen) for _ in range(world)]
    cases = [(False, False, False, "affine", False, False), (True, True, False, "identity", True, False)]
    return round_trip(rank, world, 0, E, K, H, [T] * world, N, cases, inputs=(xs, idxs, ws))


def _round_trip_checked(buf, rank, world, seed, N, H, E, K) -> bool:
    """A bf16 low-latency dispatch and identity combine of 3 tokens a rank (inputs of ``seed``), each checked against
    its oracle bit for bit; returns True."""
    xs, idxs, ws = ll_inputs(seed, world, E, K, H, [3] * world)
    recv, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
    check_dispatch(recv, count, handle, xs, idxs, world, E, rank, False, False, False)
    comb = buf.low_latency_combine(recv, idxs[rank], ws[rank], handle)[0]
    want = expected_combine(xs[rank], idxs[rank], ws[rank], E, world, "identity")
    assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), f"round trip {seed}"
    return True


def rejected_across_hosts(rank, world, N, H, E):
    """Errors that do not end the Buffer, then recovery: rank 0 rejects a dispatch (bad dtype: TypeError there,
    EPRemoteError naming it elsewhere, at once: the failure travels in the call's chunk); the next round trip
    works on every rank (the group re-synchronised); rank 1 passes ids outside [-1, E) (ValueError there,
    EPRemoteError elsewhere); the next round trip works again. Returns the errors per step and their seconds."""
    import time
    K = 2
    buf = _buffer(world, N, H, E, timeout_s=20)
    out = {}

    def round_trip_ok(seed):
        return _round_trip_checked(buf, rank, world, seed, N, H, E, K)

    def failing(name, x, idx):
        t0 = time.monotonic()
        try:
            buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
            out[name] = None
        except Exception as ex:     # noqa: BLE001
            out[name] = [type(ex).__name__, str(ex)]
        out[name + "_s"] = time.monotonic() - t0

    try:
        out["first"] = round_trip_ok(3)
        xs, idxs, _ = ll_inputs(4, world, E, K, H, [3] * world)
        failing("dtype", xs[rank].float() if rank == 0 else xs[rank], idxs[rank])
        out["after_dtype"] = round_trip_ok(5)
        bad = idxs[rank].clone()
        if rank == 1:
            bad[0, 0] = E + 3
        failing("ids", xs[rank], bad)
        out["after_ids"] = round_trip_ok(6)
        return out
    finally:
        buf.destroy()


def rejected_right_after_a_meeting(rank, world, slow_rank, delay_s=0.4):
    """2 hosts of 2 ranks (``TRITON_EP_RANKS_PER_HOST=2``; rank 1's host mate, rank 0, reached through the shared
    buffer): rank 1 rejects three dispatches in a row (a float topk_idx, found before launch), the last two right
    after the re-synchronisation the one before needs, while ``slow_rank`` takes ``delay_s`` more between the meeting
    and its restart of the call numbers (``NetLeg._restart``): rank 1 leaves the meeting first and posts its failure
    word for the call into its host mate's control block while that rank still restarts (issue: the restart cleared
    the word, so the host mate waited out ``timeout_s``, its Buffer then unusable). Then a round trip. Returns
    ``[(step, outcome, seconds)]``: the error type raised and its message, or the round trip's ``True``."""
    import time
    from triton_ep.modes.internode.low_latency import NetLeg
    N, H, E, K = 4, 128, 8, 2
    real_restart = NetLeg._restart

    def slow_restart(*args):
        time.sleep(delay_s)
        real_restart(*args)
    if rank == slow_rank:
        NetLeg._restart = staticmethod(slow_restart)
    buf = _buffer(world, N, H, E, timeout_s=6)
    log = []

    def step(name, fn):
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - reported
            out = [type(e).__name__, str(e)]
        log.append((name, out, round(time.monotonic() - t0, 1)))

    def rejected(seed):
        xs, idxs, _ = ll_inputs(seed, world, E, K, H, [3] * world)
        idx = idxs[rank].float() if rank == 1 else idxs[rank]
        buf.low_latency_dispatch(xs[rank], idx, N, E, use_fp8=False)
        return "no error"

    try:
        step("first", lambda: _round_trip_checked(buf, rank, world, 3, N, H, E, K))
        for k in range(3):
            step(f"float {k}", lambda: rejected(4 + k))
        step("after", lambda: _round_trip_checked(buf, rank, world, 8, N, H, E, K))
        return log
    finally:
        NetLeg._restart = real_restart
        buf.destroy()


def peers_on_network(rank, world, allow_nvlink):
    """A bf16 round trip on a low-latency Buffer across hosts; returns the ranks this rank's network leg
    carried bytes to and the ranks it has QPs to (``Buffer.get_rdma_stats()["low_latency"]``, QP keys
    ``"peer/QP"``), and how many QPs."""
    E, K, H, N = 2 * world, 2, 128, 4
    cases = [(False, False, False, "identity", False, False)]
    xs, idxs, ws = ll_inputs(9, world, E, K, H, [N] * world)
    for i in idxs:      # every token to one expert of every rank: every peer gets rows
        i[:, 0] = torch.arange(i.shape[0]) % world * (E // world)
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=2, timeout_s=60,
                           allow_nvlink_for_low_latency_mode=allow_nvlink)
    try:
        for use_fp8, round_scale, use_ue8m0, kind, hook, zero_copy in cases:
            out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
            check_dispatch(out, count, handle, xs, idxs, world, E, rank, False, False, False)
            comb = buf.low_latency_combine(out, idxs[rank], ws[rank], handle)[0]
            assert torch.equal(comb.view(torch.int16),
                               expected_combine(xs[rank], idxs[rank], ws[rank], E, world, kind).view(torch.int16))
        qps = buf.get_rdma_stats()["low_latency"]["qps"]
        return (sorted({int(k.split("/")[0]) for k, v in qps.items() if v["bytes"] > 0}),
                sorted({int(k.split("/")[0]) for k in qps}), len(qps))
    finally:
        buf.destroy()


def _cpu(v):
    """``v`` with every tensor in it (tuples too) copied to the CPU."""
    if isinstance(v, torch.Tensor):
        return v.cpu()
    if isinstance(v, tuple):
        return tuple(_cpu(e) for e in v)
    return v


def _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, use_fp8, hook, masked, device="cpu"):
    """One low-latency dispatch (with or without its receive hook) and combine on ``buf``, checked bit for bit
    against the oracle with the ranks ``masked`` left out (their tokens and their experts' entries)."""
    x_d, idx_d, w_d = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    out, count, handle, _, recv = buf.low_latency_dispatch(x_d, idx_d, N, E, use_fp8=use_fp8, return_recv_hook=hook)
    if hook:
        recv()
    check_dispatch(_cpu(out), _cpu(count), _cpu(handle), xs, idxs, world, E, rank, use_fp8, False, False,
                   masked=masked)
    rx = (_dequant_rows(out[0], out[1], False).to(torch.bfloat16)) if use_fp8 else out
    comb = _cpu(buf.low_latency_combine(rx, idx_d, w_d, handle)[0])
    xin = _dequant_x(xs[rank]) if use_fp8 else xs[rank]
    want = expected_combine(xin, idxs[rank], ws[rank], E, world, "identity", masked=masked)
    assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), (use_fp8, hook, masked)


def silent_peers(rank, world, victims, by_timeout, device="cpu", timeout_s=4.0):
    """Ranks ``victims`` (a remote rank, or a whole host) build the Buffer and then take no part. The others,
    with ``enable_shrink``, mask them (explicitly, or ``by_timeout``): exactly their tokens and their
    experts' entries are dropped, the next call does not wait again, and the mask query reports them.
    Unmasking them is a collective call across hosts, which the silent ranks do not join: it raises
    ``EPTimeoutError`` after ``timeout_s``, and nothing changed (still masked, a round trip without them works).
    Returns ``(mask status, seconds of each round trip, the unmask
    error's text)``. ``device="cuda"``: every rank on GPU 0 (outputs checked on the CPU)."""
    import time
    from triton_ep.errors import EPTimeoutError
    if device == "cuda":
        torch.cuda.set_device(0)
    E, K, H, N = 2 * world, 2, 128, 8
    xs, idxs, ws = ll_inputs(4, world, E, K, H, [N - 1] * world)
    buf = _buffer(world, N, H, E, timeout_s=timeout_s, enable_shrink=True, device=device)
    victims = tuple(victims)
    try:
        if rank in victims:
            return None
        if not by_timeout:
            for v in victims:
                buf.low_latency_update_mask_buffer(v, True)
        waits = []
        for use_fp8 in (False, False, True):
            t0 = time.monotonic()
            _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, use_fp8, True, victims, device)
            waits.append(time.monotonic() - t0)
        status = torch.zeros(world, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        try:
            buf.low_latency_clean_mask_buffer()
            unmask = None
        except EPTimeoutError as ex:
            unmask = str(ex)
        # nothing changed: the silent ranks are still masked, and the Buffer still works without them
        after = torch.zeros(world, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(after)
        assert torch.equal(after, status), (after, status)
        _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, True, False, victims, device)
        return status.tolist(), waits, unmask
    finally:
        torch.distributed.barrier()         # the victims stay alive but silent until the others are done
        buf.destroy()


def recovering_peer(rank, world, victim, by_timeout, how="clean", timeout_s=4.0, device="cpu"):
    """Rank ``victim`` builds the Buffer and stays silent while the others, with ``enable_shrink``, mask it
    (explicitly, or after one timeout) and make round trips without it; then it comes back, and every rank
    (the victim too) unmasks it, a collective across hosts: ``how`` ``"clean"``
    (``low_latency_clean_mask_buffer``) or ``"update"`` (``low_latency_update_mask_buffer(victim, False)``). The
    round trips after
    that include it again, bit for bit the oracle's (bf16 and FP8, with and without hooks). Then the ranks
    make different unmask calls (rank 0 ``update_mask_buffer(victim, False)``, the others
    ``clean_mask_buffer()``): every rank raises ``ValueError`` and nothing changed (a round trip follows).
    Returns ``(mask status before the unmask (None on the victim), after it, the mismatch's text)``.
    ``device="cuda"``: every rank on GPU 0 (outputs checked on the CPU)."""
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(0)
    E, K, H, N = 2 * world, 2, 128, 8
    xs, idxs, ws = ll_inputs(5, world, E, K, H, [N - 1] * world)
    buf = _buffer(world, N, H, E, timeout_s=timeout_s, enable_shrink=True, device=device)
    status = torch.zeros(world, dtype=torch.int32)
    try:
        before = None
        if rank != victim:
            if not by_timeout:
                buf.low_latency_update_mask_buffer(victim, True)
            for use_fp8 in (False, True):
                _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, use_fp8, True, (victim,), device)
            buf.low_latency_query_mask_buffer(status)
            before = status.tolist()
        dist.barrier()                      # the victim comes back once the others have gone on without it
        if how == "clean":
            buf.low_latency_clean_mask_buffer()
        else:
            buf.low_latency_update_mask_buffer(victim, False)
        buf.low_latency_query_mask_buffer(status)
        after = status.tolist()
        for use_fp8, hook in ((False, True), (True, False), (False, False)):
            _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, use_fp8, hook, (), device)
        try:
            if rank == 0:
                buf.low_latency_update_mask_buffer(victim, False)
            else:
                buf.low_latency_clean_mask_buffer()
            mismatch = None
        except ValueError as ex:
            mismatch = str(ex)
        _masked_round_trip(buf, rank, world, xs, idxs, ws, E, N, True, True, (), device)
        return before, after, mismatch
    finally:
        buf.destroy()


def _dequant_x(x):
    q, s = quantize_reference(x, False)
    return (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def ordering(rank, world, planted):
    """Round trips over a fabric that reorders requests across QPs (``TRITON_EP_EMULATED_REORDER_S`` and
    ``TRITON_EP_EMULATED_SKEW_S``), with a probe at each chunk's signal (the scheduler's ``on_signal`` hook, run
    when the signal arrives, before the tail moves): the chunk in the receive slot must already be the one
    signalled (its header names the call ``seq + 1``). With ``planted`` every rank's scheduler posts each chunk's
    signal on the next QP instead of the data's (the bug in-QP ordering prevents), so signals overtake rows. Returns ``(what failed or None,
    chunks seen incomplete at their signal, signals probed)``."""
    import numpy as np
    from triton_ep.scheduler import Scheduler, is_chunk_signal
    real_ops, real_init = Scheduler._chunk_ops, Scheduler.__init__
    seen = {"bad": 0, "all": 0}

    def init(self, transport, **kw):
        def probe(peer, qp, seq):
            head = self.recv_view(peer, seq)[:8].view(np.int64)
            seen["all"] += 1
            seen["bad"] += int(head[0]) != seq + 1
        real_init(self, transport, on_signal=probe, **kw)

    def signal_elsewhere(self, peer, qp, seq, nbytes, signaled):
        ops = real_ops(self, peer, qp, seq, nbytes, signaled)     # (the signal: a WRITE_WITH_IMM or arrival word)
        return [((q + 1) % self.t.num_qps_per_peer if is_chunk_signal(op) else q, op) for q, op in ops]
    Scheduler.__init__ = init
    if planted:
        Scheduler._chunk_ops = signal_elsewhere
    E, K, H, N = 4 * world, 3, 2048, 8
    buf = _buffer(world, N, H, E, timeout_s=3)
    failed = None
    try:
        for i in range(10):
            xs, idxs, ws = ll_inputs(20 + i, world, E, K, H, [N] * world)
            try:
                out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
                check_dispatch(out, count, handle, xs, idxs, world, E, rank, False, False, False)
                comb = buf.low_latency_combine(out, idxs[rank], ws[rank], handle)[0]
                want = expected_combine(xs[rank], idxs[rank], ws[rank], E, world, "identity")
                assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine differs from the oracle"
            except Exception as ex:     # noqa: BLE001 - what failed is the result
                failed = f"call {i}: {type(ex).__name__}: {ex}"
                break
        return failed, seen["bad"], seen["all"]
    finally:
        buf.destroy()


def combine_before_hook(rank, world):
    """A combine given the handle of a dispatch whose receive hook has not run is refused (ValueError on every
    rank: the handle's tables are written by that receive), the hook then delivers the dispatch's rows, and
    the next round trip matches the oracle (the group re-synchronised)."""
    E, K, H, N = 2 * world, 2, 128, 4
    buf = _buffer(world, N, H, E, timeout_s=20)
    try:
        xs, idxs, ws = ll_inputs(2, world, E, K, H, [N] * world)
        out, count, handle, _, hook = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False,
                                                               return_recv_hook=True)
        try:
            buf.low_latency_combine(out, idxs[rank], ws[rank], handle)
            refused = None
        except ValueError as ex:
            refused = str(ex)
        hook()
        check_dispatch(out, count, handle, xs, idxs, world, E, rank, False, False, False)
        xs, idxs, ws = ll_inputs(3, world, E, K, H, [N] * world)
        out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
        comb = buf.low_latency_combine(out, idxs[rank], ws[rank], handle)[0]
        want = expected_combine(xs[rank], idxs[rank], ws[rank], E, world, "identity")
        return refused, torch.equal(comb.view(torch.int16), want.view(torch.int16))
    finally:
        buf.destroy()


def mode_mismatch(rank, world, zero_qps=False):
    """Rank 0 builds its Buffer without low_latency_mode, the others with it (``zero_qps``: every rank with
    it and ``num_qps_per_rank=0``): ValueError on every rank, then a Buffer built alike on every rank works
    (the ranks' exchanges stayed in step)."""
    E, H, N = 2 * world, 128, 4
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    try:
        triton_ep.Buffer(None, 1 << 20, hint, low_latency_mode=zero_qps or rank != 0,
                         num_qps_per_rank=0 if zero_qps else 1, timeout_s=20).destroy()
        first = None
    except ValueError as ex:
        first = str(ex)
    buf = _buffer(world, N, H, E, timeout_s=20)
    try:
        xs, idxs, _ = ll_inputs(5, world, E, 2, H, [N] * world)
        out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
        check_dispatch(out, count, handle, xs, idxs, world, E, rank, False, False, False)
        return first
    finally:
        buf.destroy()


def wide_topk(rank, world):
    """top-k wider than num_experts on every rank: each gets ValueError before anything launches; then a
    call with 2 columns works. Returns ``(the error's message, rows this rank received)``."""
    E, H, N = 2 * world, 128, 4
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=2, timeout_s=60)
    try:
        x = torch.randn(2, H).to(torch.bfloat16)
        try:
            buf.low_latency_dispatch(x, torch.zeros(2, E + 1, dtype=torch.int64), N, E, use_fp8=False)
            return "no error", 0
        except ValueError as e:
            msg = str(e)
        _, count, _, _, _ = buf.low_latency_dispatch(x, torch.tensor([[0, 1], [E - 1, 0]]), N, E, use_fp8=False)
        return msg, int(count.sum())
    finally:
        buf.destroy()


def size_change(rank, world, delay_s=1.5, device="cpu"):
    """Sizes that change between calls while a peer is slow: every rank dispatches and combines with N = 8;
    rank 1 holds its combine's receive hook for ``delay_s`` while rank 0 goes on to a dispatch with N = 1,
    whose half of the area lies over the half rank 1 has still to reduce. Both results must equal the oracle
    (the new sizes' first call waits until every peer received the last call). Then a call of other sizes
    while this rank's hook is pending is refused. Returns ``(rank 1's combine equal, dispatch B checked,
    the refusal's message)``. ``device="cuda"``: every rank on GPU 0 (outputs checked on the CPU)."""
    import time
    if device == "cuda":
        torch.cuda.set_device(0)
    R, me = world, rank
    E, K, H = 2 * R, 2, 128
    El = E // R
    big, small = 8, 1
    gen = torch.Generator().manual_seed(5)
    xs = [(torch.randn(big, H, generator=gen) * 3).to(torch.bfloat16) for _ in range(R)]
    # every expert gets tokens: rank 1's combine rows fill its half; the next records (to rank 1) land on it
    idxs = [torch.tensor([[e, (e + 1) % E] for e in range(big)]) % E for _ in range(R)]
    ws = [torch.rand(big, K, generator=gen) for _ in range(R)]
    xb = [(torch.randn(small, H, generator=gen) * 3).to(torch.bfloat16) for _ in range(R)]
    ib = [torch.tensor([[El + 1, El]]) for _ in range(R)]     # rank 1's experts
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(big, H, R, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=El, timeout_s=60, device=device)
    d = lambda t: t.to(device)      # noqa: E731
    try:
        out, count, handle, _, _ = buf.low_latency_dispatch(d(xs[me]), d(idxs[me]), big, E, use_fp8=False)
        out, count, handle_c = _cpu(out), _cpu(count), _cpu(handle)
        check_dispatch(out, count, handle_c, xs, idxs, R, E, me, False, False, False)
        y = torch.stack([expert_fn("affine", me * El + le, out[le]) for le in range(El)])
        comb, _, hook = buf.low_latency_combine(d(y), d(idxs[me]), d(ws[me]), handle, return_recv_hook=True)
        if me == 1:
            time.sleep(delay_s)     # rank 0's next call (other sizes) comes meanwhile
        hook()
        same = torch.equal(_cpu(comb).view(torch.int16),
                           expected_combine(xs[me], idxs[me], ws[me], E, R, "affine").view(torch.int16))
        out_b, count_b, handle_b, _, _ = buf.low_latency_dispatch(d(xb[me]), d(ib[me]), small, E, use_fp8=False)
        check_dispatch(_cpu(out_b), _cpu(count_b), _cpu(handle_b), xb, ib, R, E, me, False, False, False)
        # other sizes while a hook of this rank is pending: refused on every rank (the first call of new sizes
        # waits for every peer's receive of the last call, and this rank's own would never come)
        _, _, _, _, hook_c = buf.low_latency_dispatch(d(xb[me]), d(ib[me]), small, E, use_fp8=False,
                                                      return_recv_hook=True)
        try:
            buf.low_latency_dispatch(d(xs[me]), d(idxs[me]), big, E, use_fp8=False)
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        hook_c()
        return same, True, msg
    finally:
        buf.destroy()


def pdl_bad_value(rank, world):
    """A process started with a TRITON_EP_PDL that is no switch value: its first low-latency dispatch raises
    ValueError naming the variable, before anything launches; the Buffer is destroyed cleanly."""
    N, H, E = 8, 128, 4
    buf = _buffer(world, N, H, E)
    try:
        x = torch.randn(4, H).bfloat16()
        idx = torch.randint(0, E, (4, 2))
        try:
            buf.low_latency_dispatch(x, idx, N, E)
        except ValueError as e:
            return str(e)
        return None
    finally:
        buf.destroy()


def arrival_words(rank, world):
    """Three round trips checked against the oracle; returns ``(the network leg's arrival_words, work requests
    its proxy posted, low-latency calls made)``."""
    E, K, H, N = 2 * world, 2, 128, 4
    buf = _buffer(world, N, H, E, timeout_s=20)
    try:
        calls = 0
        for i in range(3):
            xs, idxs, ws = ll_inputs(30 + i, world, E, K, H, [N] * world)
            out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
            check_dispatch(out, count, handle, xs, idxs, world, E, rank, False, False, False)
            comb = buf.low_latency_combine(out, idxs[rank], ws[rank], handle)[0]
            want = expected_combine(xs[rank], idxs[rank], ws[rank], E, world, "identity")
            assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine differs from the oracle"
            calls += 2
        # every chunk placed and credited (the last credit may trail the call): wait for the counters to settle
        sched = buf._ll.net.sched
        import time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sched.stats()["wrs"] < (3 if sched.arrival_words else 2) * calls:
            time.sleep(0.01)
        return buf._ll.net.arrival_words, buf.get_rdma_stats()["low_latency"]["wrs"], calls
    finally:
        buf.destroy()


def env_mismatch(rank, world, var, value, low_latency):
    """Rank 1 alone sets environment variable ``var`` to ``value``; every rank builds a Buffer across hosts (in
    low-latency mode, or in normal mode only), which must raise on every rank."""
    if rank == 1:
        os.environ[var] = value
    if low_latency:
        _buffer(world, 4, 128, 2 * world, timeout_s=20).destroy()
    else:
        triton_ep.Buffer(None, 1 << 20, timeout_s=20).destroy()


def control_words(rank, world, N=8, H=128, E=4, K=2):
    """The control block's words through calls without and with hooks (``L_SEQ``, ``NEXT``, ``PEND``, ``CONS``,
    ``READY``), and a call without a hook while another's hook is pending: each result equals its oracle.
    Returns the words seen after each step (every rank sees the same)."""
    from triton_ep.kernels import flags as F
    R, me, El = world, rank, E // world
    a = ll_inputs(3, R, E, K, H, [5] * R)
    b = ll_inputs(4, R, E, K, H, [6] * R)
    buf = _buffer(R, N, H, E, timeout_s=60)
    ctl = buf._ll.ctl
    seen = []

    def words(tag):
        w = ctl.tolist()
        ready = [w[int(F.off_ll_ready.host(R)) + h * R + s] for h in (0, 1) for s in range(R)]
        seen.append((tag, w[int(F.L_SEQ)], w[int(F.L_NEXT)], w[int(F.L_PEND)], w[int(F.L_PEND) + 1],
                     w[int(F.L_CONS)], w[int(F.L_CONS) + 1], w[int(F.L_DONE)], ready))

    try:
        # call 1, no hook: the send leaves NEXT = 1, the receive publishes (SEQ, READY) and records PEND[1]
        o1, c1, h1, _, _ = buf.low_latency_dispatch(a[0][me], a[1][me], N, E, use_fp8=False)
        check_dispatch(o1, c1, h1, a[0], a[1], R, E, me, False, False, False)
        words("dispatch 1")
        # call 2 with a hook: the send counts its programs and publishes; it released CONS[1] = 1 first
        y1 = torch.stack([expert_fn("affine", me * El + le, o1[le]) for le in range(El)])
        out2, _, hook2 = buf.low_latency_combine(y1, a[1][me], a[2][me], h1, return_recv_hook=True)
        words("combine 2 sent")
        hook2()
        words("combine 2 received")
        assert torch.equal(out2.view(torch.int16),
                           expected_combine(a[0][me], a[1][me], a[2][me], E, R, "affine").view(torch.int16))
        # call 3 with a hook, then call 4 without one while 3's hook is pending, then 3's hook
        o3, c3, h3, _, hook3 = buf.low_latency_dispatch(b[0][me], b[1][me], N, E, use_fp8=False,
                                                        return_recv_hook=True)
        o4, c4, h4, _, _ = buf.low_latency_dispatch(a[0][me], a[1][me], N, E, use_fp8=False)
        words("dispatch 4 beside 3's hook")
        hook3()
        words("dispatch 3 received")
        check_dispatch(o3, c3, h3, b[0], b[1], R, E, me, False, False, False)
        check_dispatch(o4, c4, h4, a[0], a[1], R, E, me, False, False, False)
        y4 = torch.stack([expert_fn("identity", me * El + le, o4[le]) for le in range(El)])
        out5, _, _ = buf.low_latency_combine(y4, a[1][me], a[2][me], h4)
        words("combine 5")
        assert torch.equal(out5.view(torch.int16),
                           expected_combine(a[0][me], a[1][me], a[2][me], E, R, "identity").view(torch.int16))
        return seen
    finally:
        buf.destroy()


def replayed_calls(rank, world, device="cpu"):
    """Decode-like steps (fresh x, routing and weights each step, the same sizes): low-latency dispatches and
    combines of one launch replay the plan of the last call (modes/low_latency/replay.py), each result against the
    oracle (FP8 with UE8M0 scales, stats and cost tensors); then what takes the general path (another stats
    argument, a receive hook, a non-contiguous x, the re-synchronisation after a rank's bad ids: that call is
    replayed and raises ``ValueError`` there and ``EPRemoteError`` on its peers) and ``destroy()`` dropping the
    plans. Returns ``(dispatch replays, combine replays, the error this rank raised)``."""
    os.environ["TRITON_EP_FUSED"] = "1"
    from triton_ep.errors import EPRemoteError
    from triton_ep.modes.low_latency import replay as RP
    from triton_ep.protocol import call_card as card
    if device == "cuda":
        torch.cuda.set_device(0)
    R, me, N, E, K, H = world, rank, 8, 2 * world, 3, 512
    El = E // R
    counts = {card.LL_DISPATCH: 0, card.LL_COMBINE: 0}
    real_usable = RP.LLPlan.usable

    def usable(self, sizes):
        ok = real_usable(self, sizes)
        counts[self.card[0]] += ok
        return ok
    RP.LLPlan.usable = usable
    buf = _buffer(R, N, H, E, timeout_s=60, device=device)
    dev = buf.device
    stats = torch.zeros(El, dtype=torch.int32, device=dev)
    cost = torch.zeros(R, dtype=torch.int64, device=dev)
    err = None

    def step(k, with_stats=True, hook=False, contiguous=True):
        xs, idxs, ws = ll_inputs(100 + k, R, E, K, H, [6] * R)
        x = xs[me].to(dev)
        if not contiguous:
            x = x.t().contiguous().t()
        o, c, h, _, hk = buf.low_latency_dispatch(
            x, idxs[me].to(dev), N, E, cumulative_local_expert_recv_stats=stats if with_stats else None,
            dispatch_wait_recv_cost_stats=cost, use_fp8=True, round_scale=True, use_ue8m0=True, return_recv_hook=hook)
        if hook:
            hk()
        o = (o[0].cpu(), o[1].cpu())
        check_dispatch(o, c.cpu(), tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in h), xs, idxs, R, E, me,
                       True, True, True)
        rx = _dequant_rows(o[0], o[1], True).to(torch.bfloat16)
        y = torch.stack([expert_fn("affine", me * El + le, rx[le]) for le in range(El)])
        comb, _, _ = buf.low_latency_combine(y.to(dev), idxs[me].to(dev), ws[me].to(dev), h,
                                             combine_wait_recv_cost_stats=cost)
        q, s = quantize_reference(xs[me], True)
        xin = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
        want = expected_combine(xin, idxs[me], ws[me], E, R, "affine")
        assert torch.equal(comb.cpu().view(torch.int16), want.view(torch.int16)), k

    try:
        for k in range(4):
            step(k)                     # the first: the general path, plans; then replays
        step(4, with_stats=False)       # another stats argument: the general path (the combine replays)
        step(5)                         # ... and back: the general path
        step(6, hook=True)              # a receive hook: the general path
        step(7)
        xs, idxs, _ = ll_inputs(108, R, E, K, H, [6] * R)
        idx = idxs[me].clone()
        if me == 1:
            idx[0, 0] = E + 3           # rank 1's bad ids, found by the replayed launch
        try:
            buf.low_latency_dispatch(xs[me].to(dev), idx.to(dev), N, E, cumulative_local_expert_recv_stats=stats,
                                     dispatch_wait_recv_cost_stats=cost, use_fp8=True, round_scale=True,
                                     use_ue8m0=True)
            if device == "cuda":        # (on GPU the error is known once the kernels ran)
                torch.cuda.synchronize()
                buf.check()
        except (ValueError, EPRemoteError) as e:
            err = type(e).__name__
        step(9)                         # the re-synchronisation: the general path
        step(10)
        step(11, contiguous=False)      # a non-contiguous x: the general path
        plans = (buf._ll.replay_dispatch, buf._ll.replay_combine)
        xs, idxs, _ = ll_inputs(112, R, E, K, H, [6] * R)
        for n, e in ((float(N), E), (N, float(E)), (N, True)):
            try:                        # values the general path refuses are refused with a plan too
                buf.low_latency_dispatch(xs[me].to(dev), idxs[me].to(dev), n, e,
                                         cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=cost,
                                         use_fp8=True, round_scale=True, use_ue8m0=True)
                raise AssertionError(f"a dispatch with N, E = {n!r}, {e!r} ran")
            except (TypeError, ValueError):     # (a float N: TypeError; a float or bool E: ValueError)
                pass
    finally:
        RP.LLPlan.usable = real_usable
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()
    assert all(p.launch is None for p in plans), "destroy() drops the plans"
    return counts[card.LL_DISPATCH], counts[card.LL_COMBINE], err


def hidden_refusals(rank, world, N=4, E=4, K=2):
    """An FP8 dispatch at hidden 2880, a bf16 one at hidden 2884 (rows of 5768 bytes) and the size hint at 2884:
    each ``ValueError``'s key phrase; then a bf16 dispatch at 2880 that works, a LogFMT combine of it refused (blocks
    of 128 channels) and a bf16 combine that works. Returns the phrases in order."""
    R, me = world, rank
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, 2888, R, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=E // R, timeout_s=60)
    seen = []
    try:
        idx = torch.tensor([[0, 3], [1, -1]], dtype=torch.int64)
        for H, fp8, phrase in ((2880, True, "use_fp8=True"), (2884, False, "hidden % 8 == 0")):
            try:
                buf.low_latency_dispatch(torch.zeros(2, H, dtype=torch.bfloat16), idx, N, E, use_fp8=fp8)
            except ValueError as e:
                assert phrase in str(e) and str(H) in str(e), str(e)
                seen.append(phrase)
        try:
            triton_ep.Buffer.get_low_latency_rdma_size_hint(N, 2884, R, E)
        except ValueError as e:
            assert "2884" in str(e), str(e)
            seen.append("not a multiple of 8")
        xs, idxs, ws = ll_inputs(3, R, E, K, 2880, [2, 3])
        out, count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], N, E, use_fp8=False)
        check_dispatch(out, count, handle, xs, idxs, R, E, me, False, False, False)
        try:        # LogFMT codes blocks of 128 channels: 2880 is refused before anything launches
            buf.low_latency_combine(out, idxs[me], ws[me], handle, use_logfmt=True)
        except ValueError as e:
            assert "use_logfmt=True" in str(e) and "2880" in str(e), str(e)
            seen.append("logfmt refused")
        comb, _, _ = buf.low_latency_combine(out, idxs[me], ws[me], handle)
        want = expected_combine(xs[me], idxs[me], ws[me], E, R, "identity")
        assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "combine after the refusal"
        seen.append("ok")
        return seen
    finally:
        buf.destroy()


def bad_calls_among_replays(rank, world, slow_rank, delay_s=0.4):
    """Rank 1 alternates valid calls with bad ones while rank 0 always passes good arguments: a float topk_idx
    (found before launch) and ids of -3 (found by rank 1's kernel), a dispatch and a combine, some while rank 0
    replays the last call's plan (modes/low_latency/replay.py), some right after a re-synchronisation (both take
    the general path). ``slow_rank`` takes ``delay_s`` more between the re-synchronisation meeting and its restart
    of the call numbers, so a rank that rejects its call at once posts its failure word while that rank still
    restarts (a new user's find: the restart cleared the word, so the peer waited out ``timeout_s``). Returns
    ``[(step, outcome)]`` with the valid steps' counts, and the dispatch plans rank 0 replayed."""
    import time
    os.environ["TRITON_EP_FUSED"] = "1"        # (one launch a call: the calls leave plans to replay)
    from triton_ep.modes.low_latency import replay as RP
    from triton_ep.modes.low_latency.state import LowLatencyState
    N, H, E = 4, 128, 4
    real_apply, real_usable = LowLatencyState.resync_apply, RP.LLPlan.usable
    replays = []

    def slow_apply(self, slots):
        time.sleep(delay_s)
        real_apply(self, slots)

    def usable(self, sizes):
        ok = real_usable(self, sizes)
        replays.append(ok)
        return ok
    if rank == slow_rank:
        LowLatencyState.resync_apply = slow_apply
    RP.LLPlan.usable = usable
    buf = _buffer(world, N, H, E, timeout_s=6)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    log = []

    def call(name, bad):
        t0 = time.monotonic()
        try:
            i = idx
            if rank == 1 and bad == "float":
                i = idx.float()
            elif rank == 1 and bad == "neg3":
                i = torch.full_like(idx, -3)
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, i, N, E, use_fp8=False)
            w = torch.ones(3, 2)
            if rank == 1 and bad == "weights":
                w = w.double()
            comb = buf.low_latency_combine(recv, idx, w, handle)[0]
            assert torch.equal(comb.float(), x.float() * 2), "combine"
            out = [int(c) for c in count.tolist()]
        except Exception as e:  # noqa: BLE001
            out = type(e).__name__
        log.append((name, out, round(time.monotonic() - t0, 1)))

    try:
        call("valid 0", None)              # the general path; leaves plans
        call("valid 1", None)              # replayed
        call("float at a replay", "float")      # rank 0 replays, rank 1 rejects before launch
        for k in range(2):                 # each after a re-synchronisation: the general path on both
            call(f"neg3 {k}", "neg3")
            call(f"float {k}", "float")
        call("valid 2", None)
        call("valid 3", None)              # replayed
        call("weights at a replay", "weights")  # rank 0 replays the combine, rank 1 rejects its weights
        call("valid 4", None)
    finally:
        LowLatencyState.resync_apply, RP.LLPlan.usable = real_apply, real_usable
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()
    return log, sum(replays)


def interrupted_mid_call(rank, world, at_call):
    """Rank 1 gets SIGINT in the middle of its low-latency call number ``at_call`` (dispatches and combines counted
    from 1; the first is the general path, later ones replay its plan): it raises ``KeyboardInterrupt``, its next
    call ``EPError`` (it left the group). Its peers raise ``EPRemoteError`` naming it at once, not at ``timeout_s``
    (a new user's find: they waited out ``timeout_s``; normal mode named the rank in 0.2 s). Returns
    ``[(step, error type, seconds, text)]``."""
    import signal
    import time
    from triton_ep.modes.low_latency.calls import LowLatency
    os.environ["TRITON_EP_FUSED"] = "1"
    N, H, E = 4, 128, 4
    real_launch = LowLatency.launch
    calls = [0]

    def launch(self, hook, async_finish, body, tensors):
        calls[0] += 1
        if calls[0] != at_call:
            return real_launch(self, hook, async_finish, body, tensors)

        def interrupted():
            os.kill(os.getpid(), signal.SIGINT)      # delivered at the launch's next bytecode
            body()
        return real_launch(self, hook, async_finish, interrupted, tensors)
    if rank == 1:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        LowLatency.launch = launch
    buf = _buffer(world, N, H, E, timeout_s=10)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    log = []
    try:
        for k in range(4):
            t0 = time.monotonic()
            try:
                recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
                buf.low_latency_combine(recv, idx, torch.ones(3, 2), handle)
                log.append((f"round {k}", "ok", 0.0, ""))
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too
                log.append((f"round {k}", type(e).__name__, round(time.monotonic() - t0, 1), str(e)))
                if not isinstance(e, KeyboardInterrupt):
                    break
    finally:
        LowLatency.launch = real_launch
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()
    return log


def _both_modes_round_trips(buf, rank, x, idx, E, N) -> list:
    """A normal-mode round trip, then a low-latency one, on a Buffer of both modes: ``[(step, outcome)]``, each
    outcome ``"ok"`` when the results match the oracle (each token reaches experts 0 and E - 1: 2 ranks)."""
    log = []
    try:
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx)
        combined = buf.combine(rx, handle)[0]
        log.append(("normal after", "ok" if torch.equal(combined.float(), x.float() * 2) else "wrong rows"))
    except Exception as e:  # noqa: BLE001
        log.append(("normal after", f"{type(e).__name__}: {e}"))
    try:
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        comb = buf.low_latency_combine(recv, idx, torch.ones(idx.shape[0], 2), handle)[0]
        log.append(("low-latency after", "ok" if torch.equal(comb.float(), x.float() * 2) else "wrong rows"))
    except Exception as e:  # noqa: BLE001
        log.append(("low-latency after", f"{type(e).__name__}: {e}"))
    return log


def modes_mixed(rank, world, ll_rank, late, N=4, H=128, E=4, timeout_s=30.0):
    """One Buffer of both modes (SGLang's ``deepep_mode auto``): after a valid normal-mode round trip, rank
    ``ll_rank`` calls ``low_latency_dispatch`` while the others call ``dispatch`` (a new user's find: every rank
    waited out ``timeout_s``, was told the peer "never called it", and the Buffer was unusable after). ``late``
    (``"ll"`` or ``"normal"``): the ranks of that mode start the call 0.5 s after the others, so that they find the
    disagreement in the others' call cards (the others' waits hear of it). Returns
    ``[(step, outcome)]``: the mixed call's ``(error type, seconds, message)``, then a normal-mode and a
    low-latency round trip checked against the oracle."""
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 1 << 20, hint, low_latency_mode=True, num_qps_per_rank=E // world,
                           timeout_s=timeout_s)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    log = []
    try:
        log += [(s.replace(" after", " before"), v) for s, v in _both_modes_round_trips(buf, rank, x, idx, E, N)][:1]
        if (rank == ll_rank) == (late == "ll"):
            time.sleep(0.5)
        t0 = time.monotonic()
        try:
            if rank == ll_rank:
                buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
            else:
                per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
                buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
            log.append(("mixed", ("ok", round(time.monotonic() - t0, 2), "")))
        except Exception as e:  # noqa: BLE001
            log.append(("mixed", (type(e).__name__, round(time.monotonic() - t0, 2), str(e))))
        log += _both_modes_round_trips(buf, rank, x, idx, E, N)
    finally:
        buf.destroy()
    return log


def fork_keyword(rank, world, which, N=4, H=128, E=4, timeout_s=30.0):
    """DeepEP's ``Buffer`` as the ``deep_ep`` switch serves it (triton_ep._deep_ep): rank 1 passes an engine fork's
    keyword triton-ep lacks (``which``: ``"nvfp4"``, ``low_latency_dispatch(use_nvfp4=True)``; ``"overlap"``,
    ``low_latency_combine(overlap=True)`` after a valid dispatch), the others make the call valid (a new user's
    find: only rank 1 raised, its peers waited out ``timeout_s`` and the Buffer was unusable after). Returns
    ``[(step, outcome)]``: the refused call's ``(error type, seconds, message)``, then a low-latency round trip
    checked against the oracle."""
    from triton_ep._deep_ep.buffers.legacy import Buffer
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = Buffer(None, 1 << 20, hint, low_latency_mode=True, num_qps_per_rank=E // world, timeout_s=timeout_s)
    x = (torch.arange(3 * H, dtype=torch.float32).reshape(3, H) % 7 + rank).to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 3)
    w = torch.ones(3, 2)
    bad = rank == 1
    log = []
    try:
        t0 = time.monotonic()
        try:
            if which == "nvfp4":
                buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, **({"use_nvfp4": True} if bad else {}))
            else:
                recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
                t0 = time.monotonic()
                buf.low_latency_combine(recv, idx, w, handle, **({"overlap": True, "block_m": 64} if bad else {}))
            log.append(("refused", ("ok", round(time.monotonic() - t0, 2), "")))
        except Exception as e:  # noqa: BLE001
            log.append(("refused", (type(e).__name__, round(time.monotonic() - t0, 2), str(e))))
        try:
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
            comb = buf.low_latency_combine(recv, idx, w, handle)[0]
            log.append(("after", "ok" if torch.equal(comb.float(), x.float() * 2) else "wrong rows"))
        except Exception as e:  # noqa: BLE001
            log.append(("after", f"{type(e).__name__}: {e}"))
    finally:
        buf.destroy()
    return log
