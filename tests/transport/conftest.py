"""Fixtures of the transport tests: connected pairs of VerbsTransport over the emulated fabric or real pyverbs."""
from __future__ import annotations

import pytest

from triton_ep.transport import topology, verbs

from tests.cases.rdma import Pair, connect_pair, dual_port_fabric, real_api_or_skip


@pytest.fixture(params=["emulated", "pyverbs"])
def make_pair(request):
    """Factory ``make_pair(reorder_seed=None, reorder_max_s=0.004, **transport_kwargs) -> Pair``; closes what
    it made.  The reorder options apply to the emulated fabric only."""
    made = []

    def make(reorder_seed=None, reorder_max_s=0.004, **kw):
        kw.setdefault("num_qps_per_peer", 4)
        kw.setdefault("timeout_s", 10.0)
        if request.param == "emulated":
            fab = dual_port_fabric(reorder_seed, reorder_max_s=reorder_max_s)
            kw.setdefault("n_paths", 4)
            kw.setdefault("path_hash", topology.emulator_path_hash)
            t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0"]), **kw)
            t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_1"]), **kw)
        else:
            api, devs = real_api_or_skip()
            fab = None
            name = [devs[0].name]   # loopback: both ranks on the first device
            t0 = verbs.VerbsTransport(0, 2, api=api, devices=name, **kw)
            t1 = verbs.VerbsTransport(1, 2, api=api, devices=name, **kw)
        connect_pair(t0, t1)
        p = Pair(t0, t1, fab)
        made.append(p)
        return p

    make.backend = request.param
    yield make
    for p in made:
        p.close()
