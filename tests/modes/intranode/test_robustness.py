"""Issue 3, kinds 1-7: the failure kinds users report, each closed by a focused test on ranks simulated in
one process (the same kernels, offsets and rounds as the multi-process path), compared with the reference.

Every test's docstring names the plausible wrong implementation it would catch. The ``case_*`` bodies take
a device so that test_gpu_robustness.py (beside this file) runs the same cases on the H200 (compiled
kernels). Generic properties (random R, E, K, ragged T, garbage-filled outputs) live in test_properties.py;
these tests add the corners that random draws rarely reach.
"""
import os
import tempfile

import pytest
import torch
from hypothesis import given, strategies as st

import triton_ep
from tests.cases.helpers import assert_bits, bits, check_dispatch, make_inputs, raise_first, virtual_dispatch
from triton_ep import kernels
from triton_ep import reference as ref
from triton_ep.kernels import _util
from triton_ep.kernels.combine import record_bytes as combine_record_bytes
from triton_ep.kernels.geometry import record_words as dispatch_record_words
from triton_ep.testing import VirtualGroup
from triton_ep.transport import ipc
from test_properties import _garbage_empty

BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------- helpers
def guarded_group(R: int, usable: int, device: str = "cpu", guard: int = 4096) -> VirtualGroup:
    """A simulated group whose Buffers may use only the first ``usable`` bytes of their buffers; the rest
    (at least ``guard`` bytes) and the whole buffer start as 0xFF, so any write past the capacity the
    Buffer computed (an out-of-bounds round) shows in :func:`guard_intact`."""
    vg = VirtualGroup(R, usable + guard, device=device)
    w = vg.world
    vg.buffers = [triton_ep.Buffer(ipc.Comm(r, R, w.device, w.buffers, w.ctrl, 0.0, w.slot_words, min_bytes=usable))
                  for r in range(R)]
    for d in w.data:
        d.fill_(0xFF)
    vg.usable = usable
    return vg


def guard_intact(vg: VirtualGroup) -> bool:
    return all(bool((d[vg.usable:] == 0xFF).all()) for d in vg.world.data)


def expert(x: torch.Tensor) -> torch.Tensor:
    """A non-trivial 'expert' (so a combine that returns the wrong rows cannot pass by symmetry)."""
    return (x.float() * 1.5 - 0.25).to(BF16)


def check_combine(vg: VirtualGroup, res, exp, Ts, device: str = "cpu", what: str = "") -> None:
    """combine (with the received weights, if any) of expert outputs, bit for bit against the reference."""
    R = len(res)
    ys = [expert(e["recv_x"]) for e in exp]
    got = raise_first(vg.call("combine", [dict(x=ys[j].to(device), handle=res[j][4], topk_weights=res[j][2])
                                          for j in range(R)]))
    rw = [e["recv_topk_weights"] for e in exp] if exp[0]["recv_topk_weights"] is not None else None
    want = ref.combine(ys, exp, Ts, rw)
    for i in range(R):
        assert_bits(got[i][0], want[i][0], f"{what}rank {i} combined_x")
        assert_bits(got[i][1], want[i][1], f"{what}rank {i} combined_topk_weights")


def check_cached(vg: VirtualGroup, handles, x2, idxs, ws, E: int, Ts, device: str = "cpu", what: str = "") -> None:
    """Cached dispatch of new data ``x2`` with ``handles``, then a cached combine of what arrived: bit for bit."""
    R = len(x2)
    cached = raise_first(vg.call("dispatch", [dict(x=x2[r].to(device), handle=handles[r]) for r in range(R)]))
    exp2 = ref.dispatch(x2, idxs, ws, E)
    for j in range(R):
        assert_bits(cached[j][0], exp2[j]["recv_x"], f"{what}rank {j} cached recv_x")
        assert cached[j][1:5] == (None, None, None, None)
    got2 = raise_first(vg.call("combine", [dict(x=cached[j][0], handle=handles[j]) for j in range(R)]))
    want2 = ref.combine([e["recv_x"] for e in exp2], exp2, Ts)
    for i in range(R):
        assert_bits(got2[i][0], want2[i][0], f"{what}rank {i} cached combine")


def verify_round_trip(vg: VirtualGroup, xs, idxs, ws, E: int, device: str = "cpu"):
    """dispatch, combine (with weights) of expert outputs, cached dispatch and cached combine on new
    data: every output bit for bit against the reference. Returns (results, reference)."""
    Ts = [x.shape[0] for x in xs]
    res = virtual_dispatch(vg, xs, idxs, ws, E, device)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp)
    check_combine(vg, res, exp, Ts, device)
    check_cached(vg, [r[4] for r in res], [(x.float() * -2 + 0.5).to(BF16) for x in xs], idxs, ws, E, Ts, device)
    return res, exp


def _idx(rows, dtype=torch.int64):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------------------------------- kind 1
def case_routing_ids(device="cpu"):
    """-1 in every column, a token whose ids are all -1, a token with one expert K times (multiplicity),
    duplicates spread over ranks, int32 and int64 ids: bit for bit against the reference.
    Catches: treating -1 as expert E-1 (Python-style negative indexing) or as rank -1 // El; a token with
    no valid id sent anyway (or sent to rank 0); duplicate ids sending the row twice or counted once."""
    R, E, K, H = 3, 6, 4, 32
    idx0 = _idx([[-1, 0, 3, 5], [-1, -1, -1, -1], [2, 2, 2, 2], [4, -1, 4, 1], [-1, -1, -1, 5],
                 [1, 0, -1, -1], [-1, -1, -1, -1]])
    idx1 = _idx([[5, 5, -1, 0], [-1, -1, -1, -1], [3, 2, 1, 0]])
    idx2 = _idx([[-1, -1, -1, -1]] * 4)                        # a rank that sends nothing at all
    idxs = [idx0, idx1, idx2]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(i.shape[0], H, generator=g).to(BF16) for i in idxs]
    ws = [torch.rand(i.shape[0], K, generator=g) for i in idxs]
    res64, exp = verify_round_trip(guarded_group(R, 1 << 16, device), xs, idxs, ws, E, device)
    assert [r[3] for r in res64] == [[4, 3], [5, 2], [2, 4]]              # multiplicity counted
    assert [r[0].shape[0] for r in res64] == [5, 3, 4]                    # one row per token and rank
    idxs32 = [i.to(torch.int32) for i in idxs]
    res32 = virtual_dispatch(guarded_group(R, 1 << 16, device), xs, idxs32, ws, E, device)
    check_dispatch(res32, ref.dispatch(xs, idxs32, ws, E))         # recv_topk_idx int32, as topk_idx
    assert all(torch.equal(a[1].long(), b[1]) for a, b in zip(res32, res64))


def test_routing_ids_minus_one_all_minus_one_duplicates_int32():
    case_routing_ids()


