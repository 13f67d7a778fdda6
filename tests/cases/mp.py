"""Rank bodies for multi-process tests (module-level so that spawned processes can import them)."""
import os

import torch

import triton_ep
from triton_ep import reference as ref


def make_inputs(seed, R, E, K, H, Ts, skew=False, fp8=False):
    """Per-rank inputs, identical in every process (seeded): x bf16 (or fp8 pair), topk_idx int64 with -1
    entries and duplicates, topk_weights fp32."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for T in Ts:
        x = torch.randn(T, H, generator=g)
        if fp8:
            xs.append((x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g) + 0.5))
        else:
            xs.append(x.to(torch.bfloat16))
        hi = max(E // 4, 1) if skew else E
        idx = torch.randint(-1, hi, (T, K), generator=g)
        idxs.append(idx)
        ws.append(torch.rand(T, K, generator=g))
    return xs, idxs, ws


def _to(v, device):
    return tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)


def round_trip(rank, world, seed, E, K, H, Ts, num_nvl_bytes, fp8=False, device="cpu"):
    """dispatch -> x*2 'experts' -> combine on every rank, then a cached dispatch on new data; each
    compared bit for bit with the reference. Returns the number of received rows."""
    xs, idxs, ws = make_inputs(seed, world, E, K, H, Ts, fp8=fp8)
    exp = ref.dispatch(xs, idxs, ws, E)
    if device == "cuda":
        torch.cuda.set_device(0)
    elif device == "cuda:rank":           # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
    buf = triton_ep.Buffer(None, num_nvl_bytes, device=device, timeout_s=60)
    xs = [_to(x, device) for x in xs]
    idxs = [i.to(device) for i in idxs]
    ws = [w.to(device) for w in ws]
    try:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[rank], E)
        recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
            xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idxs[rank], topk_weights=ws[rank])
        e = exp[rank]
        if fp8:
            assert torch.equal(recv_x[0].cpu().view(torch.uint8), e["recv_x"][0].view(torch.uint8))
            assert torch.equal(recv_x[1].cpu(), e["recv_x"][1])
            return int(recv_x[0].shape[0])
        assert torch.equal(recv_x.cpu().view(torch.int16), e["recv_x"].view(torch.int16))
        assert torch.equal(recv_idx.cpu(), e["recv_topk_idx"])
        assert torch.equal(recv_w.cpu(), e["recv_topk_weights"])
        assert lst == e["num_recv_tokens_per_expert_list"]
        assert torch.equal(handle[0].cpu(), e["rank_prefix_matrix"])
        y = (recv_x.float() * 2).to(torch.bfloat16)
        out, wout, _ = buf.combine(y, handle, topk_weights=recv_w)
        ys = [(exp[j]["recv_x"].float() * 2).to(torch.bfloat16) for j in range(world)]
        cexp = ref.combine(ys, exp, Ts, [d["recv_topk_weights"] for d in exp])[rank]
        assert torch.equal(out.cpu().view(torch.int16), cexp[0].view(torch.int16))
        assert torch.equal(wout.cpu(), cexp[1])
        # cached dispatch on new data
        x2 = (xs[rank].float() + 1).to(torch.bfloat16)
        rx2 = buf.dispatch(x2, handle=handle)[0]
        exp2 = ref.dispatch([(x.float() + 1).to(torch.bfloat16) for x in xs], idxs, ws, E)[rank]
        assert torch.equal(rx2.cpu().view(torch.int16), exp2["recv_x"].view(torch.int16))
        return int(recv_x.shape[0])
    finally:
        buf.destroy()


def _layout_kwargs(buf, idx, E):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)


def absent_peer(rank, world, timeout_s):
    """The last rank never calls dispatch (it holds its Buffer meanwhile): the others must raise EPTimeoutError naming
    it within the bound; then every rank destroys its Buffer, builds a new one and runs a correct dispatch."""
    import time
    import torch.distributed as dist
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(11, world, E, 2, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=timeout_s)
    report = None
    if rank != world - 1:
        t0 = time.monotonic()
        try:
            buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
            report = "no error"
        except triton_ep.EPTimeoutError as e:
            report = (type(e).__name__, isinstance(e, RuntimeError), isinstance(e, TimeoutError), e.rank, e.peer,
                      e.stage, round(time.monotonic() - t0, 2), str(e))
    # (the absent rank holds its Buffer until the others have timed out: one that destroyed it would be named at once,
    # tests/runtime/test_dead_peer.py)
    dist.barrier()
    buf.destroy()
    dist.barrier()
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=timeout_s)
    recv_x = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))[0]
    assert torch.equal(recv_x, ref.dispatch(xs, idxs, ws, E)[rank]["recv_x"])
    buf.destroy()
    return report


def bad_input_on_one_rank(rank, world, kind):
    """Rank 1 passes bad input; it raises ValueError, every other rank EPRemoteError naming it, nobody
    waits; then a correct dispatch works on the same Buffer."""
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(12, world, E, 2, H, [5] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=30)
    kw = _layout_kwargs(buf, idxs[rank], E)
    x = xs[rank]
    before = idxs[rank].clone()
    if rank == 1:
        if kind == "bad_ids":
            kw["topk_idx"] = idxs[rank].clone()
            kw["topk_idx"][0, 0] = E + 5
            before = kw["topk_idx"].clone()
        elif kind == "row_bytes":          # 8-byte rows: not a multiple of 16 bytes
            x = x[:, :4]
        elif kind == "not_tensor":
            x = x.tolist()
        elif kind == "mixed_dtypes":       # a legal dtype, but not the one the other ranks send
            x = x.float()
        elif kind == "worst_not_tensor":   # a bad argument while every rank passes num_worst_tokens
            x = x.tolist()
        elif kind == "config":             # a Config of one row a round (several rounds; the others take one)
            kw["config"] = triton_ep.Config(2, 1, 1)
    # each rank passes its own num_worst_tokens (DeepEP's contract): "worst": 1 on rank 1 (too small), 60
    # and more elsewhere (enough); "worst_mixed": 0 (none) on rank 1, the others > 0; "worst_one": 60 on rank 1
    # only
    extra = {}
    if kind.startswith("worst"):
        extra = dict(num_worst_tokens=60 + rank)
        if rank == 1 and kind in ("worst", "worst_mixed"):
            extra = dict(num_worst_tokens=1 if kind == "worst" else 0)
        if kind == "worst_one" and rank != 1:
            extra = {}
    import time
    t0 = time.monotonic()
    try:
        buf.dispatch(x, topk_weights=ws[rank], **kw, **extra)
        out = "no error"
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, str(e), time.monotonic() - t0)
    assert torch.equal(kw["topk_idx"], before), "topk_idx was modified"
    recv_x = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))[0]
    assert torch.equal(recv_x, ref.dispatch(xs, idxs, ws, E)[rank]["recv_x"])
    buf.destroy()
    return out


def absent_at_construction(rank, world, timeout_s):
    """The last rank never builds its Buffer: the others raise EPTimeoutError at bootstrap within the bound. It lives
    on until they have their errors (at most ``timeout_s + 3`` s)."""
    import time
    from tests.cases.helpers import all_live_ranks_reach
    if rank == world - 1:
        all_live_ranks_reach(world, bound_s=timeout_s + 3)
        return None
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=timeout_s)
        return "no error"
    except triton_ep.EPTimeoutError as e:
        return (e.stage, round(time.monotonic() - t0, 2))
    finally:
        all_live_ranks_reach(world, bound_s=timeout_s + 3)


# ---------------------------------------------------------------------------------------------------------
# Issue 3 (deployment shapes, peers, back-to-back rounds): rank bodies for
# tests/modes/intranode/test_deployment.py and tests/modes/intranode/test_gpu_robustness.py.

def _check_round(buf, me, R, seed, E, K, H, Ts, device):
    """One dispatch -> (x*3 - 1 'experts') -> combine with weights on ``buf``, checked bit for bit against
    the reference; returns (handle, inputs, reference) for later cached calls."""
    xs, idxs, ws = make_inputs(seed, R, E, K, H, Ts)
    exp = ref.dispatch(xs, idxs, ws, E)
    recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
        xs[me].to(device), topk_weights=ws[me].to(device), **_layout_kwargs(buf, idxs[me].to(device), E))
    e = exp[me]
    assert torch.equal(recv_x.cpu().view(torch.int16), e["recv_x"].view(torch.int16)), f"seed {seed}: recv_x"
    assert torch.equal(recv_idx.cpu(), e["recv_topk_idx"]) and torch.equal(recv_w.cpu(), e["recv_topk_weights"])
    assert lst == e["num_recv_tokens_per_expert_list"]
    ys = [(d["recv_x"].float() * 3 - 1).to(torch.bfloat16) for d in exp]
    out, wout, _ = buf.combine(ys[me].to(device), handle, topk_weights=recv_w)
    want = ref.combine(ys, exp, Ts, [d["recv_topk_weights"] for d in exp])[me]
    assert torch.equal(out.cpu().view(torch.int16), want[0].view(torch.int16)), f"seed {seed}: combined_x"
    assert torch.equal(wout.cpu(), want[1]), f"seed {seed}: combined weights"
    return handle, xs, idxs, ws, exp


def _cached_round(buf, me, handle, xs, idxs, ws, E, Ts, device, shift):
    """Cached dispatch and combine of new data (x + shift) with an older handle, bit for bit."""
    x2 = [(x.float() + shift).to(torch.bfloat16) for x in xs]
    exp2 = ref.dispatch(x2, idxs, ws, E)
    rx = buf.dispatch(x2[me].to(device), handle=handle)[0]
    assert torch.equal(rx.cpu().view(torch.int16), exp2[me]["recv_x"].view(torch.int16)), "cached recv_x"
    out = buf.combine(rx, handle)[0]
    want = ref.combine([d["recv_x"] for d in exp2], exp2, Ts)[me][0]
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), "cached combine"


def back_to_back_rounds(buf, me, R, rounds, seed, device, E=None, K=4, H=64, max_t=48):
    """``rounds`` dispatch -> combine rounds with fresh random routing and ragged T (zeros included), with no
    barrier between calls; every 7th round a cached dispatch/combine reuses the previous handle."""
    E = E or 2 * R
    prev = None
    for it in range(rounds):
        g = torch.Generator().manual_seed(seed * 7919 + it)
        Ts = torch.randint(0, max_t + 1, (R,), generator=g).tolist()
        cur = _check_round(buf, me, R, seed * 7919 + it, E, K, H, Ts, device)
        if prev is not None and it % 7 == 0:
            _cached_round(buf, me, prev[0], *prev[1:4], E, prev[5], device, shift=it)
        prev = cur + (Ts,)
    return rounds


def subgroups_and_two_buffers(rank, world, groups, rounds, device="cpu"):
    """The world is split into EP subgroups (e.g. [1, 2, 3, 4] and [0, 5] of 6): each member builds, on its
    subgroup only, two normal Buffers and a low-latency-mode one, all alive at once; calls on the two normal
    ones interleave (dispatch A, dispatch B, combine B, cached dispatch A, combine A), then ``rounds``
    back-to-back rounds run on A with fresh routing. Returns (group index, group rank) or None."""
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(0)
    elif device == "cuda:rank":           # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
    handles = [dist.new_group(g) for g in groups]          # collective over the world, same order everywhere
    mine = [i for i, g in enumerate(groups) if rank in g]
    if not mine:
        return None
    gi = mine[0]
    group, R = handles[gi], len(groups[gi])
    me = dist.get_rank(group)
    assert me == sorted(groups[gi]).index(rank)
    E, K, H = 2 * R, 3, 64
    hint = triton_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    a = triton_ep.Buffer(group, hint, device=device, timeout_s=60)
    b = triton_ep.Buffer(group, 1 << 16, device=device, timeout_s=60)
    ll = triton_ep.Buffer(group, 0, triton_ep.Buffer.get_low_latency_rdma_size_hint(32, H, R, E), low_latency_mode=True,
                          num_qps_per_rank=E // R, device=device, timeout_s=60)
    try:
        Ts = [3 + 5 * r for r in range(R)]
        Ts[-1] = 0
        xs, idxs, ws = make_inputs(100 + gi, R, E, K, H, Ts)
        kw_a = _layout_kwargs(a, idxs[me].to(device), E)
        ra = a.dispatch(xs[me].to(device), topk_weights=ws[me].to(device), **kw_a)
        hb, xb, ib, wb, eb = _check_round(b, me, R, 200 + gi, E, K, H, [T + 1 for T in Ts], device)
        exp = ref.dispatch(xs, idxs, ws, E)
        assert torch.equal(ra[0].cpu().view(torch.int16), exp[me]["recv_x"].view(torch.int16))
        _cached_round(a, me, ra[4], xs, idxs, ws, E, Ts, device, shift=5)
        _cached_round(b, me, hb, xb, ib, wb, E, [T + 1 for T in Ts], device, shift=-3)
        back_to_back_rounds(a, me, R, rounds, 300 + gi, device, E=E, K=K, H=H)
    finally:
        for buf in (ll, b, a):
            buf.destroy()
    return gi, me


def absent_in_combine(rank, world, timeout_s, device="cpu"):
    """Every rank dispatches; the last never calls combine (it holds its Buffer meanwhile). The others must raise
    EPTimeoutError (a RuntimeError and a TimeoutError) naming this rank, the combine stage and the missing peer within
    the bound. Afterwards every process destroys its Buffer, builds a new one and runs a correct round."""
    import time
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(0)
    elif device == "cuda:rank":           # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
    E, K, H = 2 * world, 2, 32
    Ts = [4 + r for r in range(world)]
    buf = triton_ep.Buffer(None, 1 << 18, device=device, timeout_s=timeout_s)
    xs, idxs, ws = make_inputs(13, world, E, K, H, Ts)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(xs[rank].to(device), topk_weights=ws[rank].to(device),
                                                   **_layout_kwargs(buf, idxs[rank].to(device), E))
    report = None
    if rank != world - 1:
        t0 = time.monotonic()
        try:
            buf.combine(recv_x, handle, topk_weights=recv_w)
            # on GPU combine only enqueues (no host wait): its kernels' timeout record is raised by the
            # next check (docs/design.md, Errors), here after the stream has drained
            if device != "cpu":
                torch.cuda.synchronize()
            buf.check()
            report = "no error"
        except triton_ep.EPTimeoutError as e:
            report = (isinstance(e, RuntimeError), isinstance(e, TimeoutError), e.rank, e.peer, e.stage,
                      time.monotonic() - t0, str(e))
    # (the absent rank holds its Buffer until the others have timed out: one that destroyed it would be named at once,
    # tests/runtime/test_dead_peer.py)
    dist.barrier()
    buf.destroy()
    dist.barrier()
    buf = triton_ep.Buffer(None, 1 << 18, device=device, timeout_s=timeout_s)
    try:
        _check_round(buf, rank, world, 14, E, K, H, Ts, device)
    finally:
        buf.destroy()
    return report


def back_to_back_processes(rank, world, rounds, seed, device="cpu"):
    """``rounds`` back-to-back rounds on one Buffer of the world group, no barriers between calls."""
    if device == "cuda":
        torch.cuda.set_device(0)
    elif device == "cuda:rank":           # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
    buf = triton_ep.Buffer(None, 1 << 20, device=device, timeout_s=120)
    try:
        return back_to_back_rounds(buf, rank, world, rounds, seed, device)
    finally:
        buf.destroy()


def _bf16_allocations_fail():
    """Within it, ``torch.empty`` of bf16 raises ``RuntimeError`` (as out of memory would); other dtypes allocate."""
    import unittest.mock
    real_empty = torch.empty

    def failing_empty(*a, **k):
        if k.get("dtype") == torch.bfloat16:
            raise RuntimeError("simulated out of memory")
        return real_empty(*a, **k)
    return unittest.mock.patch.object(torch, "empty", failing_empty)


def fail_mid_call(rank, world):
    """Rank 0 fails after the counts exchange (its output allocation raises, as out-of-memory would);
    the peer must not return wrong data: it times out naming rank 0, and rank 0's later calls raise at
    once instead of meeting the peer at a wrong step."""
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(21, world, E, 2, H, [5] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=3)
    kw = _layout_kwargs(buf, idxs[rank], E)
    out = []
    for attempt in range(2):
        try:
            if rank == 0 and attempt == 0:
                with _bf16_allocations_fail():
                    buf.dispatch(xs[rank], topk_weights=ws[rank], **kw)
            else:
                buf.dispatch(xs[rank], topk_weights=ws[rank], **kw)
            out.append("returned")
        except Exception as e:  # noqa: BLE001
            out.append(type(e).__name__)
    buf.destroy()
    return out


def fail_mid_call_of_rounds(rank, world):
    """A call of many rounds (a buffer of 4 KiB) where rank 0 fails in its second round (its send launch raises, as
    an interrupt or out-of-memory would): the peer stops launching rounds once its kernels have seen that, and
    raises ``EPRemoteError``, instead of launching every later round (each could only move nothing). First a
    combine, then (a new Buffer: the first is broken) a plain dispatch. Returns, per phase, ``(send launches of the
    call completed by both ranks, send launches of the failed call, the error's type)`` on this rank."""
    import unittest.mock
    from triton_ep import kernels
    E, H, T = 2 * world, 64, 192
    xs, idxs, ws = make_inputs(23, world, E, 2, H, [T] * world)
    counts = {"dispatch_send": 0, "combine_send": 0}
    fail_at = {"dispatch_send": 0, "combine_send": 0}      # (the launch that raises; 0: none)

    def counting(name):
        real = getattr(kernels, name)

        def launch(*a, **k):
            counts[name] += 1
            if counts[name] == fail_at[name]:
                raise RuntimeError("simulated failure in the middle of a call")
            return real(*a, **k)
        return unittest.mock.patch.object(kernels, name, launch)

    out = []
    with counting("dispatch_send"), counting("combine_send"):
        for phase in ("combine", "dispatch"):
            name = phase + "_send"
            buf = triton_ep.Buffer(None, 4 << 10, device="cpu", timeout_s=20)
            try:
                kw = _layout_kwargs(buf, idxs[rank], E)

                def call():
                    # (a combine of a new handle each time: a handle's second combine would replay the first's plan)
                    if phase == "dispatch":
                        counts[name] = 0
                    recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank], **kw)
                    if phase == "combine":
                        counts[name] = 0
                        buf.combine(recv_x, handle)

                call()
                good = counts[name]
                fail_at[name] = 2 if rank == 0 else 0
                try:
                    call()
                    how = "returned"
                except Exception as e:  # noqa: BLE001
                    how = type(e).__name__
                out.append((good, counts[name], how))
            finally:
                fail_at[name] = 0
                buf.destroy()
    return out


