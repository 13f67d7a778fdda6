"""Rank bodies for the internode mode's multi-process tests (module-level: spawned processes import them)."""
import gc
import os
import time

import torch

import triton_ep
from tests.cases.helpers import all_live_ranks_reach


def _error(ex: BaseException) -> list:
    return [type(ex).__name__, str(ex)]


def layout_and_checks(rank, world, env, E, K, T, seed):
    """Build a Buffer with ``env`` set in this rank; return what get_dispatch_layout gives, the reference
    per-host counts, and the errors dispatch / combine raise for a few argument shapes and handles (``None``, a
    tuple of the ok dispatch's handle's entries with a float in place of ``recv_src_meta``, one rebuilt as it was)."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=30)
    try:
        g = torch.Generator().manual_seed(seed + rank)
        idx = torch.randint(-1, E, (T, K), generator=g)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        x = torch.randn(T, 64).to(torch.bfloat16)
        out = {"idx": idx, "per_host": per_host, "in_rank": in_rank, "per_rank": per_rank}
        calls = {
            "missing": dict(num_tokens_per_rdma_rank=None),
            "int64": dict(num_tokens_per_rdma_rank=per_host.long() if per_host is not None else None),
            "shape": dict(num_tokens_per_rdma_rank=torch.zeros(7, dtype=torch.int32)),
            "value": dict(num_tokens_per_rdma_rank=per_host + 1 if per_host is not None else None),
            "ok": dict(num_tokens_per_rdma_rank=per_host),
        }
        handle = None
        for name, kw in calls.items():
            try:
                handle = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert, topk_idx=idx, **kw)[4]
                out[name] = None
            except Exception as ex:   # noqa: BLE001 - the test compares the errors
                out[name] = _error(ex)
        h = list(handle)
        for name, bad in (("combine", None), ("float", tuple(h[:7] + [0.5] + h[8:])), ("rebuilt", tuple(h))):
            try:
                buf.combine(x, handle=bad)
                out[name] = None
            except Exception as ex:   # noqa: BLE001
                out[name] = _error(ex)
        return out
    finally:
        buf.destroy()


def build_only(rank, world, env, kwargs):
    """Build a Buffer with ``env`` (a dict, or one per rank) set in this rank and ``kwargs``; the error it
    raises, or None."""
    os.environ.update(env[rank] if isinstance(env, list) else env)
    try:
        buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20, **kwargs)
    except Exception as ex:   # noqa: BLE001
        return _error(ex)
    buf.destroy()
    return None


def low_latency_buffer(rank, world, env, seed):
    """A Buffer built with low_latency_mode (and num_rdma_bytes from the hint) over ranks on several hosts:
    DeepEP's one Buffer for both modes. Normal-mode calls, then low-latency calls, then normal-mode calls
    again (with ``clean_low_latency_buffer`` between the kinds of use, as DeepEP asks), each checked against
    its oracle: ``[normal ok, low-latency rows received, normal ok]``."""
    from tests.cases import ll as ll_cases
    os.environ.update(env)
    E, K, H, N = 4 * world, 2, 128, 8
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 1 << 20, hint, low_latency_mode=True, num_qps_per_rank=2, timeout_s=60)
    try:
        per_host = int(env["TRITON_EP_RANKS_PER_HOST"])
        first = check_case(buf, rank, world, per_host, seed, E, K, H, [5 + r for r in range(world)], {})
        buf.clean_low_latency_buffer(N, H, E)
        xs, idxs, ws = ll_cases.ll_inputs(seed, world, E, K, H, [N - r for r in range(world)])
        rows = 0
        for use_fp8 in (False, True):
            out, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=use_fp8)
            ll_cases.check_dispatch(out, count, handle, xs, idxs, world, E, rank, use_fp8, False, False)
            rx = out[0].float() * out[1].repeat_interleave(128, dim=-1) if use_fp8 else out
            y = torch.stack([ll_cases.expert_fn("affine", rank * (E // world) + le, rx[le].to(torch.bfloat16))
                             for le in range(E // world)])
            comb = buf.low_latency_combine(y, idxs[rank], ws[rank], handle)[0]
            xin = xs[rank]
            if use_fp8:
                q, sc = ll_cases.quantize_reference(xin, False)
                xin = (q.float() * sc.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
            want = ll_cases.expected_combine(xin, idxs[rank], ws[rank], E, world, "affine")
            assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "low-latency combine"
            rows += int(count.sum())
        buf.clean_low_latency_buffer(N, H, E)
        again = check_case(buf, rank, world, per_host, seed + 1, E, K, H, [3 + r for r in range(world)], {})
        return first, rows, again
    finally:
        buf.destroy()


def machines(rank, world, env, per_machine, seed):
    """Each rank claims to run on machine ``rank // per_machine`` (its host identity), with ``env`` set: the
    Buffer's hosts, what its runtime maps, and a dispatch + combine round trip against the reference (or
    the error the construction raises)."""
    from triton_ep.runtime import HostsRuntime, opening
    os.environ.update(env)
    opening.host_identity = lambda: f"machine-{rank // per_machine}"
    try:
        buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    except Exception as ex:   # noqa: BLE001
        return {"error": _error(ex)}
    try:
        rt = buf._rt
        out = {"hosts": rt.hosts.host_of, "source": rt.hosts.source, "hosts_runtime": isinstance(rt, HostsRuntime),
               "mapped": rt.live().size, "rdma_buffer": buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel()}
        out.update(check_case(buf, rank, world, rt.hosts.ranks_per_host, seed, 4 * world, 2, 32, [5, 3, 0, 7][:world],
                              {"bias": True}))
        return out
    finally:
        buf.destroy()


def round_trip(rank, world, env, seed, E, K, H, Ts, opts=None):
    """Internode dispatch -> x*2 'experts' -> combine -> cached dispatch of new data on a new Buffer, each
    compared with the reference (:func:`check_case`). Returns what it checked."""
    opts = opts or {}
    os.environ.update(env)
    device = opts.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    if opts.get("bound"):
        # as init_process_group(device_id=...) leaves it (DeepEP's init_dist): the default group bound to a device,
        # which makes torch build subgroups by splitting its backend (gloo cannot)
        import torch.distributed as dist
        dist.distributed_c10d._get_default_group().bound_device_id = torch.device(device, 0)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60, device=device)
    try:
        return check_case(buf, rank, world, int(env["TRITON_EP_RANKS_PER_HOST"]), seed, E, K, H, Ts, opts)
    finally:
        buf.destroy()


def check_case(buf, rank, world, n, seed, E, K, H, Ts, opts):
    """One dispatch -> x*2 'experts' -> combine -> cached dispatch of new data on ``buf``, each compared with
    the reference bit for bit (combine: the two-level summation order, ``ref.combine(ranks_per_host=n)``).
    ``opts``: ``fp8``, ``f32`` (float32 rows: dispatch only), ``skew`` (ids in the first quarter of the
    experts), ``worst`` (num_worst_tokens; ``"per_rank"``: each rank its own, the rows it receives (at least 1)
    plus twice its rank, so rank 0's has no room to spare and no two are equal), ``bias``, ``weights`` (default
    True), ``device``, ``no_topk``
    (dispatch routed by is_token_in_rank and counted by num_tokens_per_expert, without topk_idx: no weights,
    recv_topk_idx None)."""
    from triton_ep import reference as ref
    from tests.cases.mp import make_inputs
    fp8, worst, bias, weights = (opts.get("fp8", False), opts.get("worst", 0), opts.get("bias", False),
                                 opts.get("weights", True))
    f32, device, no_topk = opts.get("f32", False), opts.get("device", "cpu"), opts.get("no_topk", False)
    xs, idxs, ws = make_inputs(seed, world, E, K, H, Ts, skew=opts.get("skew", False), fp8=fp8)
    if f32:
        xs = [x.float() for x in xs]
    if not weights or no_topk:
        ws = None
    exp = ref.dispatch(xs, idxs, ws, E)
    if worst == "per_rank":                 # (never 0: that is no num_worst_tokens)
        worst = max(exp[rank]["recv_topk_idx"].shape[0], 1) + 2 * rank
    mine = tuple(t.to(device) for t in xs[rank]) if fp8 else xs[rank].to(device)
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[rank].to(device), E)
    recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
        mine, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=None if no_topk else idxs[rank].to(device),
        topk_weights=None if ws is None else ws[rank].to(device), num_worst_tokens=worst)
    recv_x = tuple(t.cpu() for t in recv_x) if fp8 else recv_x.cpu()
    if no_topk:
        assert recv_idx is None and recv_w is None
        recv_idx = torch.full(((recv_x[0] if fp8 else recv_x).shape[0],), -1, dtype=torch.int64)
    recv_idx, recv_w = recv_idx.cpu(), None if recv_w is None else recv_w.cpu()
    handle_cpu = [t.cpu() for t in handle]
    e = exp[rank]
    N = e["recv_topk_idx"].shape[0]
    rows = recv_x[0] if fp8 else recv_x
    assert rows.shape[0] == (worst or N), (rows.shape, worst, N)
    if fp8:
        assert torch.equal(recv_x[0][:N].view(torch.uint8), e["recv_x"][0].view(torch.uint8))
        assert torch.equal(recv_x[1][:N], e["recv_x"][1])
    else:
        assert torch.equal(recv_x[:N].view(torch.uint8), e["recv_x"].view(torch.uint8))
    if not no_topk:
        assert torch.equal(recv_idx[:N], e["recv_topk_idx"])
    if ws is not None:
        assert torch.equal(recv_w[:N], e["recv_topk_weights"])
    else:
        assert recv_w is None
    if worst:
        assert lst == [] and bool((recv_idx[N:] == -1).all()) and bool((rows[N:].view(torch.uint8) == 0).all())
    else:
        assert lst == e["num_recv_tokens_per_expert_list"], (lst, e["num_recv_tokens_per_expert_list"])
    rpm = e["rank_prefix_matrix"]
    assert torch.equal(handle_cpu[0], in_rank.cpu())
    assert torch.equal(handle_cpu[6], rpm[:, rank]), (handle_cpu[6], rpm[:, rank])
    assert torch.equal(handle_cpu[7][:N, 1], e["recv_src_idx"])
    out = {"rows": int(N)}
    if fp8 or f32:
        return out
    y = torch.zeros_like(recv_x)
    y[:N] = (recv_x[:N].float() * 2).to(torch.bfloat16)
    y[N:] = float("nan")                                  # padding rows must be ignored
    b = [(torch.randn(Ts[i], H, generator=torch.Generator().manual_seed(i))).to(torch.bfloat16)
         for i in range(world)] if bias else None
    cx, cw, _ = buf.combine(y.to(device), handle, topk_weights=None if recv_w is None else recv_w.to(device),
                            bias=None if b is None else b[rank].to(device))
    cx, cw = cx.cpu(), None if cw is None else cw.cpu()
    ys = [(exp[j]["recv_x"].float() * 2).to(torch.bfloat16) for j in range(world)]
    cexp = ref.combine(ys, exp, Ts, None if ws is None else [d["recv_topk_weights"] for d in exp],
                       None if b is None else [[t] for t in b], ranks_per_host=n)[rank]
    assert torch.equal(cx.view(torch.int16), cexp[0].view(torch.int16)), (cx - cexp[0]).abs().max()
    if ws is not None:
        assert torch.equal(cw, cexp[1])
    x2 = (xs[rank].float() + 1).to(torch.bfloat16)
    rx2 = buf.dispatch(x2.to(device), handle=handle)[0].cpu()
    exp2 = ref.dispatch([(x.float() + 1).to(torch.bfloat16) for x in xs], idxs, ws, E)[rank]
    assert torch.equal(rx2[:N].view(torch.int16), exp2["recv_x"].view(torch.int16))
    out["combined"] = True
    return out


def property_cases(rank, world, env, seed, n_cases):
    """``n_cases`` random cases on one Buffer, the same on every rank (seeded): ragged T with zeros, -1 ids,
    duplicates, skew to the first host, bf16 / float32 rows / FP8 pairs, weights or not, num_worst_tokens (the
    same everywhere, or each rank its own), biases, dispatch without topk_idx. Returns the number of cases and
    the rows received in all."""
    import random
    os.environ.update(env)
    n = int(env["TRITON_EP_RANKS_PER_HOST"])
    rnd = random.Random(seed)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    rows = 0
    try:
        for c in range(n_cases):
            K = rnd.choice([1, 2, 3])
            E = world * rnd.choice([1, 2, 4])
            Ts = [rnd.choice([0, 1, 5, 13]) for _ in range(world)]
            kind = rnd.choice(["bf16", "bf16", "f32", "fp8"])
            opts = {"skew": rnd.random() < 0.3, "weights": rnd.random() < 0.7, "bias": rnd.random() < 0.3,
                    "fp8": kind == "fp8", "f32": kind == "f32", "no_topk": rnd.random() < 0.2}
            if rnd.random() < 0.3:
                opts["worst"] = rnd.choice([sum(Ts) * K, sum(Ts) * K + 3, "per_rank"])
            H = 128 if kind == "fp8" else rnd.choice([8, 64])
            rows += check_case(buf, rank, world, n, seed * 1000 + c, E, K, H, Ts, opts)["rows"]
        return {"cases": n_cases, "rows": rows}
    finally:
        buf.destroy()


def traffic(rank, world, env, T, H):
    """Every token of every rank to the other host's experts (dispatch, combine); returns
    ``Buffer.get_rdma_stats()`` and the chunk size."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 8 << 20, timeout_s=60)
    try:
        E = 2 * world
        other = (rank + world // 2) % world
        idx = torch.tensor([[other * 2, other * 2 + 1]]).repeat(T, 1)
        x = torch.randn(T, H).to(torch.bfloat16)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx)
        buf.combine(rx, handle)
        return buf.get_rdma_stats()
    finally:
        buf.destroy()


