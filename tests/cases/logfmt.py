"""Rank bodies of the LogFMT combine tests (``low_latency_combine(use_logfmt=True)``; module-level, so spawned
processes can import them) and their oracle: :func:`triton_ep.reference.logfmt_round_trip` of each returned row,
then the weighted sum of the low-latency combine."""
import os
import sys
import time

import torch

import triton_ep
from tests.cases.ll import check_dispatch, expert_fn, ll_inputs
from triton_ep import reference
from triton_ep.kernels import flags as F
from triton_ep.kernels.fp8 import quantize_reference
from triton_ep.protocol.records import NET_HEADER_WORDS

#: DeepEP's accuracy bounds for a combine (its tests/test_low_latency.py), LogFMT or not: ``calc_diff`` of
#: ``x * sum(weights)`` and the combined rows under 1e-5 after a bf16 dispatch, 9e-4 after an FP8 one (it checks
#: no bound after a dispatch with ``round_scale``)
BOUND_BF16, BOUND_FP8 = 1e-5, 9e-4


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure of two tensors (its tests/utils.py): ``1 - 2 <x+1, y+1> / (|x+1|^2 + |y+1|^2)``
    in float64."""
    a, b = x.double() + 1, y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def expected_combine(x, idx, w, E, R, kind, logfmt=True):
    """The combine's oracle: ``sum_k w[t, k] * v(t, k)`` in fp32 in ascending ``k`` (one multiply, one add),
    rounded once to bf16, where ``v`` is the expert's output row (:func:`ll_cases.expert_fn`) after the LogFMT-10
    round trip (``logfmt``) or as it is; entries outside ``[0, E)`` add nothing."""
    x, idx, w = x.cpu(), idx.long().cpu(), w.cpu()
    T, H = x.shape
    acc = torch.zeros(T, H, dtype=torch.float32)
    rows = {}       # expert (or "identity") -> the values it returns for every token

    def values(e):
        key = "identity" if kind == "identity" else e
        if key not in rows:
            y = expert_fn(kind, e, x)
            rows[key] = reference.logfmt_round_trip(y) if logfmt else y.float()
        return rows[key]

    for k in range(idx.shape[1]):
        v = torch.zeros(T, H, dtype=torch.float32)
        for e in idx[:, k].unique().tolist():
            if 0 <= e < E:
                ts = (idx[:, k] == e).nonzero().flatten()
                v[ts] = values(e)[ts]
        ok = ((idx[:, k] >= 0) & (idx[:, k] < E))[:, None]
        acc = torch.where(ok, acc + v * w[:, k:k + 1], acc)
    return acc.to(torch.bfloat16)


def deepep_model(x: torch.Tensor):
    """A float64 model of DeepEP's LogFMT-10 as its kernels behave (exact ``log2`` / ``exp2`` for its
    ``lg2.approx`` / ``ex2.approx``), for comparison: per block of 128 channels ``lmax = log2(amax)``, ``lmin =
    max(log2(amin), lmax - 32)``, step ``(lmax - lmin) / 510``, code ``floor(max((log2|x| - lmin) / step + 2 -
    log2((1 + 2**step) / 2) / step, 0))``, decoded ``2 ** ((code - 1) * step + lmin)`` (0 for code 0); a group of
    1024 channels (512 where ``hidden % 1024``) stays bf16 unless every block of it has ``lmax < 0`` and ``lmin <
    lmax``. Returns ``(fp64 values [T, H], bool [T, H]: channels DeepEP codes)``."""
    xf = x.double()
    T, H = xf.shape
    group = 1024 if H % 1024 == 0 else 512
    a = xf.abs().view(T, H // 128, 128)
    amax, amin = a.amax(-1), a.amin(-1)
    lmax = torch.log2(amax)
    lmin = torch.maximum(torch.log2(amin), lmax - 32)
    coded = ((lmax < 0) & (lmin < lmax)).view(T, H // group, group // 128).all(-1)
    coded = coded.repeat_interleave(group // 128, dim=1)[..., None].expand(T, H // 128, 128)
    step = ((lmax - lmin) / 510)[..., None]
    rounding = 2 - torch.log2((1 + torch.exp2(step)) / 2) / step
    code = torch.floor(torch.clamp((torch.log2(a) - lmin[..., None]) / step + rounding, min=0))
    dec = torch.where(code == 0, torch.zeros_like(a), torch.exp2((code - 1) * step + lmin[..., None]))
    dec = torch.where(xf.view(T, H // 128, 128) < 0, -dec, dec)
    out = torch.where(coded, dec, xf.view(T, H // 128, 128))
    return out.view(T, H), coded.reshape(T, H)


def deepep_inputs(rank, R, E, K, H, T, seed=1):
    """DeepEP's test rows for a LogFMT combine (tests/test_low_latency.py): every channel ``rank - 128`` but the
    last 128, which hold the token index; normal draws times ``0.5 * u`` (u uniform in [0, 1)); normal draws times
    0.1. Routing: top-K of random scores, then some entries -1; weights |normal|. Returns ``([x...], idx, w)``."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.full((T, H), float(rank - 128), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
    xs = [x] + [(torch.randn(T, H, generator=g) * 0.5 * float(torch.rand(1, generator=g))).to(torch.bfloat16)
                for _ in range(2)] + [(torch.randn(T, H, generator=g) * 0.1).to(torch.bfloat16)]
    idx = torch.topk(torch.randn(T, E, generator=g).abs() + 1, K, dim=-1).indices
    for _ in range(max(1, T // 8)):
        idx[int(torch.randint(T, (1,), generator=g)), int(torch.randint(K, (1,), generator=g))] = -1
    return xs, idx, torch.randn(T, K, generator=g).abs()


def _records(buf, lay, T, K, rows):
    """The LogFMT records this rank's half of the last combine holds at slots ``t * K + k`` (``rows``: the
    ``(t, k)`` to read), int32 ``[len(rows), 41 * H / 128]``, read from the low-latency area after the call."""
    ll = buf._ll
    n = int(ll.ctl[int(F.L_SEQ)])
    base = lay.ctl_words + (n & 1) * lay.half_words + lay.count_words
    words = reference.logfmt_encode(torch.zeros(1, lay.hidden, dtype=torch.bfloat16)).shape[1]
    at = torch.tensor([base + (t * K + k) * lay.logfmt_row_words for t, k in rows], dtype=torch.long)
    area = ll.area.cpu()
    return area[at[:, None] + torch.arange(words)[None, :]]


def _first_slots(idx, E):
    """The ``(t, k)`` slots a combine returns rows to: each token's first entry naming each valid expert."""
    out = []
    for t in range(idx.shape[0]):
        seen = set()
        for k, e in enumerate(idx[t].tolist()):
            if 0 <= e < E and e not in seen:
                seen.add(e)
                out.append((t, k, e))
    return out


def _ll_bytes(buf) -> int:
    """Payload bytes this rank's low-latency network leg posted so far (``get_rdma_stats()["low_latency"]``)."""
    return sum(q["bytes"] for q in buf.get_rdma_stats()["low_latency"]["qps"].values())


def _bytes_after(buf, before, want, timeout_s=20.0) -> int:
    """Bytes posted since ``before``, once they reach ``want`` (the proxy counts a chunk as it posts it) or
    ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = _ll_bytes(buf) - before
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def round_trip(rank, world, forms, E=4, K=3, H=256, Ts=(6, 5), N=8, device="cpu", across_hosts=False, seed=3):
    """Dispatch (bf16 and FP8), then combine each ``form`` of ``forms`` (``"split"``, ``"hook"``, ``"one"``: one
    launch, needs ``TRITON_EP_FUSED=1`` set by the caller; the LogFMT combine and a bf16 combine of the same rows
    each): the LogFMT result is the oracle's bit for bit and within DeepEP's bound of the bf16 one; the records
    in this rank's half are the reference encoding, ``lay.logfmt_row_words`` apart. ``across_hosts``: the network
    leg's bytes for each combine, from ``get_rdma_stats()``, against the chunk sizes worked out here. Then
    ``zero_copy=True`` with LogFMT is refused (``ValueError`` on every rank) and the group recovers. Returns
    ``{"bytes": [(logfmt, bf16) per combine across hosts], "row_bytes": (logfmt, bf16)}``."""
    xs, idxs, ws = ll_inputs(seed, world, E, K, H, list(Ts))
    R, me, El = world, rank, E // world
    buf = _buffer(R, N, H, E, device)
    lay = buf._ll.layout(N, H, E)
    seen = {"bytes": [], "row_bytes": (4 * lay.logfmt_row_words, 2 * H)}
    x, idx, w = xs[me].to(device), idxs[me].to(device), ws[me].to(device)
    try:
        for use_fp8 in (False, True):
            out, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=use_fp8)
            check_dispatch(_cpu(out), count.cpu(), _cpu(handle), xs, idxs, R, E, me, use_fp8, False, False)
            rx = (out[0].float() * out[1].float().repeat_interleave(128, dim=-1)).to(torch.bfloat16) if use_fp8 \
                else out
            y = torch.stack([expert_fn("affine", me * El + le, rx[le]) for le in range(El)])
            # rows this rank returns to each source: what it received from it
            rows_from = (handle[1].cpu() & 0xFFFFFFFF).sum(0).tolist()
            xin = xs[me]
            if use_fp8 and xin.shape[0]:
                q, s = quantize_reference(xin, False)
                xin = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
            want = expected_combine(xin, idxs[me], ws[me], E, R, "affine")
            plain = expected_combine(xin, idxs[me], ws[me], E, R, "affine", logfmt=False)
            for form in forms:
                assert (form == "one") == buf._ll.one_launch(idx.shape[0]) or form == "hook", form
                got = {}
                for logfmt in (True, False):
                    before = _ll_bytes(buf) if across_hosts else 0
                    comb, _, hook = buf.low_latency_combine(y, idx, w, handle, use_logfmt=logfmt,
                                                            return_recv_hook=form == "hook")
                    if hook is not None:
                        hook()
                    got[logfmt] = comb.cpu()
                    if logfmt:
                        slots = _first_slots(idxs[me], E)
                        if slots:
                            recs = _records(buf, lay, idx.shape[0], K, [(t, k) for t, k, _ in slots])
                            rows = torch.cat([expert_fn("affine", e, xin[t:t + 1]) for t, _, e in slots])
                            assert torch.equal(recs, reference.logfmt_encode(rows)), f"records ({form})"
                    if across_hosts:
                        rw = lay.net_logfmt_row_words if logfmt else lay.net_row_words
                        remote = buf._ll.net.remote.cpu().tolist()
                        expect = sum(4 * (NET_HEADER_WORDS + rows_from[s] * rw) for s in range(R) if remote[s])
                        seen["bytes"].append((logfmt, _bytes_after(buf, before, expect), expect))
                assert torch.equal(got[True].view(torch.int16), want.view(torch.int16)), f"logfmt combine ({form})"
                assert torch.equal(got[False].view(torch.int16), plain.view(torch.int16)), f"bf16 combine ({form})"
                d = calc_diff(got[False].float(), got[True].float())
                assert d < (BOUND_FP8 if use_fp8 else BOUND_BF16), (form, use_fp8, d)
        # DeepEP refuses zero-copy with LogFMT: every rank raises ValueError before launching, and recovers
        out, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        try:
            buf.low_latency_combine(out, idx, w, handle, use_logfmt=True, zero_copy=True)
            raise AssertionError("zero_copy with use_logfmt was accepted")
        except ValueError as ex:
            assert "zero_copy" in str(ex), ex
        out, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        comb = buf.low_latency_combine(out, idx, w, handle, use_logfmt=True)[0].cpu()
        assert torch.equal(comb.view(torch.int16),
                           expected_combine(xs[me], idxs[me], ws[me], E, R, "identity").view(torch.int16))
        return seen
    finally:
        buf.destroy()


def _buffer(R, N, H, E, device, timeout_s=60):
    """A low-latency Buffer sized by the hint, on ``device`` (``"cuda"``: GPU 0, every rank on it)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    return triton_ep.Buffer(None, 0, triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                            num_qps_per_rank=E // R, timeout_s=timeout_s, device=device)


def _cpu(v):
    return tuple(_cpu(e) for e in v) if isinstance(v, tuple) else v.cpu() if isinstance(v, torch.Tensor) else v


def across_hosts(rank, world, env, case, *args):
    """Run ``case`` of this module with ``env`` set first (``TRITON_EP_RANKS_PER_HOST``, ``TRITON_EP_RDMA``,
    ``TRITON_EP_FUSED``)."""
    os.environ.update(env)
    return globals()[case](rank, world, *args)


def disagree(rank, world, N=8, H=128, E=4, K=2):
    """Rank 1 combines with LogFMT, rank 0 without: both raise ``ValueError`` naming ``use_logfmt``; the next
    call works. Returns the messages."""
    xs, idxs, ws = ll_inputs(4, world, E, K, H, [5] * world)
    buf = _buffer(world, N, H, E, "cpu", timeout_s=30)
    try:
        out, _, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
        msg = None
        try:
            buf.low_latency_combine(out, idxs[rank], ws[rank], handle, use_logfmt=rank == 1)
            buf.check()
        except ValueError as ex:
            msg = str(ex)
        out, _, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], N, E, use_fp8=False)
        comb = buf.low_latency_combine(out, idxs[rank], ws[rank], handle, use_logfmt=True)[0]
        assert torch.equal(comb.view(torch.int16),
                           expected_combine(xs[rank], idxs[rank], ws[rank], E, world, "identity").view(torch.int16))
        return msg
    finally:
        buf.destroy()


def deepep_accuracy(rank, world, E, K, H, T, device="cpu", fused=None, timeout_s=60):
    """DeepEP's LogFMT test data (:func:`deepep_inputs`), bf16 and FP8 dispatch, identity experts: the LogFMT
    combine is the oracle's bit for bit and ``calc_diff(x * sum(w), combined)`` is under DeepEP's bound. Each step's
    wall time goes to stderr as it ends (``[rank r +s] ...``: a test stopped by a timeout shows how far each rank
    got; at hidden 7168 on the 2-core CPU a LogFMT combine takes 25-55 s under the interpreter, so a CPU run there
    needs ``timeout_s`` above 60). Returns the diffs ``[(use_fp8, bf16 combine, logfmt combine)]`` of the last
    rows."""
    if fused is not None:
        os.environ["TRITON_EP_FUSED"] = fused
    t0 = time.monotonic()

    def done(what):
        print(f"[rank {rank} +{time.monotonic() - t0:.1f} s] {what}", file=sys.stderr, flush=True)

    xs, idx, w = deepep_inputs(rank, world, E, K, H, T)
    N = T
    buf = _buffer(world, N, H, E, device, timeout_s)
    done("Buffer")
    diffs = []
    try:
        for i, x in enumerate(xs):
            for use_fp8 in (False, True):
                out, _, handle, _, _ = buf.low_latency_dispatch(x.to(device), idx.to(device), N, E, use_fp8=use_fp8)
                done(f"input {i}: dispatch (use_fp8={use_fp8})")
                rx = (out[0].float() * out[1].float().repeat_interleave(128, dim=-1)).to(torch.bfloat16) \
                    if use_fp8 else out
                ref = x.float() * w.masked_fill(idx < 0, 0).sum(1, keepdim=True)
                got = []
                for logfmt in (False, True):
                    comb = buf.low_latency_combine(rx, idx.to(device), w.to(device), handle, use_logfmt=logfmt)[0].cpu()
                    done(f"input {i}: combine (use_logfmt={logfmt})")
                    assert not torch.isnan(comb).any()
                    got.append(calc_diff(ref, comb.float()))
                    if logfmt:
                        xin = x
                        if use_fp8:
                            q, s = quantize_reference(x, False)
                            xin = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
                        want = expected_combine(xin, idx, w, E, world, "identity")
                        assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "logfmt combine"
                        done(f"input {i}: the oracle's combine compared")
                    assert got[-1] < (BOUND_FP8 if use_fp8 else BOUND_BF16), (use_fp8, logfmt, got)
                diffs.append((use_fp8, *got))
        return diffs
    finally:
        buf.destroy()