def destroy_from_another_thread(rank, world, late_s=4.0, destroy_s=0.5):
    """Rank 1 comes ``late_s`` late to a plain dispatch; on rank 0 another thread destroys the Buffer ``destroy_s``
    into the dispatch's wait (the "abort a hung step" pattern). Returns ``(error type, message, seconds until rank 0's
    dispatch raised)`` on rank 0, ``(error type, message)`` on rank 1."""
    import threading
    import time
    E = 2 * world
    xs, idxs, ws = make_inputs(25, world, E, 2, 64, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=20)
    kw = _layout_kwargs(buf, idxs[rank], E)
    buf.dispatch(xs[rank], topk_weights=ws[rank], **kw)       # (compiled and in step)
    if rank == 1:
        time.sleep(late_s)
    killer = threading.Timer(destroy_s, buf.destroy) if rank == 0 else None
    t0 = time.monotonic()
    try:
        if killer is not None:
            killer.start()
        buf.dispatch(xs[rank], topk_weights=ws[rank], **kw)
        got = ("returned", "")
    except Exception as e:  # noqa: BLE001
        got = (type(e).__name__, str(e))
    finally:
        if killer is not None:
            killer.join(30)
        buf.destroy()
    return got + (time.monotonic() - t0,) if rank == 0 else got