def failure(rank, world, env, kind, timeout_s, worst=0):
    """``kind`` "stalled": rank 1 builds its Buffer and then calls nothing (until the others have their errors, at
    most ``2 * timeout_s + 2`` s); "broken_qp": rank 0's QP 1 towards
    host 1 is put into the error state first; "dropped_signal": rank 0's proxy leaves out the signal of its
    second chunk to host 1; "killed": the last rank (on the last host) dies with SIGKILL in its first
    dispatch, after its records went out and before it unpacks its peers'. Every other rank dispatches a few
    chunks' worth to the other host (with ``num_worst_tokens=worst``). Returns ``[error type, message, seconds, type of the next call's error,
    message, seconds]`` (or None)."""
    import signal
    import time
    from triton_ep.kernels import net
    from triton_ep.testing import break_rdma_qp, drop_rdma_signal
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 8 << 20, timeout_s=timeout_s)
    try:
        if kind == "stalled" and rank == 1:
            all_live_ranks_reach(world, bound_s=2 * timeout_s + 2)     # silent until the others have their errors
            return None
        if kind == "broken_qp" and rank == 0:
            break_rdma_qp(buf, 1, 1)
        if kind == "dropped_signal" and rank == 0:
            drop_rdma_signal(buf, 1, 1)
        if kind == "killed" and rank == world - 1:
            def die(*args, **kwargs):
                time.sleep(0.5)         # the proxy posts what the pack kernel released
                os.kill(os.getpid(), signal.SIGKILL)
            net.unpack_ring = die
        T, H, E = 256, 1024, 2 * world
        other = (rank + world // 2) % world
        idx = torch.tensor([[other * 2, other * 2 + 1]]).repeat(T, 1)
        x = torch.randn(T, H).to(torch.bfloat16)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx)
        out = []
        for _ in range(2):
            t0 = time.monotonic()
            try:
                buf.dispatch(x, num_worst_tokens=worst, **kw)
                buf.check()
                out += [None, "", time.monotonic() - t0]
            except Exception as ex:   # noqa: BLE001
                out += [type(ex).__name__, str(ex), time.monotonic() - t0]
        if kind in ("broken_qp", "dropped_signal", "killed"):
            # every live rank has its errors before any tears down (on a loaded machine a quick rank's exit would
            # otherwise be what a slow one hears of first); then the peers hear of the failure from the fault word
            all_live_ranks_reach(world - (kind == "killed"), bound_s=60.0)
            time.sleep(timeout_s)
        if kind == "stalled":
            all_live_ranks_reach(world, bound_s=2 * timeout_s + 2)
        return out
    finally:
        buf.destroy()


