"""The network leg's kernels (triton_ep.kernels.net) without a proxy: record streams against a torch
reference, chunk contents, lengths and counters in the rings, records straddling chunks, rounds."""
import os

import pytest
import torch

from triton_ep.kernels import net
from triton_ep.kernels import flags as F
from triton_ep.protocol.records import NetRecord
from triton_ep.scheduler import RingLayout
from triton_ep.transport.signals import RingFlags


def _sources(T, row, sc, K, weights, R, per_host, seed, src_rank=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, row // 4), generator=g, dtype=torch.int64).to(torch.int32)
    scw = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, max(sc // 4, 1)), generator=g, dtype=torch.int64).to(torch.int32)
    ids = torch.randint(-1, 1 << 40, (T, max(K, 1)), generator=g)
    w = torch.randn(T, max(K, 1), generator=g)
    in_rank = torch.rand(T, R, generator=g) > 0.5
    num_hosts = R // per_host if per_host else 1
    cols = torch.randperm(R, generator=g)[:num_hosts * max(per_host, 1)].view(num_hosts, -1).to(torch.int32)
    rec = NetRecord(row, sc, K, K if weights else 0, per_host)
    src = net.Sources.of(rec, x, scw, ids.view(torch.int32), w.view(torch.int32), in_rank.view(torch.uint8), R, cols,
                         src_rank)
    return src, rec, (x, scw, ids, w, in_rank, cols)


@pytest.mark.parametrize("row,sc,K,weights,R,per_host", [
    (64, 0, 0, False, 4, 0),        # a cached dispatch's records: meta and row
    (32, 12, 3, True, 6, 3),        # odd scale words, 3 bytes of is_token_in_rank
    (16, 4, 2, False, 10, 5),       # 5 bytes of is_token_in_rank (two words)
    (128, 0, 0, True, 1, 0),        # weights without ids: a combine record's shape
])
def test_stream_matches_the_record_layout(row, sc, K, weights, R, per_host):
    """pack_linear writes each record's fields where NetRecord puts them, from the right token, and zeros
    in the padding (checked field by field, not only against the torch reference)."""
    if weights and not K:
        K = 2
    src, rec, (x, scw, ids, w, in_rank, cols) = _sources(11, row, sc, K, weights, R, per_host, seed=row + R)
    tokens = torch.tensor([4, 0, 10, 4, 7])
    host = cols.shape[0] - 1
    out = torch.full((tokens.numel() * src.rec_w,), -7, dtype=torch.int32)
    net.pack_linear(out, src, tokens, host)
    assert torch.equal(out, net.reference_stream(src, tokens, host))
    recs = out.view(torch.uint8).view(tokens.numel(), rec.nbytes)
    for i, t in enumerate(tokens.tolist()):
        r = recs[i]
        assert r[0:16].view(torch.int32).tolist() == [3, t, 0, 0]
        lo, hi = rec.span("row")
        assert torch.equal(r[lo:hi], x[t].view(torch.uint8))
        if sc:
            lo, hi = rec.span("scales")
            assert torch.equal(r[lo:hi], scw[t].view(torch.uint8)[:sc])
        if K:
            lo, hi = rec.span("ids")
            assert torch.equal(r[lo:hi].clone().view(torch.int64), ids[t])
        if rec.weights:
            lo, hi = rec.span("weights")
            assert torch.equal(r[lo:hi].clone().view(torch.float32), w[t, :K])
        if per_host:
            lo, hi = rec.span("local")
            assert torch.equal(r[lo:hi], in_rank[t, cols[host].long()].to(torch.uint8))
        assert not r[rec.span("local")[1]:].any()            # padding


def test_empty_stream_writes_nothing():
    src, rec, _ = _sources(3, 16, 0, 0, False, 2, 0, seed=1)
    out = torch.full((4,), -7, dtype=torch.int32)
    net.pack_linear(out, src, torch.zeros(0, dtype=torch.int64), 0)
    assert (out == -7).all()


@pytest.mark.parametrize("slot_bytes,slots,device", [
    (64, 2, "cpu"), (128, 3, "cpu"), (4096, 8, "cpu"),
    pytest.param(128, 3, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")]),
])
def test_rings_carry_streams_in_rounds(slot_bytes, slots, device):
    """Three hosts; this is host 1. pack_ring fills each peer's send slots with the stream's chunks (records
    straddle chunks when the chunk is small), stores their lengths and releases READY chunk by chunk; a stand-in
    for the proxy copies them to the receive ring and moves TAIL; unpack_ring reassembles every stream in
    place and releases HEAD. Chunk numbers continue from earlier traffic (first_seq). On a GPU the rings are
    pinned, device-mapped host memory and the sources device tensors."""
    H, me = 3, 1
    src, rec, _ = _sources(9, 32, 8, 2, True, 6, 2, seed=slot_bytes)
    if device == "cuda":
        src = net.Sources(*[v.cuda() if isinstance(v, torch.Tensor) else v for v in src])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lay = RingLayout(H, slots, slot_bytes)
    mem = torch.zeros(lay.nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    c, r = lay.ctrl_bytes, lay.ring_bytes
    ctrl, send, recv = mem[:c].view(torch.int64), mem[c:c + r].view(torch.int32), mem[c + r:].view(torch.int32)
    flags = RingFlags(ctrl.numpy(), me, H, slots)
    toks = [torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([0]), torch.tensor([8, 0, 5])]
    streams = [net.reference_stream(src, t, h) for h, t in enumerate(toks)]
    d = torch.device(device)
    SW = slot_bytes // 4
    first = [0, 0, 5]                  # host 2's ring already carried 5 chunks
    for h in (0, 2):
        flags.put(RingFlags.SENT, h, first[h])
        flags.put(RingFlags.READY, h, first[h])
        flags.put(RingFlags.TAIL, h, first[h])
        flags.put(RingFlags.HEAD, h, first[h])
    tokens = torch.cat(toks).to(d)
    tok_start = torch.tensor([0, 8, 9], device=d)
    n_words = torch.tensor([s.numel() for s in streams], device=d)
    fseq = torch.tensor(first, device=d)
    out = torch.full((int(n_words.sum()),), -7, dtype=torch.int32, device=d)
    out_start = torch.tensor([0, int(n_words[0]), int(n_words[0] + n_words[1])], device=d)
    nch = [-(-int(n) // SW) for n in n_words]
    rounds = -(-max(nch[0], nch[2]) // slots)
    for i in range(rounds):
        net.pack_ring(ctrl, send, src, tokens, tok_start, n_words, fseq, i * slots, (i + 1) * slots, me, H, slots,
                      slot_bytes, 5.0)
        sync()
        assert flags.record() is None
        for h in (0, 2):
            lo, hi = first[h] + i * slots, first[h] + min((i + 1) * slots, nch[h])
            assert flags.get(RingFlags.READY, h) == hi
            for k in range(lo, hi):      # the stand-in proxy: check the chunk, deliver it, retire it
                c0 = (k - first[h]) * SW
                n = min(SW, streams[h].numel() - c0)
                assert flags.length(h, k) == 4 * n
                o = (h * slots + k % slots) * SW
                assert torch.equal(send[o:o + n], streams[h][c0:c0 + n]), (h, k)
                recv[o:o + n] = send[o:o + n]
            flags.put(RingFlags.SENT, h, hi)
            flags.put(RingFlags.TAIL, h, hi)
        net.unpack_ring(ctrl, recv, out, out_start, n_words, fseq, i * slots, (i + 1) * slots, me, H, slots,
                        slot_bytes, 5.0)
        sync()
        assert flags.record() is None
        for h in (0, 2):
            assert flags.get(RingFlags.HEAD, h) == first[h] + min((i + 1) * slots, nch[h])
    out = out.cpu()
    for h in (0, 2):
        lo = int(out_start[h])
        assert torch.equal(out[lo:lo + streams[h].numel()], streams[h])
    lo = int(out_start[1])
    assert (out[lo:lo + streams[1].numel()] == -7).all()       # this host's own stream never enters the rings


def test_a_full_ring_ends_in_the_error_record():
    """No chunk is ever placed at the peer (SENT stays 0) and the ring has one slot: chunk 0 goes out, the
    wait for chunk 1's slot ends at the bound (the interpreter's watchdog) with a ring error record naming
    the peer, the produce stage and the chunk; nothing after it is released."""
    from triton_ep.errors import EPTimeoutError
    from triton_ep.transport.signals import watchdog
    H, slots, slot_bytes = 2, 1, 64
    src, rec, _ = _sources(4, 64, 0, 0, False, 2, 0, seed=5)
    lay = RingLayout(H, slots, slot_bytes)
    mem = torch.zeros(lay.nbytes, dtype=torch.uint8)
    c, r = lay.ctrl_bytes, lay.ring_bytes
    ctrl, send = mem[:c].view(torch.int64), mem[c:c + r].view(torch.int32)
    flags = RingFlags(ctrl.numpy(), 0, H, slots)
    n_words = torch.tensor([0, 4 * src.rec_w])
    with watchdog(flags.w, int(F.RING_ABORT), 0.5):
        net.pack_ring(ctrl, send, src, torch.arange(4), torch.tensor([0, 0]), n_words, torch.tensor([0, 0]), 0, 4, 0,
                      H, slots, slot_bytes, 0.5)
    assert flags.get(RingFlags.READY, 1) == 1
    assert flags.record() == (int(F.E_TIMEOUT), 1, int(F.STAGE_RING_PRODUCE), 1)
    err = flags.error(0.5)
    assert isinstance(err, EPTimeoutError) and "chunk 1" in str(err), err


def test_kernels_compile_for_sm90():
    """The ring kernels compile for an H200 (sm_90) to a cubin on this CPU machine, in both forms (the host
    path's, the capture path's): the interpreter runs them untyped, so type errors of the compiled path (loop
    bounds of mixed widths, loop-carried status) would show first on a GPU."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent('''
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton_ep.kernels import net
        common = dict(ctrl="*i64", n_words="*i64", first_seq="*i64", c_lo="i32", c_hi="i32", me_host="i32", S="i32",
                      SW="i32", timeout_ns="i64")
        src = dict(x32="*i32", sc32="*i32", id32="*i32", wt32="*i32", loc8="*u8", loc_stride="i32", cols="*i32",
                   src_rank="i32", row_w="i32", sc_w="i32", id_w="i32", wt_w="i32", per_host="i32", off_row="i32",
                   off_sc="i32", off_id="i32", off_wt="i32", off_loc="i32", rec_w="i32")
        cases = []
        for dev in (False, True):      # the host path's streams, and the capture path's (headers, device counts)
            cases += [
                (net._pack_ring, dict(ctrl="*i64", send="*i32", tokens="*i64", tok_start="*i64", hdr="*i32", HW="i32",
                 status="*i32", peer_words="*i64", **{k: v for k, v in common.items() if k != "ctrl"}, **src),
                 dict(R=3, BLOCK=1024, USE_CLOCK=True, DEV=dev)),
                (net._unpack_ring, dict(ctrl="*i64", recv="*i32", out="*i32", out_start="*i64", rx_count="*i32",
                 status="*i32", HW="i32", cap_words="i64", key="i32", rec_w="i32", **{k: v for k, v in
                 common.items() if k != "ctrl"}), dict(R=3, BLOCK=1024, USE_CLOCK=True, DEV=dev)),
                (net._pack_linear, dict(out="*i32", tokens="*i64", nw="i64", count="*i64", host="i32", **src),
                 dict(BLOCK=1024, COUNTED=dev)),
            ]
        for fn, sig, consts in cases:
            names = list(fn.arg_names)
            types = {n: sig.get(n, "constexpr") for n in names}
            k = triton.compile(ASTSource(fn=fn, signature=types,
                                         constexprs={(names.index(c),): v for c, v in consts.items()}),
                               target=GPUTarget("cuda", 90, 32))
            assert "cubin" in k.asm, list(k.asm)
        print("ok")
    ''')
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode and ("ptxas" in r.stderr or "No module named 'triton.backends.nvidia'" in r.stderr):
        pytest.skip(f"Triton's CUDA backend cannot compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
