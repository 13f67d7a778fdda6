"""One conformance suite for the RDMA transport: the verbs backend over the emulated fabric (always) and over
real pyverbs (where an RDMA device exists; skipped with the reason otherwise).

Every property is a promise of the verbs spec for RC QPs (see triton_ep/transport/rdma.py)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from triton_ep.errors import EPTimeoutError
from triton_ep.transport.rdma import FETCH_ADD, WRITE, WRITE_WITH_IMM, Op, RdmaCompletionError, RdmaError


def recv_count(n):
    return lambda cs: sum(c.opcode == "recv_imm" for c in cs) >= n


def sends(n):
    return lambda cs: sum(c.opcode != "recv_imm" for c in cs) >= n


def test_write_completes_only_after_placement(make_pair):
    p = make_pair(reorder_seed=3)
    rng = np.random.default_rng(0)
    src, dst = p.t0.register(1 << 18), p.t1.register(1 << 18)
    src.view()[:] = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    for qp in range(4):
        off = qp * (1 << 16)
        p.t0.post(1, qp, [Op(WRITE, src, off, 1 << 16, dst.remote(), off, signaled=True, wr_id=100 + qp)])
    got = {}
    for c in p.t0.wait(sends(4), stage="writes"):
        # at the moment a send completion is seen, that write's bytes are already in place
        off = (c.wr_id - 100) * (1 << 16)
        got[c.wr_id] = bool((dst.view()[off:off + (1 << 16)] == src.view()[off:off + (1 << 16)]).all())
        assert c.opcode == "write" and c.peer == 1 and c.qp == c.wr_id - 100
    assert got == {100: True, 101: True, 102: True, 103: True}


def test_order_within_one_qp(make_pair):
    """Writes of one QP land in order: the last of many writes to one slot wins, and the data of earlier
    writes is visible when the WRITE_WITH_IMM behind them completes at the receiver (no fence)."""
    p = make_pair(reorder_seed=11)
    src, dst = p.t0.register(1 << 16), p.t1.register(1 << 16)
    v = src.view()
    ops = []
    for i in range(40):
        v[8 * i:8 * i + 8] = np.frombuffer(np.uint64(i + 1).tobytes(), np.uint8)
        ops.append(Op(WRITE, src, 8 * i, 8, dst.remote(), 0))          # all to slot 0
        ops.append(Op(WRITE, src, 8 * i, 8, dst.remote(), 1024 + 8 * i))
    ops.append(Op(WRITE_WITH_IMM, src, 0, 0, dst.remote(), 0, imm=0xABCD, signaled=True))
    p.t0.post(1, 2, ops)
    comps = p.t1.wait(recv_count(1), stage="imm")
    # read the memory at the instant the receive completion is seen
    slot0 = int(dst.view()[0:8].view(np.uint64)[0])
    body = dst.view()[1024:1024 + 320].view(np.uint64).tolist()
    assert slot0 == 40
    assert body == list(range(1, 41))
    assert [c.imm for c in comps if c.opcode == "recv_imm"] == [0xABCD]


def test_no_order_across_qps(make_pair):
    """With the seeded reorder option, requests on different QPs overtake each other, while each QP stays
    in order.  Hardware may or may not show it, so this is asserted on the emulator only."""
    if make_pair.backend != "emulated":
        pytest.skip("ordering across QPs is unspecified; only the emulator can be made to reorder")
    p = make_pair(reorder_seed=5, reorder_max_s=0.1)   # holds long enough that a loaded CPU posts all first
    src, dst = p.t0.register(4096), p.t1.register(4096)
    eng = p.fabric.engine
    eng.placements.clear()
    posted = []   # (qp index, seq on that qp)
    for k in range(8):
        for qp in range(4):
            p.t0.post(1, qp, [Op(WRITE, src, 0, 64, dst.remote(), 64 * qp, signaled=True)])
            posted.append((qp, k))
    p.t0.wait(sends(32), stage="writes")
    qpn_to_idx = {p.t1.qps[(0, i)].info.qp_num: i for i in range(4)}
    placed = [(qpn_to_idx[qpn], seq) for qpn, seq in eng.placements if qpn in qpn_to_idx]
    assert len(placed) == 32
    for qp in range(4):
        seqs = [s for q, s in placed if q == qp]
        assert seqs == sorted(seqs), f"QP {qp} placed out of order: {seqs}"
    assert [q for q, _ in placed] != [q for q, _ in posted], "seeded reordering did not reorder across QPs"


def test_write_with_imm_consumes_posted_receive(make_pair):
    p = make_pair()
    src, dst = p.t0.register(8192), p.t1.register(8192)
    src.view()[:] = 7
    for qp in range(4):
        p.t0.post(1, qp, [Op(WRITE_WITH_IMM, src, 0, 100 * (qp + 1), dst.remote(), 0, imm=qp + 10, signaled=True)])
    comps = [c for c in p.t1.wait(recv_count(4), stage="imm") if c.opcode == "recv_imm"]
    assert sorted((c.qp, c.imm, c.byte_len, c.peer) for c in comps) == \
        [(q, q + 10, 100 * (q + 1), 0) for q in range(4)]
    # auto-replenish keeps the receive queue full
    assert all(p.t1.qps[(0, q)].recvs_posted == p.t1.rq_depth for q in range(4))


def test_write_with_imm_without_receive_is_rnr_error(make_pair):
    p = make_pair(auto_replenish=False, rnr_retry=1, min_rnr_timer=1)
    src, dst = p.t0.register(4096), p.t1.register(4096)
    p.t0.post(1, 0, [Op(WRITE_WITH_IMM, src, 0, 64, dst.remote(), 0, imm=1, signaled=True)])
    with pytest.raises(RdmaCompletionError) as ei:
        p.t0.wait(sends(1), stage="rnr")
    err = ei.value
    assert err.status == "IBV_WC_RNR_RETRY_EXC_ERR"
    q = p.t0.qps[(1, 0)]
    assert (err.device, err.port, err.qp_num, err.peer) == (q.port.device, q.port.port, q.info.qp_num, 1)
    assert f"QP {q.info.qp_num} peer 1" in str(err) and q.port.device in str(err)
    assert p.t0.qp_state(1, 0) == "ERR"


def test_receive_posted_during_rnr_retries_succeeds(make_pair):
    p = make_pair(auto_replenish=False, rnr_retry=7, min_rnr_timer=1)
    src, dst = p.t0.register(4096), p.t1.register(4096)
    src.view()[:64] = 9
    p.t0.post(1, 1, [Op(WRITE_WITH_IMM, src, 0, 64, dst.remote(), 0, imm=5, signaled=True)])
    time.sleep(0.05)
    assert not any(c.opcode == "write_imm" for c in p.t0.poll()), "completed before any receive was posted"
    p.t1.post_recv(0, 1, 1)
    assert [c.imm for c in p.t1.wait(recv_count(1), stage="late recv")] == [5]
    p.t0.wait(sends(1), stage="send")
    assert (dst.view()[:64] == 9).all()


def test_fetch_add_is_atomic_across_qps(make_pair):
    p = make_pair()
    res, ctr = p.t0.register(8 * 64), p.t1.register(64)
    ops_per_qp, adds = 8, [3, 5, 7, 11]
    for k in range(ops_per_qp):
        for qp in range(4):
            slot = 8 * (k * 4 + qp)
            p.t0.post(1, qp, [Op(FETCH_ADD, res, slot, 8, ctr.remote(), 8, add=adds[qp], signaled=True)])
    p.t0.wait(sends(32), stage="atomics")
    total = ops_per_qp * sum(adds)
    assert int(ctr.view()[8:16].view(np.uint64)[0]) == total
    olds = sorted(res.view().view(np.uint64).tolist()[:32])
    assert olds[0] == 0 and len(set(olds)) == 32 and max(olds) < total   # each saw a distinct prior value


def test_fetch_add_misaligned_is_invalid_request(make_pair):
    p = make_pair()
    res, ctr = p.t0.register(64), p.t1.register(64)
    p.t0.post(1, 0, [Op(FETCH_ADD, res, 0, 8, ctr.remote(), 4, add=1, signaled=True)])
    with pytest.raises(RdmaCompletionError) as ei:
        p.t0.wait(sends(1), stage="atomic")
    assert ei.value.status == "IBV_WC_REM_INV_REQ_ERR"
    assert int(ctr.view()[0:16].view(np.uint64).sum()) == 0


def test_bad_rkey_is_remote_access_error_then_flush(make_pair):
    """Remote access error moves the QP to ERR; requests posted after complete as flushed; other QPs work."""
    p = make_pair()
    src, dst = p.t0.register(4096), p.t1.register(4096)
    src.view()[:] = 1
    bogus = type(dst.remote())(dst.addr, dst.length, tuple(k ^ 0x5A5A for k in dst.rkeys))
    p.t0.post(1, 0, [Op(WRITE, src, 0, 64, bogus, 0, signaled=False)])
    with pytest.raises(RdmaCompletionError) as ei:
        p.t0.wait(sends(1), stage="bad rkey")
    assert ei.value.status == "IBV_WC_REM_ACCESS_ERR" and ei.value.completion.qp == 0   # unsignalled: still reported
    assert p.t0.qp_state(1, 0) == "ERR"
    assert not dst.view().any()
    p.t0.post(1, 0, [Op(WRITE, src, 0, 64, dst.remote(), 0, signaled=True, wr_id=77)])
    flushed = p.t0.wait(sends(1), stage="flush", raise_on_error=False)
    assert [(c.wr_id, c.status) for c in flushed] == [(77, "IBV_WC_WR_FLUSH_ERR")]
    p.t0.post(1, 1, [Op(WRITE, src, 0, 64, dst.remote(), 0, signaled=True)])
    assert all(c.ok for c in p.t0.wait(sends(1), stage="other qp"))
    assert (dst.view()[:64] == 1).all()


def test_out_of_bounds_write_is_remote_access_error(make_pair):
    p = make_pair()
    src, dst = p.t0.register(8192), p.t1.register(4096)
    guard = p.t1.register(4096)
    src.view()[:] = 3
    p.t0.post(1, 2, [Op(WRITE, src, 0, 128, dst.remote(), 4096 - 64, signaled=True)])
    with pytest.raises(RdmaCompletionError) as ei:
        p.t0.wait(sends(1), stage="oob")
    assert ei.value.status == "IBV_WC_REM_ACCESS_ERR"
    assert not dst.view().any() and not guard.view().any()
    assert p.t0.qp_state(1, 2) == "ERR"


def test_selective_signalling_with_full_send_queue(make_pair):
    """300 unsignalled writes through a send queue of 8: the transport adds signals and waits for space, the
    user sees only the completions it asked for, and every byte arrives."""
    p = make_pair(sq_depth=8)
    src, dst = p.t0.register(300 * 16), p.t1.register(300 * 16)
    src.view()[:] = np.arange(300 * 16) % 253
    for i in range(0, 300, 3):
        p.t0.post(1, 3, [Op(WRITE, src, 16 * j, 16, dst.remote(), 16 * j) for j in range(i, i + 3)])
        assert len(p.t0.qps[(1, 3)].inflight) <= 8
    p.t0.post(1, 3, [Op(WRITE, src, 0, 16, dst.remote(), 0, signaled=True, wr_id=999)])
    comps = p.t0.wait(sends(1), stage="last")
    assert [c.wr_id for c in comps] == [999]
    assert (dst.view() == src.view()).all()
    # a few unsignalled requests in flight, then a chain longer than the whole queue: split, never stuck
    src.view()[:] = 77
    p.t0.post(1, 3, [Op(WRITE, src, 16 * j, 16, dst.remote(), 16 * j) for j in range(3)])
    p.t0.post(1, 3, [Op(WRITE, src, 16 * j, 16, dst.remote(), 16 * j) for j in range(3, 300)]
              + [Op(WRITE, src, 0, 16, dst.remote(), 0, signaled=True, wr_id=1000)])
    assert [c.wr_id for c in p.t0.wait(sends(1), stage="long chain")] == [1000]
    assert (dst.view() == 77).all()


def test_prepared_work_requests_post_again_with_new_lengths_and_immediates(make_pair):
    """Work requests built once (``prepare``) and posted many times (``post_prepared``): each post writes exactly the
    length it names (the bytes past it keep their old value), carries its own immediate and ``wr_id``, surfaces only
    the completions asked for; a key named twice in one call and calls longer than the send queue (8) work; a chain
    ends where the call ends (nothing posted before is posted again)."""
    p = make_pair(sq_depth=8)
    S, C = 3, 256
    src, dst = p.t0.register(S * C), p.t1.register(S * C)
    dst.view()[:] = 0xEE
    for k in range(S):
        p.t0.prepare(1, 2, k, Op(WRITE_WITH_IMM, src, k * C, C, dst.remote(), k * C))
    p.t0.prepare(1, 2, "word", Op(WRITE, src, 0, 8, dst.remote(), S * C - 8))
    rng = np.random.default_rng(5)
    expect = dst.view().copy()
    imms, want_ids = [], []
    for rnd in range(12):
        for i in range(int(rng.integers(1, 5))):
            k, n = int(rng.integers(0, S)), int(rng.integers(1, C + 1))
            src.view()[k * C:(k + 1) * C] = rng.integers(0, 256, C, dtype=np.uint8)
            # a slot's bytes are read when the request executes: post one request per slot at a time and wait
            sig = bool(rng.integers(0, 2))
            imm = int(rng.integers(0, 1 << 32))
            p.t0.post_prepared(1, 2, [(k, n, imm, 5000 + 10 * rnd + i, sig)])
            expect[k * C:k * C + n] = src.view()[k * C:k * C + n]
            imms.append(imm)
            want_ids += [5000 + 10 * rnd + i] if sig else []
            got = p.t1.wait(recv_count(1), stage="prepared imm")
            assert [c.imm for c in got if c.opcode == "recv_imm"] == [imm] and got[-1].byte_len == n
            assert (dst.view() == expect).all(), (rnd, i, k, n)
    # one call naming keys twice, longer than the send queue: split into chains, every request once, in order
    src.view()[:] = 9
    reqs = [(k % S, C, 700 + k, None, False) for k in range(20)] + [("word", 8, 0, 9999, True)]
    p.t0.post_prepared(1, 2, reqs)
    comps = p.t0.wait(lambda cs: any(c.wr_id == 9999 for c in cs), stage="long prepared chain")
    got = p.t1.wait(recv_count(20), stage="prepared imms")
    assert sorted(c.imm for c in got if c.opcode == "recv_imm") == list(range(700, 720))
    assert [c.imm for c in got if c.opcode == "recv_imm"] == list(range(700, 720))     # (one QP: in order)
    assert (dst.view() == 9).all()
    seen = [c.wr_id for c in comps] + [c.wr_id for c in p.t0.wait(lambda cs: True, stage="rest")]
    assert 9999 in seen and set(seen) <= set(want_ids) | {9999}
    assert len(p.t0.qps[(1, 2)].inflight) <= 8
    with pytest.raises(KeyError):
        p.t0.post_prepared(1, 2, [("never", 8, 0, None, True)])


def test_wait_times_out_naming_rank_peer_stage(make_pair):
    p = make_pair()
    with pytest.raises(EPTimeoutError) as ei:
        p.t1.wait(recv_count(1), stage="never", peer=0, timeout_s=0.2)
    assert (ei.value.rank, ei.value.peer, ei.value.stage) == (1, 0, "never")


def test_qps_spread_over_ports_and_paths(make_pair):
    p = make_pair()
    plan = p.t0.plan(1, p.t1.local_info(0))
    ports = [e.port.port for e in plan]
    assert sorted(ports) == [1, 1, 2, 2]
    if make_pair.backend == "emulated":
        paths = [p.t0.qps[(1, i)].qp.flow()[1] for i in range(4)]
        assert sorted(paths) == [0, 1, 2, 3]          # the emulator routes them on the planned paths
        assert paths == [e.path for e in plan]
        assert all(p.t0.qps[(1, i)].sport_forced for i in range(4))


def test_region_without_remote_write_refuses_writes(make_pair):
    p = make_pair()
    src = p.t0.register(4096)
    ro = p.t1.register(4096, remote_write=False, remote_atomic=False)
    assert ro.rkey == ro.rkeys[0] and ro.lkey == ro.lkeys[0]
    p.t0.post(1, 1, [Op(WRITE, src, 0, 64, ro.remote(), 0, signaled=True)])
    with pytest.raises(RdmaCompletionError) as ei:
        p.t0.wait(sends(1), stage="read-only")
    assert ei.value.status == "IBV_WC_REM_ACCESS_ERR"


def test_register_tensors_and_arrays_in_place(make_pair):
    import torch
    p = make_pair()
    src = torch.arange(256, dtype=torch.float32)
    dst = np.zeros(256, dtype=np.float32)
    rs, rd = p.t0.register(src), p.t1.register(dst)
    assert (rs.addr, rs.length, rd.addr, rd.length) == (src.data_ptr(), 1024, dst.ctypes.data, 1024)
    p.t0.post(1, 0, [Op(WRITE, rs, 16, 512, rd.remote(), 64, signaled=True)])
    p.t0.wait(sends(1), stage="tensor")
    assert dst[16:144].tolist() == list(range(4, 132)) and not dst[:16].any() and not dst[144:].any()
    with pytest.raises(RdmaError, match="contiguous"):
        p.t0.register(torch.zeros(8, 8).t())
