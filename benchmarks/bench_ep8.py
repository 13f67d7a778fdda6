"""Expert-parallel benchmark over 8 GPUs of one host: triton-ep's normal-mode dispatch and combine against
the same exchange through NCCL's ``all_to_all_single``, at DeepSeek-V3 shapes, checked in the same run.

    ./run.sh python benchmarks/bench_ep8.py [--ranks 8] [--out DIR] [--small]   # starts its ranks
    ./run.sh torchrun --nproc-per-node 8 benchmarks/bench_ep8.py               # or under torchrun
    ./run.sh python benchmarks/bench_ep8.py --ranks 1                           # one-GPU dry run

Per rank: 4096 tokens, hidden 7168 (BF16), top-8 of 256 experts, uniform random routing (seed per rank).

1. triton-ep: ``Buffer.get_dispatch_layout``, ``dispatch`` (with top-k ids and weights), ``combine`` of the
   received rows unchanged; the outputs are checked against ``triton_ep.reference`` (dispatch: every
   returned tensor bitwise; combine: bitwise).
2. NCCL baseline (only when every rank has its own GPU): rows packed per destination with a host-computed
   gather index, ``all_to_all_single`` with host-computed splits; combine: the reverse exchange, then an
   fp32 ``index_add_`` per token. Timed with and without the pack / reduction; its received rows are
   checked against ours.
3. A plain peer-to-peer copy: every rank copies a chunk into each peer's buffer (CUDA IPC), all at once:
   what NVLink gives a copy engine in the same all-to-all pattern.

Bandwidth is DeepEP's measure: bytes of the BF16 rows a rank receives in dispatch (sends back in combine)
over the call's time (median of ``--iters`` calls, every call started together after a barrier), per rank,
averaged over ranks; times are the slowest rank's. Ranks use NCCL when each has its own GPU, gloo when
they share one (then the NCCL baseline is skipped with a message) and on CPU (``--small``: tiny shapes,
kernels under the Triton interpreter). NVLink multicast is off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).

Output: a table on rank 0's stdout, with a line saying what its figures mean on the machine it ran on, and
``<out>/ep8.json`` (``--out`` defaults to ``out/benchmarks/``, ignored by git; name ``benchmarks/results`` to
update the committed results); exit status 0 when every check passed. On CPU (about 10 s on two cores) the
figures show the benchmark runs and say nothing about GPU or NVLink speed.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import _launch  # noqa: E402  (examples/_launch.py: _common put examples/ on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command line: ``--ranks``, shapes, ``--iters``/``--warmup``, ``--out``, ``--small``, ``--timeout``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, help="ranks to start (default 8; 4 with --small; ignored under torchrun)")
    p.add_argument("--tokens", type=int, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, help="hidden size (default 7168)")
    p.add_argument("--topk", type=int, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, help="routed experts (default 256)")
    p.add_argument("--iters", type=int, help="timed calls per measurement (default 20; 3 with --small)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 5; 1 with --small)")
    C.add_out_arg(p, "ep8.json")
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU (the default without CUDA)")
    p.add_argument("--a2a-on-gloo", action="store_true",
                   help="testing aid: run the all_to_all_single baseline over gloo too (CPU; labelled gloo)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds: bound on the whole run")
    a = p.parse_args(argv)
    a.small = a.small or not C.on_gpu()
    shape = C.SMALL if a.small else C.DSV3
    for k in ("ranks", "tokens", "hidden", "topk", "experts"):
        if getattr(a, k) is None:
            setattr(a, k, shape[k])
    a.iters = a.iters or (3 if a.small else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.small else 5)
    if _launch.launched_externally():
        a.ranks = int(os.environ["WORLD_SIZE"])
    C.check_shape_args(p, a, ("ranks", "tokens", "hidden", "topk", "experts", "iters"), 8,
                       "bf16 rows of whole 16 bytes")
    return a


def gather_all(t: torch.Tensor, backend: str):
    """Every rank's ``t`` (same shape everywhere), on CPU, in rank order."""
    src = t if backend == "nccl" else t.cpu()
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, src)
    return [p.cpu() for p in parts]


def check_reference(a, rank: int, backend: str, x, idx, w, outs) -> dict:
    """Our dispatch and combine outputs on this rank against ``triton_ep.reference`` over all ranks' inputs."""
    from triton_ep import reference
    recv_x, recv_idx, recv_w, counts, handle, _, combined, _ = outs
    xs, idxs, ws = gather_all(x, backend), gather_all(idx, backend), gather_all(w, backend)
    refs = reference.dispatch(xs, idxs, ws, a.experts)
    ref = refs[rank]
    disp = (torch.equal(recv_x.cpu(), ref["recv_x"]) and torch.equal(recv_idx.cpu(), ref["recv_topk_idx"])
            and torch.equal(recv_w.cpu(), ref["recv_topk_weights"])
            and list(counts) == ref["num_recv_tokens_per_expert_list"]
            and torch.equal(handle[0].cpu(), ref["rank_prefix_matrix"])
            and torch.equal(handle[3].cpu(), ref["recv_src_idx"]))
    comb_ref = reference.combine([r["recv_x"] for r in refs], refs, [t.shape[0] for t in xs])[rank][0]
    return dict(dispatch_ok=bool(disp), combine_ok=bool(torch.equal(combined.cpu(), comb_ref)))


