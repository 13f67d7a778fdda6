"""Rank bodies for multi-process tests (module-level so that spawned processes can import them)."""
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
    """The last rank never calls dispatch: the others must raise EPTimeoutError naming it within the
    bound; then every rank destroys its Buffer, builds a new one and runs a correct dispatch."""
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
        elif kind == "dtype":
            x = x.float()
        elif kind == "worst":
            pass
    extra = dict(num_worst_tokens=1) if kind == "worst" and rank == 1 else {}
    try:
        buf.dispatch(x, topk_weights=ws[rank], **kw, **extra)
        out = "no error"
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, str(e))
    assert torch.equal(kw["topk_idx"], before), "topk_idx was modified"
    recv_x = buf.dispatch(xs[rank], topk_weights=ws[rank], **_layout_kwargs(buf, idxs[rank], E))[0]
    assert torch.equal(recv_x, ref.dispatch(xs, idxs, ws, E)[rank]["recv_x"])
    buf.destroy()
    return out


def absent_at_construction(rank, world, timeout_s):
    """The last rank never builds its Buffer: the others raise EPTimeoutError at bootstrap within the bound."""
    import time
    if rank == world - 1:
        time.sleep(timeout_s + 3)
        return None
    t0 = time.monotonic()
    try:
        triton_ep.Buffer(None, 1 << 16, device="cpu", timeout_s=timeout_s)
        return "no error"
    except triton_ep.EPTimeoutError as e:
        return (e.stage, round(time.monotonic() - t0, 2))