def worst_outputs_out_of_memory(rank, world):
    """Rank 0's outputs of ``num_worst_tokens`` rows cannot be allocated (``torch.empty`` raises, as out of memory
    would): the dispatch is refused on every rank (rank 0: that error; its peers: ``EPRemoteError``) before
    anything moves, and the same Buffer goes on: a ``num_worst_tokens`` dispatch after it gives the reference
    rows. Returns ``(the refused call's error type, whether the next call's rows equal the first's)``."""
    E, H = 2 * world, 64
    xs, idxs, ws = make_inputs(27, world, E, 2, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=20)
    try:
        kw = _layout_kwargs(buf, idxs[rank], E)
        first = buf.dispatch(xs[rank], topk_weights=ws[rank], num_worst_tokens=64, **kw)[0]
        try:
            if rank == 0:
                with _bf16_allocations_fail():
                    buf.dispatch(xs[rank], topk_weights=ws[rank], num_worst_tokens=64, **kw)
            else:
                buf.dispatch(xs[rank], topk_weights=ws[rank], num_worst_tokens=64, **kw)
            how = "returned"
        except Exception as e:  # noqa: BLE001
            how = type(e).__name__
        again = buf.dispatch(xs[rank], topk_weights=ws[rank], num_worst_tokens=64, **kw)[0]
        return how, torch.equal(first.view(torch.int16), again.view(torch.int16))
    finally:
        buf.destroy()


def mixed_handles(rank, world):
    """Ranks pass handles of different dispatches to combine / cached dispatch: every rank raises."""
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(22, world, E, 2, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=20)
    first = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
    second = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
    h = first[4] if rank == 0 else second[4]
    x = first[0] if rank == 0 else second[0]
    out = []
    for call in (lambda: buf.combine(x, h), lambda: buf.dispatch(xs[rank], handle=h)):
        try:
            call()
            out.append("returned")
        except ValueError as e:
            a, b = (1, 2) if rank == 0 else (2, 1)
            want = f"handle's dispatch number: rank {rank} passed {a}, rank {1 - rank} passed {b}"
            out.append("ValueError: " + (want in str(e) and "agree" in str(e)).__str__())
    assert buf.combine(second[0], second[4])[0].shape == (6, H)     # the group is still in step
    buf.destroy()
    return out


def ambient_float32(rank, world, device="cpu", default_device="meta"):
    """A DeepEP-style program in a real process: ``default_device`` set as default around Buffer
    construction and every call, float32 x ``[8, 64]`` dispatched bit for bit, then bf16 combined."""
    E = 2 * world
    xs, idxs, ws = make_inputs(21, world, E, 2, 64, [8] * world)
    xs32 = [x.float() for x in xs]
    exp = ref.dispatch(xs32, idxs, ws, E)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    x_in, w_in, i_in = xs32[rank].to(dev), ws[rank].to(dev), idxs[rank].to(dev)
    torch.set_default_device(default_device)
    try:
        buf = triton_ep.Buffer(None, 1 << 20, device=dev, timeout_s=30)
        recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(x_in, topk_weights=w_in,
                                                                  **_layout_kwargs(buf, i_in, E))
        comb, _, _ = buf.combine(recv_x.to(torch.bfloat16), handle)
        buf.destroy()
    finally:
        torch.set_default_device(None)
    recv_x, recv_idx, comb = recv_x.cpu(), recv_idx.cpu(), comb.cpu()
    assert recv_x.dtype == torch.float32 and torch.equal(recv_x, exp[rank]["recv_x"])
    assert torch.equal(recv_idx, exp[rank]["recv_topk_idx"]) and lst == exp[rank]["num_recv_tokens_per_expert_list"]
    want = ref.combine([e["recv_x"].to(torch.bfloat16) for e in exp], exp, [8] * world)[rank][0]
    assert torch.equal(comb.view(torch.int16), want.view(torch.int16))
    return "ok"


# ---------------------------------------------------------------------------------------------------------
# Device signalling (kernels wait for each other through flags): rank bodies for
# tests/runtime/test_signals.py and tests/runtime/test_gpu_signals.py.

def late_peer_combine(rank, world, timeout_s, device="cpu"):
    """Rank 1 reaches its combine only after rank 0 gave up on it. Rank 0's kernels wait on the device
    and raise EPTimeoutError naming rank 1 and the stage within the bound; rank 1 then raises at once that
    rank 0 left, instead of waiting out its own timeout. Returns (error type, peer, stage, seconds, text)."""
    import time
    E, H = 2 * world, 32
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    xs, idxs, ws = make_inputs(31, world, E, 2, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device=dev, timeout_s=timeout_s)
    recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank].to(dev), topk_weights=ws[rank].to(dev),
                                              **_layout_kwargs(buf, idxs[rank].to(dev), E))
    buf.combine(recv_x, handle)            # both ranks: the kernels are compiled before anything is timed
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if rank == 1:
        time.sleep(timeout_s + 2)
    t0 = time.monotonic()
    try:
        buf.combine(recv_x, handle)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        buf.check()
        out = ("no error",)
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, getattr(e, "peer", None), getattr(e, "stage", None),
               round(time.monotonic() - t0, 2), str(e))
    try:                                   # every later call refuses at once
        buf.combine(recv_x, handle)
        later = "returned"
    except Exception as e:  # noqa: BLE001
        later = type(e).__name__
    buf.destroy()
    return out + (later,)