def propagation(rank, world, env, kind):
    """2 hosts of 2 ranks. ``kind`` "capacity": every token of every rank goes to host 0's experts and
    num_worst_tokens is too small there only; "bad_args": rank 3 passes int64 topk_weights. Returns the error
    type and seconds of the failing call, then whether a correct dispatch + combine works afterwards."""
    import time
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        T, H, E = 6, 64, 8
        x = torch.randn(T, H).to(torch.bfloat16)
        idx = torch.tensor([[0, 2]]).repeat(T, 1) if kind == "capacity" else torch.randint(0, E, (T, 2))
        w = torch.rand(T, 2)
        if kind == "bad_args" and rank == 3:
            w = w.double()
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx)
        t0 = time.monotonic()
        try:
            buf.dispatch(x, topk_weights=w, num_worst_tokens=8 if kind == "capacity" else 0, **kw)
            first = [None, time.monotonic() - t0]
        except Exception as ex:   # noqa: BLE001
            first = [type(ex).__name__, time.monotonic() - t0, str(ex)]
        rx, _, _, _, handle, _ = buf.dispatch(x, **kw)
        out, _, _ = buf.combine(rx, handle)
        expect = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        return first + [bool(torch.equal(out, expect))]
    finally:
        buf.destroy()


def killed(rank, world, env):
    """Rank 1 kills itself (SIGKILL) after building its Buffer and a dispatch; the others wait for it to be
    gone, then destroy theirs. Returns the token-named emulated ring files left in /dev/shm (by rank 0)."""
    import glob
    import signal
    import time
    import torch.distributed as dist
    from triton_ep.transport.ipc import shm_name
    os.environ.update(env)
    pattern = os.path.join("/dev/shm", shm_name("tep_") + "*")      # this run's emulated ring files
    before = set(glob.glob(pattern))
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    idx = torch.randint(0, 8, (6, 2))
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
    buf.dispatch(torch.randn(6, 64).to(torch.bfloat16), num_tokens_per_rank=per_rank,
                 num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                 topk_idx=idx)
    during = set(glob.glob(pattern)) - before
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2)
    buf.destroy()
    time.sleep(1)
    return {"during": sorted(during), "after": sorted(set(glob.glob(pattern)) - before)}


