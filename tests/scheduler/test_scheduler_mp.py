"""The scheduler across processes (each one emulated host, gloo bootstrap): byte-exact all-to-all with 2
and 4 hosts, and the producer/consumer Triton kernels (the GPU test's kernels, here under the interpreter)
against the proxy in 2 hosts."""
from __future__ import annotations

import numpy as np
import pytest

from triton_ep.testing import RankFailure, run_ranks

from tests.cases.sched import alltoall_rank, kernel_rank
from tests.cases.sched_helpers import fabric

pytestmark = pytest.mark.multiprocess


def ok(results):
    bad = [r for r in results if isinstance(r, RankFailure)]
    assert not bad, "\n".join(f"{r.message}\n{r.traceback}" for r in bad)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_alltoall_processes_as_hosts(world):
    rng = np.random.default_rng(world)
    slot = 2048
    sizes = {(a, b): int(rng.choice([0, 5, slot - 1, 3 * slot + 7, 50 * slot + 3]))
             for a in range(world) for b in range(world) if a != b}
    sizes[(0, 1)], sizes[(1, 0)] = 0, 60 * slot + 11             # a zero and a transfer 20x the ring
    res = ok(run_ranks(alltoall_rank, world, fabric(world, reorder_seed=world), sizes, 3, slot, 4, timeout_s=120))
    for r, per_peer in enumerate(res):
        assert per_peer == {p: True for p in range(world) if p != r}, (r, per_peer)


def test_kernels_produce_and_consume_through_the_proxy_cpu():
    rounds, slots, slot = 3, 2, 1024
    res = ok(run_ranks(kernel_rank, 2, fabric(2, reorder_seed=1), "cpu", rounds, slots, slot, timeout_s=180))
    for r, table in enumerate(res):
        assert table[1 - r] == [0, rounds * slots], (r, table)
        assert table[r] == [0, 0]
