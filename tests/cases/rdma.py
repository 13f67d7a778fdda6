"""Helpers shared by the transport tests (a module of its own so no test imports conftest)."""
from __future__ import annotations

import pytest

from triton_ep.transport import emulated as em
from triton_ep.transport import rdma, verbs


def dual_port_fabric(reorder_seed=None, n_paths=4, ring_bytes=1 << 20, path_gbps=400.0, port_gbps=400.0,
                     reorder_max_s=0.004):
    """Two hosts, each with one dual-port mlx5 device (``mlx5_0`` on host 0, ``mlx5_1`` on host 1)."""
    ports = lambda: [em.PortSpec(speed_gbps=port_gbps), em.PortSpec(speed_gbps=port_gbps)]  # noqa: E731
    return em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", ports()), em.DeviceSpec("mlx5_1", ports())],
                                   n_paths=n_paths, path_gbps=path_gbps, reorder_seed=reorder_seed,
                                   reorder_max_s=reorder_max_s, ring_bytes=ring_bytes))


class Pair:
    """Rank 0 and rank 1 transports, connected; ``fabric`` is None on real pyverbs."""

    def __init__(self, t0, t1, fabric):
        self.t0, self.t1, self.fabric = t0, t1, fabric

    def close(self):
        self.t0.close()
        self.t1.close()


def connect_pair(t0, t1):
    t0.connect(1, t1.local_info(0))
    t1.connect(0, t0.local_info(1))


def real_api_or_skip():
    """The real pyverbs API with at least one device, else ``pytest.skip`` with the reason."""
    try:
        api = verbs.load_pyverbs()
        devs = verbs.discover(api)
    except rdma.RdmaUnavailable as ex:
        pytest.skip(f"real pyverbs leg: {ex}")
    return api, devs