def case_ids_out_of_range_on_one_rank(device="cpu"):
    """Ids equal to E and below -1 on one rank only: that rank raises ValueError counting them, the others
    EPRemoteError naming it, no byte of any communication buffer is written, the input is unchanged, and
    the next call on the same group is correct.
    Catches: an id == E written to rank R (past the peer table: an out-of-bounds write), -2 read as the
    last expert, a peer left waiting (hang) or a group unusable after the error."""
    R, E, K, H = 3, 6, 2, 16
    xs, idxs, ws = make_inputs(3, E, K, H, [4, 5, 3])
    bad = idxs[1].clone()
    bad[0, 0], bad[2, 1], bad[4, 0] = E, -2, E + 100
    keep = bad.clone()
    vg = guarded_group(R, 1 << 16, device)
    out = virtual_dispatch_results(vg, xs, [idxs[0], bad, idxs[2]], ws, E, device)
    assert isinstance(out[1], ValueError) and f"3 ids outside [-1, {E})" in str(out[1]), out[1]
    for r in (0, 2):
        assert isinstance(out[r], triton_ep.EPRemoteError) and "rank 1" in str(out[r]), out[r]
    assert all(bool((d == 0xFF).all()) for d in vg.world.data), "a buffer was written"
    assert torch.equal(bad, keep)
    verify_round_trip(vg, xs, idxs, ws, E, device)