def graph_replay(rank, world, timeout_s=3.0):
    """Cached dispatch, an expert stand-in and combine captured in one CUDA graph on each rank (processes
    sharing or not sharing a GPU), replayed with new x written into the captured input: every replay is
    bit for bit the reference. No host synchronisation in the captured calls (sync debug mode 'error').
    Then rank 1 stops replaying: rank 0's replay raises EPTimeoutError at check() within the bound, and
    its next replay returns at once. Returns a dict of what was seen."""
    import time
    import torch.distributed as dist
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, K = 4 * world, 256, 4
    Ts = [40 + 7 * r for r in range(world)]
    xs, idxs, ws = make_inputs(41, world, E, K, H, Ts)
    buf = triton_ep.Buffer(None, 1 << 16, device=dev, timeout_s=timeout_s)   # small: several rounds
    _, _, _, _, handle, _ = buf.dispatch(xs[rank].to(dev), topk_weights=ws[rank].to(dev),
                                         **_layout_kwargs(buf, idxs[rank].to(dev), E))
    x_in = xs[rank].to(dev).clone()

    def step():
        recv = buf.dispatch(x_in, handle=handle)[0]
        y = (recv.float() * 3 - 1).to(torch.bfloat16)
        return recv, buf.combine(y, handle)[0]

    step()                                     # compile the kernels outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.cuda.set_sync_debug_mode("error")     # inside: the graph context synchronises on entry
        try:
            recv_out, comb_out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    seen = {"replays_ok": 0}
    for i in range(3):
        new = [(x.float() * (i + 2) - i).to(torch.bfloat16) for x in xs]
        x_in.copy_(new[rank].to(dev))
        g.replay()
        torch.cuda.synchronize()
        exp = ref.dispatch(new, idxs, ws, E)
        ys = [(e["recv_x"].float() * 3 - 1).to(torch.bfloat16) for e in exp]
        want = ref.combine(ys, exp, Ts)[rank][0]
        assert torch.equal(recv_out.cpu().view(torch.int16), exp[rank]["recv_x"].view(torch.int16)), i
        assert torch.equal(comb_out.cpu().view(torch.int16), want.view(torch.int16)), i
        buf.check()
        seen["replays_ok"] += 1
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        g.replay()
        torch.cuda.synchronize()
        seen["stopped_s"] = round(time.monotonic() - t0, 2)
        try:
            buf.check()
            seen["error"] = None
        except triton_ep.EPTimeoutError as e:
            seen["error"] = (type(e).__name__, e.peer, e.stage)
        t0 = time.monotonic()
        g.replay()
        torch.cuda.synchronize()
        seen["later_s"] = round(time.monotonic() - t0, 2)
    dist.barrier()
    buf.destroy()
    return seen


def async_overlap(rank, world, delay_s=2.0):
    """Rank 1 starts its combine late. Rank 0's combine with async_finish returns at once; a matmul on its
    own stream then finishes while the comm stream still waits; the event then delivers the right result."""
    import time
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H = 2 * world, 128
    xs, idxs, ws = make_inputs(43, world, E, 2, H, [16] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device=dev, timeout_s=30)
    recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank].to(dev), topk_weights=ws[rank].to(dev),
                                              **_layout_kwargs(buf, idxs[rank].to(dev), E))
    buf.combine(recv_x, handle)                 # compile the kernels, start cuBLAS: nothing timed below
    a = torch.randn(512, 512, device=dev)
    b = a @ a
    torch.cuda.synchronize()
    out = {}
    if rank == 1:
        time.sleep(delay_s)
    t0 = time.monotonic()
    comb, _, ev = buf.combine(recv_x, handle, async_finish=True)
    out["call_s"] = round(time.monotonic() - t0, 3)
    b = a @ a
    torch.cuda.current_stream().synchronize()
    out["compute_s"] = round(time.monotonic() - t0, 3)
    ev.current_stream_wait()
    torch.cuda.current_stream().synchronize()
    out["done_s"] = round(time.monotonic() - t0, 3)
    exp = ref.dispatch(xs, idxs, ws, E)
    want = ref.combine([e["recv_x"] for e in exp], exp, [16] * world)[rank][0]
    out["ok"] = bool(torch.equal(comb.cpu().view(torch.int16), want.view(torch.int16))) and bool(b.isfinite().all())
    buf.destroy()
    return out


