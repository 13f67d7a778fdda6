"""Rank bodies of the ElasticBuffer tests (module level, so that rank processes can import them): random cases of
DeepEP V2's dispatch / combine, each checked bit for bit against ``triton_ep.reference.elastic_*``."""
import contextlib
import functools
import os
import random

import torch

import triton_ep
from triton_ep import reference as ref


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b, what):
    assert (a is None) == (b is None), f"{what}: one side is None ({a is None}, {b is None})"
    if a is None:
        return
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: values differ"


def draw_case(rnd: random.Random, world: int) -> dict:
    """One random case, the same on every rank (``rnd`` seeded alike): ragged T with zeros, -1 ids, duplicate ids
    (expanded: 1 local expert against K = 2 makes them certain), skew, FP8 pairs, weights or not, the layouts,
    worst-case sizes, alignment, biases, a cached dispatch."""
    K = rnd.choice([1, 2, 3])
    E = world * rnd.choice([1, 2, 4])
    N_max = rnd.choice([4, 7, 16])
    fp8 = rnd.random() < 0.25
    return dict(K=K, E=E, N_max=N_max, Ts=[rnd.choice([0, 1, 3, N_max]) for _ in range(world)],
                fp8=fp8, weights=rnd.random() < 0.8, expand=rnd.random() < 0.5,
                sync=rnd.random() < 0.6, align=rnd.choice([1, 1, 2, 4]), bias=rnd.choice([0, 0, 1, 2]),
                skew=rnd.random() < 0.3, col_major=rnd.random() < 0.5, cached=rnd.random() < 0.5,
                H=128 if fp8 else 32, async_=rnd.random() < 0.3, seed=rnd.randrange(1 << 30))


def make_inputs(case, world):
    g = torch.Generator().manual_seed(case["seed"])
    E, K, H = case["E"], case["K"], case["H"]
    xs, idxs, ws = [], [], []
    for T in case["Ts"]:
        x = torch.randn(T, H, generator=g)
        xs.append((x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g) + 0.5) if case["fp8"]
                  else x.to(torch.bfloat16))
        hi = max(E // 4, 1) if case["skew"] else E
        idx = torch.randint(-1, hi, (T, K), generator=g)
        if K > 1:
            dup = torch.rand(T, generator=g) < 0.2
            idx[:, 1] = torch.where(dup, idx[:, 0], idx[:, 1])
        idxs.append(idx)
        ws.append(torch.rand(T, K, generator=g) + 0.25)
    return xs, idxs, (ws if case["weights"] else None)


def _cpu(v):
    return tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()


def _to(v, device):
    return tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)