def in_step(rank, world, env):
    """2 hosts of 2 ranks; rank 3 alone passes bad arguments to a dispatch, a combine and a cached dispatch
    (each fails on every rank), then a combine of another hidden size. Returns each call's error type, the
    last one's message, the bad combine's message, and whether a correct dispatch + combine works
    afterwards."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        g = torch.Generator().manual_seed(rank)
        T, H, E = 8, 64, 8
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        pr, ph, pe, ir, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=pr, num_tokens_per_rdma_rank=ph, is_token_in_rank=ir,
                  num_tokens_per_expert=pe, topk_idx=idx)
        bad = rank == 3
        out = []
        msg = combine_msg = ""
        for call in ("dispatch", "combine", "cached", "hidden"):
            try:
                if call == "dispatch":
                    buf.dispatch(x.flatten() if bad else x, **kw)
                else:
                    rx, _, _, _, h, _ = buf.dispatch(x, **kw)
                    if call == "combine":
                        buf.combine(rx[:-1] if bad else rx, h)
                    elif call == "cached":
                        buf.dispatch(x[:-1] if bad else x, handle=h)
                    else:
                        buf.combine(torch.zeros(rx.shape[0], 32 if bad else H, dtype=torch.bfloat16), h)
                out.append(None)
            except Exception as ex:   # noqa: BLE001
                out.append(type(ex).__name__)
                msg = str(ex)
                if call == "combine":
                    combine_msg = str(ex)
        rx, _, _, _, h, _ = buf.dispatch(x, **kw)
        y, _, _ = buf.combine(rx, h)
        expect = (x.float() * ir.sum(1, keepdim=True).float()).to(torch.bfloat16)
        return out + [msg, combine_msg, bool(torch.equal(y, expect))]
    finally:
        buf.destroy()


def capture_sequence(rank, world, env, seed, E, K, H, Ts, per_rank=False):
    """The capture path (``TRITON_EP_INTERNODE_CAPTURE_PATH=1``) on one Buffer, each case checked against the
    reference (:func:`check_case`): num_worst_tokens with weights and biases, then without topk_idx, then a
    plain dispatch on the host path (its chunk numbers re-read from the ring counters the capture path
    advanced), then the capture path again. ``per_rank``: each rank passes its own num_worst_tokens, as small
    as its rows allow (:func:`check_case`'s ``"per_rank"``). Returns what each case checked."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    n = int(env["TRITON_EP_RANKS_PER_HOST"])
    worst = "per_rank" if per_rank else sum(Ts) * K + 3
    try:
        out = []
        for i, opts in enumerate(({"worst": worst, "bias": True}, {"worst": worst, "no_topk": True}, {"bias": True},
                                  {"worst": worst, "skew": True})):
            out.append(check_case(buf, rank, world, n, seed + i, E, K, H, Ts, opts))
        out.append(buf.get_rdma_stats()["host_exchanges"])
        # (the ranks' rounds, sized by their own T, end at different times: destroy() meets the RDMA peers before
        # its QPs go, so no rank leaves under a peer's last writes; test_destroy_meets_the_rdma_peers_as_they_close)
        return out
    finally:
        buf.destroy()


def _pause_after_notify(seconds):
    """This process's next intranode dispatch sleeps ``seconds`` after its notify send launch (once). The count
    exchange stays two launches here (``TRITON_EP_FUSED=0``: one launch has no point between them)."""
    import time
    from triton_ep.modes.intranode import Intranode
    os.environ["TRITON_EP_FUSED"] = "0"
    orig = Intranode.dispatch_steps

    def paused(self, *args, **kwargs):
        Intranode.dispatch_steps = orig
        gen = orig(self, *args, **kwargs)
        stage = next(gen)
        while True:
            yield stage
            if stage == "dispatch/notify receive":   # its counts are out, its receive not yet run
                time.sleep(seconds)
            try:
                stage = next(gen)
            except StopIteration as stop:
                return stop.value

    Intranode.dispatch_steps = paused


def capture_errors(rank, world, env, kind):
    """2 hosts of 2 ranks on the capture path. ``kind`` "bad_ids": rank 3 passes an id past the experts;
    "capacity": every token goes to host 0 and num_worst_tokens is too small there ("capacity_late": and rank 0
    pauses 2 s after its notify launch, so rank 1 finds the error, raises and leaves first; "capacity_rank": every
    token goes to rank 0 alone, whose num_worst_tokens alone is too small: the staging areas, sized by host 0's
    ranks' sum, take every record, and the forwarding leg finds rank 0's; "capacity_net", run on 2 hosts of one
    rank: rank 1's tokens go to rank 0, whose num_worst_tokens is too small for that stream, which is cut after
    its first round on both sides, and rank 0's to rank 1; "capacity_room": the same with num_worst_tokens 64
    everywhere, but rank 1 tells its RDMA peer it has 1 token, so rank 0's staging area, sized by the token
    counts, has room for 1 record); "bad_shape": rank 3
    passes int64 topk_weights (a host-side check). The call returns (bad values are found on the device);
    ``Buffer.check()`` then raises on the ranks that recorded it, and every rank's next call raises at once.
    Returns the first call's, the check's and the next call's errors ([type, message] or None) and the calls'
    seconds."""
    import time
    import torch.distributed as dist
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        # (capacity_net: rank 0's own rounds, from its T of 1, cover only its room for rank 1's 6 records)
        net = kind in ("capacity_net", "capacity_room")
        T, H, E = 1 if net and rank == 0 else 6, 64, 8
        if kind == "capacity_room" and rank == 1:
            from triton_ep.modes.internode.peer_tokens import PeerTokens
            told = PeerTokens.post
            PeerTokens.post = lambda self, seq, num_tokens: told(self, seq, 1)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        capacity = kind.startswith("capacity")
        idx = torch.tensor([[0, 1 if kind == "capacity_rank" else 2]]).repeat(T, 1) if capacity else \
            torch.randint(0, E, (T, 2), generator=g)
        if net:
            idx = torch.tensor([[4, 5] if rank == 0 else [0, 1]]).repeat(T, 1)
        if kind == "capacity_late" and rank == 0:
            _pause_after_notify(2.0)
        w = torch.rand(T, 2, generator=g)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        # every rank's layout before any rank's dispatch: a layout raises at once where a peer's call already ended
        # the network leg (a fresh-clone CI run saw rank 1, slowed, get rank 3's ProxyRemoteError from its layout)
        dist.barrier()
        if kind == "bad_ids" and rank == 3:
            idx = idx.clone()
            idx[0, 0] = E + 5
        if kind == "bad_shape" and rank == 3:
            w = w.double()
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        worst = {"capacity_net": 2 if rank == 0 else 64, "capacity_rank": 4 if rank == 0 else 64}.get(
            kind, 4 if capacity else 64)
        first = None
        t0 = time.monotonic()
        try:
            buf.dispatch(x, num_worst_tokens=worst, **kw)
        except Exception as ex:   # noqa: BLE001
            first = [type(ex).__name__, str(ex)]
        first_s = time.monotonic() - t0
        if net:      # rank 1's call must end by itself (its cut stream), not by rank 0's failure
            dist.barrier()
        checked = None                  # (no barrier first: this rank's own error must win over its peers' echo)
        try:
            buf.check()
        except Exception as ex:   # noqa: BLE001
            checked = [type(ex).__name__, str(ex)]
        dist.barrier()
        t0 = time.monotonic()
        try:
            buf.dispatch(x, num_worst_tokens=64, **kw)
            nxt = None
        except Exception as ex:   # noqa: BLE001
            nxt = [type(ex).__name__, str(ex)]
        return {"first": first, "first_s": first_s, "checked": checked, "next": nxt, "next_s": time.monotonic() - t0}
    finally:
        buf.destroy()


def capture_staging(rank, world, env, Ts, worst):
    """The capture path with ``num_worst_tokens`` = ``worst`` on every rank, far above the tokens (``Ts``, per
    rank): dispatch, combine and cached dispatch the reference's bit for bit (:func:`check_case`), then the bytes
    of the largest staging areas a call took (``get_rdma_stats()["capture_staging_bytes"]``)."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    try:
        out = check_case(buf, rank, world, int(env["TRITON_EP_RANKS_PER_HOST"]), 7, 8, 2, 64, Ts, {"worst": worst})
        out["staging"] = buf.get_rdma_stats()["capture_staging_bytes"]
        return out
    finally:
        buf.destroy()


def close_meeting(rank, world, env, late_s):
    """One round trip across hosts, then the last rank destroys its Buffer ``late_s`` seconds after the others:
    returns ``(seconds destroy() took, seconds it waited for the RDMA peers to close)``, the round trip's result
    checked first (:func:`check_case`)."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=60)
    leg = buf._modes.internode
    try:
        out = check_case(buf, rank, world, int(env["TRITON_EP_RANKS_PER_HOST"]), 7, 8, 2, 64, [5] * world, {})
        assert out["combined"], out
    finally:
        if rank == world - 1:
            time.sleep(late_s)
        t0 = time.monotonic()
        buf.destroy()
    return time.monotonic() - t0, leg.close_waited_s


def graph_across_hosts(rank, world, env, seed):
    """Layout, a num_worst_tokens dispatch, an expert stand-in and combine across hosts captured in one CUDA
    graph (no host synchronisation inside: sync debug mode 'error'), replayed with new x and new routing
    written into the captured inputs (random, every token to rank 0's experts, mostly -1): each replay
    bit for bit the reference (combine: the two-level order), padding rows zero / -1. Each rank passes its own
    num_worst_tokens. Returns the replays."""
    from triton_ep import reference as ref
    from tests.cases.mp import capture, check_replayed_dispatch, graph_inputs
    import torch.distributed as dist
    os.environ.update(env)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    n = int(env["TRITON_EP_RANKS_PER_HOST"])
    E, H, K, T = 4 * world, 512, 4, 24
    worst = T * world + 3 * rank        # each rank its own (rank 0's exactly what the skewed case sends it)
    buf = triton_ep.Buffer(None, 1 << 20, device=dev, timeout_s=60)
    try:
        cases, x_in, idx_in, w_in, load = graph_inputs(rank, world, seed, E, K, H, T, dev)

        def step():
            per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_in, E)
            recv_x, recv_idx, recv_w, lst, h, _ = buf.dispatch(
                x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx_in, topk_weights=w_in, num_worst_tokens=worst)
            y = (recv_x.float() * 3 - 1).to(torch.bfloat16)
            return recv_x, recv_idx, recv_w, lst, h, buf.combine(y, h, topk_weights=recv_w)

        load(0)
        g, (recv_x, recv_idx, recv_w, lst, h, comb) = capture(step, dist.barrier)
        assert lst == []
        replays = 0
        for c in [0, 1, 2, 0]:
            load(c)
            dist.barrier()
            g.replay()
            torch.cuda.synchronize()
            buf.check()
            exp = check_replayed_dispatch(rank, E, cases[c], recv_x, recv_idx, recv_w, c)
            e = exp[rank]
            N = e["recv_x"].shape[0]
            assert torch.equal(h[6].cpu(), e["rank_prefix_matrix"][:, rank]), c
            assert torch.equal(h[7][:N, 1].cpu(), e["recv_src_idx"]), c
            ys = [(d["recv_x"].float() * 3 - 1).to(torch.bfloat16) for d in exp]
            want = ref.combine(ys, exp, [T] * world, [d["recv_topk_weights"] for d in exp], ranks_per_host=n)[rank]
            assert torch.equal(comb[0].cpu().view(torch.int16), want[0].view(torch.int16)), c
            assert torch.equal(comb[1].cpu(), want[1]), c
            replays += 1
        dist.barrier()
        return {"replays": replays}
    finally:
        buf.destroy()


