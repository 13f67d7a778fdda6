"""Issue 3, kind 9: autograd use as in Megatron's flex dispatcher (megatron/core/transformer/moe/fused_a2a.py):
dispatch's backward is a combine of the gradients (rows and top-k weights) along the dispatch handle, and
combine's backward is a cached dispatch. Here the two autograd Functions drive every rank of a simulated
group at once (each collective needs all ranks), and the gradients of x and topk_weights are compared with
dense single-process autograd of the same MoE computation."""
import torch

from tests.cases.helpers import make_inputs, raise_first, virtual_dispatch
from triton_ep.testing import VirtualGroup

BF16 = torch.bfloat16


class FusedDispatch(torch.autograd.Function):
    """forward: dispatch on every rank; backward: combine(grad_recv_x, handle, topk_weights=grad_recv_w)."""

    @staticmethod
    def forward(ctx, vg, E, idxs, box, *xs_ws):
        R = len(vg.buffers)
        res = virtual_dispatch(vg, list(xs_ws[:R]), idxs, list(xs_ws[R:]), E, str(xs_ws[0].device))
        ctx.vg, ctx.handles = vg, [r[4] for r in res]
        box["handles"], box["recv_idx"] = ctx.handles, [r[1] for r in res]
        return tuple(r[0] for r in res) + tuple(r[2] for r in res)

    @staticmethod
    def backward(ctx, *grads):
        R = len(ctx.handles)
        kw = [dict(x=grads[j].contiguous(), handle=ctx.handles[j], topk_weights=grads[R + j].float().contiguous())
              for j in range(R)]
        out = raise_first(ctx.vg.call("combine", kw))
        return (None, None, None, None) + tuple(o[0] for o in out) + tuple(o[1] for o in out)


class FusedCombine(torch.autograd.Function):
    """forward: combine on every rank; backward: cached dispatch(grad_combined, handle)."""

    @staticmethod
    def forward(ctx, vg, handles, *ys):
        ctx.vg, ctx.handles = vg, handles
        out = raise_first(vg.call("combine", [dict(x=y, handle=h) for y, h in zip(ys, handles)]))
        return tuple(o[0] for o in out)

    @staticmethod
    def backward(ctx, *grads):
        out = raise_first(ctx.vg.call("dispatch", [dict(x=g.contiguous(), handle=h)
                                                   for g, h in zip(grads, ctx.handles)]))
        return (None, None) + tuple(o[0] for o in out)


def case_autograd_matches_dense(device="cpu", R=3, Ts=(7, 0, 5), E=6, K=3, H=32, nbytes=1 << 15):
    """Gradients of x and topk_weights through dispatch -> experts -> combine equal dense autograd within
    bf16 tolerance; tokens with no valid expert get exactly zero gradient, and -1 slots zero weight
    gradient. Catches: a dispatch backward that forgets the weight gradients or sums them from the wrong
    rows, a combine backward that is not the cached dispatch of the same handle (gradients of another
    token), weight gradients leaking into -1 slots."""
    Ts = list(Ts)
    xs, idxs, ws = make_inputs(77, E, K, H, Ts, p_invalid=0.25, p_dup=0.2)
    idxs[0][0] = -1                                           # a token with no valid expert
    scale = torch.linspace(0.5, 1.5, E)                      # expert e multiplies its rows by scale[e]
    g = torch.Generator().manual_seed(78)
    G = [torch.randn(T, H, generator=g) for T in Ts]
    vg = VirtualGroup(R, nbytes, device=device)
    El = E // R

    x_leaf = [x.to(device).clone().requires_grad_() for x in xs]
    w_leaf = [w.to(device).clone().requires_grad_() for w in ws]
    box = {}
    outs = FusedDispatch.apply(vg, E, [i.to(device) for i in idxs], box, *x_leaf, *w_leaf)
    recv_x, recv_w = outs[:R], outs[R:]
    ys = []
    for j in range(R):
        local = box["recv_idx"][j]
        a = torch.where(local >= 0, scale.to(device)[(local + j * El).clamp(0, E - 1)], 0.0)
        ys.append((recv_x[j].float() * (recv_w[j] * a).sum(1, keepdim=True)).to(BF16))
    combined = FusedCombine.apply(vg, box["handles"], *ys)
    sum((c.float() * Gi.to(device)).sum() for c, Gi in zip(combined, G)).backward()

    for r in range(R):
        xd = xs[r].float().requires_grad_()
        wd = ws[r].clone().requires_grad_()
        valid = idxs[r] >= 0
        a = torch.where(valid, scale[idxs[r].clamp(0, E - 1)], 0.0)
        out = xd * (wd * a).sum(1, keepdim=True)
        (out * G[r]).sum().backward()
        torch.testing.assert_close(combined[r].detach().float().cpu(), out.detach(), rtol=2e-2, atol=2e-2)
        gx, gw = x_leaf[r].grad, w_leaf[r].grad
        assert gx is not None and gx.dtype == BF16 and gw is not None and gw.dtype == torch.float32
        torch.testing.assert_close(gx.float().cpu(), xd.grad, rtol=2e-2, atol=2e-2)
        gmax = float(wd.grad.abs().max()) if wd.grad.numel() else 1.0
        torch.testing.assert_close(gw.cpu(), wd.grad, rtol=2e-2, atol=1e-2 * gmax)
        none = ~valid.any(1)
        assert bool((gx.cpu()[none] == 0).all()), "a token with no expert got a gradient"
        assert bool((gw.cpu()[~valid] == 0).all()), "a -1 slot got a weight gradient"
    assert Ts[0] and bool(~(idxs[0][0] >= 0).any())


def test_autograd_matches_dense():
    case_autograd_matches_dense()