def nccl_baseline(a, x, in_rank, recv_x, combined) -> dict:
    """The same exchange through ``all_to_all_single`` (host-computed splits and gather index): median
    ms with and without the pack (dispatch) / reduction (combine), and checks against our outputs."""
    R = dist.get_world_size()
    counts = [None] * R
    dist.all_gather_object(counts, in_rank.sum(0).tolist())
    me = dist.get_rank()
    send_splits = counts[me]
    recv_splits = [counts[i][me] for i in range(R)]
    order = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(R)])
    H = x.shape[1]
    packed = x.index_select(0, order)
    got = torch.empty((sum(recv_splits), H), dtype=x.dtype, device=x.device)
    back = torch.empty((sum(send_splits), H), dtype=x.dtype, device=x.device)

    def dispatch():
        torch.index_select(x, 0, order, out=packed)
        dist.all_to_all_single(got, packed, recv_splits, send_splits)

    def combine():
        dist.all_to_all_single(back, recv_x, send_splits, recv_splits)
        acc = torch.zeros((x.shape[0], H), dtype=torch.float32, device=x.device)
        return acc.index_add_(0, order, back.float()).to(torch.bfloat16)

    dispatch()
    ok_d = torch.equal(got, recv_x)
    ok_c = torch.allclose(combine().float(), combined.float(), rtol=1e-2, atol=1e-2)
    t = {}
    for name, fn in (("dispatch", dispatch), ("combine", combine),
                     ("dispatch_a2a", lambda: dist.all_to_all_single(got, packed, recv_splits, send_splits)),
                     ("combine_a2a", lambda: dist.all_to_all_single(back, recv_x, send_splits, recv_splits))):
        t[name + "_ms"] = C.timed(fn, a.iters, a.warmup, x.device, None)
    return dict(t, dispatch_ok=bool(ok_d), combine_close=bool(ok_c))


def p2p_copy(a, buf) -> dict:
    """Every rank copies a chunk into each peer's buffer at once (``copy_`` into the CUDA IPC mapping;
    with one rank, into its own buffer): median ms and GB/s per rank (bytes it sends over the time)."""
    comm = buf._rt.comm
    R, me = comm.size, comm.rank
    chunk = max(16, min(comm.min_bytes // R, 64 << 20) // 16 * 16)
    src = torch.ones(chunk, dtype=torch.uint8, device=comm.device)
    peers = [p for p in range(R) if p != me] or [me]

    def copy():
        for p in peers:
            comm.peers[p][me * chunk:(me + 1) * chunk].copy_(src)

    ms = C.timed(copy, a.iters, a.warmup, comm.device, None)
    return dict(chunk_bytes=chunk, peers=len(peers), ms=ms, GBps=C.gbps(chunk * len(peers), ms))


def rank_main(a: argparse.Namespace) -> int:
    """One rank: inputs, our exchange (checked, timed), the NCCL baseline, the p2p copy; rank 0 reports."""
    t_start = time.perf_counter()
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.small:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // R))
    a.device = "cpu" if a.small else "cuda"
    device, backend, sharing = C.pick_device(a)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=a.timeout))
    import triton_ep

    gen = torch.Generator().manual_seed(rank)
    x = C.random_rows(a.tokens, a.hidden, gen, device)
    idx = C.random_topk(a.tokens, a.topk, a.experts, gen, device)
    w = torch.rand(idx.shape, generator=gen).to(device)
    buf = triton_ep.Buffer(dist.group.WORLD, C.nvl_bytes_hint(a.hidden, R), device=device)
    steps = C.stages(("triton-ep", "reference check", "all_to_all baseline", "p2p copy"), "bench_ep8 rank 0",
                     show=rank == 0)
    next(steps)
    ours, outs = C.dispatch_combine(buf, x, idx, w, a.experts, a.iters, a.warmup, show_progress=rank == 0)
    next(steps)
    checks = check_reference(a, rank, backend, x, idx, w, outs)
    checks["combine_expected_ok"] = ours.pop("combine_ok")
    nccl = None
    next(steps)
    if backend == "nccl" or (a.a2a_on_gloo and device.type == "cpu"):
        nccl = nccl_baseline(a, x, outs[7], outs[0], outs[6])
        checks["nccl_dispatch_equal"] = nccl.pop("dispatch_ok")
        checks["nccl_combine_close"] = nccl.pop("combine_close")
    elif rank == 0:
        C.say(f"[bench_ep8] backend {backend} ({'CPU' if device.type == 'cpu' else f'{sharing} ranks per GPU'}): "
              f"the NCCL all_to_all_single baseline is skipped (it needs one GPU per rank)")
    next(steps)
    p2p = p2p_copy(a, buf)
    next(steps, None)
    buf.destroy()

    per_rank = dict(ours=ours, nccl=nccl, p2p=p2p, checks=checks)
    every = [None] * R
    dist.all_gather_object(every, per_rank)
    if rank == 0:
        report(a, every, device, backend, sharing, time.perf_counter() - t_start)
    ok = all(all(e["checks"].values()) for e in every)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def figures_note(device, ranks: int, sharing: int) -> str:
    """What the table's figures mean for ``ranks`` ranks on ``device`` with ``sharing`` ranks per GPU."""
    if device.type == "cpu":
        return ("CPU: rank processes over gloo, kernels under the Triton interpreter; ms is interpreter wall time, "
                "GB/s (ours and the p2p copy) host memory: functional figures, they say nothing about GPU or "
                "NVLink speed")
    if ranks == 1:
        return "dry run (one rank on one GPU, nothing crosses NVLink): functional figures, not NVLink bandwidth"
    if sharing > 1:
        return f"dry run ({sharing} ranks time-slice each GPU): functional figures, not NVLink bandwidth"
    return "one GPU per rank: GB/s is DeepEP's per-rank NVLink figure"


