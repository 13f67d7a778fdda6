"""Limits of the emulated fabric that the transport never lets a user reach: raw send-queue and CQ depth,
state checks, fragmentation, the rate model, and two ranks in two processes over shared memory."""
from __future__ import annotations

import errno
import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import pytest

from triton_ep.transport import emulated as em
from triton_ep.transport import topology, verbs
from triton_ep.transport.rdma import WRITE, WRITE_WITH_IMM, Op, QPInfo

from tests.cases.rdma import connect_pair, dual_port_fabric


_RAW_QPS = []


@pytest.fixture(autouse=True)
def _close_raw_qps():
    """Destroy the raw QPs a test made (their rings and the emulated HCA thread go with the last one)."""
    yield
    while _RAW_QPS:
        _RAW_QPS.pop().close()


@dataclass
class RawQP:
    """One raw emulated QP (pyverbs level) on port 1 of a device: its context, QP, CQ (send and receive), a 4 KiB
    MR of the QP's PD, and the QPInfo a peer connects to (GID index 3, the port's IPv4-mapped RoCEv2 GID)."""
    ctx: Any
    qp: Any
    cq: Any
    mr: Any
    info: QPInfo


def raw_qp(api, name: str, access: int, *, sq: int = 4, cqe: int = 16, keep: Optional[List[Any]] = None) -> RawQP:
    """A :class:`RawQP` on device ``name`` of ``api`` (send queue ``sq`` deep, receive queue 4, a CQ of ``cqe``
    entries, the MR registered with ``access``); ``keep``: a list the QP joins as soon as it exists (the test's
    teardown destroys the QPs of ``_RAW_QPS``)."""
    ctx = api.Context(name=name)
    pd = api.PD(ctx)
    cq = api.CQ(ctx, cqe, None, None, 0)
    qp = api.QP(pd, verbs.build_init_attr(api, cq, sq, 4))
    if keep is not None:
        keep.append(qp)
    mr = api.MR(pd, 4096, access)
    return RawQP(ctx, qp, cq, mr, QPInfo(qp.qp_num, 1, ctx.query_gid(1, 3).gid, 3, 0, 5, 1, name))


def raw_pair(sq=4, cqe=64, **fabric_kw):
    """Two raw emulated QPs (pyverbs-level), connected to each other; returns (api, qa, qb, cqa, cqb, mra, mrb).
    The test's teardown destroys them."""
    fab = dual_port_fabric(**fabric_kw)
    api = fab.pyverbs()
    e = api.enums
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
    a, b = (raw_qp(api, name, access, sq=sq, cqe=cqe, keep=_RAW_QPS) for name in ("mlx5_0", "mlx5_1"))
    qa, cqa, mra, ia, qb, cqb, mrb, ib = a.qp, a.cq, a.mr, a.info, b.qp, b.cq, b.mr, b.info
    for q, mine, other in ((qa, ia, ib), (qb, ib, ia)):
        attr = verbs.build_qp_attr(api, port=1, local=mine, remote=other)
        q.to_rts(attr)
    return api, qa, qb, cqa, cqb, mra, mrb


def write_wr(api, mr_local, mr_remote, wr_id, signaled):
    return verbs.build_send_wr(api, WRITE, wr_id, api.SGE(mr_local.buf, 8, mr_local.lkey), mr_remote.rkey,
                               mr_remote.buf, signaled=signaled)


def poll_until(cq, n, tries=20000):
    got = []
    for _ in range(tries):
        k, wcs = cq.poll(16)
        got += wcs
        if len(got) >= n:
            return got
        import time
        time.sleep(0.0002)
    raise AssertionError(f"only {len(got)} of {n} completions")


def test_send_queue_overflow_is_enomem_until_a_signalled_completion_is_polled():
    api, qa, qb, cqa, cqb, mra, mrb = raw_pair(sq=4)
    for i in range(3):
        qa.post_send(write_wr(api, mra, mrb, i, signaled=False))
    qa.post_send(write_wr(api, mra, mrb, 3, signaled=True))
    with pytest.raises(api.PyverbsRDMAError) as ei:
        qa.post_send(write_wr(api, mra, mrb, 4, signaled=True))
    assert ei.value.error_code == errno.ENOMEM
    assert [w.wr_id for w in poll_until(cqa, 1)] == [3]     # unsignalled ones: no completion
    for i in range(3):                                       # polling the signalled one freed all 4 slots
        qa.post_send(write_wr(api, mra, mrb, 10 + i, signaled=True))
    chain = [write_wr(api, mra, mrb, 20 + i, signaled=True) for i in range(3)]
    chain[0].next_wr, chain[1].next_wr = chain[1], chain[2]
    with pytest.raises(api.PyverbsRDMAError):                # one slot left: the first of the chain is posted
        qa.post_send(chain[0])
    assert sorted(w.wr_id for w in poll_until(cqa, 4)) == [10, 11, 12, 20]