def capture_mismatch(rank, world, env, kind):
    """Ranks across hosts that make different capture-path calls, each ending in a clear error on every rank
    at its call or its next ``check()`` (never a wait that runs out): ``"combine_vs_cached"`` (2 hosts of 1:
    after a num_worst_tokens dispatch, rank 0 combines while rank 1 makes a cached dispatch: records of one
    size, another operation), ``"hidden"`` (rank 1's rows are 4x wider: its stream outruns rank 0's rounds
    unless both cut it), ``"zero_worst"`` (rank 0 passes no num_worst_tokens, so it takes the host path),
    ``"sum_overflow"`` (2 ranks a host, each passing 2^31 - 1: their sum does not fit a stream's count).
    Returns the call's and the check's errors ([type, message] or None) and the seconds they took."""
    import time
    import torch.distributed as dist
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        T, E = 6, 8
        H = 256 if kind == "hidden" and rank == 1 else 64
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, E, (T, 2), generator=g)
        w = torch.rand(T, 2, generator=g)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        worst = 0 if kind == "zero_worst" and rank == 0 else (1 << 31) - 1 if kind == "sum_overflow" else 64
        t0, first = time.monotonic(), None
        try:
            if kind == "combine_vs_cached":
                recv_x, _, _, _, handle, _ = buf.dispatch(x, num_worst_tokens=worst, **kw)
                buf.check()
                dist.barrier()
                t0 = time.monotonic()
                if rank == 0:       # (no weights: its records are then a cached dispatch's, bf16 rows alone)
                    buf.combine(recv_x, handle)
                else:
                    buf.dispatch(x, handle=handle)
            else:
                buf.dispatch(x, num_worst_tokens=worst, **kw)
        except Exception as ex:   # noqa: BLE001
            first = [type(ex).__name__, str(ex)]
        checked = None
        try:
            buf.check()
        except Exception as ex:   # noqa: BLE001
            checked = [type(ex).__name__, str(ex)]
        return {"first": first, "checked": checked, "s": time.monotonic() - t0}
    finally:
        buf.destroy()


