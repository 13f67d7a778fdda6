"""The paths of the verbs backend that need pyverbs but no device: attribute building, the enum shim, and the
clear "no RDMA device" error.  Run against real pyverbs where it imports (scripts/install_pyverbs.sh brings
Debian's python3-pyverbs into the venv) and against the emulated namespace everywhere.  Also: the script
itself says nothing when pyverbs already imports (run.sh runs it on every setup)."""
from __future__ import annotations

import enum
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from triton_ep.transport import emulated as em
from triton_ep.transport import rdma, verbs
from triton_ep.transport.rdma import QPInfo


def real_api():
    try:
        return verbs.load_pyverbs()
    except rdma.RdmaUnavailable as ex:
        pytest.skip(f"real pyverbs not importable here: {ex}")


@pytest.fixture(params=["pyverbs", "emulated"])
def api(request):
    if request.param == "pyverbs":
        return real_api()
    return em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0")])).pyverbs()


LOCAL = QPInfo(0x123, 0x4567, "0000:0000:0000:0000:0000:ffff:0a00:0101", 3, 0, 5, 1, "mlx5_0")
REMOTE = QPInfo(0x89A, 0xBCDE, "0000:0000:0000:0000:0000:ffff:0a00:0201", 3, 0, 3, 1, "mlx5_1")


def test_qp_attr_carries_rtr_and_rts_fields(api):
    a = verbs.build_qp_attr(api, port=2, local=LOCAL, remote=REMOTE, flow_label=0x1ABCDE, rnr_retry=3)
    e = verbs.enums_of(api)
    assert (a.port_num, a.dest_qp_num, a.rq_psn, a.sq_psn, a.path_mtu) == (2, 0x89A, 0xBCDE, 0x4567, 3)
    assert a.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
    assert (a.rnr_retry, a.retry_cnt, a.timeout, a.min_rnr_timer) == (3, 7, 14, 12)
    ah = a.ah_attr
    assert (ah.is_global, ah.port_num, ah.sgid_index, ah.flow_label) == (1, 2, 3, 0xABCDE)   # masked to 20 bits
    assert ah.dgid == REMOTE.gid


def test_send_wrs_of_each_kind(api):
    e = verbs.enums_of(api)
    sge = api.SGE(0x1000, 64, 7)
    w = verbs.build_send_wr(api, rdma.WRITE_WITH_IMM, 5, sge, 9, 0x2000, imm=0xFEEDBEEF, signaled=True)
    assert (w.wr_id, w.opcode, w.imm_data, w.send_flags, w.num_sge) == \
        (5, e.IBV_WR_RDMA_WRITE_WITH_IMM, 0xFEEDBEEF, e.IBV_SEND_SIGNALED, 1)
    w = verbs.build_send_wr(api, rdma.WRITE, 6, sge, 9, 0x2000)
    assert (w.opcode, w.send_flags) == (e.IBV_WR_RDMA_WRITE, 0)
    w = verbs.build_send_wr(api, rdma.FETCH_ADD, 7, sge, 9, 0x2008, add=-1)
    assert w.opcode == e.IBV_WR_ATOMIC_FETCH_AND_ADD
    init = verbs.build_init_attr(api, None, 64, 32)
    assert (init.max_send_wr, init.max_recv_wr, init.qp_type, init.sq_sig_all) == (64, 32, e.IBV_QPT_RC, 0)


def test_no_device_error_is_clear():
    api = real_api()
    try:
        devs = verbs.discover(api)
    except rdma.RdmaUnavailable as ex:
        assert str(ex).startswith("triton-ep RDMA: no RDMA device:") and "TRITON_EP_RDMA=emulated" in str(ex)
        with pytest.raises(rdma.RdmaUnavailable, match="no RDMA device"):
            verbs.VerbsTransport(0, 2, api=api)
        return
    pytest.skip(f"this host has RDMA devices: {[d.name for d in devs]}")


def test_real_enum_values_match_the_emulator():
    """The emulator's constants are libibverbs' numbers; checked against the installed pyverbs."""
    shim = verbs.enums_of(real_api())
    names = [n for n in dir(em.enums) if n.startswith("IBV_")]
    assert set(verbs.NEEDED_ENUMS) <= set(names)
    assert {n: getattr(shim, n) for n in names} == {n: getattr(em.enums, n) for n in names}
    assert [shim.name_of("", shim.values[n], verbs.WC_STATUS_NAMES) for n in verbs.WC_STATUS_NAMES] == \
        verbs.WC_STATUS_NAMES