def test_cq_overrun_raises_on_poll():
    api, qa, qb, cqa, cqb, mra, mrb = raw_pair(sq=8, cqe=2)
    for i in range(3):
        qa.post_send(write_wr(api, mra, mrb, i, signaled=True))
    import time
    deadline = time.monotonic() + 10
    while qa.outstanding and time.monotonic() < deadline:   # all three acknowledged before anyone polls
        time.sleep(0.001)
    assert not qa.outstanding
    with pytest.raises(api.PyverbsRDMAError, match="overrun"):
        poll_until(cqa, 3)


def test_post_before_rts_and_bad_transitions_fail():
    fab = dual_port_fabric()
    api = fab.pyverbs()
    ctx = api.Context(name="mlx5_0")
    pd, cq = api.PD(ctx), api.CQ(ctx, 8, None, None, 0)
    qp = api.QP(pd, verbs.build_init_attr(api, cq, 4, 4))
    _RAW_QPS.append(qp)
    mr = api.MR(pd, 64, api.enums.IBV_ACCESS_LOCAL_WRITE)
    with pytest.raises(api.PyverbsRDMAError) as ei:
        qp.post_send(write_wr(api, mr, mr, 1, True))
    assert ei.value.error_code == errno.EINVAL
    with pytest.raises(api.PyverbsRDMAError):
        qp.post_recv(api.RecvWR(wr_id=1, num_sge=1, sg=[api.SGE(mr.buf, 8, mr.lkey)]))   # RESET
    attr = api.QPAttr()
    attr.port_num = 3                                            # the device has 2 ports
    with pytest.raises(api.PyverbsRDMAError):
        qp.to_init(attr)
    with pytest.raises(api.PyverbsUserError):
        api.SendWR(wr_id=1, num_sge=0, sg=None)
    with pytest.raises(api.PyverbsRDMAError):
        api.Context(name="mlx5_9")


def test_write_larger_than_ring_is_fragmented_in_order():
    fab = dual_port_fabric(ring_bytes=1 << 16)
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=1, timeout_s=20)
    t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_1"]), num_qps_per_peer=1, timeout_s=20)
    try:
        connect_pair(t0, t1)
        n = 1 << 20
        src, dst = t0.register(n), t1.register(n)
        src.view()[:] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        t0.post(1, 0, [Op(WRITE_WITH_IMM, src, 0, n, dst.remote(), 0, imm=1, signaled=True)])
        t1.wait(lambda cs: len(cs) >= 1, stage="big")
        assert (dst.view() == src.view()).all()
    finally:
        t0.close()
        t1.close()


def test_rate_model_matches_analytic_prediction():
    """8 equal streams, 2 ports x 4 paths: the virtual makespan equals bytes / bottleneck bandwidth."""
    m = em.RateModel()
    port_bw, path_bw, chunk, per_qp = 50e9, 25e9, 1 << 20, 16
    for k in range(per_qp):
        for q in range(8):
            m.charge(("qp", q), [(("tx", q % 2), port_bw), (("path", q % 4), path_bw), (("rx", q % 2), port_bw)], chunk)
    total = 8 * per_qp * chunk
    predicted = max(total / 2 / port_bw, total / 4 / path_bw)
    assert m.makespan() == pytest.approx(predicted, rel=0.02)
    m.reset()
    for k in range(per_qp):
        m.charge(("qp", 0), [(("tx", 0), port_bw), (("path", 0), path_bw), (("rx", 0), port_bw)], chunk)
    assert m.makespan() == pytest.approx(per_qp * chunk / path_bw, rel=1e-9)