def worst_after_rejection(rank, world, env):
    """2 hosts of 2 ranks, host path for num_worst_tokens calls (TRITON_EP_INTERNODE_CAPTURE_PATH=0): rank 3
    rejects a num_worst_tokens dispatch (int64 topk_weights), the others raise; then, on the capture path
    (as while a CUDA graph is captured), a valid num_worst_tokens dispatch, combine and cached dispatch are the
    reference's bit for bit on every rank (the host's ranks re-synchronise before they exchange their values).
    Returns the first call's error type and the check's result."""
    import torch.distributed as dist
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        T, H, E = 6, 64, 8
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, E, (T, 2), generator=g)
        w = torch.rand(T, 2, generator=g)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        first = None
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                         topk_weights=w.double() if rank == 3 else w, num_worst_tokens=64)
        except Exception as ex:   # noqa: BLE001
            first = type(ex).__name__
        dist.barrier()
        buf._modes.internode.capture.mode = True
        Ts = [7, 0, 9, 4]
        checked = check_case(buf, rank, world, 2, 5, 16, 3, 64, Ts, {"worst": "per_rank", "bias": True})
        return {"first": first, "checked": checked}
    finally:
        buf.destroy()


# ---------------------------------------------------------------------------------------------------------
# Ambient defaults (docs/design.md, invariant 12) in every mode: tests/modes/internode/test_ambient_and_errors.py

#: the modes :func:`ambient_defaults` runs: (ranks per host, or None for one host; low-latency calls; capture path)
AMBIENT_MODES = {"intranode": (None, False, False), "low_latency": (None, True, False),
                 "internode": (1, False, False), "internode_capture": (1, False, True),
                 "internode_low_latency": (1, True, False)}


def _flat_tensors(v) -> list:
    """Every tensor in ``v`` (nested tuples and lists; a handle's entries included), moved to the CPU."""
    if isinstance(v, torch.Tensor):
        return [v.detach().cpu()]
    if isinstance(v, (tuple, list)):
        return [t for item in v for t in _flat_tensors(item)]
    return []


def _normal_calls(buf, rank, world, inputs, E, worst, device):
    """layout -> dispatch -> x*2 'experts' -> combine (weights) -> cached dispatch of x+1: every output tensor."""
    xs, idxs, ws = inputs
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    x2 = (xs[rank].float() + 1).to(torch.bfloat16).to(device)
    layout = buf.get_dispatch_layout(idx, E)
    per_rank, per_host, per_expert, in_rank, _ = layout
    recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
    y = (recv_x.float() * 2).to(torch.bfloat16)
    comb = buf.combine(y, handle, topk_weights=recv_w)
    cached = buf.dispatch(x2, handle=handle)[0]
    return _flat_tensors([layout[:4], recv_x, recv_idx, recv_w, list(handle), comb[:2], cached]) + \
        [torch.tensor(lst, dtype=torch.int64, device="cpu")]


