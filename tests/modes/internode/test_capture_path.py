"""The capture path of internode normal mode (docs/internode.md, "CUDA graphs"): num_worst_tokens calls
across hosts with no host wait and no host exchange, on CPU processes over the emulated fabric
(``TRITON_EP_INTERNODE_CAPTURE_PATH=1``; on GPU it is the default, and tests/modes/internode/test_gpu_internode.py
captures it in a CUDA graph)."""
import pytest

import internode_cases as cases
from triton_ep.testing import RankFailure, run_ranks


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(str(o) for o in bad)
    return out


def _env(per_host, **more):
    return dict({"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated",
                 "TRITON_EP_INTERNODE_CAPTURE_PATH": "1"}, **more)


@pytest.mark.parametrize("world,per_host,Ts,more", [
    (4, 2, [7, 0, 9, 4], {}),                                                        # 2 hosts of 2 ranks
    (3, 1, [5, 8, 2], {"TRITON_EP_RDMA_CHUNK_BYTES": "128", "TRITON_EP_RDMA_SLOTS": "2"}),  # 3 hosts, many rounds
])
def test_capture_path_round_trips_and_host_path_between(world, per_host, Ts, more):
    """num_worst_tokens dispatch, combine and cached dispatch bit for bit the reference on the capture path
    (with weights and biases; without topk_idx; skewed), with a plain dispatch on the host path between them on
    the same Buffer: the host path re-reads the chunk numbers the capture path's kernels advanced, and the plain
    dispatch's combine and cached dispatch take the capture path with its host-known counts. Records straddle
    128-byte chunks in the second case. Only the plain dispatch exchanges headers."""
    out = _values(run_ranks(cases.capture_sequence, world, _env(per_host, **more), 11, 4 * world, 3, 64, Ts,
                            timeout_s=300))
    for o in out:
        assert all(c["combined"] for c in o[:4]), o
        # the plain dispatch alone (its header and status): its combine and cached dispatch take the capture path
        assert o[4] == 2, o
    assert sum(c["rows"] for o in out for c in o[:4]) > 0


@pytest.mark.parametrize("kind", ["bad_ids", "capacity", "capacity_late", "bad_shape"])
def test_capture_path_errors_reach_every_rank(kind):
    """A bad id on rank 3 (found on the device: the call returns, Buffer.check() raises ValueError there), a
    num_worst_tokens too small for host 0 (EPCapacityError on host 0's ranks: the forwarding leg's; also where
    rank 1 finds it, raises and leaves the host's group while rank 0 is still in the call), int64
    topk_weights on rank 3 (TypeError at once). Each ends the network leg for good: every rank's next call raises at once,
    none waits out its 20 s bound."""
    out = _values(run_ranks(cases.capture_errors, 4, _env(2), kind, timeout_s=240))
    for r, o in enumerate(out):
        first = (o["first"] or [None])[0]
        assert o["first_s"] < 10.0, (r, o)
        if kind == "bad_shape":     # the others return, or raise at once where rank 3 left first
            assert first == "TypeError" if r == 3 else first in (None, "EPRemoteError", "ProxyRemoteError"), (r, o)
        elif kind == "bad_ids":     # rank 3's call returns (or hears of a peer that already failed)
            assert first in (None, "EPRemoteError", "ProxyRemoteError"), (r, o)
            if r == 3:              # its own recorded error, not its peers' echo of it
                assert o["checked"][0] == "ValueError" and "topk_idx" in o["checked"][1], o
        elif r in (0, 1):      # on CPU the forwarding leg raises at the call's end; on GPU at check()
            assert "EPCapacityError" in (first, (o["checked"] or [None])[0]), (r, o)
        assert o["next"] is not None and o["next_s"] < 10.0, (r, o)


def test_capture_path_dropped_signal_ends_every_wait():
    """A dropped signal on the capture path: rank 1's ring wait for the chunk runs out of time, which ends
    every later ring wait at once; both ranks raise (at the call's end on CPU, at the next check() on a GPU)
    within the bound, and their next calls at once."""
    out = _values(run_ranks(cases.failure, 2, _env(1), "dropped_signal", 3.0, 512, timeout_s=120))
    for o in out:
        assert o[0] in ("ProxyError", "ProxyRemoteError", "EPTimeoutError", "EPRemoteError"), o
        assert o[2] < 3.0 + 5.0 and o[3] is not None and o[5] < 1.0, o
