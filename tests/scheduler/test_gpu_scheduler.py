"""GPU: the scheduler's producer and consumer Triton kernels (kernels/chunks.py) against the RDMA proxy,
two processes on one GPU as two emulated hosts (gloo bootstrap).  The rings and the control block are in
pinned, device-mapped host memory: the kernels write and read it over PCIe, the emulated fabric moves it
as the host memory it is (docs/rdma.md says why).

    python -m pytest -q -m gpu tests/scheduler/test_gpu_scheduler.py
"""
from __future__ import annotations

import pytest
import torch

from triton_ep.testing import RankFailure, run_ranks

from tests.cases.sched import kernel_rank
from tests.cases.sched_helpers import fabric

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rounds,slots,slot_bytes", [(4, 4, 64 << 10), (2, 2, 1 << 20)])
def test_gpu_kernels_produce_and_consume_through_the_proxy(rounds, slots, slot_bytes):
    res = run_ranks(kernel_rank, 2, fabric(2, reorder_seed=7, ring_bytes=4 << 20), "cuda", rounds, slots,
                    slot_bytes, 60.0, timeout_s=300)
    bad = [r for r in res if isinstance(r, RankFailure)]
    assert not bad, "\n".join(f"{r.message}\n{r.traceback}" for r in bad)
    for r, table in enumerate(res):
        assert table[1 - r] == [0, rounds * slots], (r, table)     # every chunk checked, no wrong word
        assert table[r] == [0, 0]