def report(a, every, device, backend: str, sharing: int, elapsed_s: float) -> None:
    """Rank 0: the table (slowest rank's ms, mean GB/s per rank) and ``<out>/ep8.json``."""
    R = len(every)
    nbytes = [e["ours"]["recv_bytes"] for e in every]

    def row(name, key_of):
        ms = [key_of(e) for e in every]
        bw = sum(b / m / 1e6 for b, m in zip(nbytes, ms)) / R
        return dict(name=name, ms=max(ms), GBps=bw)

    lib = backend.upper()
    rows = [row("triton-ep dispatch", lambda e: e["ours"]["dispatch_ms"]),
            row("triton-ep combine", lambda e: e["ours"]["combine_ms"])]
    if every[0]["nccl"] is not None:
        for op in ("dispatch", "combine"):
            rows.append(row(f"{lib} {op} (a2a + {'pack' if op == 'dispatch' else 'reduce'})",
                            lambda e, op=op: e["nccl"][f"{op}_ms"]))
            rows.append(row(f"{lib} {op} (a2a only)", lambda e, op=op: e["nccl"][f"{op}_a2a_ms"]))
    p2p_GBps = sum(e["p2p"]["GBps"] for e in every) / R
    by = {r["name"]: r for r in rows}
    for r in rows:
        op = "dispatch" if "dispatch" in r["name"] else "combine"
        nccl = by.get(f"{lib} {op} (a2a + {'pack' if op == 'dispatch' else 'reduce'})")
        r["ours_over_nccl_GBps"] = (r["GBps"] / nccl["GBps"]) if (nccl and r["name"].startswith("triton")) else None
        r["frac_of_p2p"] = r["GBps"] / p2p_GBps
    print(f"[bench_ep8] {R} ranks, {C.device_name() if device.type == 'cuda' else 'cpu'}, backend {backend}"
          f"{f', {sharing} ranks per GPU' if sharing > 1 else ''}; {a.tokens} tokens x {a.hidden} bf16, "
          f"top-{a.topk} of {a.experts} experts; rows received per rank {[e['ours']['recv_rows'] for e in every]}")
    C.print_table(["", "ms (slowest rank)", "GB/s per rank", f"ours/{lib}", "of p2p copy"],
                  [[r["name"], C.sig(r["ms"]), C.sig(r["GBps"]), C.sig(r["ours_over_nccl_GBps"], 3),
                    C.sig(r["frac_of_p2p"], 3)] for r in rows])
    print(f"p2p copy (all ranks into all peers at once): {p2p_GBps:.1f} GB/s per rank sent "
          f"({every[0]['p2p']['peers']} peers x {every[0]['p2p']['chunk_bytes'] / 1e6:.1f} MB)")
    checks = {k: all(e["checks"][k] for e in every) for k in every[0]["checks"]}
    print(f"checks: {checks}")
    note = figures_note(device, R, sharing)
    print(f"({note})")
    C.write_json(os.path.join(a.out, "ep8.json"), dict(
        ranks=R, device=C.device_name() if device.type == "cuda" else "cpu", backend=backend, ranks_per_gpu=sharing,
        tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts, iters=a.iters, rows=rows,
        p2p_GBps=p2p_GBps, checks=checks, ok=all(checks.values()), note=note, per_rank=every,
        env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                            "NVSHMEM_DISABLE_NVLS")},
        elapsed_s=elapsed_s))


def main(argv=None) -> int:
    """Parse the command line and run ``rank_main`` on every rank (see examples/_launch.py)."""
    a = parse_args(argv)
    return _launch.run(functools.partial(rank_main, a), a.ranks, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