def test_enum_shim_reads_both_layouts():
    flat = types.ModuleType("pyverbs.enums")                       # rdma-core <= 58: module-level names
    flat.IBV_WR_RDMA_WRITE, flat.IBV_QPT_RC = 0, 2

    class ibv_wr_opcode(enum.IntEnum):                             # rdma-core >= 59: only inside classes
        IBV_WR_RDMA_WRITE = 0
        IBV_WR_RDMA_WRITE_WITH_IMM = 1

    classes = types.ModuleType("pyverbs.libibverbs_enums")
    classes.ibv_wr_opcode = ibv_wr_opcode
    for mods in ([flat], [classes], [classes, flat]):
        shim = verbs.EnumShim(*mods)
        assert shim.IBV_WR_RDMA_WRITE == 0 and type(shim.IBV_WR_RDMA_WRITE) is int
    assert verbs.EnumShim(classes).IBV_WR_RDMA_WRITE_WITH_IMM == 1
    assert "enum classes" in verbs.EnumShim(classes).layouts[0] and "flat" in verbs.EnumShim(flat).layouts[0]
    with pytest.raises(AttributeError, match="IBV_QPT_RC not found in pyverbs.libibverbs_enums"):
        verbs.EnumShim(classes).IBV_QPT_RC


def test_gid_choice_prefers_roce_v2_ipv4():
    G = verbs.GidInfo
    table = [G(0, "fe80:0000:0000:0000:0200:00ff:fe00:0001", "RoCEv1"),
             G(1, "fe80:0000:0000:0000:0200:00ff:fe00:0001", "RoCEv2"),
             G(2, "0000:0000:0000:0000:0000:ffff:0a00:0101", "RoCEv1"),
             G(3, "0000:0000:0000:0000:0000:ffff:0a00:0101", "RoCEv2")]
    assert verbs.pick_gid(table).index == 3
    assert verbs.pick_gid(table[:3]).index == 2          # routable RoCEv1 before link-local RoCEv2
    with pytest.warns(UserWarning, match="only a link-local GID"):
        assert verbs.pick_gid(table[:2]).index == 1      # link-local as a last resort, RoCEv2 first
    with pytest.warns(UserWarning, match="reaches peers on this L2 segment only"):
        assert verbs.pick_gid(table[:1]).index == 0
    assert verbs.pick_gid([]) is None
    ib = [G(0, "fe80:0000:0000:0000:0002:c903:0001:0002", "IB")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # IB's fe80:: subnet prefix is no link-local RoCE GID
        assert verbs.pick_gid(ib).index == 0


def test_gid_choice_prefers_routable_ipv6_over_link_local():
    """Issue 12: a RoCEv2 table of IPv6 entries only, link-local first -- the global address wins."""
    G = verbs.GidInfo
    table = [G(0, "fe80:0000:0000:0000:0200:00ff:fe00:0001", "RoCEv2"),
             G(1, "2001:0db8:0000:0000:0000:0000:0000:0001", "RoCEv2")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verbs.pick_gid(table).index == 1
        assert verbs.pick_gid(table + [G(2, "0000:0000:0000:0000:0000:ffff:0a00:0101", "RoCEv2")]).index == 2
        assert verbs.pick_gid([G(0, table[1].gid, "RoCEv1"), G(1, table[1].gid, "RoCEv2")]).index == 1
    assert verbs.speed_gbps(128, 2) == 400.0 and verbs.speed_gbps(64, 2) == 200.0 and verbs.speed_gbps(0, 2) == 0


def test_discover_emulated_ports_and_gids():
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [em.PortSpec(), em.PortSpec(active=False)]),
                                   em.DeviceSpec("ib0", [em.PortSpec(link_layer="InfiniBand", speed_gbps=200)])]))
    d = verbs.discover(fab.pyverbs())
    assert [(p.device, p.port, p.active, p.link_layer, p.speed_gbps) for x in d for p in x.ports] == \
        [("mlx5_0", 1, True, "Ethernet", 400.0), ("mlx5_0", 2, False, "Ethernet", 400.0),
         ("ib0", 1, True, "InfiniBand", 200.0)]
    assert d[0].ports[0].best_gid().index == 3 and d[1].ports[0].best_gid().type == "IB"
    assert d[1].ports[0].lid == em.port_lid(1, 1) and d[0].is_mlx5 and not d[1].is_mlx5
    with pytest.raises(rdma.RdmaUnavailable, match="no RDMA device"):
        verbs.discover(em.Fabric(em.FabricSpec([])).pyverbs())


def test_install_script_is_silent_when_pyverbs_already_imports(tmp_path):
    pkg = tmp_path / "pyverbs"                      # a stand-in with the modules the script's probe imports
    pkg.mkdir()
    for mod in ("__init__", "device", "qp", "wr", "addr", "mr", "cq", "pd"):
        (pkg / f"{mod}.py").write_text("")
    script = Path(__file__).resolve().parents[2] / "scripts" / "install_pyverbs.sh"
    r = subprocess.run([str(script), sys.executable], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