def _low_latency_calls(buf, rank, world, inputs, E, N):
    """low_latency_dispatch (bf16, then FP8) -> a stand-in expert -> low_latency_combine: every output tensor."""
    xs, idxs, ws = inputs
    out = []
    for use_fp8 in (False, True):
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=use_fp8)
        rows = recv[0].to(torch.bfloat16) if use_fp8 else recv
        y = (rows.float() * 2 + 1).to(torch.bfloat16)
        comb = buf.low_latency_combine(y, idxs[rank], ws[rank], handle)[0]
        # the rows past each expert's count are not defined (as DeepEP's): only the received ones are compared
        valid = [(t[e, :int(count[e])] for e in range(count.numel())) for t in (recv if use_fp8 else (recv,))]
        out += _flat_tensors([[list(v) for v in valid], count, comb])
    return out


def ambient_defaults(rank, world, env, mode, default_device, default_dtype, device="cpu"):
    """One mode's calls (:data:`AMBIENT_MODES`), first in the plain state, then on a new Buffer built and used
    under ``torch.set_default_device(default_device)`` and ``torch.set_default_dtype(default_dtype)`` (DeepEP's
    tests set ``'cuda'`` and ``torch.bfloat16``; on CPU ``'meta'`` stands in for a device other than the
    Buffer's). The inputs are made in the plain state. Returns the number of output tensors, each compared bit
    for bit (dtype, shape, bytes) with the plain state's."""
    per_host, low_latency, capture = AMBIENT_MODES[mode]
    os.environ.update(env)
    if per_host is not None:
        os.environ.update({"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated",
                           "TRITON_EP_INTERNODE_CAPTURE_PATH": "1" if capture else "0"})
    if device == "cuda":
        torch.cuda.set_device(0)
    E, K, N = 2 * world, 2, 8
    H = 128 if low_latency else 64
    Ts = [N - 2 * r for r in range(world)] if low_latency else [7 + 2 * r for r in range(world)]
    if low_latency:
        from tests.cases import ll as ll_cases
        inputs = ll_cases.ll_inputs(3, world, E, K, H, Ts)
        inputs = tuple([t.to(device) for t in part] for part in inputs)
    else:
        from tests.cases.mp import make_inputs
        inputs = make_inputs(3, world, E, K, H, Ts)
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E) if low_latency else 0
    kwargs = dict(low_latency_mode=True, num_qps_per_rank=2) if low_latency else {}

    def run():
        buf = triton_ep.Buffer(None, 1 << 20, hint, timeout_s=60, device=device, **kwargs)
        try:
            if low_latency:
                return _low_latency_calls(buf, rank, world, inputs, E, N)
            return _normal_calls(buf, rank, world, inputs, E, sum(Ts) * K if capture else 0, device)
        finally:
            buf.destroy()

    plain = run()
    old_dtype = torch.get_default_dtype()
    torch.set_default_device(default_device)
    torch.set_default_dtype(default_dtype)
    try:
        got = run()
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(old_dtype)
    assert len(got) == len(plain), (len(got), len(plain))
    for i, (a, b) in enumerate(zip(got, plain)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"output {i} differs"
    return len(got)


# ---------------------------------------------------------------------------------------------------------
# Disagreements across hosts (docs/design.md, "Error model"): tests/modes/internode/test_ambient_and_errors.py

def disagreement(rank, world, env, kind):
    """2 hosts of 2 ranks on the host path. ``kind`` names the call and the rank that differs: ``"dispatch_hidden"``
    (rank 3's x is 32 wide, the others' 64: its RDMA peer finds it), ``"combine_hidden"`` (rank 3 combines rows
    32 wide: its host's forwarding leg finds it), ``"dispatch_hidden_in_host"`` (rank 1 and rank 3
    pass 32: each RDMA pair agrees, each host's forwarding leg finds it), ``"dispatch_topk"`` (rank 2
    passes 3 ids a token), ``"combine_weights"`` (rank 0 passes no topk_weights to combine),
    ``"cached_hidden"`` (rank 1's cached dispatch is 32 wide). Returns the failing call's ``[type, message]``
    (or None), and whether a correct dispatch + combine works afterwards."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        g = torch.Generator().manual_seed(rank)
        T, H, E = 6, 64, 8
        odd = {"dispatch_hidden": 3, "combine_hidden": 3, "dispatch_topk": 2, "combine_weights": 0,
               "cached_hidden": 1}.get(kind, -1)
        wide = 32 if (rank == odd and kind.endswith("hidden")) or (kind == "dispatch_hidden_in_host" and rank % 2) \
            else H
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        w = torch.rand(T, 2, generator=g)
        pr, ph, pe, ir, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=pr, num_tokens_per_rdma_rank=ph, is_token_in_rank=ir, num_tokens_per_expert=pe)
        first = None
        try:
            if kind.startswith("dispatch"):
                bad_idx = torch.cat([idx, torch.full((T, 1), -1)], 1) if rank == odd and kind == "dispatch_topk" \
                    else idx
                bad_w = torch.cat([w, torch.zeros(T, 1)], 1) if bad_idx is not idx else w
                buf.dispatch(torch.randn(T, wide).to(torch.bfloat16), topk_idx=bad_idx, topk_weights=bad_w, **kw)
            else:
                rx, _, rw, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
                if kind == "combine_hidden":
                    buf.combine(torch.zeros(rx.shape[0], wide, dtype=torch.bfloat16), h, topk_weights=rw)
                elif kind == "combine_weights":
                    buf.combine(rx, h, topk_weights=None if rank == odd else rw)
                else:
                    buf.dispatch(torch.randn(T, wide).to(torch.bfloat16), handle=h)
        except Exception as ex:   # noqa: BLE001 - the test compares the errors
            first = _error(ex)
        rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, **kw)
        y, _, _ = buf.combine(rx, h)
        expect = (x.float() * ir.sum(1, keepdim=True).float()).to(torch.bfloat16)
        return first, bool(torch.equal(y, expect))
    finally:
        buf.destroy()


def capture_disagreement(rank, world, env, kind):
    """2 hosts of 2 ranks on the capture path (``TRITON_EP_INTERNODE_CAPTURE_PATH=1``). ``kind``: ``"dispatch_hidden"``
    (rank 3's num_worst_tokens dispatch has x 32 wide, the others' 64: its RDMA peer, rank 1, and rank 3 itself
    find it on the network), ``"combine_hidden"`` (after a num_worst_tokens dispatch, rank 3 combines rows 32
    wide). Returns the first error of the call or of a ``check()`` after it (each after a barrier: a rank whose call
    returned hears of the failure once the others found it) ([type, message] or None), the next call's error type and seconds (the network leg ends for good), and whether a dispatch +
    combine on a new Buffer is correct."""
    import time
    import torch.distributed as dist
    os.environ.update(env)
    T, H, E, W = 6, 64, 8, 64
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    wide = 32 if rank == 3 else H
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        pr, ph, pe, ir, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=pr, num_tokens_per_rdma_rank=ph, is_token_in_rank=ir, num_tokens_per_expert=pe,
                  topk_idx=idx, topk_weights=w, num_worst_tokens=W)
        seen = []
        try:
            if kind == "dispatch_hidden":
                buf.dispatch(torch.randn(T, wide).to(torch.bfloat16), **kw)
            else:
                rx, _, rw, _, h, _ = buf.dispatch(x, **kw)
                buf.check()
                buf.combine(torch.zeros(rx.shape[0], wide, dtype=torch.bfloat16), h, topk_weights=rw)
        except Exception as ex:   # noqa: BLE001 - the test compares the errors
            seen.append(_error(ex))
        for _ in range(2):      # (a rank whose call returned hears of it at a check: the others found it first)
            dist.barrier()
            try:
                buf.check()
            except Exception as ex:   # noqa: BLE001
                seen.append(_error(ex))
        first = seen[0] if seen else None
        t0, nxt = time.monotonic(), None
        try:
            buf.dispatch(x, **kw)
        except Exception as ex:   # noqa: BLE001
            nxt = type(ex).__name__
        nxt_s = time.monotonic() - t0
    finally:
        buf.destroy()
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20)
    try:
        pr, ph, pe, ir, _ = buf.get_dispatch_layout(idx, E)
        rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=pr, num_tokens_per_rdma_rank=ph, is_token_in_rank=ir,
                                         num_tokens_per_expert=pe, topk_idx=idx, num_worst_tokens=W)
        y, _, _ = buf.combine(rx, h)
        expect = (x.float() * ir.sum(1, keepdim=True).float()).to(torch.bfloat16)
        return first, nxt, nxt_s, bool(torch.equal(y, expect))
    finally:
        buf.destroy()


def _bytes_of(*ts) -> int:
    """Bytes of the storages of ``ts`` (tensors, tuples of tensors, None), each storage once."""
    seen = {}
    for t in _flat_tensors_live(ts):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _flat_tensors_live(v) -> list:
    """Every tensor in ``v`` (nested tuples and lists), as it is (not moved)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for item in v for t in _flat_tensors_live(item)]
    return []