def check_case(buf, rank, world, case, device="cpu", ranks_per_host=None, ambient=contextlib.nullcontext):
    """dispatch -> 'experts' (x * 3 - 1 per row, NaN in padding rows) -> combine (weights, biases), and a cached
    dispatch of new data; every output and handle field bit for bit against the reference. The inputs and the
    reference are made here; the buffer's calls run inside ``ambient()`` (a context that sets ambient torch state).
    Returns rows received."""
    xs, idxs, ws = make_inputs(case, world)
    E, N_max, align, expand, sync = case["E"], case["N_max"], case["align"], case["expand"], case["sync"]
    exp = ref.elastic_dispatch(xs, idxs, ws, E, N_max, align, expand, sync)
    e = exp[rank]
    El = E // world
    stats = torch.full((El,), 5, dtype=torch.int32, device=device)
    x_in, idx_in = _to(xs[rank], device), idxs[rank].to(device)
    w_in = None if ws is None else ws[rank].to(device)
    with ambient():
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
            x_in, topk_idx=idx_in, topk_weights=w_in, cumulative_local_expert_recv_stats=stats, num_experts=E,
            num_max_tokens_per_rank=N_max, expert_alignment=align, do_cpu_sync=sync, do_expand=expand,
            use_tma_aligned_col_major_sf=case["col_major"], async_with_compute_stream=case["async_"],
            allocate_on_comm_stream=case["async_"], previous_event=buf.capture())
        assert isinstance(handle, triton_ep.EPHandle) and isinstance(event, triton_ep.EventOverlap)
        assert (event.event is not None) == (case["async_"] and device == "cuda")
        event.current_stream_wait()
    if case["fp8"]:
        _same(recv_x[0], e["recv_x"][0], "recv_x")
        _same(recv_x[1], e["recv_x"][1], "recv_x scales")
        n = recv_x[1].shape[0]
        if case["col_major"] and n:
            assert recv_x[1].stride() == (1, (n + 3) // 4 * 4), recv_x[1].stride()
    else:
        _same(recv_x, e["recv_x"], "recv_x")
    _same(recv_idx, e["recv_topk_idx"], "recv_topk_idx")
    _same(recv_w, e["recv_topk_weights"], "recv_topk_weights")
    assert handle.num_recv_tokens == e["num_recv_tokens"], (handle.num_recv_tokens, e["num_recv_tokens"])
    assert handle.num_expanded_tokens == e["num_expanded_tokens"]
    assert handle.num_recv_tokens_per_expert_list == e["num_recv_tokens_per_expert_list"]
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata"):
        _same(getattr(handle, name), e[name], name)
    _same(stats, (5 + e["num_unaligned_recv_tokens_per_expert"]).to(torch.int32), "cumulative stats")
    assert handle.do_expand == expand and handle.num_experts == E and handle.expert_alignment == align
    _same(handle.topk_idx, idxs[rank], "handle.topk_idx")

    # experts: y = x * 3 - 1 on real rows, NaN on padding rows (combine must not read them)
    if case["fp8"]:
        return int(handle.num_recv_tokens)
    rows = recv_x.cpu().float() * 3 - 1
    if expand:
        real = torch.zeros(rows.shape[0], dtype=torch.bool)
        sl = e["recv_src_metadata"][:, 2:]
        real[sl[sl >= 0].long()] = True
    else:
        real = torch.arange(rows.shape[0]) < int(e["psum_num_recv_tokens_per_scaleup_rank"][-1])
    rows[~real] = float("nan")
    ys = [None] * world
    ys[rank] = rows.to(torch.bfloat16)
    for j in range(world):          # every rank's expert outputs, for the reference
        if j != rank:
            rx = exp[j]["recv_x"].float() * 3 - 1
            ys[j] = rx.to(torch.bfloat16)
    g = torch.Generator().manual_seed(case["seed"] + 7)
    cw_in = None
    if ws is not None:
        cw_in = [torch.rand(tuple(exp[j]["recv_topk_weights"].shape), generator=g) for j in range(world)]
    biases = [[torch.randn(T, case["H"], generator=g).to(torch.bfloat16) for _ in range(case["bias"])]
              for T in case["Ts"]]
    b = biases[rank]
    bias = None if not b else (b[0].to(device) if len(b) == 1 else (b[0].to(device), b[1].to(device)))
    y_in, cw_rank = ys[rank].to(device), None if cw_in is None else cw_in[rank].to(device)
    with ambient():
        cx, cw, event = buf.combine(y_in, handle, topk_weights=cw_rank, bias=bias,
                                    async_with_compute_stream=case["async_"], allocate_on_comm_stream=case["async_"])
        event.current_stream_wait()
    want = ref.elastic_combine(ys, exp, case["Ts"], cw_in, biases, expand, ranks_per_host)[rank]
    _same(cx, want[0], "combined_x")
    _same(cw, want[1], "combined_topk_weights")

    if case["cached"]:
        x2 = [(x.float() * -0.5 + 1).to(torch.bfloat16) for x in xs]
        w2 = None if ws is None else [w * 2 for w in ws]
        x2_in, w2_in = x2[rank].to(device), None if w2 is None else w2[rank].to(device)
        with ambient():
            rx2, ri2, rw2, h2, _ = buf.dispatch(x2_in, handle=handle, topk_weights=w2_in, do_expand=expand)
        assert h2 is handle
        e2 = ref.elastic_dispatch(x2, idxs, w2, E, N_max, align, expand, sync)[rank]
        _same(rx2, e2["recv_x"], "cached recv_x")
        _same(ri2, e2["recv_topk_idx"], "cached recv_topk_idx")
        _same(rw2, e2["recv_topk_weights"], "cached recv_topk_weights")
    return int(handle.num_recv_tokens)


def cases(rank, world, env, seed, n_cases, device="cpu", deterministic=False):
    """``n_cases`` random cases (:func:`draw_case`) on one ElasticBuffer; then argument errors (every rank makes
    the same bad call: each raises before anything launches, and the buffer still works). ``deterministic``: under
    ``torch.use_deterministic_algorithms(True)`` (ops without a deterministic implementation would raise).
    Returns the cases run."""
    os.environ.update(env)
    torch.use_deterministic_algorithms(deterministic)
    if device == "cuda":
        torch.cuda.set_device(0)
    per_host = int(env["TRITON_EP_RANKS_PER_HOST"]) if "TRITON_EP_RANKS_PER_HOST" in env else None
    rnd = random.Random(seed)
    for kind, word, kw in ((ValueError, "num_bytes must", dict(num_bytes=-5)),
                           (ValueError, "num_gpu_timeout_secs must", dict(num_bytes=1 << 20, num_gpu_timeout_secs=0)),
                           (ValueError, "num_bytes must", dict(num_bytes="big"))):
        _expect(lambda **k: triton_ep.ElasticBuffer(None, device=device, **k), kind, word, kw)
    buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=16, hidden=128, num_topk=3, device=device,
                                  num_gpu_timeout_secs=60, explicitly_destroy=True)
    try:
        hosts = buf.get_physical_domain_size()
        assert hosts == ((world // per_host, per_host) if per_host else (1, world)), hosts
        assert buf.get_logical_domain_size() == (1, world)
        for _ in range(n_cases):
            check_case(buf, rank, world, draw_case(rnd, world), device, per_host if hosts[0] > 1 else None)
        errors(buf, rank, world, device)
        buf.barrier(with_cpu_sync=True)
        if hosts[0] > 1:            # the rows crossed the (emulated) network
            assert buf._buffer.get_rdma_stats()["chunks"] > 0
        return n_cases
    finally:
        buf.destroy()


def _expect(fn, kind, word, kw):
    try:
        fn(**kw)
    except kind as ex:
        assert word in str(ex), (word, str(ex))
    else:
        raise AssertionError(f"no {kind.__name__} naming {word}")


def errors(buf, rank, world, device):
    """Bad arguments raise ValueError/TypeError naming them, on every rank, before anything launches; a good call
    after them still gives the reference's result."""
    E, K, H = 2 * world, 2, 128
    x = (torch.arange(3 * H, dtype=torch.float32, device=device).reshape(3, H) % 7).to(torch.bfloat16)
    idx = torch.zeros((3, K), dtype=torch.int64, device=device)
    bad = [
        (ValueError, "num_max_tokens_per_rank", dict(x=x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=2)),
        # (a new user's find: R * num_max_tokens_per_rank past int32 was told as Buffer's num_worst_tokens)
        (ValueError, f"num_max_tokens_per_rank must be at most {(2**31 - 1) // world} with {world} ranks",
         dict(x=x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=(2**31 - 1) // world + 1, do_cpu_sync=False)),
        (ValueError, "num_experts", dict(x=x, topk_idx=idx, num_experts=E + 1)),
        (ValueError, "topk_idx", dict(x=x, topk_idx=idx[:2], num_experts=E)),
        (ValueError, "topk_idx", dict(x=x, num_experts=E)),
        (ValueError, "do_zero_padding", dict(x=x, topk_idx=idx, num_experts=E, do_zero_padding=True)),
        (ValueError, "expert_alignment", dict(x=x, topk_idx=idx, num_experts=E, expert_alignment=0)),
        (TypeError, "cumulative_local_expert_recv_stats",
         dict(x=x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=torch.zeros(
             (2,), dtype=torch.int64, device=device))),
        (TypeError, "previous_event", dict(x=x, topk_idx=idx, num_experts=E, previous_event=object())),
    ]
    for kind, word, kw in bad:
        _expect(buf.dispatch, kind, word, kw)
    rx, ri, rw, h, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    for kind, word, kw in [
        (ValueError, "rows", dict(x=torch.zeros((h.num_recv_tokens + 1, H), dtype=torch.bfloat16, device=device),
                                  handle=h)),
        (TypeError, "bf16", dict(x=rx.float(), handle=h)),
        (TypeError, "EPHandle", dict(x=rx, handle=(1, 2))),
        (ValueError, "topk_weights", dict(x=rx, handle=h, topk_weights=torch.zeros((rx.shape[0],), dtype=torch.float32,
                                                                                   device=device))),
    ]:
        _expect(buf.combine, kind, word, kw)
    for kind, word, kw in [(ValueError, "topk_idx", dict(x=x, handle=h, topk_idx=idx)),
                           (ValueError, "do_cpu_sync", dict(x=x, handle=h, do_cpu_sync=True)),
                           (ValueError, "do_expand", dict(x=x, handle=h, do_expand=True)),
                           (ValueError, "rows", dict(x=x[:2], handle=h))]:
        _expect(buf.dispatch, kind, word, kw)
    handle_mismatches(buf, rank, world, device, x, idx, E, h)
    cx, _, _ = buf.combine(rx, h)
    # every token's ids are expert 0 (rank 0) twice: rank 0 gets each token once and returns it once
    assert torch.equal(cx.cpu(), x.cpu()), "round trip after the rejected calls"


def handle_mismatches(buf, rank, world, device, x, idx, E, h):
    """A handle given to a call of another kind (every rank alike): an expanded handle to a cached dispatch without
    ``do_expand=True`` (and the reverse), other ``num_experts`` / ``num_max_tokens_per_rank`` / ``expert_alignment``
    than the handle's, weights or stats of another shape, a combine's weights in the other layout, a handle of
    another buffer, a Buffer's handle: each raises naming the argument before anything launches, and the handle
    still works. A cached dispatch of rows of another hidden size (and of an FP8 pair) is new data: the reference's
    rows. ``h``: a non-expanded handle of ``x`` routed by ``idx`` (every token to expert 0)."""
    import dataclasses
    K = idx.shape[1]
    rx_e, _, _, he, _ = buf.dispatch(x, topk_idx=idx, num_experts=E, do_expand=True)
    assert he.do_expand and rx_e.shape[0] == he.num_expanded_tokens
    w = torch.ones((3, K), dtype=torch.float32, device=device)
    for kind, word, kw in [
        (ValueError, "do_expand=False with a handle of an expanded dispatch", dict(x=x, handle=he)),
        (ValueError, "do_expand=False with a handle of an expanded", dict(x=x, handle=he, do_expand=False,
                                                                          topk_weights=w)),
        (ValueError, "do_expand=True needs a handle of an expanded dispatch", dict(x=x, handle=h, do_expand=True)),
        (ValueError, "num_experts", dict(x=x, handle=he, do_expand=True, num_experts=2 * E)),
        (ValueError, "num_max_tokens_per_rank", dict(x=x, handle=he, do_expand=True, num_max_tokens_per_rank=8)),
        (ValueError, "expert_alignment", dict(x=x, handle=h, expert_alignment=4)),
        (ValueError, "topk_weights must have shape [3, 2]", dict(x=x, handle=h, topk_weights=w[:, :1])),
        (TypeError, "topk_weights must have dtype", dict(x=x, handle=h, topk_weights=w.double())),
        (ValueError, "cumulative_local_expert_recv_stats must have shape [2]",
         dict(x=x, handle=h, cumulative_local_expert_recv_stats=torch.zeros((3,), dtype=torch.int32, device=device))),
        (ValueError, "comes from another ElasticBuffer", dict(x=x, handle=dataclasses.replace(h, owner=-1))),
        (TypeError, "a Buffer's handle", dict(x=x, handle=h.buffer_handle)),
    ]:
        _expect(buf.dispatch, kind, word, kw)
    rows, n = he.num_expanded_tokens, h.recv_topk_idx.shape[0]
    for kind, word, kw in [
        (ValueError, "topk_weights must have shape [%d, 2]" % n,
         dict(x=torch.zeros((n, x.shape[1]), dtype=torch.bfloat16, device=device), handle=h,
              topk_weights=torch.zeros((n,), dtype=torch.float32, device=device))),
        (ValueError, "topk_weights must have shape [%d]" % rows,
         dict(x=rx_e, handle=he, topk_weights=torch.zeros((rows, K), dtype=torch.float32, device=device))),
        (ValueError, "num_expanded_tokens", dict(x=torch.zeros((rows + 1, x.shape[1]), dtype=torch.bfloat16,
                                                               device=device), handle=he)),
        (TypeError, "a Buffer's handle", dict(x=rx_e, handle=he.buffer_handle)),
    ]:
        _expect(buf.combine, kind, word, kw)
    # new data through the same handles: another hidden size, an FP8 pair (the reference's rows)
    wide = torch.cat([x, -x], 1)
    fp8 = ((x.float() / 8).to(torch.float8_e4m3fn), torch.full((3, 1), 0.5, dtype=torch.float32, device=device))
    for xin, hh in ((wide, he), (wide, h), (fp8, he)):
        got = buf.dispatch(xin, handle=hh, do_expand=hh.do_expand)[0]
        want = ref.elastic_dispatch([_cpu(xin)] * world, [idx.cpu()] * world, None, E, hh.num_max_tokens_per_rank,
                                    1, hh.do_expand)[rank]["recv_x"]
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            _same(a, b, "cached recv_x of new data")
    cx, _, _ = buf.combine(rx_e, he)
    assert torch.equal(cx.cpu(), (x.float() * 2).to(torch.bfloat16).cpu()), "expanded round trip after the rejections"


def _one_rank_rejects(rank, call, kind, word, bad):
    """Rank 0 makes ``call(**bad)``, its peers ``call()``: rank 0 raises ``kind`` naming ``word``; each peer's call
    raises ``EPRemoteError`` (it must neither complete, paired with rank 0's next call, nor wait out its timeout)."""
    if rank == 0:
        _expect(call, kind, word, bad)
        return
    try:
        call()
    except triton_ep.EPRemoteError:
        return
    raise AssertionError("a peer's call completed although rank 0 rejected its part of it")


def rejected_on_one_rank(rank, world, env, device="cpu"):
    """A value that only ElasticBuffer checks is bad on rank 0 alone, its peers' values good: rank 0 raises its
    error, the peers ``EPRemoteError``; then every rank makes a good call, which gives the reference's results. For
    a dispatch (exact and worst-case sizes: ``T > num_max_tokens_per_rank``, and a float ``topk_idx`` that the
    layout rejects), a cached dispatch (a ``topk_idx`` with the handle; an expanded handle without
    ``do_expand=True``) and a combine (three biases). Returns the good calls checked after a rejection."""
    os.environ.update(env)
    per_host = int(env["TRITON_EP_RANKS_PER_HOST"]) if "TRITON_EP_RANKS_PER_HOST" in env else None
    per_host = per_host if per_host and per_host < world else None
    case = dict(K=2, E=2 * world, N_max=4, Ts=[3] * world, fp8=False, weights=True, expand=False, sync=True, align=1,
                bias=0, skew=False, col_major=False, cached=True, H=32, async_=False, seed=17)
    xs, idxs, ws = make_inputs(case, world)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    good = dict(topk_idx=idx, topk_weights=w, num_experts=case["E"], num_max_tokens_per_rank=case["N_max"])
    buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=4, hidden=32, device=device, num_gpu_timeout_secs=60,
                                  explicitly_destroy=True)
    try:
        for sync, kind, word, bad in ((True, ValueError, "num_max_tokens_per_rank", dict(num_max_tokens_per_rank=2)),
                                      (False, TypeError, "topk_idx", dict(topk_idx=idx.float()))):
            _one_rank_rejects(rank, lambda **kw: buf.dispatch(x, do_cpu_sync=sync, **dict(good, **kw)), kind, word, bad)
            check_case(buf, rank, world, dict(case, sync=sync), device, per_host)
        exp = ref.elastic_dispatch(xs, idxs, ws, case["E"], case["N_max"], 1)
        rx, _, _, h, _ = buf.dispatch(x, **good)
        _same(rx, exp[rank]["recv_x"], "recv_x")
        x2 = [(v.float() * 2 + 1).to(torch.bfloat16) for v in xs]
        _one_rank_rejects(rank, lambda **kw: buf.dispatch(x2[rank].to(device), handle=h, **kw), ValueError, "topk_idx",
                          dict(topk_idx=idx))
        _same(buf.dispatch(x2[rank].to(device), handle=h)[0],
              ref.elastic_dispatch(x2, idxs, ws, case["E"], case["N_max"], 1)[rank]["recv_x"], "cached recv_x")
        # an expanded handle to a cached dispatch without do_expand=True, on rank 0 alone
        he = buf.dispatch(x, **good, do_expand=True)[3]
        _one_rank_rejects(rank, lambda **kw: buf.dispatch(x2[rank].to(device), handle=he, **dict(dict(do_expand=True),
                                                                                                 **kw)),
                          ValueError, "do_expand=False with a handle of an expanded dispatch", dict(do_expand=False))
        _same(buf.dispatch(x2[rank].to(device), handle=he, do_expand=True)[0],
              ref.elastic_dispatch(x2, idxs, ws, case["E"], case["N_max"], 1, True)[rank]["recv_x"],
              "cached expanded recv_x")
        ys = [(e["recv_x"].float() * 3 - 1).to(torch.bfloat16) for e in exp]
        b = torch.zeros((3, case["H"]), dtype=torch.bfloat16, device=device)
        _one_rank_rejects(rank, lambda **kw: buf.combine(ys[rank].to(device), h, **kw), ValueError, "bias",
                          dict(bias=(b, b, b)))
        want = ref.elastic_combine(ys, exp, case["Ts"], None, None, False, per_host)[rank][0]
        _same(buf.combine(ys[rank].to(device), h)[0], want, "combined_x")
        return 4
    finally:
        buf.destroy()


def rejected_on_one_rank_capture(rank, world, env, device="cpu"):
    """:func:`rejected_on_one_rank` on the capture path across hosts (``TRITON_EP_INTERNODE_CAPTURE_PATH=1``, the
    path of ``do_cpu_sync=False`` on a GPU, and of the calls on its handles): for a dispatch without a host wait
    (``T > num_max_tokens_per_rank`` on rank 0), a cached dispatch of its handle (a ``topk_idx`` with it) and a
    combine of its handle (three biases), each on a buffer of its own, rank 0 raises its error naming the argument,
    and its peers' call returns or raises at once; as any argument error there, it ends the network leg for good
    (docs/api_v1_v2.md, 9): every rank's ``check()`` and next call raise at once, and none waits out its 20 s
    bound. A new buffer's round trip then gives the reference's results. Returns the rejections checked."""
    import time
    os.environ.update(env)
    assert env.get("TRITON_EP_INTERNODE_CAPTURE_PATH") == "1" and int(env["TRITON_EP_RANKS_PER_HOST"]) < world
    case = dict(K=2, E=2 * world, N_max=4, Ts=[3] * world, fp8=False, weights=True, expand=False, sync=False, align=1,
                bias=0, skew=False, col_major=False, cached=True, H=32, async_=False, seed=17)
    xs, idxs, ws = make_inputs(case, world)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    good = dict(topk_idx=idx, topk_weights=w, num_experts=case["E"], num_max_tokens_per_rank=4, do_cpu_sync=False)
    b = torch.zeros((3, case["H"]), dtype=torch.bfloat16, device=device)
    bad = {"dispatch": (ValueError, "num_max_tokens_per_rank", lambda buf, h, rx, kw: buf.dispatch(x, **dict(good, **kw)),
                        dict(num_max_tokens_per_rank=2)),
           "cached": (ValueError, "topk_idx", lambda buf, h, rx, kw: buf.dispatch(x, handle=h, **kw),
                      dict(topk_idx=idx)),
           "combine": (ValueError, "bias", lambda buf, h, rx, kw: buf.combine(rx, h, **kw), dict(bias=(b, b, b)))}
    for call, (kind, word, fn, kw) in bad.items():
        buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=4, hidden=32, device=device,
                                      num_gpu_timeout_secs=20, explicitly_destroy=True)
        try:
            rx, _, _, h, _ = buf.dispatch(x, **good)
            assert buf._buffer._modes.internode.capture._capture_used, "the dispatch did not take the capture path"
            t0 = time.monotonic()
            if rank == 0:
                _expect(lambda **k: fn(buf, h, rx, k), kind, word, kw)
            else:
                try:
                    fn(buf, h, rx, {})
                except triton_ep.EPRemoteError:       # (ProxyRemoteError among them)
                    pass
            assert time.monotonic() - t0 < 10.0, (call, "the rejected call took", time.monotonic() - t0)
            for what, then in (("check()", buf.check), ("the next call", lambda: buf.dispatch(x, **good))):
                t0 = time.monotonic()
                try:
                    then()
                except triton_ep.EPError:
                    pass
                else:
                    raise AssertionError(f"{call}: {what} after the rejection did not raise (the leg should be over)")
                assert time.monotonic() - t0 < 5.0, (call, what, time.monotonic() - t0)
        finally:
            buf.destroy()
    buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=4, hidden=32, device=device, num_gpu_timeout_secs=20,
                                  explicitly_destroy=True)
    try:
        check_case(buf, rank, world, case, device, int(env["TRITON_EP_RANKS_PER_HOST"]))
    finally:
        buf.destroy()
    return len(bad)



def barrier_skipped(rank, world, env, device="cpu"):
    """(A new user's find: the rank that called ``barrier()`` where its peer made a dispatch was told the fields of
    the barrier's dispatch of no tokens, "hidden: rank 0 passed 8, rank 1 passed 128; ... num_experts: rank 0 passed
    2", which it never passed.) Rank 0 calls ``barrier()`` where rank 1 makes another call (a dispatch with exact
    sizes, one with worst-case sizes, a combine): both raise ``ValueError`` naming what each called ("the operation:
    rank 0 called barrier, rank 1 called dispatch") within 20 s (their bound is 60 s: no wait runs out); then a barrier
    and a round trip on both give the reference's results. Two ranks. Returns the disagreements checked."""
    import time
    assert world == 2
    os.environ.update(env)
    per_host = 1 if env.get("TRITON_EP_RANKS_PER_HOST") == "1" else None
    case = dict(K=2, E=2 * world, N_max=4, Ts=[3] * world, fp8=False, weights=True, expand=False, sync=True, align=1,
                bias=0, skew=False, col_major=False, cached=True, H=32, async_=False, seed=19)
    xs, idxs, ws = make_inputs(case, world)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    good = dict(topk_idx=idx, topk_weights=w, num_experts=case["E"])
    buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=4, hidden=32, device=device, num_gpu_timeout_secs=60,
                                  explicitly_destroy=True)
    try:
        rx, _, _, h, _ = buf.dispatch(x, **good)
        others = (("dispatch", lambda: buf.dispatch(x, **good)),
                  ("dispatch with num_worst_tokens", lambda: buf.dispatch(x, do_cpu_sync=False, **good)),
                  ("combine", lambda: buf.combine(rx, h)))
        for name, call in others:
            t0 = time.monotonic()
            try:
                buf.barrier() if rank == 0 else call()
            except ValueError as ex:
                what = str(ex)
            else:
                raise AssertionError(f"rank {rank} raised nothing where rank 0 called barrier and rank 1 {name}")
            # (within one host this rank is named first; across hosts, rank 0 on every rank)
            calls = ["rank 0 called barrier", f"rank 1 called {name}"]
            want = [f"the operation: {calls[rank]}, {calls[1 - rank]}", f"the operation: {calls[0]}, {calls[1]}"]
            assert want[per_host is not None] in what and "hidden" not in what, (want, what)
            assert time.monotonic() - t0 < 20.0, (name, time.monotonic() - t0)
        buf.barrier()
        check_case(buf, rank, world, case, device, per_host)
        return len(others)
    finally:
        buf.destroy()