def virtual_dispatch_results(vg, xs, idxs, ws, E, device="cpu", **extra):
    """Like helpers.virtual_dispatch, but returns each rank's result or exception (nothing raised)."""
    try:
        return virtual_dispatch(vg, xs, idxs, ws, E, device, **extra)
    except Exception:  # noqa: BLE001 - rerun to collect every rank's outcome
        pass
    kw = []
    for r in range(len(xs)):
        idx = idxs[r].to(device)
        per_rank, _, per_expert, in_rank, _ = vg.buffers[r].get_dispatch_layout(idx, E)
        kw.append(dict(x=xs[r].to(device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=ws[r].to(device), **extra))
    return vg.call("dispatch", kw)


def test_ids_out_of_range_on_one_rank():
    case_ids_out_of_range_on_one_rank()


# ---------------------------------------------------------------------------------------------- kind 2
@pytest.mark.parametrize("R,Ts", [(1, [7]), (3, [0, 5, 1]), (5, [3, 0, 11, 1, 0]), (7, [1, 9, 0, 2, 5, 0, 3]),
                                  (5, [0, 0, 0, 0, 0])])
def test_odd_ranks_ragged_and_empty(R, Ts):
    case_odd_ranks_ragged_and_empty(R, Ts)


def case_odd_ranks_ragged_and_empty(R, Ts, device="cpu"):
    """R = 1, 3, 5, 7 with a different (odd) T on every rank and T = 0 on some (or all) ranks, where the
    empty ranks pass x = torch.empty(0, H) (null data pointer) and empty topk tensors.
    Catches: code assuming a power-of-two R (rank = id >> log2(El), masks sized by R), T = 0 launching a
    grid of 0 programs or dereferencing the null pointer, counts exchanged for the wrong rank."""
    E, K, H = 2 * R, 3, 48
    xs, idxs, ws = make_inputs(R * 7 + sum(Ts), E, K, H, Ts, p_dup=0.2)
    for r, T in enumerate(Ts):
        if T == 0:
            xs[r], idxs[r], ws[r] = torch.empty(0, H, dtype=BF16), torch.empty(0, K, dtype=torch.int64), \
                torch.empty(0, K)
            assert xs[r].data_ptr() == 0
    verify_round_trip(guarded_group(R, 1 << 15, device), xs, idxs, ws, E, device)


def case_rank_receiving_nothing_combines_empty(device="cpu"):
    """A rank that receives no row gets [0, H] outputs and combines a torch.empty(0, H) (null pointer).
    Catches: a combine that requires a non-empty x, or reads x's (null) pointer."""
    R, E, H = 3, 6, 16
    idxs = [_idx([[0, 1], [3, -1]]), _idx([[2, 3]]), _idx([[-1, 0]])]       # nothing for rank 2 (experts 4, 5)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(i.shape[0], H, generator=g).to(BF16) for i in idxs]
    vg = guarded_group(R, 1 << 15, device)
    res = virtual_dispatch(vg, xs, idxs, None, E, device)
    assert res[2][0].shape == (0, H)
    ys = [res[0][0], res[1][0], torch.empty(0, H, dtype=BF16, device=device)]
    got = raise_first(vg.call("combine", [dict(x=ys[j], handle=res[j][4]) for j in range(R)]))
    exp = ref.dispatch(xs, idxs, None, E)
    want = ref.combine([e["recv_x"] for e in exp], exp, [2, 1, 1])
    for i in range(R):
        assert_bits(got[i][0], want[i][0], f"rank {i}")


def test_rank_receiving_nothing_combines_empty():
    case_rank_receiving_nothing_combines_empty()


# ---------------------------------------------------------------------------------------------- kind 3
def hint_bytes(H: int, R: int) -> int:
    """A DeepEP-style size hint that is small (one channel, one-token chunks), so that a modest token count
    is many rounds' worth."""
    return triton_ep.Config(2, 6, 1, 6, 1).get_nvl_buffer_size_hint(H * 2, R)


def skewed_inputs(mode: str, R: int, E: int, K: int, H: int, Ts, seed: int):
    """``one_expert``: every valid id is expert E-1 (so K-fold duplicates); ``one_rank``: ids drawn from
    rank 0's experts only. A few -1 entries either way."""
    xs, idxs, ws = make_inputs(seed, E, K, H, Ts, p_invalid=0.1, p_dup=0.0)
    El = E // R
    for i in idxs:
        valid = i >= 0
        i.copy_(torch.where(valid, torch.full_like(i, E - 1) if mode == "one_expert" else i % El, i))
    return xs, idxs, ws


@pytest.mark.parametrize("mode", ["one_expert", pytest.param("one_rank", marks=pytest.mark.extended)])
def test_skew_hint_sized_buffer_many_rounds(mode):
    case_skew_hint_sized_buffer(mode)


def case_skew_hint_sized_buffer(mode, device="cpu", R=2, H=1024, Ts=(23, 21)):
    """Every token to one expert / one rank, through a buffer sized by DeepEP's hint that holds about a
    tenth of what that rank receives (10+ rounds for dispatch and for combine): bit-for-bit results and no
    byte written past the capacity. Then num_worst_tokens equal to the hot rank's count pads the cold ranks
    (-1 ids, 0 weights, zero rows, over buffers full of 0xFF), and one less raises EPCapacityError on
    every rank naming the hot rank, after which the group still works.
    Catches: a transfer larger than the buffer refused or written past its end (out-of-bounds), rounds
    that drop or repeat rows at a window edge, padding left with stale memory, a capacity error raised on
    the hot rank only (the others hang)."""
    E, K = 2 * R, 3
    xs, idxs, ws = skewed_inputs(mode, R, E, K, H, list(Ts), seed=len(mode))
    usable = hint_bytes(H, R)
    vg = guarded_group(R, usable, device)
    res, exp = verify_round_trip(vg, xs, idxs, ws, E, device)
    hot = R - 1 if mode == "one_expert" else 0
    n_hot = exp[hot]["recv_x"].shape[0]
    rows_per_round = usable // (4 * dispatch_record_words(H // 2, 0, K, True))
    assert n_hot >= 10 * rows_per_round, (n_hot, rows_per_round)
    assert guard_intact(vg), "a write landed past the buffer capacity"
    # num_worst_tokens: exact fit, over garbage-filled buffers and outputs
    for d in vg.world.data:
        d.fill_(0xFF)
    with pytest.MonkeyPatch.context() as m:
        if device == "cpu":
            m.setattr(torch, "empty", _garbage_empty)
        res = virtual_dispatch(vg, xs, idxs, ws, E, device, num_worst_tokens=n_hot)
        # the padded handle, cached, on new data: padding rows zero again
        x2 = [(x.float() * 3).to(BF16) for x in xs]
        cached = raise_first(vg.call("dispatch", [dict(x=x2[r].to(device), handle=res[r][4]) for r in range(R)]))
    exp2 = ref.dispatch(x2, idxs, ws, E)
    for j in range(R):
        rx, ri, rw, lst, h, _ = res[j]
        n = exp[j]["recv_x"].shape[0]
        assert rx.shape[0] == n_hot and cached[j][0].shape[0] == n_hot
        assert_bits(rx[:n], exp[j]["recv_x"], f"rank {j} rows")
        assert_bits(ri[:n], exp[j]["recv_topk_idx"], f"rank {j} ids")
        assert_bits(rw[:n], exp[j]["recv_topk_weights"], f"rank {j} weights")
        assert bool((ri[n:] == -1).all()) and bool((bits(rw[n:]) == 0).all()) and bool((bits(rx[n:]) == 0).all())
        assert_bits(cached[j][0][:n], exp2[j]["recv_x"], f"rank {j} cached rows")
        assert bool((bits(cached[j][0][n:]) == 0).all()), f"rank {j} cached padding"
    got = raise_first(vg.call("combine", [dict(x=cached[j][0], handle=res[j][4]) for j in range(R)]))
    want = ref.combine([e["recv_x"] for e in exp2], exp2, list(Ts))
    for i in range(R):
        assert_bits(got[i][0], want[i][0], f"rank {i} combine over a padded handle")
    assert guard_intact(vg)
    out = virtual_dispatch_results(vg, xs, idxs, ws, E, device, num_worst_tokens=n_hot - 1)
    for r, o in enumerate(out):
        assert isinstance(o, triton_ep.EPCapacityError), (r, o)
        assert f"rank {hot} receives {n_hot} rows" in str(o), str(o)
    small = [x[:2] for x in xs], [i[:2] for i in idxs], [w[:2] for w in ws]
    check_dispatch(virtual_dispatch(vg, *small, E, device), ref.dispatch(*small, E))


def test_per_rank_num_worst_tokens_many_rounds():
    case_per_rank_worst()


def case_per_rank_worst(device="cpu", R=3, H=1024, Ts=(23, 5, 9)):
    """Each rank passes its own num_worst_tokens (DeepEP's contract: it sizes that rank's outputs), through a
    buffer holding a tenth of what the hot rank receives: the rounds follow from the largest value (no rank
    assumes its own is everyone's), every rank's outputs have its own number of rows, its rows are the
    reference's with zero padding after them, and a cached dispatch and a combine over the padded handles
    are bit-exact. Then one rank's value one short of its count: every rank raises EPCapacityError naming
    that rank and its value, and the group goes on.
    Catches: rounds taken from a rank's own value (too few rounds on the ranks with small values: rows lost
    or a hang), a combine area bound from one rank's value, a capacity check against another rank's value."""
    E, K = 2 * R, 3
    xs, idxs, ws = skewed_inputs("one_rank", R, E, K, H, list(Ts), seed=5)
    vg = guarded_group(R, hint_bytes(H, R), device)
    exp = ref.dispatch(xs, idxs, ws, E)
    counts = [e["recv_x"].shape[0] for e in exp]
    worst = [c + 2 * r + 1 for r, c in enumerate(counts)]          # every value different
    rows_per_round = hint_bytes(H, R) // (4 * dispatch_record_words(H // 2, 0, K, True))
    assert max(worst) >= 5 * rows_per_round > min(worst), (worst, rows_per_round)
    kw = [dict(x=xs[r].to(device), num_worst_tokens=worst[r]) for r in range(R)]
    for r in range(R):
        per_rank, _, per_expert, in_rank, _ = vg.buffers[r].get_dispatch_layout(idxs[r].to(device), E)
        kw[r].update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=idxs[r].to(device), topk_weights=ws[r].to(device))
    res = raise_first(vg.call("dispatch", kw))
    for j in range(R):
        rx, ri, rw, lst, h, _ = res[j]
        n = counts[j]
        assert rx.shape[0] == worst[j] and ri.shape[0] == worst[j] and lst == []
        assert_bits(rx[:n], exp[j]["recv_x"], f"rank {j} rows")
        assert_bits(ri[:n], exp[j]["recv_topk_idx"], f"rank {j} ids")
        assert bool((ri[n:] == -1).all()) and bool((bits(rx[n:]) == 0).all())
    x2 = [(x.float() * 3).to(BF16) for x in xs]
    cached = raise_first(vg.call("dispatch", [dict(x=x2[r].to(device), handle=res[r][4]) for r in range(R)]))
    exp2 = ref.dispatch(x2, idxs, ws, E)
    got = raise_first(vg.call("combine", [dict(x=cached[j][0], handle=res[j][4]) for j in range(R)]))
    want = ref.combine([e["recv_x"] for e in exp2], exp2, list(Ts))
    for j in range(R):
        assert_bits(cached[j][0][:counts[j]], exp2[j]["recv_x"], f"rank {j} cached rows")
        assert_bits(got[j][0], want[j][0], f"rank {j} combine over a padded handle")
    assert guard_intact(vg), "a write landed past the buffer capacity"
    short = counts.index(max(counts))           # the hot rank, one row short
    kw[short]["num_worst_tokens"] = counts[short] - 1
    out = vg.call("dispatch", kw)
    for r, o in enumerate(out):
        assert isinstance(o, triton_ep.EPCapacityError), (r, o)
        assert f"rank {short} receives {counts[short]} rows, more than its num_worst_tokens={counts[short] - 1}" \
            in str(o), str(o)
    small = [x[:2] for x in xs], [i[:2] for i in idxs], [w[:2] for w in ws]
    check_dispatch(virtual_dispatch(vg, *small, E, device), ref.dispatch(*small, E))


