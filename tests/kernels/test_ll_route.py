"""The low-latency route kernel (triton_ep.kernels.ll_dispatch.ll_route) against a plain-Python model: each
(token, k) entry's slot among this rank's rows for its expert, in token order, and the rows per expert;
no row for -1, for a masked rank's experts, or for a duplicate of an earlier entry of the same token.
Several token blocks, a program per expert and per several (a partial block of experts), under the interpreter
with both its own launch shapes and the GPU's."""
import pytest
import torch

from triton_ep.kernels import flags
from triton_ep.kernels._util import GPU_TUNING, INTERP_TUNING
from triton_ep.kernels.ll_dispatch import ll_route


def _model(idx, E, per_rank, masked):
    slots = torch.full(idx.shape, -1, dtype=torch.int32)
    counts = [0] * E
    for t in range(idx.shape[0]):
        seen = set()
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0 or e >= E or e // per_rank in masked or e in seen:
                continue
            seen.add(e)
            slots[t, k] = counts[e]
            counts[e] += 1
    return slots, torch.tensor(counts, dtype=torch.int32)


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


@pytest.mark.parametrize("shapes", ["own", "gpu", "small"])
@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("T,K,E,R,masked", [(300, 3, 100, 4, ()), (70, 8, 64, 8, (2, 5)), (0, 2, 8, 2, ())])
def test_route_slots_follow_token_order(T, K, E, R, masked, device, shapes, monkeypatch):
    table = GPU_TUNING if device == "cuda" else INTERP_TUNING
    if shapes == "gpu":
        monkeypatch.setitem(table, "ll_route", dict(GPU_TUNING["ll_route"]))
    elif shapes == "small":     # many token blocks of 16 tokens, 3 experts a program (rounded up to 4)
        monkeypatch.setitem(table, "ll_route", dict(block_t=16, experts=3, num_warps=1))
    g = torch.Generator().manual_seed(T + K + E)
    idx = torch.randint(-1, E, (T, K), generator=g)
    if T:
        idx[: T // 3] = torch.randint(0, max(E // 8, 1), (T // 3, K), generator=g)   # skew and duplicates
    ctl = torch.zeros(flags.ll_ctl_words.host(R), dtype=torch.int64)
    for r in masked:
        ctl[flags.off_ll_mask.host(R) + r] = 1
    slots = torch.full((T, K), 7, dtype=torch.int32)          # garbage: every entry must be written
    counts = torch.full((E,), 7, dtype=torch.int32)
    dummy = torch.zeros(64, dtype=torch.int64, device=device)
    idx_d, slots, counts, ctl = (t.to(device) for t in (idx, slots, counts, ctl))
    ll_route(idx_d, slots, counts, ctl, E, R, {"hdr": dummy, "hdr_delta": dummy, "host": dummy, "me": 0})
    want_slots, want_counts = _model(idx, E, E // R, set(masked))
    assert torch.equal(slots.cpu(), want_slots)
    assert torch.equal(counts.cpu(), want_counts)
