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
