"""Where the time of one normal-mode dispatch / combine goes, phase by phase (host clock).

Each rank records, for every host wait of a call, when it got there, when its device answered and
when all peers had arrived; the gaps are: host+GPU work before the wait, the wait itself, and (at a host
barrier) the wait for the slowest peer. Since ranks wait for each other on the device, the only host
wait of a call is a plain dispatch's poll of the counts its notify kernel writes (``dispatch/notify
(host wait)``: it includes the device work queued before it and the peers' notify); the rest of a call
shows as the time after it. Printed as medians over ``--iters`` calls, for rank 0. Ranks get one GPU each where there are enough, else share one (gloo).

    ./run.sh python benchmarks/profile_phases.py [--ranks 2] [--tokens 4096 --hidden 7168] [--cprofile]

Shapes default to DeepSeek-V3's on a GPU (4096 tokens, hidden 7168, top-8 of 256 experts) and to tiny ones
on CPU (24 tokens, hidden 256, top-4 of 32 experts: about 10 s on two cores), where the kernels run under
the Triton interpreter and the times say nothing about a GPU. Output: stdout only.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import torch  # noqa: E402


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
    for it in C.progress(range(iters + 2), desc="dispatch+combine (first 2 untimed)", unit="call", leave=False,
                         disable=rank != 0):
        if prof_host is not None and it == 2:
            prof_host.enable()
        for op in ("dispatch", "combine"):
            buf._rt.comm.profile = prof = []
            t_start = time.perf_counter()
            if op == "dispatch":
                out = buf.dispatch(x, **kw)
            else:
                buf.combine(out[0], out[4])
            t_end = time.perf_counter()
            buf._rt.comm.profile = None
            if it < 2:
                continue
            prev = t_start
            for stage, t0, t1, t2 in prof:
                rows.setdefault((op, stage, "work before"), []).append((t0 - prev) * 1e3)
                rows.setdefault((op, stage, "wait"), []).append((t1 - t0) * 1e3)
                rows.setdefault((op, stage, "wait for peers"), []).append((t2 - t1) * 1e3)
                prev = t2
            rows.setdefault((op, "after the last host wait", "work"), []).append((t_end - prev) * 1e3)
            rows.setdefault((op, "whole call", "total"), []).append((t_end - t_start) * 1e3)
    buf.destroy()
    out = {" | ".join(k): statistics.median(v) for k, v in rows.items()}
    if prof_host is not None:
        prof_host.disable()
        text = io.StringIO()
        pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(25)
        out["cprofile"] = text.getvalue()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Command line: ranks, shapes (DeepSeek-V3's on a GPU, tiny on CPU), ``--iters``, ``--cprofile``."""
    shape = C.DSV3 if C.on_gpu() else C.SMALL
    where = "GPU" if C.on_gpu() else "CPU"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    for k in ("tokens", "hidden", "experts", "topk"):
        p.add_argument(f"--{k}", type=int, default=shape[k], help=f"default {shape[k]} on this machine's {where}")
    p.add_argument("--iters", type=int, default=10, help="timed calls (default 10; two untimed calls come first)")
    p.add_argument("--cprofile", action="store_true", help="also print rank 0's host-side cProfile (tottime)")
    a = p.parse_args(argv)
    C.check_shape_args(p, a, ("ranks", "tokens", "hidden", "experts", "topk", "iters"), 8, "bf16 rows of whole 16 bytes")
    return a


def figures_note(ranks: int) -> str:
    """What the host-clock figures of ``ranks`` ranks mean on this machine."""
    ngpu = torch.cuda.device_count()
    if not ngpu:
        return "CPU: kernels under the Triton interpreter; host-clock times that say nothing about a GPU"
    if ngpu < ranks:
        return (f"{ranks} ranks share {ngpu} GPU(s) (gloo): they time-slice a GPU, so the waits are not those of "
                "one GPU per rank")
    return f"one GPU per rank ({ranks} of {ngpu}, NCCL)"


def main(argv=None):
    """Run the ranks and print rank 0's medians per phase."""
    a = parse_args(argv)
    from triton_ep.testing import run_ranks
    backend = "nccl" if torch.cuda.device_count() >= a.ranks else "gloo"
    print(f"profile_phases: {a.ranks} ranks ({backend}), {a.tokens} tokens x {a.hidden}, top-{a.topk} of "
          f"{a.experts} experts; {figures_note(a.ranks)}", flush=True)
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