@st.composite
def skewed_problems(draw):
    R = draw(st.sampled_from([1, 3, 5, 7]))
    return dict(R=R, E=R * draw(st.integers(1, 3)), K=draw(st.integers(1, 4)), H=draw(st.sampled_from([16, 48, 200])),
                Ts=draw(st.lists(st.sampled_from([0, 1, 3, 8, 17]), min_size=R, max_size=R)),
                mode=draw(st.sampled_from(["random", "one_expert", "one_rank"])),
                small=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


@pytest.mark.extended
@pytest.mark.property
@given(skewed_problems())
def test_property_odd_ranks_heavy_skew(p):
    """Property over odd R up to 7 (and 1), ragged T with zeros, -1 entries, duplicates and heavy skew
    (every id on one expert or on one rank), through a small hint-sized buffer (many rounds) or a large
    one, with every tensor the library allocates and every buffer byte starting as 0xFF: dispatch,
    combine, cached dispatch and combine bit for bit, nothing written past the buffer capacity.
    Catches what the focused tests catch, at combinations they do not list."""
    R, E, K, H, Ts = p["R"], p["E"], p["K"], p["H"], p["Ts"]
    if p["mode"] == "random":
        xs, idxs, ws = make_inputs(p["seed"], E, K, H, Ts, skew=0.5, p_dup=0.3)
    else:
        xs, idxs, ws = skewed_inputs(p["mode"], R, E, K, H, Ts, p["seed"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "empty", _garbage_empty)
        vg = guarded_group(R, hint_bytes(H, R) if p["small"] else 1 << 16)
        verify_round_trip(vg, xs, idxs, ws, E)
    assert guard_intact(vg)


# ---------------------------------------------------------------------------------------------- kind 4
def sparse_tensor(shape, dtype) -> torch.Tensor:
    """A tensor over a sparse file mapping: gigabytes of address space, only the pages touched cost
    memory or disk. Lets CPU tests place rows past 2^31 and 2^32 elements."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    fd, path = tempfile.mkstemp(prefix="triton_ep_sparse_")
    try:
        os.ftruncate(fd, nbytes)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    return t.view(dtype).view(shape)


# Window bases whose arithmetic crosses 2^31 and 2^32 (int32 / uint32 truncation) and reaches 2^33.
_BIG = [(1 << 31) - 3, (1 << 32) - 2, 1 << 33]


def _send_setup(device):
    T, R, E, K, WX = 6, 2, 4, 2, 8
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, WX), generator=g, dtype=torch.int32)
    idx = _idx([[0, 3], [2, -1], [1, 1], [-1, -1], [3, 0], [2, 2]])
    w = torch.rand(T, K, generator=g).view(torch.int32)
    send_pos = kernels.routing_layout(idx.to(device), E, R)[3]
    return [t.to(device) for t in (x, idx, w)] + [send_pos, E, K, WX]


@pytest.mark.parametrize("base", _BIG)
def test_dispatch_send_window_offsets_are_64bit(base):
    case_dispatch_send_offsets(base)


def case_dispatch_send_offsets(base, device="cpu"):
    """dispatch_send with receive-row bases and window near/after 2^31, 2^32, 2^33 writes exactly the bytes
    it writes with base 0. Catches: row_base, lo or dst = row_base + pos held in 32 bits (rows masked out
    or written at a wrapped, negative offset: out of bounds)."""
    x, idx, w, send_pos, E, K, WX = _send_setup(device)
    rec_words = dispatch_record_words(WX, 0, K, True)
    outs = []
    for b in (0, base):
        rec = torch.full((2, 16 * rec_words), -7, dtype=torch.int32, device=device)
        delta = torch.tensor([0, rec.stride(0)], dtype=torch.int64, device=device)
        row_base = torch.tensor([b + 1, b + 3], dtype=torch.int64, device=device)
        kernels.dispatch_send(x, None, idx, w, send_pos, row_base, delta, rec.view(-1), b, b + 16, E, rec_words,
                              with_src=True)
        outs.append(rec.cpu())
    assert torch.equal(outs[0], outs[1])
    recs = outs[0][0].view(16, rec_words)
    assert torch.equal(recs[1, :WX], x[0].cpu()) and int(recs[1, WX + 2 * K]) == 0     # token 0 -> rank 0, pos 0


@pytest.mark.parametrize("base", _BIG[:2])
def test_dispatch_recv_output_rows_past_2_31_elements(base):
    case_dispatch_recv_offsets(base)


def case_dispatch_recv_offsets(base, device="cpu"):
    """dispatch_recv unpacking into output rows whose element offset (row x width) passes 2^31 / 2^32:
    every output lands at its row. Catches: out_row * WX (or * K) computed in 32 bits."""
    WX, K, n = 8, 2, 5
    lo = base // WX - 2                                  # rows straddle the boundary in elements
    rec_words = dispatch_record_words(WX, 0, K, True)
    g = torch.Generator().manual_seed(5)
    rec = torch.randint(0, 1 << 20, (n, rec_words), generator=g, dtype=torch.int32)
    rec[:, WX:WX + K] = _idx([[4, 5], [5, -1], [0, 4], [5, 5], [-1, 4]], torch.int32)   # global ids
    mk = (lambda shape, dt: sparse_tensor(shape, dt)) if device == "cpu" else \
        (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
    out_x, out_idx = mk((lo + n, WX), torch.int32), mk((lo + n, K), torch.int64)
    out_w, out_src = mk((lo + n, K), torch.int32), mk((lo + n,), torch.int32)
    kernels.dispatch_recv(rec.to(device).view(-1), n, lo, 2, 2, WX, 0, K, rec_words, out_x, None, out_idx, out_w,
                          out_src)
    assert torch.equal(out_x[lo:].cpu(), rec[:, :WX])
    assert torch.equal(out_idx[lo:].cpu(), _idx([[0, 1], [1, -1], [-1, 0], [1, 1], [-1, 0]]))
    w = rec[:, WX + K:WX + 2 * K]
    assert torch.equal(out_w[lo:].cpu(), torch.where(out_idx[lo:].cpu() >= 0, w, 0))
    assert torch.equal(out_src[lo:].cpu(), rec[:, WX + 2 * K])
    assert int(out_x[lo - 1].abs().sum()) == 0 and int(out_x[0].abs().sum()) == 0


@pytest.mark.parametrize("base", _BIG)
def test_combine_windows_past_2_31(base):
    case_combine_offsets(base)


def case_combine_offsets(base, device="cpu"):
    """combine_send and combine_reduce with slot bases and windows near/after 2^31, 2^32, 2^33 write and
    reduce exactly as with base 0. Catches: comb_base / send_base + pos or the window ``lo`` truncated to
    32 bits (returned rows masked out, written out of bounds, or summed from the wrong slot)."""
    H, K = 16, 2
    rb = combine_record_bytes(H, K)
    g = torch.Generator().manual_seed(6)
    n_rows = 5
    x = torch.randn(n_rows, H, generator=g).to(BF16).to(device)
    w = torch.rand(n_rows, K, generator=g).to(device)
    prefix = torch.tensor([3, 5], dtype=torch.int64, device=device)     # 3 rows from source 0, 2 from source 1
    # int32, as the handle's send_head: slots (int64 base + int32 position) must still pass 2^31
    send_pos = torch.tensor([[0, -1], [1, 0], [-1, 1], [2, -1]], dtype=torch.int32, device=device)
    outs = []
    for b in (0, base):
        area = torch.zeros((2, 32 * rb), dtype=torch.uint8, device=device)
        delta = torch.tensor([0, area.stride(0) // 4], dtype=torch.int64, device=device)
        comb_base = torch.tensor([b + 2, b + 7], dtype=torch.int64, device=device)
        kernels.combine_send(x.view(torch.int32), w.view(torch.int32), n_rows, prefix, comb_base, delta,
                             area.view(-1).view(torch.int32), b, b + 32, rb // 4)
        out = torch.empty((4, H), dtype=BF16, device=device)
        wout = torch.empty((4, K), dtype=torch.float32, device=device)
        send_base = torch.tensor([b + 2, b + 5], dtype=torch.int64, device=device)
        kernels.combine_reduce(area[0], send_pos, send_base, b, b + 32, H, K, rb, None, out, [], None, wout,
                               first=True, last=True)
        outs.append((area.cpu(), out.cpu(), wout.cpu()))
    for a, b_ in zip(outs[0], outs[1]):
        assert torch.equal(bits(a), bits(b_))
    # received rows 0..2 went to source 0's slots 2..4, rows 3..4 to source 1's slots 7..8; source 0's reduce
    # reads slots 2 + pos (destination 0) and 5 + pos (destination 1, nothing written there: zeros)
    xc = x.cpu()
    assert torch.equal(outs[0][1], torch.stack([xc[0], xc[1], torch.zeros_like(xc[0]), xc[2]]))
    assert torch.equal(outs[0][0][1].view(32, rb)[7:9, :2 * H].view(BF16), xc[3:5])


def test_layout_past_65536_tokens():
    case_layout_past_65536_tokens()


def test_numpy_integer_num_experts():
    """``num_experts`` as a numpy integer (``_isint`` accepts it) gives the same layout as a Python int.
    Catches: a numpy scalar handed to a Triton launch, which the launcher rejects."""
    import numpy as np
    from triton_ep.testing import VirtualGroup
    vg = VirtualGroup(2, 1 << 16)
    idx = torch.tensor([[0, 3], [-1, 2], [1, 1]])
    want = vg.buffers[0].get_dispatch_layout(idx, 4)
    for e in (np.int64(4), np.int32(4)):
        got = vg.buffers[0].get_dispatch_layout(idx, e)
        assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]) if a is not None)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.routing_layout(idx.t(), 4, 2)


@pytest.mark.parametrize("T,K,E,R", [(50, 8, 1024, 8), (33, 6, 384, 8), (20, 9, 144, 72), (1, 1, 4096, 4)])
@pytest.mark.parametrize("one_launch,max_bins,blocks", [(None, None, None), (0, 32, None), (0, None, "two"),
                                                         (0, None, "scan")])
def test_layout_many_experts_and_ranks(T, K, E, R, one_launch, max_bins, blocks):
    case_layout_many_experts_and_ranks(T, K, E, R, one_launch=one_launch, max_bins=max_bins, blocks=blocks)


#: tuning of the layout's launch forms with several blocks (``blocks`` of :func:`case_layout_many_experts_and_ranks`)
_LAYOUT_BLOCKS = {"two": dict(block_t=8, scan_tokens=0), "scan": dict(block_t=8, scan_tokens=1 << 20, scan_block_t=4)}


def case_layout_many_experts_and_ranks(T, K, E, R, device="cpu", one_launch=None, max_bins=None, blocks=None):
    """routing_layout with many experts (the per-block histograms grow with E) and more than 64 ranks
    (rank sets no longer fit one int64), ids drawn with -1s and bad ids (-5, E, 2^40) mixed in: counts,
    ``is_token_in_rank``, send positions and the bad-id count equal the reference's; garbage-filled memory
    underneath does not leak. ``one_launch`` overrides the one-launch token bound (0: always two launches),
    ``max_bins`` the histogram bound (past it: atomics), ``blocks`` (``"two"``, ``"scan"``) blocks of 8 tokens in two
    launches or in one whose programs each read every id (:data:`_LAYOUT_BLOCKS`).
    Catches: a histogram too small for E + 2 bins, a rank-bit overflow past 64 ranks, padding ids counted."""
    g = torch.Generator().manual_seed(E + R)
    idx = torch.randint(-1, E, (T, K), generator=g)
    if T > 2:
        idx[0, 0], idx[1, -1], idx[2, 0] = -5, E, 2 ** 40
    table = _util.GPU_TUNING if device != "cpu" else _util.INTERP_TUNING
    saved = dict(table["layout"])
    try:
        if one_launch is not None:
            table["layout"]["one_launch_tokens"] = one_launch
        if max_bins is not None:
            table["layout"]["histogram_max_bins"] = max_bins
        table["layout"].update(_LAYOUT_BLOCKS.get(blocks, {}))
        per_rank, per_expert, in_rank, send_pos, nbad, counts = kernels.routing_layout(idx.to(device), E, R)
    finally:
        table["layout"].clear()
        table["layout"].update(saved)
    clean = torch.where((idx >= -1) & (idx < E), idx, -1)
    r_rank, r_expert, r_in = ref.get_dispatch_layout(clean, E, R)
    assert torch.equal(per_rank.cpu(), r_rank) and torch.equal(per_expert.cpu(), r_expert)
    assert torch.equal(in_rank.cpu(), r_in)
    want = torch.where(r_in, r_in.long().cumsum(0) - 1, torch.full_like(r_in, -1, dtype=torch.int64))
    assert torch.equal(send_pos.cpu(), want)
    assert int(nbad.item()) == int(((idx < -1) | (idx >= E)).sum())
    assert torch.equal(counts.cpu(), torch.cat([per_rank, per_expert, nbad]).cpu())


def case_layout_past_65536_tokens(device="cpu", T=70_001):
    """routing_layout with T past 65,536 (and counts past 2^16): counts and send positions equal the
    reference's. Catches: 16-bit counters or positions, a prefix over blocks that misses blocks past a
    fixed count, or in_rank indexing that wraps."""
    R, E, K = 4, 8, 2
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(-1, E, (T, K), generator=g)
    idx[: T - 100] = torch.where(idx[: T - 100] >= 0, idx[: T - 100] % 2, idx[: T - 100])   # rank 0 hot
    per_rank, per_expert, in_rank, send_pos, nbad, counts = kernels.routing_layout(idx.to(device), E, R)
    assert torch.equal(counts.cpu(), torch.cat([per_rank, per_expert, nbad]).cpu())
    r_rank, r_expert, r_in = ref.get_dispatch_layout(idx, E, R)
    assert torch.equal(per_rank.cpu(), r_rank) and torch.equal(per_expert.cpu(), r_expert)
    assert torch.equal(in_rank.cpu(), r_in) and int(nbad.item()) == 0
    want = torch.where(r_in, r_in.long().cumsum(0) - 1, torch.full_like(r_in, -1, dtype=torch.int64))
    assert torch.equal(send_pos.cpu(), want)
    assert int(per_rank[0]) > 65536


# ---------------------------------------------------------------------------------------------- kind 5
@pytest.mark.parametrize("H,Ts", [(16, [5, 0, 3]), (2880, [3, 1, 2]), (8192, [2, 1])])
def test_hidden_sizes(H, Ts):
    case_hidden_sizes(H, Ts)


def case_hidden_sizes(H, Ts, device="cpu"):
    """H not a multiple of 128 (2880), small (16: one 32-byte row) and large (8192+): bit for bit.
    Catches: a block over H assumed to divide it (tail columns dropped or written past the row), a record
    width computed for H % 128 == 0 only, a single block over H that misses columns beyond its size."""
    R = len(Ts)
    xs, idxs, ws = make_inputs(H, 2 * R, 2, H, Ts)
    verify_round_trip(guarded_group(R, 1 << 17, device), xs, idxs, ws, 2 * R, device)


def test_inputs_with_storage_offset_and_strides():
    """x as a row slice of a larger tensor (contiguous, with a storage offset), topk_idx and weights as
    every-other-column views: the result of their contiguous copies, inputs unchanged.
    Catches: a launcher passing the storage's base pointer (offset ignored) or assuming unit strides."""
    R, E, K, H = 2, 4, 2, 32
    xs, idxs, ws = make_inputs(8, E, K, H, [5, 4])
    exp = ref.dispatch(xs, idxs, ws, E)
    xs_v = [torch.cat([torch.zeros(3, H, dtype=BF16), x])[3:] for x in xs]
    idx_v = [torch.stack([i, -torch.ones_like(i)], 2).flatten(1)[:, ::2] for i in idxs]
    ws_v = [torch.stack([w, w + 9], 2).flatten(1)[:, ::2] for w in ws]
    assert xs_v[0].storage_offset() == 3 * H and not idx_v[0].is_contiguous()
    before = [bits(t).clone() for t in xs_v + idx_v + ws_v]
    check_dispatch(virtual_dispatch(guarded_group(R, 1 << 15), xs_v, idx_v, ws_v, E), exp)
    assert all(torch.equal(b, bits(t)) for b, t in zip(before, xs_v + idx_v + ws_v))


@pytest.mark.parametrize("name,bad,exc", [
    ("topk_idx", dict(topk_idx=torch.zeros(4, 2, dtype=torch.int16)), TypeError),
    ("topk_idx", dict(topk_idx=torch.zeros(4, 2, dtype=torch.int64, device="meta")), ValueError),
    ("topk_weights", dict(topk_weights=torch.zeros(4, 2, device="meta")), ValueError),
    ("topk_weights", dict(topk_weights=torch.zeros(4, 3)), ValueError),
    ("is_token_in_rank", dict(is_token_in_rank=torch.zeros(4, 1, dtype=torch.int8)), TypeError),
    ("num_tokens_per_expert", dict(num_tokens_per_expert=torch.zeros(4)), TypeError),
    ("num_tokens_per_rank", dict(num_tokens_per_rank=torch.zeros(1, dtype=torch.int32, device="meta")), ValueError),
])
def test_dispatch_errors_name_the_tensor(name, bad, exc):
    """Wrong dtype / device / shape of each routing tensor: a clear error naming that tensor, before any
    kernel runs (the buffer stays untouched). Catches: a check that only covers x, or a kernel that
    silently reinterprets int16 ids / float counts."""
    vg = guarded_group(1, 1 << 14)
    buf = vg.buffers[0]
    idx = _idx([[0, 1], [1, -1], [-1, -1], [2, 2]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    kw = dict(x=torch.randn(4, 16).to(BF16), topk_weights=torch.rand(4, 2), num_tokens_per_rank=per_rank,
              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    kw.update(bad)
    (err,) = vg.call("dispatch", [kw])
    assert isinstance(err, exc) and name in str(err), repr(err)
    assert bool((vg.world.data[0] == 0xFF).all())


@pytest.mark.parametrize("name,bad,exc", [
    ("x", dict(x=lambda y: y.float()), TypeError),
    ("x", dict(x=lambda y: y.to("meta")), ValueError),
    ("topk_weights", dict(topk_weights=lambda w: w.double()), TypeError),
    ("bias", dict(bias=lambda y: torch.zeros(3, 16)), TypeError),
    ("bias", dict(bias=lambda y: torch.zeros(2, 16, dtype=BF16)), ValueError),
])
def test_combine_errors_name_the_tensor(name, bad, exc):
    """Wrong dtype / device / shape in combine: an error naming the tensor, and the group still works."""
    vg = guarded_group(1, 1 << 14)
    xs, idxs, ws = make_inputs(9, 2, 2, 16, [3], p_invalid=0.0)
    (res,) = virtual_dispatch(vg, xs, idxs, ws, 2)
    kw = dict(x=res[0], handle=res[4], topk_weights=res[2])
    (key, fn), = bad.items()
    kw[key] = fn(kw.get(key) if key != "bias" else None)
    (err,) = vg.call("combine", [kw])
    assert isinstance(err, exc) and name in str(err), repr(err)
    (ok,) = raise_first(vg.call("combine", [dict(x=res[0], handle=res[4])]))
    assert ok[0].shape == (3, 16)


# ---------------------------------------------------------------------------------------------- kind 6
def test_cached_dispatch_rejects_mismatched_handles():
    """A handle of another Buffer, a handle for another T, a plain tuple, and topk passed with a handle are
    rejected (ValueError/TypeError on that rank, EPRemoteError on its peers); the group still works. (A new
    user's find: a tuple with a float entry said "got tuple".) A tuple in a handle's place names its first bad
    entry, index, field and type; one of the right entries says it is no handle; one of another length is a
    ValueError. Catches: a cached dispatch trusting the handle blindly (rows copied from the wrong T: out of
    bounds)."""
    R, E, K, H = 2, 4, 2, 16
    xs, idxs, ws = make_inputs(10, E, K, H, [5, 3])
    a, b = guarded_group(R, 1 << 15), guarded_group(R, 1 << 15)
    ra = virtual_dispatch(a, xs, idxs, ws, E)
    rb = virtual_dispatch(b, xs, idxs, ws, E)
    h = list(rb[0][4])
    cases = [(dict(x=xs[0], handle=ra[0][4]), ValueError, "another Buffer"),
             (dict(x=xs[0][:4], handle=rb[0][4]), ValueError, "5 tokens"),
             (dict(x=xs[0], handle=tuple(rb[0][4])), TypeError, "got a tuple of its entries: the handle itself"),
             (dict(x=xs[0], handle=tuple(h[:3] + [1.5] + h[4:])), TypeError,
              "handle[3] (recv_src_idx) must be a torch.Tensor, got float"),
             (dict(x=xs[0], handle=h[:4] + [h[4].int()] + h[5:]), TypeError,
              "handle[4] (is_token_in_rank) must have dtype torch.bool, got torch.int32"),
             (dict(x=xs[0], handle=tuple(h[:5])), ValueError, "a tuple of 5 entries is not one (it holds 6: "
                                                             "rank_prefix_matrix, channel_prefix_matrix, "),
             (dict(x=xs[0], handle=rb[0][4], topk_idx=idxs[0]), ValueError, "takes no topk")]
    for kw0, exc, words in cases:
        out = b.call("dispatch", [kw0, dict(x=xs[1], handle=rb[1][4])])
        assert isinstance(out[0], exc) and words in str(out[0]), repr(out[0])
        assert isinstance(out[1], triton_ep.EPRemoteError) and "rank 0" in str(out[1]), repr(out[1])
    out = b.call("combine", [dict(x=rb[0][0], handle=None), dict(x=rb[1][0], handle=rb[1][4])])
    assert isinstance(out[0], TypeError) and str(out[0]) == ("handle must be a handle this Buffer's dispatch "
                                                             "returned, got NoneType"), repr(out[0])
    assert isinstance(out[1], triton_ep.EPRemoteError), repr(out[1])
    cached = raise_first(b.call("dispatch", [dict(x=xs[r], handle=rb[r][4]) for r in range(R)]))
    for j in range(R):
        assert_bits(cached[j][0], rb[j][0], f"rank {j}")


def test_another_modes_handle_is_named():
    """A handle of another mode where a normal-mode one within one host belongs (and the other way round): a
    TypeError naming its class and what it is (runtime.checks.handle_error, which every mode's check raises)."""
    from triton_ep.modes.internode.handle import InternodeHandle
    from triton_ep.modes.intranode_args import DispatchHandle
    from triton_ep.modes.low_latency.handle import LLHandle
    from triton_ep.runtime.checks import handle_error
    i32 = torch.zeros(2, dtype=torch.int32, device="cpu")
    ll = LLHandle((i32, i32.long(), 8, 128, 4), "uid", i32, i32, 3, 2)
    e = handle_error(ll, DispatchHandle, "dispatch")
    assert isinstance(e, TypeError) and str(e) == ("handle must be a handle this Buffer's dispatch returned, got "
                                                   "LLHandle, the handle of a low_latency_dispatch"), e
    e = handle_error(InternodeHandle((i32,) * 10, None), LLHandle, "low_latency_dispatch")
    assert isinstance(e, TypeError) and str(e).endswith("got InternodeHandle, the handle of a normal-mode dispatch "
                                                        "across hosts"), e


def layout_kwargs(idx: torch.Tensor, E: int, R: int, device: str = "cpu") -> dict:
    """dispatch's routing arguments from the reference layout (as a caller computing them elsewhere would:
    dispatch recomputes its routing from topk_idx), skipping a layout launch per rank."""
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(idx, E, R)
    return dict(num_tokens_per_rank=per_rank.to(device), is_token_in_rank=in_rank.to(device),
                num_tokens_per_expert=per_expert.to(device), topk_idx=idx.to(device))


def back_to_back(vg: VirtualGroup, rounds: int, R: int, E: int, K: int, H: int, max_t: int, seed: int,
                 device: str = "cpu", cached_every: int = 5) -> None:
    """``rounds`` dispatch -> combine rounds with fresh random routing (ragged T, skew, -1, duplicates),
    no extra synchronisation; every ``cached_every`` rounds, the previous round's handle is reused (cached
    dispatch and combine on new data) after newer calls. Everything bit for bit against the reference."""
    g = torch.Generator().manual_seed(seed)
    prev = None
    for it in range(rounds):
        Ts = torch.randint(0, max_t + 1, (R,), generator=g).tolist()
        xs, idxs, ws = make_inputs(seed * 100003 + it, E, K, H, Ts, skew=[0.0, 0.5, 1.0][it % 3], p_invalid=0.2,
                                   p_dup=0.2)
        res = raise_first(vg.call("dispatch", [dict(x=xs[r].to(device), topk_weights=ws[r].to(device),
                                                     **layout_kwargs(idxs[r], E, R, device)) for r in range(R)]))
        exp = ref.dispatch(xs, idxs, ws, E)
        check_dispatch(res, exp)
        check_combine(vg, res, exp, Ts, device, f"round {it} ")
        if prev is not None and it % cached_every == 0:       # an older handle stays valid after newer calls
            p_res, p_xs, p_idxs, p_ws, p_Ts = prev
            check_cached(vg, [r[4] for r in p_res], [(x.float() + it).to(BF16) for x in p_xs], p_idxs, p_ws, E, p_Ts,
                         device, f"round {it} ")
        prev = (res, xs, idxs, ws, Ts)


@pytest.mark.extended
def test_fifty_back_to_back_rounds():
    """50 rounds with fresh routing through one (small, multi-round) buffer. Catches: state carried from
    one call to the next (stale counts or flags, an exchange-slot parity mix-up, a handle that points at
    buffer contents a later call overwrote)."""
    back_to_back(guarded_group(2, 1 << 14), 50, R=2, E=4, K=3, H=16, max_t=9, seed=3)


# ---------------------------------------------------------------------------------------------- kind 7
def case_fp32_accumulation_rounded_once(device="cpu"):
    """A token sent to 3 ranks whose expert outputs are 1, 2^-8 and 2^-8: the fp32 sum 1 + 2^-7 is exact in
    bf16, while summing in bf16 (or rounding a partial sum) gives 1. Same for the weights' sums, which
    stay fp32. Catches: bf16 accumulation, rounding per round or per rank, summing in another order."""
    R, E, H = 3, 3, 16
    idxs = [_idx([[0, 1, 2]]), _idx([[-1, -1, -1]]), _idx([[-1, -1, -1]])]
    xs = [torch.ones(1, H, dtype=BF16), torch.zeros(1, H, dtype=BF16), torch.zeros(1, H, dtype=BF16)]
    vg = guarded_group(R, 1 << 14, device)
    res = virtual_dispatch(vg, xs, idxs, None, E, device)
    vals = [1.0, 2.0 ** -8, 2.0 ** -8]
    ys = [torch.full((res[j][0].shape[0], H), vals[j], dtype=BF16, device=device) for j in range(R)]
    got = raise_first(vg.call("combine", [dict(x=ys[j], handle=res[j][4]) for j in range(R)]))
    assert float(got[0][0][0, 0]) == 1.0 + 2.0 ** -7
    assert float((torch.ones(1, dtype=BF16) + 2.0 ** -8 + 2.0 ** -8)[0]) == 1.0      # what bf16 sums give


def test_fp32_accumulation_rounded_once():
    case_fp32_accumulation_rounded_once()


_TUNINGS = [
    dict(grid=dict(programs_per_sm=1),  # (a grid cap: programs loop over blocks)
         layout=dict(block_t=16, block_b=2, one_launch_tokens=0), dispatch_send=dict(block_t=1, block_w=4, split_w=1, store_cache=".cs", programs_per_sm=1),
         dispatch_recv=dict(block_t=2, block_w=8), combine_send=dict(block_t=4, block_w=2),
         combine_reduce=dict(block_t=1, block_h=16)),
    dict(layout=dict(block_t=2, block_b=4, one_launch_tokens=8), dispatch_send=dict(block_t=8, block_w=16, split_w=1, store_evict="evict_first", record_align_words=32),
         dispatch_recv=dict(block_t=1, block_w=1), combine_send=dict(block_t=2, block_w=32),
         combine_reduce=dict(block_t=8, block_h=32)),
]


def case_results_independent_of_config_and_blocks(monkeypatch, device="cpu", tunings=_TUNINGS):
    """Identical calls, every Config, every buffer size (number of rounds) and every tuned block size
    (layout, send, receive, combine tiles) give bitwise-identical dispatch and combine results.
    Catches: a reduction whose order follows the tiling or the round split (atomics, split-K), a block
    size that must divide H or T, a result depending on Config's SM count or chunk sizes."""
    R, E, K, H = 3, 6, 3, 40
    Ts = [7, 0, 5]
    xs, idxs, ws = make_inputs(21, E, K, H, Ts, skew=0.5, p_dup=0.3)
    table = _util.GPU_TUNING if device != "cpu" else _util.INTERP_TUNING
    runs = []
    for nbytes, cfg, tune in ((1 << 16, None, None), (1 << 16, None, None),
                              (1024, triton_ep.Config(24, 8, 512, 16, 128), tunings[0]),
                              (3000, triton_ep.Config(2, 1, 1, 1, 1), tunings[1])):
        with monkeypatch.context() as m:
            for kernel, vals in (tune or {}).items():
                for key, v in vals.items():
                    assert key in table[kernel], f"tuning table has no {kernel}.{key}"   # really varied
                    m.setitem(table[kernel], key, v)
            vg = guarded_group(R, nbytes, device)
            res = virtual_dispatch(vg, xs, idxs, ws, E, device, config=cfg)
            ys = [(r[0].float() * 0.37 + r[2].sum(1, keepdim=True)).to(BF16) for r in res]
            got = raise_first(vg.call("combine", [dict(x=ys[j], handle=res[j][4], topk_weights=res[j][2], config=cfg)
                                                  for j in range(R)]))
        runs.append([bits(t) for r in res for t in r[:3]] + [bits(t) for g in got for t in g[:2]])
    for other in runs[1:]:
        assert len(other) == len(runs[0]) and all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_results_independent_of_config_and_blocks(monkeypatch):
    case_results_independent_of_config_and_blocks(monkeypatch)


def case_isolation_from_other_tokens(device="cpu"):
    """Adding tokens (NaN, +-Inf and huge rows, routed everywhere, also sharing the same experts) around
    the original tokens on every rank changes neither what the original tokens deliver nor their combined
    rows and weights, bit for bit. Catches: a masked lane loaded without ``other`` (NaN * 0 = NaN leaking
    into a neighbour), a tile reduction mixing rows, a position computed from the wrong token."""
    R, E, K, H = 3, 6, 2, 24
    Ts = [6, 4, 5]
    xs, idxs, ws = make_inputs(31, E, K, H, Ts, p_dup=0.2)
    g = torch.Generator().manual_seed(32)
    specials = [float("nan"), float("inf"), float("-inf"), 3e38]
    xs_b, idxs_b, ws_b, keep = [], [], [], []
    for r in range(R):
        n_new = Ts[r] + 3
        new_x = torch.tensor(specials, dtype=torch.float32).repeat(n_new * H // 4 + 1)[:n_new * H].view(n_new, H)
        new_idx = torch.randint(-1, E, (n_new, K), generator=g)
        order = torch.randperm(Ts[r] + n_new, generator=g)
        pos = order.argsort()[:Ts[r]].sort().values            # where the original tokens end up, in order
        x = torch.empty(Ts[r] + n_new, H, dtype=BF16)
        i = torch.empty(Ts[r] + n_new, K, dtype=torch.int64)
        w = torch.empty(Ts[r] + n_new, K)
        mask = torch.zeros(Ts[r] + n_new, dtype=torch.bool)
        mask[pos] = True
        x[mask], i[mask], w[mask] = xs[r], idxs[r], ws[r]
        x[~mask], i[~mask], w[~mask] = new_x.to(BF16), new_idx, torch.full((n_new, K), float("nan"))
        xs_b.append(x), idxs_b.append(i), ws_b.append(w), keep.append(pos)
    outs = []
    for X, I, W in ((xs, idxs, ws), (xs_b, idxs_b, ws_b)):
        vg = guarded_group(R, 1 << 16, device)
        res = virtual_dispatch(vg, X, I, W, E, device)
        ys = [(r[0].float() * 2 + r[2].sum(1, keepdim=True)).to(BF16) for r in res]
        got = raise_first(vg.call("combine", [dict(x=ys[j], handle=res[j][4], topk_weights=res[j][2])
                                              for j in range(R)]))
        outs.append((res, got))
    (ra, ga), (rb, gb) = outs
    for r in range(R):
        assert_bits(gb[r][0][keep[r].to(gb[r][0].device)], ga[r][0], f"rank {r} combined rows")
        assert_bits(gb[r][1][keep[r].to(gb[r][1].device)], ga[r][1], f"rank {r} combined weights")
        # rows the original tokens delivered to rank r, found by their source index
        for j in range(R):
            pa, pb = ra[r][4][0][:, r].cpu().long(), rb[r][4][0][:, r].cpu().long()
            sa = ra[r][4][3].cpu().long()[(pa[j - 1] if j else 0):pa[j]]
            sb = rb[r][4][3].cpu().long()[(pb[j - 1] if j else 0):pb[j]]
            sel = torch.isin(sb, keep[j])
            assert torch.equal(keep[j][sa], sb[sel]), "delivered token set changed"
            off_a, off_b = (int(pa[j - 1]) if j else 0), (int(pb[j - 1]) if j else 0)
            rows_b = torch.nonzero(sel).flatten() + off_b
            assert_bits(rb[r][0][rows_b.to(rb[r][0].device)], ra[r][0][off_a:off_a + sa.numel()],
                        f"rank {r} rows from {j}")


def test_isolation_from_other_tokens_nan_inf():
    case_isolation_from_other_tokens()