def graph_inputs(rank, world, seed, E, K, H, T, dev):
    """Inputs for replays of a captured graph: three cases of every rank's (x, topk_idx, topk_weights) --
    random, every token to rank 0's experts, mostly -1 -- and this rank's captured input tensors with
    ``load(c)``, which writes case ``c`` into them. Returns (cases, x_in, idx_in, w_in, load)."""
    cases = []
    for c in range(3):
        xs, idxs, ws = make_inputs(seed + c, world, E, K, H, [T] * world)
        if c == 1:
            idxs = [i % (E // world) for i in idxs]   # rank 0's experts only
        if c == 2:
            idxs = [torch.where(torch.rand(i.shape, generator=torch.Generator().manual_seed(c)) < 0.8, -1, i)
                    for i in idxs]
        cases.append((xs, idxs, ws))
    x_in = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    idx_in = torch.empty((T, K), dtype=torch.int64, device=dev)
    w_in = torch.empty((T, K), dtype=torch.float32, device=dev)

    def load(c):
        xs, idxs, ws = cases[c]
        x_in.copy_(xs[rank].to(dev))
        idx_in.copy_(idxs[rank].to(dev))
        w_in.copy_(ws[rank].to(dev))
    return cases, x_in, idx_in, w_in, load


def capture(step, barrier=None):
    """Run ``step()`` once outside the capture (its kernels compile), then capture it in a CUDA graph with
    any host synchronisation an error inside (sync debug mode 'error'); ``barrier``: called between the two.
    Returns the graph and what the captured ``step()`` returned."""
    step()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return g, out


def check_replayed_dispatch(rank, E, case, recv_x, recv_idx, recv_w, tag):
    """Assert that a replayed num_worst_tokens dispatch's outputs are the reference's for ``case`` (every
    rank's (x, topk_idx, topk_weights)) bit for bit, padding rows zero / -1. Returns the reference."""
    xs, idxs, ws = case
    exp = ref.dispatch(xs, idxs, ws, E)
    e = exp[rank]
    n = e["recv_x"].shape[0]
    assert torch.equal(recv_x[:n].cpu().view(torch.int16), e["recv_x"].view(torch.int16)), tag
    assert bool((recv_x[n:] == 0).all()) and bool((recv_idx[n:] == -1).all()), tag
    assert torch.equal(recv_idx[:n].cpu(), e["recv_topk_idx"]), tag
    assert torch.equal(recv_w[:n].cpu(), e["recv_topk_weights"]), tag
    return exp


def graph_full(rank, world, timeout_s=30.0):
    """Layout, dispatch with num_worst_tokens, an expert stand-in and combine captured in one CUDA graph
    (no host synchronisation inside: sync debug mode 'error'), replayed with new x and new routing written
    into the captured inputs -- random, then every token to rank 0's experts (no row for the others),
    then mostly -1: each replay bit for bit the reference, padding rows zero / -1."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, K, T = 4 * world, 256, 4, 48
    worst = T * world                                 # room for every token of every rank
    buf = triton_ep.Buffer(None, 1 << 16, device=dev, timeout_s=timeout_s)   # small: several rounds
    cases, x_in, idx_in, w_in, load = graph_inputs(rank, world, 50, E, K, H, T, dev)

    def step():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_in, E)
        recv_x, recv_idx, recv_w, lst, h, _ = buf.dispatch(
            x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx_in, topk_weights=w_in, num_worst_tokens=worst)
        y = (recv_x.float() * 3 - 1).to(torch.bfloat16)
        return recv_x, recv_idx, recv_w, lst, h, buf.combine(y, h)[0]

    load(0)
    g, (recv_x, recv_idx, recv_w, lst, h, comb) = capture(step)
    assert lst == []
    for c in range(3):
        load(c)
        g.replay()
        torch.cuda.synchronize()
        buf.check()
        exp = check_replayed_dispatch(rank, E, cases[c], recv_x, recv_idx, recv_w, c)
        assert torch.equal(h[0].cpu(), exp[rank]["rank_prefix_matrix"]), c
        ys = [(d["recv_x"].float() * 3 - 1).to(torch.bfloat16) for d in exp]
        want = ref.combine(ys, exp, [T] * world)[rank][0]
        assert torch.equal(comb.cpu().view(torch.int16), want.view(torch.int16)), c
    import torch.distributed as dist
    dist.barrier()
    buf.destroy()
    return "ok"


def late_at_exchange(rank, world, timeout_s):
    """Rank 1 reaches a plain dispatch after rank 0 gave up at the counts exchange: rank 0 raises
    EPTimeoutError there, rank 1 raises at once that rank 0 left (it does not wait in the kernels)."""
    import time
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(61, world, E, 2, H, [4] * world)
    buf = triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=timeout_s)
    buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
    if rank == 1:
        time.sleep(timeout_s + 2)
    t0 = time.monotonic()
    try:
        buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
        out = ("returned", 0.0, "")
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, round(time.monotonic() - t0, 2), str(e))
    buf.destroy()
    return out


def failed_mid_call_next_call(rank, world):
    """Rank 1 fails inside its send (an error of its own, after the counts exchange). Rank 0's call raises
    at once that rank 1 left; so does rank 0's next call (no timeout), and rank 1's Buffer refuses calls."""
    import time
    import unittest.mock
    from triton_ep import kernels as K
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(62, world, E, 2, H, [4] * world)
    buf = triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=20)
    out = []
    for attempt in range(2):
        t0 = time.monotonic()
        try:
            if rank == 1 and attempt == 0:
                def boom(*a, **k):
                    raise RuntimeError("injected failure")
                with unittest.mock.patch.object(K, "dispatch_send", boom):
                    buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
            else:
                buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
            out.append(("returned", 0.0, ""))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, round(time.monotonic() - t0, 2), str(e)))
    buf.destroy()
    return out


def peer_fails_to_build(rank, world):
    """Rank 1 cannot build its Buffer (a buffer far beyond memory): rank 0 raises EPRemoteError saying a
    peer failed at bootstrap, at once, not a timeout; neither leaves a file in /dev/shm."""
    import time
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, (1 << 50) if rank == 1 else (1 << 16), device="cpu", timeout_s=20)
        return ("built", 0.0, "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, round(time.monotonic() - t0, 2), str(e))


def peer_fails_late_in_building(rank, world):
    """Rank 1 fails in ``Buffer()`` right after the ranks mapped each other's buffers (an error injected once its
    barrier passed; a timeout of a rank that came late does the same), so rank 0 goes on and waits for it at the next
    stage: rank 0 raises EPRemoteError saying rank 1 released its Buffer after an error of its own, at once (new
    user's find: it said "rank 1 destroyed its Buffer (destroy())", which rank 1 never called). Returns ``(what the
    rank raised, seconds, message)``."""
    import time
    from triton_ep.transport import ipc
    if rank == 1:
        real = ipc.Comm.barrier

        def barrier(self, stage, *a, **kw):
            real(self, stage, *a, **kw)
            if stage == "bootstrap/map buffers":
                raise RuntimeError("injected after the barrier")
        ipc.Comm.barrier = barrier
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=30)
        return ("built", 0.0, "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, round(time.monotonic() - t0, 2), str(e))


def peer_interrupted_while_building(rank, world):
    """Rank 1 is interrupted (KeyboardInterrupt, as Ctrl-C raises it) while it waits in ``Buffer()`` for rank 0,
    which comes 2 s late: rank 0 raises EPRemoteError saying rank 1 was interrupted, at once on arrival, not after
    ``timeout_s`` (30 s). Returns ``(what rank raised, seconds, message)``."""
    import _thread
    import threading
    import time
    if rank == 0:
        time.sleep(2.0)
    else:
        threading.Timer(0.5, _thread.interrupt_main).start()
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=30)
        return ("built", 0.0, "")
    except BaseException as e:  # noqa: BLE001 - the interrupt is this case's subject
        return (type(e).__name__, round(time.monotonic() - t0, 2), str(e))


def bad_call_after_valid(rank, world, device="cpu"):
    """Every rank alternates a valid call with the same invalid one (combine with fp32 x, then a cached
    dispatch with a short x); rank 1's receive launches start late, so rank 0 has rejected its next call
    while rank 1 still runs the valid one. Returns what each call did: the valid calls must
    return and be correct, the invalid ones raise TypeError/ValueError, never an error of the peer's."""
    import time
    from triton_ep import kernels as K
    if rank == 1:           # rank 1's receive launches start late: its peer has moved on to the next call
        for name in ("combine_reduce", "dispatch_recv"):
            def late(*a, _real=getattr(K, name), **k):
                time.sleep(0.4)
                return _real(*a, **k)
            setattr(K, name, late)
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(71, world, E, 2, H, [6] * world)
    x = xs[rank].to(device)
    buf = triton_ep.Buffer(None, 1 << 16, device=device, timeout_s=20)
    first = buf.dispatch(x, topk_weights=ws[rank].to(device), **_layout_kwargs(buf, idxs[rank].to(device), E))
    recv_x, handle = first[0], first[4]
    want_comb = buf.combine(recv_x, handle)[0].cpu()
    out = []

    def call(name, fn):
        try:
            fn()
            out.append((name, "ok"))
        except Exception as e:  # noqa: BLE001
            out.append((name, type(e).__name__))

    for _ in range(2):
        call("combine", lambda: out.append(("same", bool(torch.equal(buf.combine(recv_x, handle)[0].cpu(), want_comb)))))
        call("bad combine", lambda: buf.combine(recv_x.float(), handle))
        call("cached", lambda: out.append(("same", bool(torch.equal(buf.dispatch(x, handle=handle)[0].cpu(),
                                                                       recv_x.cpu())))))
        call("bad cached", lambda: buf.dispatch(x[:-1], handle=handle))
    call("final dispatch", lambda: buf.dispatch(x, **_layout_kwargs(buf, idxs[rank].to(device), E)))
    buf.destroy()
    return out


def never_builds(rank, world, timeout_s, pid_file, subgroup):
    """Group rank 1 never builds its Buffer and stays alive. Rank 0 must raise EPTimeoutError within the
    bound naming rank 1, then ``destroy_process_group()`` must return at once (no collective left
    pending) and the process exit; rank 1 reports whether rank 0's process is gone within 12 s after the bound.
    With ``subgroup``, the Buffer is built over ``new_group([0, 1])`` of a 3-rank world (rank 2 idles)."""
    import os
    import time
    import torch.distributed as dist
    group = dist.new_group([0, 1]) if subgroup else None
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        t0 = time.monotonic()
        try:
            triton_ep.Buffer(group, 1 << 16, device="cpu", timeout_s=timeout_s)
            return "built"
        except triton_ep.EPTimeoutError as e:
            waited = time.monotonic() - t0
            t1 = time.monotonic()
            dist.destroy_process_group()
            return (e.stage, e.peers, str(e), round(waited, 2), round(time.monotonic() - t1, 2))
    if rank == 1:
        deadline = time.monotonic() + timeout_s + 12
        pid = None
        while time.monotonic() < deadline:
            try:
                pid = pid or int(open(pid_file).read())
                os.kill(pid, 0)
            except (FileNotFoundError, ValueError):     # rank 0 has not written its pid yet
                pass
            except ProcessLookupError:
                return "rank 0 exited"
            time.sleep(0.1)
        return "rank 0 still running"
    return None


def rejects_its_arguments(rank, world):
    """Rank 1 passes a bad num_nvl_bytes: every rank raises ValueError at once naming rank 1 and its reason (not a
    timeout)."""
    import time
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, -5 if rank == 1 else 1 << 16, device="cpu", timeout_s=30)
        return ("built", 0.0, "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, round(time.monotonic() - t0, 2), str(e))


def fused(rank, world, seed, rounds):
    """With ``TRITON_EP_FUSED=1`` (the send and receive of a call of one round as one launch, one program
    under the interpreter, and the count exchange as one launch): :func:`round_trip` and
    :func:`back_to_back_processes` (dispatch, cached dispatch, combine, ragged T with zeros). Returns the rows
    received and whether the fused dispatch, combine and count-exchange launches ran."""
    os.environ["TRITON_EP_FUSED"] = "1"
    from triton_ep.kernels import combine as C, dispatch as D, notify as NT
    launched = []

    class Counted:          # the one-launch count exchange's launcher, counted
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, grid):
            launched.append(grid)
            return self.inner[grid]
    NT._notify_launch = Counted(NT._notify_launch)
    rows = round_trip(rank, world, seed, 4 * world, 3, 64, [5 + 3 * r for r in range(world)], 1 << 20)
    back_to_back_processes(rank, world, rounds, seed)
    return rows, len(D._FUSED_BOUND) > 0 and len(C._FUSED_BOUND) > 0 and len(launched) > 0


