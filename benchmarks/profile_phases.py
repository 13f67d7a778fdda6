"""Where the time of one normal-mode dispatch / combine goes, phase by phase (host clock).

Each rank records, for every barrier of a call, when it got there, when its GPU work was done
(``sync_device``) and when all peers had arrived; the gaps are: host+GPU work before the barrier,
the device synchronisation alone, and the wait for the slowest peer. Printed as medians over ``--iters``
calls, for rank 0. Ranks get one GPU each where there are enough, else share one (gloo).

    python benchmarks/profile_phases.py --ranks 2 [--tokens 4096 --hidden 7168]
"""
import argparse
import statistics
import time

import torch


def rank_main(rank, world, tokens, hidden, experts, topk, iters, cprofile=False):
    """Run dispatch+combine ``iters`` times with profiling on; return per-phase medians (ms), and with
    ``cprofile`` (rank 0) the top of a cProfile of the host side under key ``"cprofile"``."""
    import triton_ep
    ngpu = torch.cuda.device_count()
    if ngpu:
        torch.cuda.set_device(rank % ngpu)
    dev = torch.device("cuda", torch.cuda.current_device()) if ngpu else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, topk, generator=g).to(dev)
    cfg = triton_ep.Buffer.get_dispatch_config(world)
    buf = triton_ep.Buffer(None, cfg.get_nvl_buffer_size_hint(hidden * 2, world), device=dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=idx, topk_weights=w)
    rows = {}
    import cProfile
    import io
    import pstats
    prof_host = cProfile.Profile() if (cprofile and rank == 0) else None
    for it in range(iters + 2):
        if prof_host is not None and it == 2:
            prof_host.enable()
        for op in ("dispatch", "combine"):
            buf._comm.profile = prof = []
            t_start = time.perf_counter()
            if op == "dispatch":
                out = buf.dispatch(x, **kw)
            else:
                buf.combine(out[0], out[4])
            t_end = time.perf_counter()
            buf._comm.profile = None
            if it < 2:
                continue
            prev = t_start
            for stage, t0, t1, t2 in prof:
                rows.setdefault((op, stage, "work before"), []).append((t0 - prev) * 1e3)
                rows.setdefault((op, stage, "device sync"), []).append((t1 - t0) * 1e3)
                rows.setdefault((op, stage, "wait for peers"), []).append((t2 - t1) * 1e3)
                prev = t2
            rows.setdefault((op, "after last barrier", "work"), []).append((t_end - prev) * 1e3)
            rows.setdefault((op, "whole call", "total"), []).append((t_end - t_start) * 1e3)
    buf.destroy()
    out = {" | ".join(k): statistics.median(v) for k, v in rows.items()}
    if prof_host is not None:
        prof_host.disable()
        text = io.StringIO()
        pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(25)
        out["cprofile"] = text.getvalue()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cprofile", action="store_true", help="also print rank 0's host-side cProfile (tottime)")
    a = p.parse_args()
    from triton_ep.testing import run_ranks
    backend = "nccl" if torch.cuda.device_count() >= a.ranks else "gloo"
    res = run_ranks(rank_main, a.ranks, a.tokens, a.hidden, a.experts, a.topk, a.iters, a.cprofile,
                    backend=backend)
    if not isinstance(res[0], dict):
        raise SystemExit(f"failed: {res}")
    print(f"rank 0 of {a.ranks} ({backend}), {a.tokens} tokens x {a.hidden}, median ms over {a.iters} calls")
    for k, v in res[0].items():
        if k != "cprofile":
            print(f"  {k:60s} {v:9.3f}")
    if "cprofile" in res[0]:
        print(res[0]["cprofile"])


if __name__ == "__main__":
    main()
