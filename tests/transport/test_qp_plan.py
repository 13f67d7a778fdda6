"""Unit tests of the topology-aware QP plan (pure functions)."""
from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_ep.transport import topology as tp

SRC = ["0000:0000:0000:0000:0000:ffff:0a00:0101", "0000:0000:0000:0000:0000:ffff:0a00:0201"]
DST = ["0000:0000:0000:0000:0000:ffff:0a01:0101", "0000:0000:0000:0000:0000:ffff:0a01:0201"]


def ports(n):
    return [tp.PortRef("mlx5_0", i + 1, SRC[i]) for i in range(n)]


@pytest.mark.parametrize("n_ports", [1, 2])
@pytest.mark.parametrize("num_qps", list(range(1, 33)))
def test_ports_balanced(n_ports, num_qps):
    got = collections.Counter(p.port for p in tp.spread_ports(num_qps, ports(n_ports)))
    assert sum(got.values()) == num_qps
    assert set(got) == set(range(1, min(n_ports, num_qps) + 1))
    assert max(got.values()) - min(got.values()) <= 1


@pytest.mark.parametrize("hash_fn", [tp.emulator_path_hash, tp.crc_path_hash], ids=["emulator", "crc32"])
@pytest.mark.parametrize("n_paths", [2, 4, 8])
@pytest.mark.parametrize("n_ports", [1, 2])
def test_paths_balanced_for_every_qp_count(hash_fn, n_paths, n_ports):
    for num_qps in range(1, 33):
        plan = tp.plan_peer(num_qps, ports(n_ports), [DST[i % n_ports] for i in range(num_qps)], n_paths, hash_fn)
        # the hash, recomputed from what the plan sends, lands where the plan says
        for e, d in zip(plan, [DST[i % n_ports] for i in range(num_qps)]):
            assert hash_fn(e.port.gid, d, e.udp_sport, n_paths) == e.path
            assert e.udp_sport == tp.flow_label_to_udp_sport(e.flow_label)
        counts = collections.Counter(e.path for e in plan)
        full = [counts.get(k, 0) for k in range(n_paths)]
        assert max(full) - min(full) <= 1, (num_qps, full)
        assert len({e.udp_sport for e in plan}) == num_qps   # distinct source ports


def test_unplanned_default_collides_where_the_plan_does_not():
    """Without the plan (flow label 0: the kernel hashes the QP numbers) 8 QPs pile onto fewer paths."""
    qpns = [(0x1001 + i, 0x2001 + i) for i in range(8)]
    naive = collections.Counter(
        tp.emulator_path_hash(SRC[i % 2], DST[i % 2], tp.effective_udp_sport(0, lq, rq), 4)
        for i, (lq, rq) in enumerate(qpns))
    planned = collections.Counter(e.path for e in tp.plan_peer(8, ports(2), [DST[i % 2] for i in range(8)], 4))
    assert sorted(planned.values()) == [2, 2, 2, 2]
    assert sorted(naive.values()) != [2, 2, 2, 2]


def test_kernel_flow_label_formulas():
    # rdma_flow_label_to_udp_sport: fold bits 14..19 onto 0..5, set 0xC000
    assert tp.flow_label_to_udp_sport(0) == 0xC000
    assert tp.flow_label_to_udp_sport(0x3FFF) == 0xFFFF
    assert tp.flow_label_to_udp_sport(1 << 14) == 0xC001
    assert tp.flow_label_to_udp_sport(0xFFFFF) == 0xC000 | (0x3FFF ^ 0x3F)
    # rdma_calc_flow_label: symmetric, 20 bits
    assert tp.calc_flow_label(0x11, 0x22) == tp.calc_flow_label(0x22, 0x11) == 0x11 * 0x22
    assert tp.calc_flow_label(0xFFFFFF, 0xFFFFFF) < (1 << 20)
    assert tp.effective_udp_sport(0x1234, 5, 6, forced_sport=50000) == 50000
    assert tp.effective_udp_sport(0, 5, 6) == tp.flow_label_to_udp_sport(30)


def test_inactive_ports_get_no_qps_and_none_active_raises():
    ps = [tp.PortRef("mlx5_0", 1, SRC[0], active=False), tp.PortRef("mlx5_1", 1, SRC[1])]
    assert {p.device for p in tp.spread_ports(5, ps)} == {"mlx5_1"}
    with pytest.raises(tp.PlanError, match="no active RDMA port: mlx5_0:1"):
        tp.spread_ports(2, ps[:1])
    with pytest.raises(tp.PlanError):
        tp.spread_ports(0, ps)


def test_unreachable_path_raises():
    with pytest.raises(tp.PlanError, match="no flow label"):
        tp.plan_peer(3, ports(1), [DST[0]] * 3, 4, path_hash=lambda s, d, sp, n: 0, )


def test_nics_near_gpu_prefers_shared_pci_path():
    gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/0000:18:00.0"
    nics = {"mlx5_0": "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0",
            "mlx5_1": "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/0000:19:00.0",
            "mlx5_2": "/sys/devices/pci0000:00/0000:00:02.0/0000:20:00.0"}
    assert tp.nics_near_gpu(gpu, nics) == ["mlx5_1", "mlx5_2", "mlx5_0"]
    assert tp.nics_near_gpu(None, nics) == ["mlx5_0", "mlx5_1", "mlx5_2"]


def test_plan_table_renders_every_qp():
    plan = tp.plan_peer(3, ports(2), [DST[0], DST[1], DST[0]], 2)
    text = tp.plan_table(plan).render().splitlines()
    assert text[0].split() == ["qp", "device", "port", "lag", "flow_label", "udp_sport", "path"]
    assert len(text) == 2 + 3
    assert text[3].split()[:3] == ["1", "mlx5_0", "2"]


def test_nearest_nics_keeps_only_the_closest_group():
    gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/0000:18:00.0"
    nics = {"mlx5_0": "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/0000:19:00.0",
            "mlx5_1": "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/0000:19:00.1",
            "mlx5_2": "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"}
    assert tp.nearest_nics(gpu, nics) == ["mlx5_0", "mlx5_1"]
    assert tp.nearest_nics(None, nics) == ["mlx5_0", "mlx5_1", "mlx5_2"]
    import torch
    if not torch.cuda.is_available():
        assert tp.gpu_sysfs_path(0) is None        # no CUDA device: no path, no exception


@pytest.mark.property
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=4, max_size=4), st.integers(1, 32), st.integers(1, 8),
       st.integers(1, 2), st.sampled_from([tp.emulator_path_hash, tp.crc_path_hash]))
def test_plan_balances_any_addresses(v4, num_qps, n_paths, n_ports, hash_fn):
    g = ["0000:0000:0000:0000:0000:ffff:%04x:%04x" % (x >> 16, x & 0xFFFF) for x in v4]
    ps = [tp.PortRef("d", i + 1, g[i]) for i in range(n_ports)]
    dst = [g[2 + i % n_ports] for i in range(num_qps)]
    plan = tp.plan_peer(num_qps, ps, dst, n_paths, hash_fn, seed=v4[0] & 7)
    counts = [sum(e.path == k for e in plan) for k in range(n_paths)]
    assert max(counts) - min(counts) <= 1
    per_port = collections.Counter(e.port.port for e in plan)
    assert max(per_port.values()) - min(per_port.values()) <= 1