def bad_switch(rank, world, which="fused"):
    """A switch with a value that is no switch value (``which``: ``"fused"``, ``TRITON_EP_FUSED=maybe``, read per
    call; ``"pdl"``, ``TRITON_EP_PDL=2`` as :mod:`triton_ep.kernels.pdl` keeps it from import, set here after the
    first call): every call raises ``ValueError`` on every rank before anything runs; with the value fixed the same
    Buffer goes on (a cached dispatch gives the rows of the first dispatch again). Returns the error messages of a
    plain dispatch, a cached dispatch and a combine, and whether the rows came back equal."""
    from triton_ep.kernels import pdl

    def set_bad(bad):
        if which == "fused":
            if bad:
                os.environ["TRITON_EP_FUSED"] = "maybe"
            else:
                os.environ.pop("TRITON_EP_FUSED", None)
        else:
            pdl.SWITCH = "2" if bad else False
            pdl._CHECKED.clear()        # (judged once per device: judge the new value)

    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=30)
    xs, idxs, ws = make_inputs(3, world, 4 * world, 2, 64, [6, 4, 5][:world])
    msgs = []
    try:
        first, _, _, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank],
                                                 **_layout_kwargs(buf, idxs[rank], 4 * world))
        out = torch.full_like(first, float("nan"))
        set_bad(True)
        for call in (lambda: buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], 4 * world)),
                     lambda: buf.dispatch(xs[rank], handle=handle),
                     lambda: buf.combine(out, handle)):
            try:
                call()
                msgs.append("no error")
            except ValueError as e:
                msgs.append(str(e))
        set_bad(False)
        again = buf.dispatch(xs[rank], handle=handle)[0]
        return msgs, torch.equal(first.view(torch.int16), again.view(torch.int16)) and bool(out.isnan().all())
    finally:
        set_bad(False)
        buf.destroy()


def header_words(rank, world, num_nvl_bytes, seed=3):
    """Split send / receive launches without end-of-launch counts (ranks as processes): after every call of a
    dispatch -> combine -> cached dispatch -> cached combine sequence (checked bit for bit), the signal header
    holds ``BASE`` = the rounds so far, ``NEXT`` = ``PENDC`` = ``BASE`` (the last round, published by its
    receive launch, not yet released), ``CONSUMED`` = ``BASE - 1`` (released by the last round's send launch) and
    ``READY[s]`` = ``BASE`` from every rank, and the launch counters at 0. Returns each call's words."""
    from triton_ep.kernels import flags as F
    R, me = world, rank
    E, K, H = 4 * R, 3, 512
    Ts = [9 + 5 * r for r in range(R)]
    buf = triton_ep.Buffer(None, num_nvl_bytes, timeout_s=60)
    hdr = buf._rt.sig.header
    seen = []

    def words(tag):
        w = hdr.tolist()
        seen.append((tag, w[int(F.W_BASE)], w[int(F.W_CONSUMED)], w[int(F.W_PENDC)], w[int(F.W_NEXT)],
                     w[int(F.W_DONE)], w[int(F.W_DONE2)], w[int(F.off_ready.host(R)):int(F.off_ready.host(R)) + R]))

    try:
        xs, idxs, ws = make_inputs(seed, R, E, K, H, Ts)
        exp = ref.dispatch(xs, idxs, ws, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(xs[me], topk_weights=ws[me],
                                                                **_layout_kwargs(buf, idxs[me], E))
        assert torch.equal(recv_x.view(torch.int16), exp[me]["recv_x"].view(torch.int16))
        words("dispatch")
        ys = [(d["recv_x"].float() * 3 - 1).to(torch.bfloat16) for d in exp]
        out, _, _ = buf.combine(ys[me], handle, topk_weights=recv_w)
        want = ref.combine(ys, exp, Ts, [d["recv_topk_weights"] for d in exp])[me]
        assert torch.equal(out.view(torch.int16), want[0].view(torch.int16))
        words("combine")
        _cached_round(buf, me, handle, xs, idxs, ws, E, Ts, "cpu", 2.0)
        words("cached dispatch + combine")
        return seen
    finally:
        buf.destroy()


def other_collective_after_a_call(rank, world, second, timeout_s=30.0):
    """A dispatch on every rank, then rank 0 a plain dispatch while the others make ``second`` (``"combine"`` or a
    cached ``"dispatch"``): every rank raises ValueError at once, not after the timeout (the split launches leave
    the last receive's CONSUMED to the next launch: the notify releases it too). Returns (error type, seconds)."""
    import time
    R, me = world, rank
    E, K, H = 4 * R, 2, 64
    Ts = [6 + r for r in range(R)]
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=timeout_s)
    try:
        xs, idxs, ws = make_inputs(1, R, E, K, H, Ts)
        rx, _, rw, _, handle, _ = buf.dispatch(xs[me], topk_weights=ws[me], **_layout_kwargs(buf, idxs[me], E))
        t0 = time.monotonic()
        try:
            if me == 0:
                buf.dispatch(xs[me], topk_weights=ws[me], **_layout_kwargs(buf, idxs[me], E))
            elif second == "combine":
                buf.combine(rx, handle, topk_weights=rw)
            else:
                buf.dispatch(xs[me], handle=handle)
            return ("no error", time.monotonic() - t0)
        except Exception as ex:     # noqa: BLE001 - the type is the result
            return (type(ex).__name__, time.monotonic() - t0)
    finally:
        buf.destroy()


