"""GPU tests of the device signalling (marker ``gpu``): CUDA-graph capture and replay of cached dispatch
and combine, kernel-side timeouts timed by the GPU clock, the communication stream and host syncs."""
import pytest
import torch

from tests.cases import mp as mp_cases
from tests.cases.helpers import check_dispatch, ok_results, make_inputs, raise_first, virtual_dispatch
from triton_ep import reference as ref
from triton_ep.testing import VirtualGroup, run_ranks

pytestmark = pytest.mark.gpu


def test_graph_capture_replay_and_stopped_peer():
    """Two processes on one GPU: captured cached dispatch + expert + combine replay bit-exact with new x;
    a peer that stops replaying makes the other raise EPTimeoutError at check() within the bound, and
    its later replays return at once."""
    out = ok_results(run_ranks(mp_cases.graph_replay, 2, 3.0, backend="gloo"))
    assert all(o["replays_ok"] == 3 for o in out), out
    assert out[0]["error"] == ("EPTimeoutError", 1, out[0]["error"][2]) and out[0]["error"][2].startswith(
        ("dispatch", "combine")), out
    assert 3.0 <= out[0]["stopped_s"] < 8.0, out
    assert out[0]["later_s"] < 0.5, out


def test_kernel_timeout_and_late_peer_gpu():
    """Rank 1 reaches combine after rank 0 gave up: rank 0 raises EPTimeoutError (GPU clock) naming rank 1
    and the stage; rank 1 raises at once that rank 0 left."""
    out = ok_results(run_ranks(mp_cases.late_peer_combine, 2, 2.0, "cuda"))
    name, peer, stage, waited, text, later = out[0]
    assert name == "EPTimeoutError" and peer == 1 and stage.startswith("combine"), out
    assert 2.0 <= waited < 7.0, out
    name, _, _, waited, text, _ = out[1]
    assert name == "EPRemoteError" and "left the group" in text and waited < 1.5, out


def test_async_finish_leaves_the_callers_stream_free():
    """With async_finish a late peer stalls only the communication stream: compute on the caller's stream
    finishes long before the combine does, and the event then delivers the right result."""
    out = ok_results(run_ranks(mp_cases.async_overlap, 2, 2.0))
    o = out[0]
    assert o["ok"] and out[1]["ok"], out
    assert o["call_s"] < 0.5 and o["compute_s"] < 1.0 and o["done_s"] >= 1.5, out


def test_no_host_sync_in_cached_dispatch_and_combine():
    """Cached dispatch and combine only enqueue work: no synchronising CUDA call (sync debug mode 'error')."""
    R, E = 2, 8
    xs, idxs, ws = make_inputs(9, E, 2, 128, [33, 20])
    vg = VirtualGroup(R, 1 << 14, device="cuda")
    res = virtual_dispatch(vg, xs, idxs, ws, E, "cuda")
    xc = [x.cuda() for x in xs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cached = raise_first(vg.call("dispatch", [dict(x=xc[r], handle=res[r][4]) for r in range(R)]))
        comb = raise_first(vg.call("combine", [dict(x=res[r][0], handle=res[r][4]) for r in range(R)]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    exp = ref.dispatch(xs, idxs, ws, E)
    want = ref.combine([e["recv_x"] for e in exp], exp, [33, 20])
    for r in range(R):
        assert torch.equal(cached[r][0].cpu(), exp[r]["recv_x"])
        assert torch.equal(comb[r][0].cpu(), want[r][0])


def test_no_stream_sync_in_plain_dispatch():
    """A plain dispatch's one host wait polls an event on a pinned copy of the counts: no synchronising
    CUDA call (sync debug mode 'error'), and the results are the reference's; a dispatch with
    num_worst_tokens and the layout make none either."""
    R, E = 2, 8
    xs, idxs, ws = make_inputs(11, E, 2, 128, [40, 17])
    vg = VirtualGroup(R, 1 << 14, device="cuda")
    xc, ic, wc = ([t.cuda() for t in ts] for ts in (xs, idxs, ws))     # inputs on the GPU beforehand
    virtual_dispatch(vg, xc, ic, wc, E, "cuda")          # compile and warm up outside the check
    virtual_dispatch(vg, xc, ic, wc, E, "cuda", num_worst_tokens=64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = virtual_dispatch(vg, xc, ic, wc, E, "cuda")
        worst = virtual_dispatch(vg, xc, ic, wc, E, "cuda", num_worst_tokens=64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp)
    for r in range(R):
        n = exp[r]["recv_x"].shape[0]
        assert torch.equal(worst[r][0][:n].cpu(), exp[r]["recv_x"])
        assert not worst[r][0][n:].any()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_graph_capture_of_layout_dispatch_with_num_worst_tokens_and_combine(backend):
    """The whole decode step captures: layout, dispatch with num_worst_tokens (the counts travel on the
    device), an expert stand-in and combine; replays with new x and new routing (including none to a
    peer) are bit for bit the reference. nccl: one rank per GPU (needs 2 GPUs)."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert ok_results(run_ranks(mp_cases.graph_full, 2, backend=backend)) == ["ok", "ok"]