def _rank_main(rank, fabric, init_file, q):
    """One rank of the two-process test: torch.distributed (gloo) exchange, then RDMA over the fabric."""
    try:
        import torch.distributed as dist
        from triton_ep.transport import rdma
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        t = verbs.VerbsTransport(rank, 2, api=fabric.pyverbs([f"mlx5_{rank}"]), num_qps_per_peer=2,
                                 n_paths=4, path_hash=topology.emulator_path_hash, timeout_s=30)
        peer = 1 - rank
        t.connect(peer, rdma.exchange_info({peer: t.local_info(peer)})[peer])
        buf = t.register(4096)
        regions = rdma.exchange_regions(buf.remote())
        dist.barrier()
        if rank == 0:
            buf.view()[:256] = np.arange(256, dtype=np.uint8)
            t.post(1, 1, [Op(WRITE, buf, 0, 256, regions[1], 512),
                          Op(WRITE_WITH_IMM, buf, 0, 0, regions[1], 0, imm=42, signaled=True)])
            t.wait(lambda cs: any(c.opcode == "write_imm" for c in cs), stage="mp write")
        else:
            cs = t.wait(lambda cs: any(c.opcode == "recv_imm" for c in cs), stage="mp recv", peer=0)
            ok = bool((buf.view()[512:768] == np.arange(256, dtype=np.uint8)).all())
            q.put(("recv", [c.imm for c in cs if c.opcode == "recv_imm"], ok, os.getpid()))
        dist.barrier()
        t.close()
        dist.destroy_process_group()
        q.put(("done", rank))
    except BaseException as ex:  # report to the parent rather than hang it
        q.put(("error", rank, repr(ex)))


@pytest.mark.multiprocess
def test_two_processes_over_shared_memory(tmp_path):
    fab = dual_port_fabric()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, fab, str(tmp_path / "init"), q)) for r in range(2)]
    for p in procs:
        p.start()
    msgs = []
    try:
        while len([m for m in msgs if m[0] in ("done", "error")]) < 2:
            msgs.append(q.get(timeout=90))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not [m for m in msgs if m[0] == "error"], msgs
    (recv,) = [m for m in msgs if m[0] == "recv"]
    assert recv[1] == [42] and recv[2] is True and recv[3] != os.getpid()
    assert not [f for f in os.listdir(fab.shm_dir) if fab.token in f]   # rings unlinked at close


def test_bonded_device_spreads_qps_over_lag_ports():
    spec = em.FabricSpec([em.DeviceSpec("mlx5_bond_0", [em.PortSpec(speed_gbps=200, lag_ports=2)]),
                          em.DeviceSpec("mlx5_bond_1", [em.PortSpec(speed_gbps=200, lag_ports=2)])])
    fab = em.Fabric(spec)
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_bond_0"]), num_qps_per_peer=4)
    t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_bond_1"]), num_qps_per_peer=4)
    try:
        connect_pair(t0, t1)
        assert [t0.qps[(1, i)].port.lag_port for i in range(4)] == [1, 2, 1, 2]
        assert [t0.qps[(1, i)].qp.lag_port for i in range(4)] == [1, 2, 1, 2]   # steered by modify_lag_port
        src, dst = t0.register(1 << 16), t1.register(1 << 16)
        src.view()[:] = 5
        fab.model.reset()
        for i in range(4):
            t0.post(1, i, [Op(WRITE, src, 0, 1 << 16, dst.remote(), 0, signaled=True)])
        t0.wait(lambda cs: len(cs) >= 4, stage="bond")
        assert (dst.view() == 5).all()
        tx = {k: v for k, v in fab.model.bytes.items() if k[0] == "tx"}
        assert sorted(tx.values()) == [2 << 16, 2 << 16]      # both LAG members carried half
    finally:
        t0.close()
        t1.close()


def test_dual_port_nic_as_two_devices_uses_each_devices_rkey():
    """A dual-port HCA that shows as two single-port devices: one PD per device, so a region has one rkey
    per device and each QP must use the rkey of the device its remote QP lives on."""
    spec = em.FabricSpec([em.DeviceSpec(f"mlx5_{i}") for i in range(4)])
    fab = em.Fabric(spec)
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0", "mlx5_1"]), num_qps_per_peer=4)
    t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_2", "mlx5_3"]), num_qps_per_peer=4)
    try:
        connect_pair(t0, t1)
        assert [t0.qps[(1, i)].port.device for i in range(4)] == ["mlx5_0", "mlx5_1"] * 2
        src, dst = t0.register(4096), t1.register(4096)
        assert len(dst.remote().rkeys) == 2 and dst.rkeys[0] != dst.rkeys[1]
        src.view()[:] = np.arange(4096) % 199
        for i in range(4):
            t0.post(1, i, [Op(WRITE, src, 1024 * i, 1024, dst.remote(), 1024 * i, signaled=True)])
        assert all(c.ok for c in t0.wait(lambda cs: len(cs) >= 4, stage="two devices"))
        assert (dst.view() == src.view()).all()
    finally:
        t0.close()
        t1.close()