def replayed_calls(rank, world, seed, device="cpu", fused=True):
    """Cached dispatches and combines of one handle with unchanged shapes replay the plan their first call left
    (``TRITON_EP_FUSED=1``: calls of one launch; modes/intranode_replay.py): fresh contents each call, bit for
    bit against the reference; then what makes a call take the general path instead (a non-contiguous x, other
    weights, a tuning change, ``TRITON_EP_FUSED=0``, a rank that passes a bad x while its peers replay: they
    raise ``EPRemoteError`` and the group goes on), an x off the plan's 16-byte alignment (replayed through the
    bound launch), and ``destroy()`` dropping the plans. ``fused``: calls of one launch (``TRITON_EP_FUSED=1``), else
    a send and a receive launch each (``0``; the step that changes it sets the other value). Returns
    ``(replays counted after each step, the error each rank raised at the bad call)``."""
    on, off = ("1", "0") if fused else ("0", "1")
    os.environ["TRITON_EP_FUSED"] = on
    from triton_ep.errors import EPRemoteError
    from triton_ep.kernels import _util
    from triton_ep.modes import intranode_replay as RP
    if device == "cuda":
        torch.cuda.set_device(0)
    E, K, H = 4 * world, 3, 64
    Ts = [5 + 3 * r for r in range(world)]
    xs, idxs, ws = make_inputs(seed, world, E, K, H, Ts)
    replays = [0]
    real_run = RP._run

    def counted(*a, **k):
        replays[0] += 1
        return real_run(*a, **k)
    RP._run = counted
    buf = triton_ep.Buffer(None, 1 << 20, device=device, timeout_s=60)
    seen, err = [], None
    try:
        dev = buf.device
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            xs[rank].to(dev), topk_weights=ws[rank].to(dev), **_layout_kwargs(buf, idxs[rank].to(dev), E))
        exp0 = ref.dispatch(xs, idxs, ws, E)

        def fresh(k):       # new contents, same shapes: each rank's x and the reference's
            xk = [(x.float() * (k + 2) - k).to(torch.bfloat16) for x in xs]
            return xk, ref.dispatch(xk, idxs, ws, E)

        def check_dispatch(k, **kw):
            xk, ek = fresh(k)
            got = buf.dispatch(kw.pop("x", xk[rank].to(dev)), handle=handle, **kw)
            assert got[1:5] == (None, None, None, None), got[1:5]
            assert torch.equal(got[0].cpu().view(torch.int16), ek[rank]["recv_x"].view(torch.int16)), k
            return ek

        def check_combine(k, ek, weights=True):
            ys = [(ek[j]["recv_x"].float() * 2).to(torch.bfloat16) for j in range(world)]
            wk = [d["recv_topk_weights"] * (k + 1) for d in ek]
            out, wout, _ = buf.combine(ys[rank].to(dev), handle, topk_weights=wk[rank].to(dev) if weights else None)
            cexp = ref.combine(ys, ek, Ts, wk)[rank]
            assert torch.equal(out.cpu().view(torch.int16), cexp[0].view(torch.int16)), k
            assert (wout is None) if not weights else torch.equal(wout.cpu(), cexp[1]), k

        ek = check_dispatch(0)                  # the general path: plans
        check_combine(0, ek)
        seen.append(replays[0])
        assert handle.replay_dispatch is not None and handle.replay_combine is not None
        for k in range(1, 4):                   # replays, fresh contents each
            ek = check_dispatch(k)
            check_combine(k, ek)
        seen.append(replays[0])
        xk, ek = fresh(5)                       # a non-contiguous x of the same values: the general path
        xt = xk[rank].to(dev).t().contiguous().t()
        assert not xt.is_contiguous()
        check_dispatch(5, x=xt)
        check_combine(5, ek, weights=False)     # no weights where the plan had them: the general path, replans
        check_combine(6, ek, weights=False)     # ... and replays that
        seen.append(replays[0])
        _util.INTERP_TUNING["fused"]["reduce_block_h"] = _util.INTERP_TUNING["fused"]["reduce_block_h"]
        ek = check_dispatch(7)                  # a tuning change: the general path
        os.environ["TRITON_EP_FUSED"] = off
        check_combine(7, ek, weights=False)     # the other launches: the general path
        os.environ["TRITON_EP_FUSED"] = on
        ek = check_dispatch(8)                  # replays (the plan of step 7)
        seen.append(replays[0])
        bad = xk[rank].to(dev)[:-1] if rank == 1 else xk[rank].to(dev)
        try:
            buf.dispatch(bad, handle=handle)
            if device == "cuda":        # (on GPU the peers' kernels learn it after the call returned)
                torch.cuda.synchronize()
                buf.check()
        except (ValueError, EPRemoteError) as e:
            err = type(e).__name__
        ek = check_dispatch(9)                  # after the error: the re-synchronisation, the general path
        check_combine(9, ek)
        ek = check_dispatch(10)                 # replays again
        check_combine(10, ek)
        seen.append(replays[0])
        xk, ek = fresh(11)                      # x 4 bytes past a 16-byte boundary (the plan's was on one): the
        flat = torch.empty(xk[rank].numel() + 2, dtype=torch.bfloat16, device=dev)   # replay takes the bound launch
        xm = flat[2:].view(xk[rank].shape)
        xm.copy_(xk[rank].to(dev))
        assert xm.is_contiguous() and xm.data_ptr() % 16 == 4
        check_dispatch(11, x=xm)
        seen.append(replays[0])
        assert torch.equal(buf.dispatch(xs[rank].to(dev), handle=handle)[0].cpu().view(torch.int16),
                           exp0[rank]["recv_x"].view(torch.int16))
        plans = (handle.replay_dispatch, handle.replay_combine)
        # (values the general path refuses, refused with a plan too: refused_values_with_a_plan, one rank; here, with
        # peers, a rank that refused its value first and destroyed its Buffer could leave a slower peer waiting to
        # re-synchronise after that refusal: a peer gone, EPRemoteError, seen once on a loaded 2-core machine)
    finally:
        RP._run = real_run
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()
    assert all(p.launches is None for p in plans), "destroy() drops the plans"
    try:
        buf.dispatch(xs[rank].to(dev), handle=handle)
        raise AssertionError("a destroyed Buffer's cached dispatch ran")
    except triton_ep.EPError:
        pass
    return seen, err


def refused_values_with_a_plan(rank, world, seed, device="cpu"):
    """A cached dispatch whose handle holds a plan (its last call's shapes) still refuses the values the general path
    refuses (``expert_alignment`` 1.0 or True, ``num_worst_tokens`` 0.0: "must be an int"), each call, and then
    replays its plan again, bit for bit against the reference. One rank: its refusals leave no peer to
    re-synchronise with. Returns the refusals' texts."""
    E, K, H = 4 * world, 3, 64
    xs, idxs, ws = make_inputs(seed, world, E, K, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device=device, timeout_s=60)
    try:
        dev = buf.device
        handle = buf.dispatch(xs[rank].to(dev), topk_weights=ws[rank].to(dev),
                              **_layout_kwargs(buf, idxs[rank].to(dev), E))[4]
        want = ref.dispatch(xs, idxs, ws, E)[rank]["recv_x"].view(torch.int16)
        assert torch.equal(buf.dispatch(xs[rank].to(dev), handle=handle)[0].cpu().view(torch.int16), want)
        assert handle.replay_dispatch is not None and handle.replay_dispatch.launches is not None
        texts = []
        for kw in (dict(expert_alignment=1.0), dict(num_worst_tokens=0.0), dict(expert_alignment=True)):
            try:
                buf.dispatch(xs[rank].to(dev), handle=handle, **kw)
                raise AssertionError(f"a cached dispatch with {kw} ran")
            except ValueError as e:
                assert "must be an int" in str(e), (kw, e)
                texts.append(str(e))
        assert torch.equal(buf.dispatch(xs[rank].to(dev), handle=handle)[0].cpu().view(torch.int16), want)
        return texts
    finally:
        buf.destroy()


def replayed_rounds(rank, world, seed, num_nvl_bytes, fused=False):
    """A buffer small enough for several rounds a call: cached dispatches and combines replay their send and receive
    launches of every round (a combine with fresh fp32 sums each call), fresh contents each call, bit for bit
    against the reference, with and without weights. ``fused``: every call (the plain dispatch too) runs all its
    rounds as one launch (``TRITON_EP_FUSED=1``), and a replay is that one launch. Returns ``(dispatch replays,
    combine replays)``."""
    from triton_ep.modes import intranode_replay as RP
    E, K, H = 4 * world, 3, 64
    Ts = [40 + 5 * r for r in range(world)]
    xs, idxs, ws = make_inputs(seed, world, E, K, H, Ts)
    counts = {}
    real_run = RP._run

    def counted(rt, p, *a, **k):
        counts[p.code] = counts.get(p.code, 0) + 1
        if fused:
            assert len(p.launches) == 1, ("several rounds as one launch", len(p.launches))
        else:
            assert len(p.launches) > 2, ("several rounds: a send and a receive launch each", len(p.launches))
        return real_run(rt, p, *a, **k)
    RP._run = counted
    if fused:
        os.environ["TRITON_EP_FUSED"] = "1"
    buf = triton_ep.Buffer(None, num_nvl_bytes, timeout_s=60)
    try:
        _, _, recv_w, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
        for k in range(6):
            xk = [(x.float() * (k + 2) - k).to(torch.bfloat16) for x in xs]
            ek = ref.dispatch(xk, idxs, ws, E)
            got = buf.dispatch(xk[rank], handle=handle)[0]
            assert torch.equal(got.view(torch.int16), ek[rank]["recv_x"].view(torch.int16)), k
            ys = [(e["recv_x"].float() * 2).to(torch.bfloat16) for e in ek]
            weights = k >= 3         # (the combine's plan changes once: with weights from here)
            wk = [e["recv_topk_weights"] * (k + 1) for e in ek]
            out, wout, _ = buf.combine(ys[rank], handle, topk_weights=wk[rank] if weights else None)
            cexp = ref.combine(ys, ek, Ts, wk)[rank]
            assert torch.equal(out.view(torch.int16), cexp[0].view(torch.int16)), k
            assert torch.equal(wout, cexp[1]) if weights else wout is None, k
        from triton_ep.protocol import call_card as card
        return counts.get(card.CACHED_DISPATCH, 0), counts.get(card.COMBINE, 0)
    finally:
        RP._run = real_run
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()


