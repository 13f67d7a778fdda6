"""FP8 scales moved as DeepEP moves them, and the dtype and shape of every tensor a call returns or keeps
in its handle, against DeepEP V1 (commit 567632d, /work/shared/peers/; file:line below is in that tree).

Normal mode runs on ranks simulated in one process; low-latency mode in real rank processes."""
import pytest
import torch

import triton_ep
from tests.cases.helpers import _to, assert_bits, check_dispatch, make_inputs, raise_first, virtual_dispatch
from triton_ep import reference as ref
from triton_ep.kernels.fp8 import pack_ue8m0
from triton_ep.testing import VirtualGroup, run_ranks


def _raw(shape, dtype, g):
    """Random bit patterns (NaNs and infinities included for floats): bit-for-bit transport only."""
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32).view(dtype)


def _scales(kind, T, H, g):
    """Scales of one rank for a case: (kind of layout, S, dtype) -> [T, S] tensor, maybe strided."""
    if kind == "ue8m0":       # what low-latency mode's use_ue8m0 produces: 4 exponent bytes per int32 word
        s = torch.exp2(torch.randint(-10, 10, (T, H // 128), generator=g).float())
        return pack_ue8m0(s)
    dtype, S, order = kind
    s = _raw((T, S), dtype, g)
    if order == "col":        # column-major [T, S]: stride (1, T)
        return s.t().contiguous().t()
    if order == "strided":    # every other column of a wider tensor: stride (2S, 2)
        return _raw((T, 2 * S), dtype, g)[:, ::2]
    return s


def _fp8_inputs(seed, E, K, H, Ts, kind, xdtype=torch.float8_e4m3fn):
    xs, idxs, ws = make_inputs(seed, E, K, H, Ts)
    g = torch.Generator().manual_seed(seed + 7)
    pairs = [(x.float().to(xdtype) if xdtype.is_floating_point else _raw((x.shape[0], H // 4), torch.int32, g)
              .view(xdtype), _scales(kind, x.shape[0], H, g)) for x in xs]
    return pairs, idxs, ws


_CASES = {
    "fp32 S=1 (per token)": ((torch.float32, 1, "row"), 256),
    "fp32 S=H/128": ((torch.float32, 2, "row"), 256),
    "fp32 S=3 (odd)": ((torch.float32, 3, "row"), 256),
    "fp32 S=3 column-major": ((torch.float32, 3, "col"), 256),
    "fp32 S=5 strided": ((torch.float32, 5, "strided"), 256),
    "int32 UE8M0 packed": ("ue8m0", 512),
    "int32 S=2 column-major": ((torch.int32, 2, "col"), 256),
    "fp32 S=1, H=48 (not a multiple of 128)": ((torch.float32, 1, "row"), 48),
    "fp32 S=0": ((torch.float32, 0, "row"), 256),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_fp8_scales_any_width_dtype_and_layout(case):
    case_fp8_scales(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_CASES))
def test_fp8_scales_any_width_dtype_and_layout_cuda(case):
    case_fp8_scales(case, "cuda")


def case_fp8_scales(case, device="cpu"):
    """Scales of any width S >= 0, fp32 or int32 (UE8M0 words), in any layout move bit for bit with their
    rows; the received scales have the given dtype and shape [N, S], row-major (DeepEP:
    csrc/deep_ep.cpp:550-559 takes them, :673-676 allocates recv_x_scales with x_scales' options).
    A cached dispatch moves new scales along the same routes; num_worst_tokens pads scales with 0."""
    kind, H = _CASES[case]
    R, E, K, Ts = 3, 6, 2, [5, 0, 9]
    xs, idxs, ws = _fp8_inputs(11, E, K, H, Ts, kind)
    vg = VirtualGroup(R, 1 << 15, device=device)
    res = virtual_dispatch(vg, xs, idxs, ws, E, device)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp, fp8=True)
    for j in range(R):
        sc, want = res[j][0][1], xs[j][1]
        assert sc.dtype == want.dtype and sc.shape == (res[j][0][0].shape[0], want.shape[1]), (sc.dtype, sc.shape)
        assert sc.is_contiguous(), "received scales are row-major, as DeepEP allocates them"
    # cached dispatch: new rows and scales, same routes
    xs2, _, _ = _fp8_inputs(12, E, K, H, Ts, kind)
    cached = raise_first(vg.call("dispatch", [dict(x=_to(xs2[r], device), handle=res[r][4]) for r in range(R)]))
    exp2 = ref.dispatch(xs2, idxs, ws, E)
    for j in range(R):
        assert_bits(cached[j][0][0], exp2[j]["recv_x"][0], f"rank {j} cached recv_x")
        assert_bits(cached[j][0][1], exp2[j]["recv_x"][1], f"rank {j} cached scales")
    # fixed-size outputs: the padding rows' scales are 0
    worst = sum(Ts) + 2
    padded = virtual_dispatch(VirtualGroup(R, 1 << 15, device=device), xs, idxs, ws, E, device, num_worst_tokens=worst)
    for j in range(R):
        n = exp[j]["recv_x"][0].shape[0]
        sc = padded[j][0][1]
        assert sc.shape == (worst, xs[j][1].shape[1]) and sc.dtype == xs[j][1].dtype
        assert_bits(sc[:n], exp[j]["recv_x"][1], f"rank {j} padded scales")
        assert (sc[n:].cpu().view(torch.int32) == 0).all()


@pytest.mark.parametrize("xdtype", [torch.float8_e5m2, torch.uint8])
def test_scales_travel_with_any_one_byte_x(xdtype):
    """DeepEP asks only x.element_size() == 1 of x with scales (csrc/deep_ep.cpp:551)."""
    xs, idxs, ws = _fp8_inputs(3, 4, 2, 64, [4, 6], (torch.float32, 1, "row"), xdtype)
    res = virtual_dispatch(VirtualGroup(2, 1 << 15), xs, idxs, ws, 4)
    check_dispatch(res, ref.dispatch(xs, idxs, ws, 4), fp8=True)
    assert all(r[0][0].dtype == xdtype for r in res)


_WORD_DTYPES = [torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.complex64, torch.float8_e4m3fn, torch.bool,
                torch.float64]


def case_any_dtype_and_misaligned_x(xdtype, device="cpu"):
    """Rows of any dtype move bit for bit, Triton's types or not (fnuz / e8m0 FP8, complex: the kernels then take
    an int32 view), and so do rows of an ``x`` that starts between two 32-bit words (a contiguous slice at an
    odd element: copied to an aligned tensor first); combine takes such an ``x`` too."""
    R, E, K, Ts = 2, 4, 2, [5, 7]
    xs, idxs, ws = make_inputs(21, E, K, 64, Ts)
    g = torch.Generator().manual_seed(22)
    if xdtype is not None:
        xs = [_raw((T, 16), torch.int32, g).view(torch.uint8).view(xdtype) if xdtype != torch.bool else
              (_raw((T, 16), torch.int32, g).view(torch.uint8) & 1).bool() for T in Ts]
    else:           # bf16 rows starting 2 bytes into a flat buffer
        xs = [torch.cat([torch.zeros(1, dtype=torch.bfloat16), x.flatten()])[1:].view(x.shape) for x in xs]
        assert all(x.data_ptr() % 4 == 2 and x.is_contiguous() for x in xs)
    vg = VirtualGroup(R, 1 << 15, device=device)
    res = virtual_dispatch(vg, xs, idxs, ws, E, device)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp)
    assert all(r[0].dtype == xs[0].dtype for r in res)
    if xdtype is None:
        ys = [(e["recv_x"].float() * 3).to(torch.bfloat16) for e in exp]
        ys = [torch.cat([torch.zeros(1, dtype=torch.bfloat16), y.flatten()])[1:].view(y.shape) for y in ys]
        got = raise_first(vg.call("combine", [dict(x=_to(ys[j], device), handle=res[j][4]) for j in range(R)]))
        want = ref.combine(ys, exp, Ts)
        for j in range(R):
            assert_bits(got[j][0], want[j][0], f"rank {j} combined_x")


@pytest.mark.parametrize("xdtype", _WORD_DTYPES + [None], ids=[str(d) for d in _WORD_DTYPES] + ["misaligned bf16"])
def test_any_dtype_and_misaligned_x(xdtype):
    case_any_dtype_and_misaligned_x(xdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", _WORD_DTYPES + [None], ids=[str(d) for d in _WORD_DTYPES] + ["misaligned bf16"])
def test_any_dtype_and_misaligned_x_cuda(xdtype):
    case_any_dtype_and_misaligned_x(xdtype, "cuda")


def test_pair_with_none_scales_is_plain_x():
    """DeepEP unpacks ``(x, None)`` as ``x`` without scales and returns ``recv_x`` alone
    (deep_ep/buffer.py:382, :398-401); a cached dispatch likewise."""
    xs, idxs, ws = make_inputs(8, 4, 2, 16, [5, 3])
    vg = VirtualGroup(2, 1 << 15)
    kw = []
    for r in range(2):
        per_rank, _, per_expert, in_rank, _ = vg.buffers[r].get_dispatch_layout(idxs[r], 4)
        kw.append(dict(x=(xs[r], None), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r]))
    res = raise_first(vg.call("dispatch", kw))
    check_dispatch(res, ref.dispatch(xs, idxs, ws, 4))
    cached = raise_first(vg.call("dispatch", [dict(x=(xs[r], None), handle=res[r][4]) for r in range(2)]))
    assert all(isinstance(c[0], torch.Tensor) and torch.equal(c[0], r[0]) for c, r in zip(cached, res))


def _one_rank_dispatch(x):
    vg = VirtualGroup(1, 1 << 16)
    buf = vg.buffers[0]
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [2, 2]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    (out,) = vg.call("dispatch", [dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                       num_tokens_per_expert=per_expert, topk_idx=idx)])
    return out


_FP8 = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("x,exc,words", [
    ((_FP8, torch.zeros(4, 1, dtype=torch.bfloat16)), TypeError,
     ["x[1] (scales)", "torch.float32 or torch.int32", "torch.bfloat16"]),
    ((_FP8, torch.zeros(4, 1, dtype=torch.int64)), TypeError, ["x[1] (scales)", "torch.int64"]),
    ((_FP8, torch.zeros(5, 1)), ValueError, ["x[1] (scales)", "[4, *]", "[5, 1]"]),
    ((_FP8, torch.zeros(4)), ValueError, ["x[1] (scales)", "[4, *]", "[4]"]),
    ((_FP8, torch.zeros(4, 1, device="meta")), ValueError, ["x[1] (scales)", "meta"]),
    ((torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, 1)), TypeError,
     ["x[0]", "1-byte", "torch.bfloat16"]),
    ((torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(4, 1)), ValueError, ["16 bytes", "8"]),
    ((_FP8,), ValueError, ["x as a tuple", "scales"]),
])
def test_bad_scales_raise_before_launch(x, exc, words):
    err = _one_rank_dispatch(x)
    assert isinstance(err, exc), err
    assert all(w in str(err) for w in words), str(err)


@pytest.mark.parametrize("second", [(torch.float32, 2), (torch.int32, 1)])
def test_ranks_with_other_scale_width_or_dtype_raise_everywhere(second):
    """Scale width and dtype are part of the call signature: ranks that disagree all raise ValueError,
    in a plain and in a cached dispatch."""
    R, E = 2, 4
    xs, idxs, ws = _fp8_inputs(5, E, 2, 128, [6, 5], (torch.float32, 1, "row"))
    dtype, S = second
    g = torch.Generator().manual_seed(1)
    other = [xs[0], (xs[1][0], _raw((xs[1][0].shape[0], S), dtype, g))]
    vg = VirtualGroup(R, 1 << 16)
    with pytest.raises(ValueError, match="all ranks must agree"):
        virtual_dispatch(vg, other, idxs, ws, E)
    res = virtual_dispatch(vg, xs, idxs, ws, E)        # the group goes on
    out = vg.call("dispatch", [dict(x=other[r], handle=res[r][4]) for r in range(R)])
    assert all(isinstance(o, ValueError) and "all ranks must agree" in str(o) for o in out), out


# ---------------------------------------------------------------- dtypes and shapes of every result
# What DeepEP V1 returns (intranode), with the file:line that allocates it; "x", "idx", "w", "sc": the dtype
# of the argument of that name. T tokens, N rows received, R ranks, E experts, K top-k, S scale columns.
_DEEPEP_NORMAL = {
    # get_dispatch_layout: csrc/deep_ep.cpp:416-421, returned at :456
    "layout.num_tokens_per_rank": ("int32", "R"),
    "layout.num_tokens_per_rdma_rank": (None, None),          # None within one node
    "layout.num_tokens_per_expert": ("int32", "E"),
    "layout.is_token_in_rank": ("bool", "T,R"),
    # dispatch: csrc/deep_ep.cpp:656-675, returned at :759; handle built at deep_ep/buffer.py:398
    "dispatch.recv_x": ("x", "N,H"),
    "dispatch.recv_x_scales": ("sc", "N,S"),
    "dispatch.recv_topk_idx": ("idx", "N,K"),
    "dispatch.recv_topk_weights": ("float32", "N,K"),
    "handle.rank_prefix_matrix": ("int32", "R,R"),          # :594
    "handle.channel_prefix_matrix": ("int32", "R,C"),       # :595 (C = num_sms / 2 channels; here C = 1)
    "handle.recv_channel_prefix_matrix": ("int32", "R,C"),  # :660
    "handle.recv_src_idx": ("int32", "N"),                  # :657
    "handle.is_token_in_rank": ("bool", "T,R"),             # the argument, passed through
    "handle.send_head": ("int32", "T,R"),                   # :661
    # cached dispatch: deep_ep/buffer.py:387-390
    "cached.recv_x": ("x", "N,H"),
    "cached.recv_x_scales": ("sc", "N,S"),
    # combine: csrc/deep_ep.cpp:830 and :859, returned at :910
    "combine.combined_x": ("x", "T,H"),
    "combine.combined_topk_weights": ("float32", "T,K"),
}


def _check_entry(name, t, spec, dims, dtypes):
    dtype, shape = spec
    if dtype is None:
        assert t is None, f"{name}: DeepEP returns None here"
        return
    assert isinstance(t, torch.Tensor), f"{name}: {type(t).__name__}"
    want_dtype = dtypes.get(dtype) or getattr(torch, dtype)
    want_shape = tuple(dims[d] for d in shape.split(","))
    assert t.dtype == want_dtype, f"{name}: dtype {t.dtype}, DeepEP {want_dtype}"
    assert tuple(t.shape) == want_shape, f"{name}: shape {tuple(t.shape)}, DeepEP {want_shape}"


_TABLE_CASES = [(torch.int64, torch.float32, 0), (torch.int32, torch.int32, 0), (torch.int64, torch.float32, 40)]


@pytest.mark.parametrize("idx_dtype,sc_dtype,worst", _TABLE_CASES)
def test_every_returned_tensor_has_deepeps_dtype_and_shape(idx_dtype, sc_dtype, worst):
    case_returned_dtypes(idx_dtype, sc_dtype, worst)


@pytest.mark.gpu
@pytest.mark.parametrize("idx_dtype,sc_dtype,worst", _TABLE_CASES)
def test_every_returned_tensor_has_deepeps_dtype_and_shape_cuda(idx_dtype, sc_dtype, worst):
    case_returned_dtypes(idx_dtype, sc_dtype, worst, "cuda")


def case_returned_dtypes(idx_dtype, sc_dtype, worst, device="cpu"):
    """Every tensor of get_dispatch_layout, dispatch, cached dispatch and combine (and every handle entry)
    has the dtype and shape of _DEEPEP_NORMAL; the handle's channel matrices and send_head hold DeepEP's
    one-channel values."""
    R, E, K, H, Ts, S = 3, 6, 3, 256, [7, 0, 12], 3
    xs, idxs, ws = _fp8_inputs(2, E, K, H, Ts, (sc_dtype, S, "row"))
    idxs = [i.to(idx_dtype) for i in idxs]
    exp = ref.dispatch(xs, idxs, ws, E)
    xs, idxs, ws = [_to(x, device) for x in xs], [i.to(device) for i in idxs], [w.to(device) for w in ws]
    vg = VirtualGroup(R, 1 << 16, device=device)
    lays = [vg.buffers[r].get_dispatch_layout(idxs[r], E) for r in range(R)]
    res = raise_first(vg.call("dispatch", [dict(x=xs[r], num_tokens_per_rank=lays[r][0], is_token_in_rank=lays[r][3],
                                                num_tokens_per_expert=lays[r][2], topk_idx=idxs[r], topk_weights=ws[r],
                                                num_worst_tokens=worst) for r in range(R)]))
    cached = raise_first(vg.call("dispatch", [dict(x=xs[r], handle=res[r][4]) for r in range(R)]))
    ys = [torch.zeros(res[r][0][0].shape[0], H, dtype=torch.bfloat16, device=device) for r in range(R)]
    comb = raise_first(vg.call("combine", [dict(x=ys[r], handle=res[r][4], topk_weights=res[r][2]) for r in range(R)]))
    for r in range(R):
        N = worst or exp[r]["recv_x"][0].shape[0]
        dims = dict(T=Ts[r], N=N, R=R, E=E, K=K, H=H, S=S, C=1)
        # "x" of combine is its bf16 input, of the other calls the fp8 rows
        dtypes = dict(x=torch.float8_e4m3fn, sc=sc_dtype, idx=idx_dtype)
        (rx, rsc), ri, rw, lst, h, ev = res[r]
        got = {
            "layout.num_tokens_per_rank": lays[r][0], "layout.num_tokens_per_rdma_rank": lays[r][1],
            "layout.num_tokens_per_expert": lays[r][2], "layout.is_token_in_rank": lays[r][3],
            "dispatch.recv_x": rx, "dispatch.recv_x_scales": rsc, "dispatch.recv_topk_idx": ri,
            "dispatch.recv_topk_weights": rw,
            "handle.rank_prefix_matrix": h[0], "handle.channel_prefix_matrix": h[1],
            "handle.recv_channel_prefix_matrix": h[2], "handle.recv_src_idx": h[3],
            "handle.is_token_in_rank": h[4], "handle.send_head": h[5],
            "cached.recv_x": cached[r][0][0], "cached.recv_x_scales": cached[r][0][1],
            "combine.combined_x": comb[r][0], "combine.combined_topk_weights": comb[r][1],
        }
        assert set(got) == set(_DEEPEP_NORMAL)
        for name, spec in _DEEPEP_NORMAL.items():
            _check_entry(name, got[name], spec, dims,
                         dict(dtypes, x=torch.bfloat16) if name.startswith("combine") else dtypes)
        assert len(h) == 6 and isinstance(lst, list) and (lst == [] if worst else len(lst) == E // R)
        assert cached[r][1:5] == (None, None, None, None) and isinstance(ev, triton_ep.EventOverlap)
        # values DeepEP gives with one channel: channel_prefix_matrix[r][C-1] is the tokens sent to r
        # (csrc/kernels/intranode.cu:102-110); recv_channel_prefix_matrix[s][c] is where channel c starts
        # within source s's rows (intranode.cu:307, :422): 0 with one channel
        assert torch.equal(h[1][:, 0], lays[r][0]), (h[1], lays[r][0])
        assert (h[2] == 0).all(), h[2]
        # send_head: the index of token t among the rows sent to rank j (DeepEP's channel tail index with
        # one channel, intranode.cu:345), -1 where not sent
        sent = h[4].to(torch.int32)
        assert torch.equal(h[5], torch.where(h[4], sent.cumsum(0, dtype=torch.int32) - 1, -1))
    # routed by is_token_in_rank alone (no topk_idx: send positions from torch, not the layout kernel)
    plain = raise_first(vg.call("dispatch", [dict(x=xs[r], num_tokens_per_rank=lays[r][0], is_token_in_rank=lays[r][3],
                                                  num_tokens_per_expert=lays[r][2]) for r in range(R)]))
    for r in range(R):
        h = plain[r][4]
        assert plain[r][1] is None and plain[r][2] is None
        assert [(t.dtype, tuple(t.shape)) for t in h] == [(v.dtype, tuple(v.shape)) for v in res[r][4]][:3] + [
            (torch.int32, (plain[r][0][0].shape[0],)), (torch.bool, (Ts[r], R)), (torch.int32, (Ts[r], R))]
        assert torch.equal(h[5], res[r][4][5]) and torch.equal(h[1], res[r][4][1])


_DEEPEP_LOW_LATENCY = {
    # low_latency_dispatch: csrc/deep_ep.cpp:1588-1611, returned at :1667; handle at deep_ep/buffer.py:610
    "recv_x": ("x", "El,RN,H"),
    "recv_x_scales": ("sc", "El,RN,S"),         # column-major in the last two dims (torch::transpose, :1611)
    "recv_count": ("int32", "El"),
    "handle.src_info": ("int32", "El,RN"),
    "handle.layout_range": ("int64", "El,R"),
    # low_latency_combine: csrc/deep_ep.cpp:1740 (x.options(): bf16)
    "combined_x": ("bfloat16", "T,H"),
}


def ll_dtypes_rank(rank, world, cases):
    """Rank body: low-latency dispatch and combine per (use_fp8, use_ue8m0); returns per case every
    result's (dtype name, shape, stride) and the handle's Python entries."""
    R, E, K, H, N = world, 2 * world, 2, 512, 8
    xs, idxs, ws = make_inputs(4, E, K, H, [5 + r for r in range(R)])
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, timeout_s=60)

    def d(t):
        return None if t is None else (str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))
    out = []
    try:
        for use_fp8, ue8m0 in cases:
            rx, cnt, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=use_fp8,
                                                             round_scale=ue8m0, use_ue8m0=ue8m0)
            x, sc = rx if use_fp8 else (rx, None)
            y = torch.zeros(x.shape, dtype=torch.bfloat16)
            comb, _, _ = buf.low_latency_combine(y, idxs[rank], ws[rank], handle)
            out.append(dict(recv_x=d(x), recv_x_scales=d(sc), recv_count=d(cnt), combined_x=d(comb),
                            **{"handle.src_info": d(handle[0]), "handle.layout_range": d(handle[1])},
                            rest=tuple(handle[2:]), T=xs[rank].shape[0]))
    finally:
        buf.destroy()
    return out


@pytest.mark.multiprocess
def test_low_latency_results_have_deepeps_dtype_and_shape():
    cases = [(False, False), (True, False), (True, True)]
    R, E, H, N = 2, 4, 512, 8
    out = run_ranks(ll_dtypes_rank, R, cases)
    bad = [o for o in out if hasattr(o, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    for rank, per_case in enumerate(out):
        for (use_fp8, ue8m0), got in zip(cases, per_case):
            dims = dict(El=E // R, RN=R * N, H=H, R=R, T=got["T"], S=H // 512 if ue8m0 else H // 128)
            types = dict(x="float8_e4m3fn" if use_fp8 else "bfloat16", sc="int32" if ue8m0 else "float32")
            for name, (dtype, shape) in _DEEPEP_LOW_LATENCY.items():
                if name == "recv_x_scales" and not use_fp8:
                    assert got[name] is None
                    continue
                dt, sh, st = got[name]
                assert dt == types.get(dtype, dtype), (name, dt)
                assert sh == tuple(dims[k] for k in shape.split(",")), (name, sh)
                if name == "recv_x_scales":
                    assert st[1] == 1 and st[2] == R * N, f"scales not column-major: stride {st}"
            assert got["rest"] == (N, H, E)