def test_failed_transition_names_device_port_qp_and_peer():
    import dataclasses
    fab = dual_port_fabric()
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=2)
    t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_1"]), num_qps_per_peer=2)
    try:
        infos = t1.local_info(0)
        nowhere = "0000:0000:0000:0000:0000:ffff:c0a8:0001"
        with pytest.raises(verbs.RdmaError) as ei:
            t0.connect(1, [dataclasses.replace(infos[0], gid=nowhere), infos[1]])
        q = t0.qps[(1, 0)]
        assert (ei.value.device, ei.value.port, ei.value.qp_num, ei.value.peer) == ("mlx5_0", 1, q.info.qp_num, 1)
        assert "modify QP to RTR failed" in str(ei.value) and "unreachable" in str(ei.value)
        with pytest.raises(verbs.RdmaError, match="post before connect"):
            t0.post(1, 1, [Op(WRITE, t0.register(64), 0, 8, t1.register(64).remote())])
        with pytest.raises(verbs.RdmaError, match="peer sent 1 QP infos, expected 2"):
            t0.connect(1, infos[:1])
    finally:
        t0.close()
        t1.close()


@pytest.mark.parametrize("var", ["TRITON_EP_EMULATED_REORDER_S", "TRITON_EP_EMULATED_SKEW_S"])
def test_fabric_delay_variables_take_seconds_and_refuse_the_rest(var, monkeypatch):
    """The emulated fabric a Buffer builds reads its reordering and skew from the environment: a number of
    seconds lands in the spec, anything else (a word, a negative, inf, nan) is a ValueError naming the variable."""
    from triton_ep.transport.factory import emulated_fabric
    monkeypatch.setenv(var, "0.25")
    spec = emulated_fabric(["mlx5_0"], "t").spec
    assert (spec.reorder_max_s if var.endswith("REORDER_S") else spec.skew_s) == 0.25
    assert (spec.reorder_seed is not None) == var.endswith("REORDER_S")
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            emulated_fabric(["mlx5_0"], "t")


def _responder_main(fabric, q_in, q_out):
    """The responder of :func:`test_a_request_to_a_qp_whose_process_died_fails_with_retry_exceeded`: one QP and MR on
    ``mlx5_1``, connected to the requester's QP, then it waits to be killed."""
    import time
    api = fabric.pyverbs(["mlx5_1"])
    e = api.enums
    me = raw_qp(api, "mlx5_1", e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    q_out.put((me.info, me.mr.buf, me.mr.rkey))
    me.qp.to_rts(verbs.build_qp_attr(api, port=1, local=me.info, remote=q_in.get(timeout=60)))
    assert q_in.get(timeout=60) == "mapped"        # the requester mapped this QP's ring: its file may go
    fabric.unlink_rings()
    q_out.put("ready")
    time.sleep(120)


@pytest.mark.multiprocess
@pytest.mark.extended       # (20 s: a process of its own; test_dead_peer_hosts.py covers the path in the default tier)
def test_a_request_to_a_qp_whose_process_died_fails_with_retry_exceeded():
    """As a NIC drops the packets of a QP that no longer exists: once the responder's process is killed (SIGKILL),
    a WRITE to its QP completes with IBV_WC_RETRY_EXC_ERR after the requester's retry time (timeout 14,
    retry_cnt 7: 0.54 s), not at the verbs backend's bound; the QP is in ERR then. Before the kill the same
    WRITE completes. (The fabric knows from the responder's lock on its ring file, which the kernel releases.)"""
    import signal
    import time
    fab = dual_port_fabric()
    ctx_mp = mp.get_context("spawn")
    q_in, q_out = ctx_mp.Queue(), ctx_mp.Queue()
    child = ctx_mp.Process(target=_responder_main, args=(fab, q_in, q_out), daemon=True)
    child.start()
    try:
        theirs, addr, rkey = q_out.get(timeout=60)
        api = fab.pyverbs(["mlx5_0"])
        e = api.enums
        me = raw_qp(api, "mlx5_0", e.IBV_ACCESS_LOCAL_WRITE, keep=_RAW_QPS)
        qp, cq, mr = me.qp, me.cq, me.mr
        q_in.put(me.info)
        qp.to_rts(verbs.build_qp_attr(api, port=1, local=me.info, remote=theirs))
        q_in.put("mapped")
        assert q_out.get(timeout=60) == "ready"

        def write(wr_id):
            wr = verbs.build_send_wr(api, WRITE, wr_id, api.SGE(mr.buf, 8, mr.lkey), rkey, addr, signaled=True)
            qp.post_send(wr)
            t0 = time.monotonic()
            (wc,) = poll_until(cq, 1, tries=40000)
            return wc.status, time.monotonic() - t0

        assert write(1)[0] == e.IBV_WC_SUCCESS
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        status, dt = write(2)
        assert status == e.IBV_WC_RETRY_EXC_ERR, status
        assert 0.5 <= dt < 5.0, dt
        assert qp.qp_state == e.IBV_QPS_ERR
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=30)