def replayed_layouts(rank, world, seed):
    """``get_dispatch_layout`` of a ``topk_idx`` of the last layout's shape and dtype replays that layout's launches
    (modes/intranode_replay.py, kernels/layout.py ``LayoutPlan``): fresh routing each call (with ``-1`` and ids out
    of range), the layout against the reference and the dispatch that takes it (its remembered send positions)
    against the reference; another dtype, a non-contiguous ``topk_idx``, a tuning change (two launches of
    several blocks; one launch of several blocks; atomic counts) take the general path once and plan again; a float ``num_experts`` is refused
    as on the general path. Returns the replays counted."""
    from triton_ep.kernels import _util, layout as LY
    E, K, H, T = 4 * world, 3, 64, 10
    replays = [0]
    real_call = LY.LayoutPlan.__call__

    def counted(self, idx):
        replays[0] += 1
        return real_call(self, idx)
    LY.LayoutPlan.__call__ = counted
    table = _util.INTERP_TUNING["layout"]
    saved = dict(table)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    try:
        def check(k, dtype=torch.int64, contiguous=True):
            xs, idxs, ws = make_inputs(seed + k, world, E, K, H, [T] * world)
            idx = idxs[rank].to(dtype)
            bad = idx.clone()
            bad[0, 0] = E + 2           # an id out of range: masked (and reported by the dispatch)
            if not contiguous:
                idx = idx.t().contiguous().t()
            per_rank, none, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            want = ref.get_dispatch_layout(idx, E, world)
            assert none is None
            assert torch.equal(per_rank, want[0]) and torch.equal(per_expert, want[1]), k
            assert torch.equal(in_rank, want[2]), k
            recv_x, _, _, _, _, _ = buf.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=ws[rank])
            exp = ref.dispatch(xs, [i.to(dtype) for i in idxs], ws, E)[rank]
            assert torch.equal(recv_x.view(torch.int16), exp["recv_x"].view(torch.int16)), k
            got_bad = buf.get_dispatch_layout(bad, E)
            want_bad = ref.get_dispatch_layout(bad, E, world)
            for got, want in zip((got_bad[0], got_bad[2], got_bad[3]), want_bad):
                assert torch.equal(got, want), k

        for k in range(3):
            check(k)                    # the first: the general path, plans; then replays
        check(3, dtype=torch.int32)     # another dtype: the general path, plans again
        check(4, dtype=torch.int32)
        check(5, contiguous=False)      # a copy on the general path (a plan of int64 again)
        table.update(one_launch_tokens=4, block_t=4, scan_tokens=0)     # several blocks, two launches
        check(6)
        check(7)
        table.update(scan_tokens=64, scan_block_t=4)   # several blocks, one launch (each program reads every id)
        check(8)
        check(9)
        table["histogram_max_bins"] = 8     # atomic counts into zeroed counts (two launches)
        check(10)
        check(11)
        try:
            buf.get_dispatch_layout(make_inputs(seed, world, E, K, H, [T] * world)[1][rank], float(E))
            raise AssertionError("a float num_experts was taken")
        except ValueError:
            pass
        return replays[0]
    finally:
        table.update(saved)
        LY.LayoutPlan.__call__ = real_call
        buf.destroy()


def replay_plans_let_a_dropped_buffer_go(rank, world):
    """A Buffer dropped without ``destroy()`` while a handle whose cached dispatch and combine were replayed is kept:
    nothing of the Buffer stays alive (its Runtime and its shared data area are collected; the plans' launches,
    which referred to that area, are dropped). Returns ``(Runtime collected, data area collected, plans dropped)``."""
    import gc
    import weakref
    E, K, H = 4 * world, 2, 64
    xs, idxs, ws = make_inputs(9, world, E, K, H, [6] * world)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
    for _ in range(3):
        buf.dispatch(xs[rank], handle=handle)
        buf.combine(recv_x, handle)
    assert handle.replay_dispatch.launches is not None and handle.replay_combine.launches is not None
    rt, data = weakref.ref(buf._rt), weakref.ref(buf._rt.comm.data)
    import torch.distributed as dist
    dist.barrier()                      # (every rank's calls are done before any drops its Buffer)
    del buf
    gc.collect()
    dropped = handle.replay_dispatch.launches is None and handle.replay_combine.launches is None
    return rt() is None, data() is None, dropped


def replays_follow_config(rank, world, seed):
    """Cached dispatches and combines of one handle with per-call Configs (docs/tuning.md): a call replays the plan
    of its handle's last call only under the same Config; another Config takes the general path and launches as
    it says (rows per block, programs, rounds), then its plan replays. Every result bit for bit against the
    reference. Returns per step ``(replays so far, {launch name: (BLOCK_T, programs)} of the step's launches,
    dispatch_send launches of the step)``."""
    from triton_ep.kernels import launch as L
    from triton_ep.modes import intranode_replay as RP
    E, K, H = 4 * world, 2, 64
    Ts = [6 + 2 * r for r in range(world)]
    xs, idxs, ws = make_inputs(seed, world, E, K, H, Ts)
    replays, seen = [0], []
    real_run, real_call = RP._run, L.BoundLaunch.__call__

    def counted(*a, **k):
        replays[0] += 1
        return real_run(*a, **k)

    def spied(self, *args):
        seen.append((self.launcher.name, self.meta.get("BLOCK_T"), self.grid[0]))
        return real_call(self, *args)
    RP._run, L.BoundLaunch.__call__ = counted, spied
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    steps = []
    try:
        _, _, _, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))
        one_row = triton_ep.Config(2, 1, 4096)              # 1 row a block, at most 2 programs, one round
        small_rounds = triton_ep.Config(2, 64, 1)           # 64 rows a block, 2 rows a round
        for k, cfg in enumerate([one_row, one_row, small_rounds, small_rounds, None, one_row]):
            xk = [(x.float() * (k + 2) - k).to(torch.bfloat16) for x in xs]
            ek = ref.dispatch(xk, idxs, ws, E)
            del seen[:]
            got = buf.dispatch(xk[rank], handle=handle, config=cfg)[0]
            assert torch.equal(got.view(torch.int16), ek[rank]["recv_x"].view(torch.int16)), k
            ys = [(e["recv_x"].float() * 2).to(torch.bfloat16) for e in ek]
            out, _, _ = buf.combine(ys[rank], handle, config=cfg)
            cexp = ref.combine(ys, ek, Ts, [e["recv_topk_weights"] for e in ek])[rank]
            assert torch.equal(out.view(torch.int16), cexp[0].view(torch.int16)), k
            params = {name: (bt, g) for name, bt, g in seen}
            steps.append((replays[0], params, sum(name == "dispatch_send" for name, _, _ in seen)))
    finally:
        RP._run, L.BoundLaunch.__call__ = real_run, real_call
        buf.destroy()
    return steps


def combine_weights_of_another_width(rank, world):
    """A dispatch with top-2 weights, then a combine where rank 1 passes its received weights cut to one column
    and the other ranks pass none: rank 1 raises ValueError naming topk_weights' shape (the handle's dispatch took
    2 columns), every other rank EPRemoteError naming rank 1, at once (a new user's find: it was reported as the
    ranks disagreeing on the weights' columns); then a correct combine works. Returns ``(error type, text,
    seconds)``."""
    import time
    E, H = 2 * world, 32
    xs, idxs, ws = make_inputs(5, world, E, 2, H, [5] * world)
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=30)
    try:
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(xs[rank], topk_weights=ws[rank],
                                                       **_layout_kwargs(buf, idxs[rank], E))
        t0 = time.monotonic()
        try:
            buf.combine(recv_x, handle, topk_weights=recv_w[:, :1] if rank == 1 else None)
            out = ("no error", "", 0.0)
        except Exception as e:  # noqa: BLE001
            out = (type(e).__name__, str(e), time.monotonic() - t0)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        exp = ref.dispatch(xs, idxs, ws, E)
        want_x, want_w = ref.combine([d["recv_x"] for d in exp], exp, [5] * world,
                                     [d["recv_topk_weights"] for d in exp])[rank]
        assert torch.equal(combined, want_x) and torch.equal(combined_w, want_w), "the combine after the refusal"
        return out
    finally:
        buf.destroy()