def transient_bytes(rank, world, env, T, H, E, K, worst, fp8, calls=1, top=6):
    """Each internode call's peak live bytes on this rank (:class:`triton_ep.testing.LiveBytes`): a dispatch with
    ``topk_idx``, ``topk_weights`` and ``num_worst_tokens = worst`` of rows ``[T, H]`` (bf16, or with ``fp8`` an
    FP8 pair), then (bf16 only) its combine with weights, then a cached dispatch; ``calls`` times, the last time's
    counts returned. Per call ``{"peak", "out", "in", "retained", "cyclic", "largest", "kept"}``: ``out`` the bytes
    of the call's main results (rows, scales, ids, weights; a combine's rows and weights), ``in`` of its rows
    argument, ``retained`` what its allocations still hold at its end with its results alive (results, handle,
    caches), ``cyclic`` what of that only a ``gc.collect()`` freed (reference cycles of the call's own code),
    ``largest`` the ``top`` allocations live at the peak and ``kept`` those retained, as ``(nbytes, op, site)``."""
    from tests.cases.mp import make_inputs
    from triton_ep.testing import LiveBytes
    os.environ.update(env)
    xs, idxs, ws = make_inputs(3, world, E, K, H, [T] * world, fp8=fp8)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=120)

    def measured(fn, x_in, results):
        with LiveBytes() as m:
            res = fn()
            cyclic = m.now
            gc.collect()
            cyclic -= m.now
            kept = sorted(((a.nbytes, a.op, a.site) for a in m.live.values()), reverse=True)[:top]
            entry = {"peak": m.peak, "out": _bytes_of(results(res)), "in": _bytes_of(x_in), "retained": m.now,
                     "cyclic": cyclic, "kept": kept, "largest": [(a.nbytes, a.op, a.site) for a in m.peak_live[:top]]}
        return res, entry
    try:
        for _ in range(calls):
            per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            got = {}
            d, got["dispatch"] = measured(lambda: buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst), x,
                lambda r: r[:3])
            recv_x, recv_w, handle = d[0], d[2], d[4]
            del d
            if not fp8:
                y = recv_x * 2
                c, got["combine"] = measured(lambda: buf.combine(y, handle, topk_weights=recv_w), y, lambda r: r[:2])
                del c, y
            cd, got["cached"] = measured(lambda: buf.dispatch(x, handle=handle), x, lambda r: r[0])
            del cd, recv_x, recv_w, handle
        return got
    finally:
        buf.destroy()
