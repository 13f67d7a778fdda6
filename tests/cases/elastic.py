"""Rank bodies of the ElasticBuffer tests (module level, so that rank processes can import them): random cases of
DeepEP V2's dispatch / combine, each checked bit for bit against ``triton_ep.reference.elastic_*``."""
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


def check_case(buf, rank, world, case, device="cpu", ranks_per_host=None):
    """dispatch -> 'experts' (x * 3 - 1 per row, NaN in padding rows) -> combine (weights, biases), and a cached
    dispatch of new data; every output and handle field bit for bit against the reference. Returns rows received."""
    xs, idxs, ws = make_inputs(case, world)
    E, N_max, align, expand, sync = case["E"], case["N_max"], case["align"], case["expand"], case["sync"]
    exp = ref.elastic_dispatch(xs, idxs, ws, E, N_max, align, expand, sync)
    e = exp[rank]
    El = E // world
    stats = torch.full((El,), 5, dtype=torch.int32, device=device)
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
        _to(xs[rank], device), topk_idx=idxs[rank].to(device), topk_weights=None if ws is None else ws[rank].to(device),
        cumulative_local_expert_recv_stats=stats, num_experts=E, num_max_tokens_per_rank=N_max,
        expert_alignment=align, do_cpu_sync=sync, do_expand=expand,
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
    cx, cw, event = buf.combine(ys[rank].to(device), handle,
                                topk_weights=None if cw_in is None else cw_in[rank].to(device), bias=bias,
                                async_with_compute_stream=case["async_"], allocate_on_comm_stream=case["async_"])
    event.current_stream_wait()
    want = ref.elastic_combine(ys, exp, case["Ts"], cw_in, biases, expand, ranks_per_host)[rank]
    _same(cx, want[0], "combined_x")
    _same(cw, want[1], "combined_topk_weights")

    if case["cached"]:
        x2 = [(x.float() * -0.5 + 1).to(torch.bfloat16) for x in xs]
        w2 = None if ws is None else [w * 2 for w in ws]
        rx2, ri2, rw2, h2, _ = buf.dispatch(x2[rank].to(device), handle=handle,
                                            topk_weights=None if w2 is None else w2[rank].to(device),
                                            do_expand=expand)
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
                           (TypeError, "num_bytes must", dict(num_bytes="big"))):
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
        (TypeError, "topk_weights", dict(x=rx, handle=h, topk_weights=torch.zeros((rx.shape[0],), dtype=torch.float32,
                                                                                  device=device))),
    ]:
        _expect(buf.combine, kind, word, kw)
    for kind, word, kw in [(ValueError, "topk_idx", dict(x=x, handle=h, topk_idx=idx)),
                           (ValueError, "do_cpu_sync", dict(x=x, handle=h, do_cpu_sync=True)),
                           (ValueError, "do_expand", dict(x=x, handle=h, do_expand=True)),
                           (ValueError, "rows", dict(x=x[:2], handle=h))]:
        _expect(buf.dispatch, kind, word, kw)
    cx, _, _ = buf.combine(rx, h)
    # every token's ids are expert 0 (rank 0) twice: rank 0 gets each token once and returns it once
    assert torch.equal(cx.cpu(), x.cpu()), "round trip after the rejected calls"
