"""Internode normal mode on one GPU: 2 hosts of 1 rank and 2 hosts of 2 ranks (processes sharing the GPU
over gloo, the emulated fabric between the hosts), dispatch bit-exact against the reference, combine
bit-exact against its two-level order, cached dispatch, FP8 pairs. Functional only (a shared GPU)."""
import pytest
import torch

from tests.cases import internode as cases
from triton_ep.testing import RankFailure, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(str(o) for o in bad)
    return out


@pytest.mark.parametrize("world,per_host,opts", [
    (2, 1, {"device": "cuda"}),
    (4, 2, {"device": "cuda", "bias": True, "worst": 128}),
    (2, 1, {"device": "cuda", "fp8": True}),
    (4, 2, {"device": "cuda", "no_topk": True}),
])
def test_round_trip_gpu(world, per_host, opts):
    env = {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated"}
    H = 256 if opts.get("fp8") else 7168
    out = _values(run_ranks(cases.round_trip, world, env, 3, 8 * world, 4, H, [33, 17, 0, 40][:world], opts,
                            timeout_s=140))
    assert sum(o["rows"] for o in out) > 0


def test_small_chunks_many_rounds_gpu():
    """4 KiB chunks in 2 slots: records (about 14 KiB at hidden 7168) straddle several chunks and each call
    runs many rounds of the ring kernels on the GPU, with pinned, device-mapped rings."""
    env = {"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated", "TRITON_EP_RDMA_CHUNK_BYTES": "4096",
           "TRITON_EP_RDMA_SLOTS": "2"}
    out = _values(run_ranks(cases.round_trip, 2, env, 5, 16, 4, 7168, [9, 6], {"device": "cuda", "bias": True},
                            timeout_s=140))
    assert all(o["combined"] for o in out)


@pytest.mark.parametrize("world,per_host", [(2, 1), (4, 2)])
def test_graph_capture_across_hosts_gpu(world, per_host):
    """Layout + num_worst_tokens dispatch + combine across hosts captured in one CUDA graph (the capture path:
    no host wait, no host exchange; sync debug mode 'error' inside), replayed 4 times with new x and new
    routing: each replay bit for bit the reference, combine in its two-level order."""
    env = {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated"}
    out = _values(run_ranks(cases.graph_across_hosts, world, env, 7, timeout_s=200))
    assert all(o["replays"] == 4 for o in out), out