#: fixed cases for the ambient defaults: non-expanded with exact sizes, expanded with worst-case sizes, and FP8
#: pairs with column-major scales (weights, biases, alignment and cached dispatches among them)
AMBIENT_CASES = (
    dict(K=2, N_max=7, fp8=False, weights=True, expand=False, sync=True, align=2, bias=2, skew=False,
         col_major=False, cached=True, H=32, async_=False, seed=3),
    dict(K=3, N_max=4, fp8=False, weights=True, expand=True, sync=False, align=4, bias=1, skew=True,
         col_major=False, cached=True, H=32, async_=True, seed=4),
    dict(K=2, N_max=4, fp8=True, weights=True, expand=True, sync=True, align=1, bias=0, skew=False,
         col_major=True, cached=False, H=128, async_=False, seed=5),
)


@contextlib.contextmanager
def ambient_defaults(dtype, device):
    """``torch.set_default_dtype(dtype)`` and ``torch.set_default_device(device)`` inside, restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(old)


def ambient(rank, world, dtypes, default_device, device="cpu"):
    """For each of ``dtypes``: an ElasticBuffer built and called under ``torch.set_default_dtype(dtype)`` and
    ``torch.set_default_device(default_device)`` (DeepEP's tests set ``torch.bfloat16`` and ``'cuda'``; on CPU
    ``'meta'`` stands in for a device other than the buffer's) runs :data:`AMBIENT_CASES`, each output and handle
    field bit for bit against the reference (inputs and reference made in the plain state), then a barrier.
    Returns the cases run."""
    if device == "cuda":
        torch.cuda.set_device(0)
    n = 0
    for dtype in dtypes:
        here = functools.partial(ambient_defaults, dtype, default_device)
        with here():
            buf = triton_ep.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=128, device=device,
                                          num_gpu_timeout_secs=60, explicitly_destroy=True)
        try:
            for case in AMBIENT_CASES:
                Ts = [(case["N_max"] - r) % (case["N_max"] + 1) for r in range(world)]
                check_case(buf, rank, world, dict(case, E=2 * world, Ts=Ts), device, None, here)
                n += 1
            with here():
                buf.barrier()
        finally:
            buf.destroy()
    return n
