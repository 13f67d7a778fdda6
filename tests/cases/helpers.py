"""Input builders and checks shared by the tests: every check compares with triton_ep.reference."""
import os
import subprocess
import sys
from typing import List, Optional, Sequence

import pytest
import torch

from triton_ep import reference as ref
from triton_ep.testing import VirtualGroup


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor on CPU, for bit-for-bit comparisons (NaN == NaN)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor], what: str) -> None:
    assert (a is None) == (b is None), f"{what}: one side is None"
    if a is None:
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def make_inputs(seed: int, E: int, K: int, H: int, Ts: Sequence[int], skew: float = 0.0, p_invalid: float = 0.15,
                p_dup: float = 0.1, fp8: bool = False, idx_dtype=torch.int64, x_scale: float = 1.0):
    """Per-rank inputs: x bf16 (or an fp8 pair), topk_idx with -1 entries and duplicates, weights fp32.
    ``skew`` in [0, 1]: probability that an id is drawn from the first quarter of experts (hot experts);
    ``x_scale`` multiplies x's normal draws before the cast."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for T in Ts:
        x = torch.randn(T, H, generator=g) * x_scale
        xs.append((x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g) + 0.5) if fp8
                  else x.to(torch.bfloat16))
        idx = torch.randint(0, E, (T, K), generator=g)
        hot = torch.randint(0, max(E // 4, 1), (T, K), generator=g)
        idx = torch.where(torch.rand(T, K, generator=g) < skew, hot, idx)
        if K > 1:
            dup = torch.rand(T, K, generator=g) < p_dup
            idx[:, 1:] = torch.where(dup[:, 1:], idx[:, :1].expand(-1, K - 1), idx[:, 1:])
        idx = torch.where(torch.rand(T, K, generator=g) < p_invalid, torch.full_like(idx, -1), idx)
        idxs.append(idx.to(idx_dtype))
        ws.append(torch.rand(T, K, generator=g))
    return xs, idxs, ws


def _to(v, device):
    return tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)


def virtual_dispatch(vg: VirtualGroup, xs, idxs, ws, E: int, device: str = "cpu", **extra) -> List:
    """get_dispatch_layout + dispatch on every simulated rank; raises the first rank's exception."""
    R = len(xs)
    kw = []
    for r in range(R):
        idx = idxs[r].to(device)
        per_rank, _, per_expert, in_rank, _ = vg.buffers[r].get_dispatch_layout(idx, E)
        kw.append(dict(x=_to(xs[r], device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=idx,
                       topk_weights=ws[r].to(device) if ws is not None else None, **extra))
    return raise_first(vg.call("dispatch", kw))


def raise_first(results: List) -> List:
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def check_dispatch(res, exp, fp8: bool = False) -> None:
    """Every received row, id, weight, count and handle entry equals the reference's."""
    for j, (got, e) in enumerate(zip(res, exp)):
        rx, ri, rw, lst, h, _ = got
        if fp8:
            assert_bits(rx[0], e["recv_x"][0], f"rank {j} recv_x")
            assert_bits(rx[1], e["recv_x"][1], f"rank {j} recv_x scales")
        else:
            assert_bits(rx, e["recv_x"], f"rank {j} recv_x")
        assert_bits(ri, e["recv_topk_idx"], f"rank {j} recv_topk_idx")
        assert_bits(rw, e["recv_topk_weights"], f"rank {j} recv_topk_weights")
        assert lst == e["num_recv_tokens_per_expert_list"], f"rank {j} per-expert counts"
        assert_bits(h[0], e["rank_prefix_matrix"], f"rank {j} rank_prefix_matrix")
        assert_bits(h[3], e["recv_src_idx"], f"rank {j} recv_src_idx")


def check_round_trip_virtual(R, E, K, H, Ts, seed, num_nvl_bytes, device="cpu", config=None, **kw) -> None:
    """dispatch, a non-trivial 'expert' (x*3 - 1), combine with weights and bias, and a cached dispatch,
    on R simulated ranks (every call with ``config``); all bit for bit against the reference."""
    xs, idxs, ws = make_inputs(seed, E, K, H, Ts, **kw)
    vg = VirtualGroup(R, num_nvl_bytes, device=device)
    res = virtual_dispatch(vg, xs, idxs, ws, E, device, config=config)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp)
    ys = [(e["recv_x"].float() * 3 - 1).to(torch.bfloat16) for e in exp]
    g = torch.Generator().manual_seed(seed + 1)
    biases = [[torch.randn(T, H, generator=g).to(torch.bfloat16)] for T in Ts]
    got = raise_first(vg.call("combine", [dict(x=ys[j].to(device), handle=res[j][4],
                                                topk_weights=res[j][2], bias=biases[j][0].to(device),
                                                config=config)
                                           for j in range(R)]))
    want = ref.combine(ys, exp, Ts, [e["recv_topk_weights"] for e in exp], biases)
    for i in range(R):
        assert_bits(got[i][0], want[i][0], f"rank {i} combined_x")
        assert_bits(got[i][1], want[i][1], f"rank {i} combined_topk_weights")
    x2 = [(x.float() * -0.5).to(torch.bfloat16) for x in xs]
    cached = raise_first(vg.call("dispatch", [dict(x=x2[r].to(device), handle=res[r][4], config=config)
                                              for r in range(R)]))
    exp2 = ref.dispatch(x2, idxs, ws, E)
    for j in range(R):
        assert_bits(cached[j][0], exp2[j]["recv_x"], f"rank {j} cached recv_x")
        assert cached[j][1:5] == (None, None, None, None)


def all_live_ranks_reach(live: int, bound_s: float) -> None:
    """Wait (at most ``bound_s`` seconds) until ``live`` ranks have called this, counted in the default group's
    store (a barrier that a dead rank does not spoil; once per group: its key is not reset). Rank bodies of the
    failure cases call it before they tear down, so that no rank's teardown is what a slower one hears first."""
    import time

    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    store.add("failure_cases_done", 1)
    deadline = time.monotonic() + bound_s
    while store.add("failure_cases_done", 0) < live and time.monotonic() < deadline:
        time.sleep(0.05)


def ok_results(results: List) -> List:
    """``run_ranks`` results, after failing the test with every rank's traceback if any rank raised."""
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def compiles_for_the_gpu(code: str, timeout_s: float = 600.0) -> None:
    """Run ``code`` in a fresh interpreter with ``TRITON_INTERPRET=0``: a script that compiles kernels for a GPU target
    (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, which needs no GPU) and prints ``ok``.
    Skips the calling test where Triton's CUDA backend cannot compile here (no ``ptxas``, no NVIDIA backend); fails
    it with the script's error output otherwise."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s)
    if r.returncode and ("ptxas" in r.stderr or "No module named 'triton.backends.nvidia'" in r.stderr):
        pytest.skip(f"Triton's CUDA backend cannot compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def sleeping_rank(rank: int, world: int, seconds: float) -> int:
    """A rank body of ``run_ranks`` that sleeps ``seconds`` and returns its rank (for tests of run_ranks itself)."""
    import time
    time.sleep(seconds)
    return rank
