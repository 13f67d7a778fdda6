"""Issue 12, connection parameters checked on the emulated fabric: which GID a port sends from, the QoS
fields (traffic class, service level) every QP's address carries, the path MTU against the ports' active
MTUs, and link-local GIDs that reach only their own L2 segment."""
from __future__ import annotations

import errno
import warnings

import numpy as np
import pytest

from triton_ep.transport import emulated as em
from triton_ep.transport import verbs, verbs_discovery
from triton_ep.transport.rdma import WRITE, Op, RdmaCompletionError

from tests.cases.rdma import connect_pair

#: The table of issue 12: IPv6 entries only, link-local at index 0, a routable address at index 1.
LINK_LOCAL, ROUTABLE = "fe80::200:ff:fe00:1", "2001:db8::1"


def ipv6_port(host: int, **kw) -> em.PortSpec:
    """A RoCE port whose GID table is [link-local RoCEv2, routable 2001:db8::<host+1> RoCEv2]."""
    return em.PortSpec(gids=[(f"fe80::200:ff:fe00:{host + 1}", "RoCEv2"), (f"2001:db8::{host + 1}", "RoCEv2")], **kw)


def two_hosts(port0: em.PortSpec, port1: em.PortSpec) -> em.Fabric:
    return em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [port0]), em.DeviceSpec("mlx5_1", [port1])]))


def pair(fab: em.Fabric, **kw):
    kw.setdefault("num_qps_per_peer", 2)
    kw.setdefault("timeout_s", 10.0)
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0"]), **kw)
    try:
        t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_1"]), **kw)
    except BaseException:
        t0.close()
        raise
    return t0, t1


def test_emulated_ipv6_only_table_sends_from_the_routable_gid():
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [em.PortSpec(gids=[(LINK_LOCAL, "RoCEv2"),
                                                                               (ROUTABLE, "RoCEv2")])])]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a routable GID exists: no link-local warning
        (dev,) = verbs.discover(fab.pyverbs())
        assert [(g.index, g.gid, g.type) for g in dev.ports[0].gids] == [
            (0, "fe80:0000:0000:0000:0200:00ff:fe00:0001", "RoCEv2"),
            (1, "2001:0db8:0000:0000:0000:0000:0000:0001", "RoCEv2")]
        assert dev.ports[0].best_gid().index == 1
        (port,) = verbs.ports_of([dev])
        assert (port.gid_index, port.gid) == (1, "2001:0db8:0000:0000:0000:0000:0000:0001")


def test_only_link_local_gids_warn_and_still_connect_on_one_segment():
    ll = lambda h: em.PortSpec(gids=[(f"fe80::{h}", "RoCEv2")], segment="rack-a")  # noqa: E731
    with pytest.warns(UserWarning, match="only a link-local GID"):
        t0, t1 = pair(two_hosts(ll(1), ll(2)), num_qps_per_peer=1)
    try:
        connect_pair(t0, t1)
        src, dst = t0.register(64), t1.register(64)
        src.view()[:] = 7
        t0.post(1, 0, [Op(WRITE, src, 0, 64, dst.remote(), 0, signaled=True)])
        assert all(c.ok for c in t0.wait(lambda cs: len(cs) >= 1, stage="same segment"))
        assert (dst.view() == 7).all()
    finally:
        t0.close()
        t1.close()


def test_qos_arguments_reach_every_qps_address(monkeypatch):
    monkeypatch.delenv("TRITON_EP_RDMA_TC", raising=False)
    monkeypatch.delenv("TRITON_EP_RDMA_SL", raising=False)
    t0, t1 = pair(em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0"), em.DeviceSpec("mlx5_1")])),
                  traffic_class=106, service_level=3)
    try:
        connect_pair(t0, t1)
        assert t0.qos == verbs.QoS(106, 3, ("argument", "argument"))
        assert [(q.qp.ah.traffic_class, q.qp.ah.sl, q.qp.ah.is_global) for q in t0.qps.values()] == [(106, 3, 1)] * 2
        assert [(q.qp.ah.traffic_class, q.qp.ah.sl) for q in t1.qps.values()] == [(106, 3)] * 2
    finally:
        t0.close()
        t1.close()


def test_qos_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_EP_RDMA_TC", "0x68")
    monkeypatch.setenv("TRITON_EP_RDMA_SL", "5")
    t0, t1 = pair(em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0"), em.DeviceSpec("mlx5_1")])), num_qps_per_peer=1)
    try:
        connect_pair(t0, t1)
        assert t0.qos == verbs.QoS(104, 5, ("TRITON_EP_RDMA_TC", "TRITON_EP_RDMA_SL"))
        ah = t1.qps[(0, 0)].qp.ah
        assert (ah.traffic_class, ah.sl) == (104, 5)
    finally:
        t0.close()
        t1.close()
    assert verbs.QoS.resolve(7, None).sources == ("argument", "TRITON_EP_RDMA_SL")   # an argument beats the env


@pytest.mark.parametrize("var,text", [("TRITON_EP_RDMA_TC", "256"), ("TRITON_EP_RDMA_TC", "af41"),
                                      ("TRITON_EP_RDMA_SL", "16"), ("TRITON_EP_RDMA_SL", "-1")])
def test_bad_qos_environment_is_a_value_error_naming_the_variable(monkeypatch, var, text):
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=f"^{var}='{text}': the RDMA .* must be an integer in 0..(255|15)$"):
        verbs.VerbsTransport(0, 2, api=em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0")])).pyverbs())


@pytest.mark.parametrize("kw", [dict(traffic_class=256), dict(traffic_class=-1), dict(service_level=16),
                                dict(service_level=1.5), dict(service_level=True)])
def test_bad_qos_arguments_are_value_errors(kw):
    with pytest.raises(ValueError, match="must be an integer in 0..(255|15), got"):
        verbs.VerbsTransport(0, 2, api=em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0")])).pyverbs(), **kw)


def raw_qp(fab: em.Fabric, device: str):
    """A raw emulated QP on ``device`` port 1 (closed by the caller) and its QPInfo (GID index 3)."""
    api = fab.pyverbs()
    ctx = api.Context(name=device)
    pd, cq = api.PD(ctx), api.CQ(ctx, 16, None, None, 0)
    qp = api.QP(pd, verbs.build_init_attr(api, cq, 4, 4))
    mtu = ctx.query_port(1).active_mtu
    from triton_ep.transport.rdma import QPInfo
    return api, qp, QPInfo(qp.qp_num, 1, ctx.query_gid(1, 3).gid, 3, 0, mtu, 1, device)


def test_emulated_rtr_rejects_bad_qos_fields():
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0"), em.DeviceSpec("mlx5_1")]))
    api, qa, ia = raw_qp(fab, "mlx5_0")
    _, qb, ib = raw_qp(fab, "mlx5_1")
    try:
        for field, value in (("sl", 16), ("traffic_class", 256)):
            attr = verbs.build_qp_attr(api, port=1, local=ia, remote=ib)
            setattr(attr.ah_attr, field, value)
            with pytest.raises(api.PyverbsRDMAError) as ei:
                qa.to_rtr(attr)
            assert ei.value.error_code == errno.EINVAL
        with pytest.raises(ValueError):
            verbs.build_qp_attr(api, port=1, local=ia, remote=ib, service_level=16)
    finally:
        qa.close()
        qb.close()


def test_rtr_path_mtu_above_either_active_mtu_is_einval_and_the_transport_takes_the_smaller():
    fab = two_hosts(em.PortSpec(), em.PortSpec(active_mtu=1024))
    api, qa, ia = raw_qp(fab, "mlx5_0")
    _, qb, ib = raw_qp(fab, "mlx5_1")
    e = api.enums
    try:
        assert (ia.mtu, ib.mtu) == (e.IBV_MTU_4096, e.IBV_MTU_1024)
        for q, mine, other in ((qa, ia, ib), (qb, ib, ia)):     # 4096 is above the remote / the local port's
            attr = verbs.build_qp_attr(api, port=1, local=mine, remote=other)
            attr.path_mtu = e.IBV_MTU_4096
            with pytest.raises(api.PyverbsRDMAError, match="path_mtu 5 above the active MTU") as ei:
                q.to_rtr(attr)
            assert ei.value.error_code == errno.EINVAL
        attr = verbs.build_qp_attr(api, port=1, local=ia, remote=ib)
        assert attr.path_mtu == e.IBV_MTU_1024
        qa.to_rtr(attr)
        assert qa.mtu == e.IBV_MTU_1024
    finally:
        qa.close()
        qb.close()
    with pytest.raises(ValueError, match="active_mtu 1000"):
        em.mtu_code(em.PortSpec(active_mtu=1000))


def old_pick_gid(gids):
    """The GID choice before issue 12: RoCEv2 IPv4-mapped, else any RoCEv2 (lowest index), else the first."""
    nonzero = [g for g in gids if g.gid.strip("0:")]
    for cond in (lambda g: g.type == "RoCEv2" and g.ipv4_mapped, lambda g: g.type == "RoCEv2", lambda g: True):
        for g in nonzero:
            if cond(g):
                return g
    return None


def write_once(t0, t1):
    """One signalled 4 KiB WRITE from rank 0 to rank 1 on QP 0; returns (source, destination) regions."""
    src, dst = t0.register(4096), t1.register(4096)
    src.view()[:] = np.arange(4096) % 251
    t0.post(1, 0, [Op(WRITE, src, 0, 4096, dst.remote(), 0, signaled=True)])
    return src, dst


def test_link_local_gid_across_segments_is_retry_exceeded_and_the_routable_choice_connects(monkeypatch):
    """Two hosts on different L2 segments, each port's table [fe80::..., 2001:db8::<n>].  The old choice (the
    link-local GID) connects, but its first send ends in IBV_WC_RETRY_EXC_ERR after the retry time and the QP
    goes to ERR, as on hardware; the new choice (the routable GID) delivers."""
    import time
    fab = two_hosts(ipv6_port(0), ipv6_port(1))
    monkeypatch.setattr(verbs_discovery, "pick_gid", old_pick_gid)   # (what PortInfo.best_gid calls)
    t0, t1 = pair(fab, num_qps_per_peer=1, qp_timeout=8)        # 8: 1.05 ms local ACK timeout
    try:
        assert t0.qps[(1, 0)].info.gid_index == 0
        connect_pair(t0, t1)                                      # RTR resolves no link-local neighbour
        t_post = time.monotonic()
        write_once(t0, t1)
        with pytest.raises(RdmaCompletionError) as ei:
            t0.wait(lambda cs: len(cs) >= 1, stage="across segments")
        waited = time.monotonic() - t_post
        assert ei.value.completion.status == "IBV_WC_RETRY_EXC_ERR"
        assert waited >= t0.qps[(1, 0)].qp.retry_time_s() == pytest.approx(8 * 4.096e-6 * 256)
        assert t0.qp_state(1, 0) == "ERR"
    finally:
        t0.close()
        t1.close()
    monkeypatch.undo()
    t0, t1 = pair(fab, num_qps_per_peer=1, qp_timeout=8)
    try:
        assert t0.qps[(1, 0)].info.gid_index == 1
        connect_pair(t0, t1)
        src, dst = write_once(t0, t1)
        assert all(c.ok for c in t0.wait(lambda cs: len(cs) >= 1, stage="routable"))
        assert (dst.view() == src.view()).all() and t0.qp_state(1, 0) == "RTS"
    finally:
        t0.close()
        t1.close()


def test_wrong_gid_for_the_dest_qp_is_retry_exceeded_and_flushes_the_rest():
    """The GID of a port where the destination QP does not live: packets arrive, nobody answers."""
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec(f"mlx5_{i}") for i in range(3)]))
    api, qa, ia = raw_qp(fab, "mlx5_0")
    _, qb, ib = raw_qp(fab, "mlx5_1")
    _, qc, ic = raw_qp(fab, "mlx5_2")
    e = api.enums
    try:
        import dataclasses
        attr = verbs.build_qp_attr(api, port=1, local=ia, remote=dataclasses.replace(ib, gid=ic.gid), timeout=4)
        qa.to_rts(attr)
        mr = api.MR(qa.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
        for i in range(2):
            qa.post_send(verbs.build_send_wr(api, WRITE, i, api.SGE(mr.buf, 8, mr.lkey), 1, 0, signaled=False))
        wcs = []
        import time
        deadline = time.monotonic() + 5
        while len(wcs) < 2 and time.monotonic() < deadline:
            wcs += qa.scq.poll(4)[1]
        assert [(w.wr_id, w.status) for w in wcs] == [(0, e.IBV_WC_RETRY_EXC_ERR), (1, e.IBV_WC_WR_FLUSH_ERR)]
        assert qa.qp_state == e.IBV_QPS_ERR
        mr.close()
    finally:
        for q in (qa, qb, qc):
            q.close()


def test_peers_limits_the_qps_to_those_ranks_and_bad_peers_are_value_errors():
    """``peers``: QPs to those ranks only (rank 0 of 3 with peers [2]: none to rank 1; a generator works as
    a list, numpy ints as ints); a peer that is this rank, outside the group or given twice is a ValueError, a non-int a
    TypeError, before any device is opened."""
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec(f"mlx5_{h}", [em.PortSpec()]) for h in range(3)]))
    t = verbs.VerbsTransport(0, 3, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=3, timeout_s=10.0, peers=[2])
    try:
        assert t.peer_ranks() == [2] and sorted(t.qps) == [(2, 0), (2, 1), (2, 2)]
        assert len(t.local_info(2)) == 3
        with pytest.raises(KeyError):
            t.local_info(1)
    finally:
        t.close()
    t = verbs.VerbsTransport(0, 3, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=1, peers=(p for p in [np.int64(2), 1]))
    try:
        assert t.peer_ranks() == [1, 2] and len(t.qps) == 2
    finally:
        t.close()
    for bad in ([0], [3], [-1, 2], [1, 1, 2]):
        with pytest.raises(ValueError, match="peers must be distinct ranks"):
            verbs.VerbsTransport(0, 3, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=1, peers=bad)
    for bad in ([1.5], ["2"], "12", [True]):
        with pytest.raises(TypeError, match="peers must be a sequence of int"):
            verbs.VerbsTransport(0, 3, api=fab.pyverbs(["mlx5_0"]), num_qps_per_peer=1, peers=bad)
