"""Latency of each normal-mode call, timed the way DeepEP's figures were: layout, dispatch, cached dispatch
and combine at several token counts, with NCCL's ``all_to_all_single`` of the same rows as an in-run anchor.

    ./run.sh python benchmarks/bench_calls.py [--ranks 2] [--tokens 128,1024,4096] [--buffers hint,2e9] [--out DIR]
    ./run.sh torchrun --nproc-per-node 2 benchmarks/bench_calls.py

``worst`` is a dispatch with ``num_worst_tokens`` = tokens x ranks (its counts stay on the device). Per
call: ``dist.barrier()`` and a device synchronise, CUDA events around the one call, the median of
``--iters`` calls, the slowest rank's median. Bandwidth is DeepEP's measure: the bf16 rows a rank receives
(dispatch) or sends back (combine) over that time. Host microseconds per call are the host time of the same
call when the previous one has finished (``perf_counter`` around the call, no synchronise inside): the
launch and argument work, which bounds small calls from below.

Shapes: hidden 7168 bf16, top-8 of 256 experts, uniform random routing (DeepEP's benchmark); ``--buffers``
``hint`` is the size frameworks pass (``Config.get_nvl_buffer_size_hint``), ``2e9`` a buffer that holds
every transfer in one round. On CPU (tiny shapes, kernels under the Triton interpreter) the figures only
show the script runs. Output: a table on rank 0's stdout and ``<out>/calls.json`` (``ranks``,
``ranks_per_gpu``, ``tokens``, µs per call); ``calls.png`` where matplotlib is installed.

Side by side with another DeepEP V1 implementation (an installed ``deep_ep``, or ``triton_ep`` itself):

    ./run.sh python benchmarks/bench_calls.py --compare deep_ep [--repeats 3] [--tokens ...] [--out DIR]

Both libraries' Buffers (the first ``--buffers`` size; the peer's built as ``Buffer(group, num_nvl_bytes, 0)``,
with ``explicitly_destroy=True`` where it takes that, and destroyed at the end only where it has
``destroy()``) live in the same rank processes and get the same inputs. Per token count and repeat, layout,
dispatch, cached dispatch and combine are timed with one library and then the other, the order alternating
(repeat 1: the peer first, repeat 2: ours first, ...); each call two ways, one after the other:

* after a barrier (``ours_host_us``, ``peer_host_us``, ``ratio``; ``ours_us``, ``peer_us``): device
  synchronise, ``dist.barrier()``, ``perf_counter`` around the one call with nothing waited for inside (host
  µs), CUDA events around it (µs, end to end; on CPU the same wall time); the median of ``--iters`` after
  ``--warmup``. The process has just woken from the barrier, so host µs include that wake-up (a cold CPU: on
  an H200 even ``Tensor.add_`` of 64 floats took 24-68 µs there against about 8 in a loop), which weighs more on
  a library with more Python on its path.
* hot, back to back (``ours_hot_host_us``, ``peer_hot_host_us``, ``hot_ratio``; ``ours_hot_us``,
  ``peer_hot_us``): device synchronise, one ``dist.barrier()``, then ``--warmup`` + ``--iters`` calls in a row
  with no synchronise or barrier between them (every rank makes the same number, so a collective call waits
  for no rank on the host), ``perf_counter`` around each; hot host µs are the median of the last ``--iters``
  (the wake-up lands in the warm-up calls), the pace a serving loop sees while its Python is hot. Hot µs are
  the loop's pace per call: CUDA events before the first timed call and after the last, over ``--iters`` (on
  CPU the loop's wall time over ``--iters``), about the larger of a call's host and GPU work; the device is
  synchronised after the loop. Where hot µs exceed hot host µs the GPU is the slower side and the host runs
  ahead, queueing launches; host µs stay free of waiting until the launch queue is full (on the order of a
  thousand pending launches, a CUDA driver limit; a call makes a few), which is why ``--compare`` takes at most
  ``HOT_CALLS_MAX`` (64) calls per loop. The plain ``dispatch`` is different: it waits on the host for the
  received counts (both libraries do), so its hot host µs include that wait, which takes in the GPU work still
  queued before it; and its layout, computed between the calls (untimed), is part of its hot µs.

Each timed call gets fresh tensors, picked before its timer from a rotation of 4 with one routing: ``x`` and
``topk_weights`` of new values, ``topk_idx`` copies of the same ids (so the cached handle stays valid); combine
takes rows of the received shape, also 4 of them; outputs are new every call. A dispatch gets the layout
``get_dispatch_layout`` returned for its ``topk_idx`` just before it (untimed), as a framework calls them. Each
figure is the slowest rank's per repeat, then the median over repeats. ``ratio`` = ``ours_host_us`` /
``peer_host_us`` and ``hot_ratio`` = ``ours_hot_host_us`` / ``peer_hot_host_us``: below 1, ours is quicker.
DeepEP's Buffer takes 2, 4 or 8 ranks, one GPU each. Output: a table on rank 0's stdout,
``<out>/calls_compare.json`` (rows of ``tokens``, ``call``, the ten figures above, ``repeats``: each repeat's
``[ours, peer]`` after-barrier host µs, ``repeats_us`` the same end to end, ``repeats_hot`` the hot host µs;
the peer module's name, file and version; ``hot_calls_max``; ``note``: what the figures mean on this machine)
and ``calls_compare.png`` (both ratios as bars; needs matplotlib). A module that does not import:
a message and exit status 2.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import importlib.metadata
import inspect
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import _launch  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CALLS = ("layout", "dispatch", "worst", "cached", "combine", "a2a_dispatch", "a2a_combine")
#: The calls ``--compare`` times with both libraries, and how many input tensors each rotates through.
COMPARED = ("layout", "dispatch", "cached", "combine")
ROTATION = 4
#: The most calls (``--warmup`` + ``--iters``) of one ``--compare`` hot loop: the host runs ahead of a slower
#: GPU by at most this many calls' launches, far below CUDA's queue of pending launches, so hot host µs do not
#: include waiting for room in it.
HOT_CALLS_MAX = 64


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; defaults are DeepEP's shapes on a GPU and tiny ones on CPU."""
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=max(torch.cuda.device_count(), 1) if gpu else 2)
    p.add_argument("--tokens", default="128,1024,4096" if gpu else "16,48")
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 16)
    p.add_argument("--topk", type=int, default=8 if gpu else 4)
    p.add_argument("--buffers", default="hint,2e9" if gpu else "hint",
                   help="comma-separated buffer sizes: 'hint' (DeepEP's size hint) or bytes such as 2e9")
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped")
    p.add_argument("--compare", metavar="MODULE",
                   help="time these calls side by side with MODULE's Buffer (DeepEP V1's API, e.g. deep_ep)")
    p.add_argument("--repeats", type=int, default=3,
                   help="with --compare: timings of each token count per library, the order alternating")
    C.add_out_arg(p, "calls.json and calls.png (with --compare: calls_compare.json and calls_compare.png)")
    a = p.parse_args(argv)
    check_args(p, a)
    if a.compare and a.warmup + a.iters > HOT_CALLS_MAX:
        p.error(f"--compare: --warmup + --iters is at most {HOT_CALLS_MAX} (the hot loop makes that many calls "
                f"back to back; more could fill the GPU's launch queue and time the wait for it)")
    return a


def check_args(p, a) -> None:
    """Argument errors of parser ``p`` (exit status 2, before any rank starts): counts of at least 1 (``--warmup`` at
    least 0, ``--timeout`` above 0), ``--tokens`` a comma-separated list of token counts of at least 1, each of
    ``--buffers`` ``hint`` or a number of bytes of at least 1, ``--experts`` a multiple of ``--ranks``, ``--topk``
    at most ``--experts``, bf16 rows of whole 16 bytes (``--hidden`` a multiple of 8), ``--out`` a folder this
    process can write in."""
    C.check_shape_args(p, a, ("ranks", "hidden", "experts", "topk", "iters", "repeats"), 8,
                       "bf16 rows of whole 16 bytes")
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        p.error(f"--tokens must be comma-separated token counts of at least 1, got {a.tokens!r}")
    a.token_list, a.buffer_list = tokens, a.buffers.split(",")     # (parsed once; the runs read these)
    for b in a.buffer_list:
        try:
            ok = b == "hint" or float(b) >= 1
        except ValueError:
            ok = False
        if not ok:
            p.error(f"--buffers must be comma-separated 'hint' or byte counts of at least 1, got {b!r} in "
                    f"{a.buffers!r}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, iters: int, warmup: int, device) -> tuple:
    """(median device-or-wall µs, median host µs) of ``fn()``, every call started together after a barrier."""
    return time_drawn(lambda i: fn, iters, warmup, device)


def time_drawn(draw, iters: int, warmup: int, device) -> tuple:
    """:func:`time_call` of a new callable each time: ``draw(i)`` gives call ``i``'s (its inputs picked, any
    untimed set-up done) before the synchronise, the barrier and the timer."""
    times, host = [], []
    for i in range(warmup + iters):
        fn = draw(i)
        _sync(device)
        dist.barrier()
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            e1.record()
            _sync(device)
            t = e0.elapsed_time(e1) * 1e3
        else:
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            t = (h1 - h0) * 1e6
        if i >= warmup:
            times.append(t)
            host.append((h1 - h0) * 1e6)
    return statistics.median(times), statistics.median(host)


def time_hot(draw, iters: int, warmup: int, device) -> tuple:
    """(µs per call at the loop's pace, median host µs) of ``warmup + iters`` calls made back to back after one
    barrier: a device synchronise, the barrier, then per call ``draw(i)`` (inputs picked, untimed set-up such as
    dispatch's layout done, as a framework calls them) and the call with ``perf_counter`` around it, no
    synchronise or barrier between calls; the host µs are the median of the last ``iters``. µs: CUDA events
    before the first of those and after the last, over ``iters`` (on CPU their wall time over ``iters``): the
    loop's pace, about the larger of a call's host and GPU work, untimed set-up included. The device is
    synchronised after the loop. Every rank must make the same number of calls (collective calls then wait for
    no rank on the host)."""
    cuda = device.type == "cuda"
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    _sync(device)
    dist.barrier()
    for i in range(warmup + iters):
        if i == warmup:
            if cuda:
                e0.record()
            w0 = time.perf_counter()
        fn = draw(i)
        h0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - h0) * 1e6)
    w1 = time.perf_counter()
    if cuda:
        e1.record()
    _sync(device)
    pace = e0.elapsed_time(e1) * 1e3 / iters if cuda else (w1 - w0) * 1e6 / iters
    return pace, statistics.median(host[warmup:])


def one_case(a, tokens: int, nbytes: int, device, rank: int, R: int) -> dict:
    """Every call of one (tokens, buffer) case on this rank: medians in µs and received bytes."""
    import triton_ep
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    x = C.random_rows(tokens, a.hidden, gen, device)
    idx = C.random_topk(tokens, a.topk, a.experts, gen, device)
    w = torch.rand(idx.shape, generator=gen).to(device)
    buf = triton_ep.Buffer(dist.group.WORLD, nbytes, device=device)
    lay = buf.get_dispatch_layout(idx, a.experts)
    per_rank, _, per_expert, in_rank, _ = lay

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    first = dispatch()
    recv_x, handle = first[0], first[4]
    out = {}
    def worst():         # num_worst_tokens: the counts stay on the device (no host wait)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                            num_worst_tokens=tokens * R)

    for name, fn in (("layout", lambda: buf.get_dispatch_layout(idx, a.experts)), ("dispatch", dispatch),
                     ("worst", worst),
                     ("cached", lambda: buf.dispatch(x, handle=handle)), ("combine", lambda: buf.combine(recv_x, handle))):
        out[name], out[name + "_host"] = time_call(fn, a.iters, a.warmup, device)
    # NCCL anchor: the same rows, packed beforehand, through all_to_all_single (both directions)
    if dist.get_backend() == "nccl":
        counts = [None] * R
        dist.all_gather_object(counts, in_rank.sum(0).tolist())
        send_splits, recv_splits = counts[rank], [counts[i][rank] for i in range(R)]
        order = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(R)])
        packed = x.index_select(0, order)
        got = torch.empty((sum(recv_splits), a.hidden), dtype=x.dtype, device=device)
        back = torch.empty((sum(send_splits), a.hidden), dtype=x.dtype, device=device)
        out["a2a_dispatch"], _ = time_call(lambda: dist.all_to_all_single(got, packed, recv_splits, send_splits),
                                           a.iters, a.warmup, device)
        out["a2a_combine"], _ = time_call(lambda: dist.all_to_all_single(back, recv_x, send_splits, recv_splits),
                                          a.iters, a.warmup, device)
    buf.check()
    buf.destroy()
    out["recv_bytes"] = int(recv_x.shape[0]) * a.hidden * 2
    return out


def init_rank(a) -> tuple:
    """Join the launched group: ``(rank, R, device, ranks sharing a GPU, backend)``; one GPU per rank over
    NCCL, else gloo (ranks sharing a GPU, or CPU)."""
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = C.on_gpu()
    ngpu = torch.cuda.device_count() if gpu else 0
    device = torch.device("cuda", rank % ngpu) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    sharing = -(-R // ngpu) if gpu else R
    backend = "nccl" if gpu and sharing == 1 else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=a.timeout))
    return rank, R, device, sharing, backend


def rank_main(a) -> int:
    rank, R, device, sharing, backend = init_rank(a)
    (compare_calls if a.compare else all_calls)(a, rank, R, device, sharing, backend)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def all_calls(a, rank: int, R: int, device, sharing: int, backend: str) -> None:
    """Every call of every (tokens, buffer) case, triton-ep alone; rank 0 reports."""
    results = []
    cases = [(t, b) for t in a.token_list for b in a.buffer_list]
    for tokens, b in C.progress(cases, desc="bench_calls", disable=rank != 0):
        nbytes = C.nvl_bytes_hint(a.hidden, R) if b == "hint" else int(float(b))
        mine = one_case(a, tokens, nbytes, device, rank, R)
        every = [None] * R
        dist.all_gather_object(every, mine)
        row = dict(tokens=tokens, buffer=b, buffer_bytes=nbytes)
        for k in mine:
            vals = [e[k] for e in every if k in e]
            row[k] = max(vals) if vals else None            # the slowest rank
        for k in ("dispatch", "cached", "combine"):
            row[k + "_GBps"] = C.gbps(row["recv_bytes"], row[k] / 1e3) if row.get(k) else None
        results.append(row)
    if rank == 0:
        report(a, results, R, sharing, backend)


def peer_buffer(mod, nbytes: int):
    """``mod.Buffer(WORLD, nbytes, 0)``, DeepEP V1's constructor; with ``explicitly_destroy=True`` where it
    takes that (DeepEP's ``destroy()`` refuses a Buffer made without it)."""
    try:
        kw = {"explicitly_destroy": True} if "explicitly_destroy" in inspect.signature(mod.Buffer).parameters else {}
    except (TypeError, ValueError):      # no signature to read (a compiled class)
        kw = {}
    return mod.Buffer(dist.group.WORLD, nbytes, 0, **kw)


def compare_inputs(a, tokens: int, rank: int, device) -> dict:
    """This rank's inputs, the same for both libraries: ``ROTATION`` tensors each of ``x`` (new values),
    ``topk_weights`` (new values) and ``topk_idx`` (copies of one routing), and the seed of combine's rows."""
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    idx = C.random_topk(tokens, a.topk, a.experts, gen, device)
    return dict(x=[C.random_rows(tokens, a.hidden, gen, device) for _ in range(ROTATION)],
                w=[torch.rand(idx.shape, generator=gen).to(device) for _ in range(ROTATION)],
                idx=[idx.clone() for _ in range(ROTATION)], seed=int(torch.randint(1 << 62, (1,), generator=gen)))


def compare_draws(buf, inp: dict, a, device) -> tuple:
    """``(rows received, {call: draw})`` of one library's Buffer on ``inp``: the untimed first dispatch (for
    its handle), then per compared call a ``draw(i)`` for :func:`time_drawn` that takes rotation
    ``i % ROTATION`` (combine: rows of the received shape drawn from ``inp``'s seed, so both libraries
    combine the same values)."""
    xs, ws, idxs = inp["x"], inp["w"], inp["idx"]

    def dispatch(k):      # the layout of this topk_idx just before, untimed, as a framework calls them
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[k], a.experts)
        return functools.partial(buf.dispatch, xs[k], num_tokens_per_rank=per_rank,
                                 num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idxs[k], topk_weights=ws[k])

    first = dispatch(0)()
    handle, n = first[4], int(first[0].shape[0])
    gen = torch.Generator().manual_seed(inp["seed"])
    rows = [C.random_rows(n, a.hidden, gen, device) for _ in range(ROTATION)]
    return n, {"layout": lambda i: functools.partial(buf.get_dispatch_layout, idxs[i % ROTATION], a.experts),
               "dispatch": lambda i: dispatch(i % ROTATION),
               "cached": lambda i: functools.partial(buf.dispatch, xs[i % ROTATION], handle=handle),
               "combine": lambda i: functools.partial(buf.combine, rows[i % ROTATION], handle)}


def compare_calls(a, rank: int, R: int, device, sharing: int, backend: str) -> None:
    """``--compare``: the compared calls with triton-ep's Buffer and the peer module's, alternately, per
    token count and repeat; rank 0 reports."""
    import triton_ep
    peer = importlib.import_module(a.compare)
    b = a.buffer_list[0]
    nbytes = C.nvl_bytes_hint(a.hidden, R) if b == "hint" else int(float(b))
    bufs = {"ours": triton_ep.Buffer(dist.group.WORLD, nbytes, device=device), "peer": peer_buffer(peer, nbytes)}
    rows = []
    for tokens in C.progress(a.token_list, desc="bench_calls --compare",
                             disable=rank != 0):
        inp = compare_inputs(a, tokens, rank, device)
        recv, draws = {}, {}
        for side, buf in bufs.items():
            recv[side], draws[side] = compare_draws(buf, inp, a, device)
        if recv["ours"] != recv["peer"]:
            raise RuntimeError(f"rank {rank}, {tokens} tokens: {a.compare} received {recv['peer']} rows, "
                               f"triton_ep {recv['ours']}: not the same routing")
        mine = []            # per repeat: {side: {call: (µs, host µs, hot µs, hot host µs)}}
        for r in range(a.repeats):
            mine.append({side: {c: time_drawn(draws[side][c], a.iters, a.warmup, device) +
                                time_hot(draws[side][c], a.iters, a.warmup, device) for c in COMPARED}
                         for side in (("peer", "ours") if r % 2 == 0 else ("ours", "peer"))})
        every = [None] * R
        dist.all_gather_object(every, mine)
        rows += compare_rows(tokens, every)
    bufs["ours"].check()
    for buf in bufs.values():
        if callable(getattr(buf, "destroy", None)):
            buf.destroy()
    if rank == 0:
        compare_report(a, rows, R, sharing, backend, peer, b, nbytes)


#: The figures of one timed call in :func:`compare_calls`, in order: after a barrier (µs, host µs), then hot.
FIGURES = ("us", "host_us", "hot_us", "hot_host_us")


def compare_rows(tokens: int, every: list) -> list:
    """Rows of one token count from every rank's timings: per call, repeat and figure (:data:`FIGURES`) the
    slowest rank's median, then the median over repeats of each; ``ratio`` = ours / peer host µs after a
    barrier, ``hot_ratio`` = ours / peer hot host µs."""
    rows = []
    for c in COMPARED:
        # slow[r][side][j] = figure j of repeat r, the slowest rank's
        slow = [{side: tuple(max(e[r][side][c][j] for e in every) for j in range(len(FIGURES)))
                 for side in ("ours", "peer")} for r in range(len(every[0]))]
        row = dict(tokens=tokens, call=c)
        for j, f in enumerate(FIGURES):
            for side in ("ours", "peer"):
                row[f"{side}_{f}"] = statistics.median(rep[side][j] for rep in slow)
        for ratio, f in (("ratio", "host_us"), ("hot_ratio", "hot_host_us")):
            row[ratio] = row["ours_" + f] / row["peer_" + f] if row["peer_" + f] else None
        for key, f in (("repeats", "host_us"), ("repeats_us", "us"), ("repeats_hot", "hot_host_us")):
            j = FIGURES.index(f)
            row[key] = [[rep["ours"][j], rep["peer"][j]] for rep in slow]
        rows.append(row)
    return rows


def module_info(mod) -> dict:
    """A module's name, file and version (``__version__``, else its installed distribution's; else None)."""
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(mod.__name__.split(".")[0])
        except importlib.metadata.PackageNotFoundError:
            pass
    return dict(module=mod.__name__, file=getattr(mod, "__file__", None), version=version)


def compare_note(R: int, sharing: int) -> str:
    """What ``--compare``'s figures mean on this machine."""
    if not C.on_gpu():
        return (f"CPU: {R} ranks share this CPU and triton-ep's kernels run under the Triton interpreter; host µs "
                f"and µs (after a barrier and hot) are all wall time of the calls: they show the comparison runs "
                f"and say nothing about GPU speed")
    hot = ("; hot µs above hot host µs: the GPU is the slower side (the host queues ahead, up to "
           f"{HOT_CALLS_MAX} calls); dispatch's hot host µs include its host wait for the counts")
    if sharing > 1:
        return (f"{sharing} ranks share each GPU: host µs (each process's own Python and launch work) compare; "
                f"µs (CUDA events) are the GPU's time-slicing between processes and do not" + hot)
    return ("one GPU per rank: host µs are the Python and launch work of one call (nothing waited for inside), "
            "µs the CUDA-event time of the same call, end to end; both compare" + hot)


def compare_report(a, rows, R, sharing, backend, peer, buffer: str, nbytes: int) -> None:
    import triton_ep
    gpu = C.on_gpu()
    note = compare_note(R, sharing)
    C.say(f"[bench_calls] {C.device_name()}, {R} ranks ({backend}), hidden {a.hidden}, top-{a.topk} of "
          f"{a.experts}, buffer {buffer}; triton_ep vs {a.compare}, median of {a.repeats} repeats (order "
          f"alternating), slowest rank. host us: perf_counter around one call right after a synchronise and a "
          f"barrier (includes the process waking from the barrier), median of {a.iters}; us: CUDA events around "
          f"that call; ratio = ours / peer host us. hot host us: the same call made {a.warmup} + {a.iters} times "
          f"back to back after one barrier, median of the last {a.iters}; hot us: that loop's CUDA-event time per "
          f"call; hot ratio = ours / peer hot host us. Ratios below 1: ours quicker; {note}")
    C.print_table(["T", "call", "ours host us", "peer host us", "ratio", "ours hot host us", "peer hot host us",
                   "hot ratio", "ours us", "peer us", "ours hot us", "peer hot us"],
                  [[r["tokens"], r["call"], C.sig(r["ours_host_us"]), C.sig(r["peer_host_us"]), C.sig(r["ratio"], 3),
                    C.sig(r["ours_hot_host_us"]), C.sig(r["peer_hot_host_us"]), C.sig(r["hot_ratio"], 3),
                    C.sig(r["ours_us"]), C.sig(r["peer_us"]), C.sig(r["ours_hot_us"]), C.sig(r["peer_hot_us"])]
                   for r in rows])
    path = os.path.join(a.out, "calls_compare.json")
    C.write_json(path, dict(device=C.device_name(), ranks=R, ranks_per_gpu=sharing if gpu else None,
                            backend=backend, hidden=a.hidden, experts=a.experts, topk=a.topk, iters=a.iters,
                            warmup=a.warmup, num_repeats=a.repeats, rotation=ROTATION, buffer=buffer,
                            buffer_bytes=nbytes, ours=module_info(triton_ep), peer=module_info(peer),
                            order="repeat 1: the peer first, then ours; repeat 2: ours first; and so on",
                            hot_calls_max=HOT_CALLS_MAX,
                            note=note, results=rows))
    C.bar_chart(os.path.join(a.out, "calls_compare.png"), [f"T{r['tokens']} {r['call']}" for r in rows],
                {"ours / peer host µs after a barrier": [r["ratio"] or 0.0 for r in rows],
                 "ours / peer hot host µs": [r["hot_ratio"] or 0.0 for r in rows]},
                f"triton-ep / {a.compare}, {R} ranks, {C.device_name()}", "ratio (below 1: ours quicker)",
                hline=1.0)
    C.say(f"[bench_calls] wrote {path}")


def peer_error(a) -> str:
    """Why ``--compare`` cannot run here ("" when it can): the module does not import, or DeepEP's rank
    counts."""
    try:
        mod = importlib.import_module(a.compare)
    except Exception as e:  # noqa: BLE001 - any failure to import is reported the same way
        return f"--compare {a.compare}: module not importable: {type(e).__name__}: {e}"
    if not callable(getattr(mod, "Buffer", None)):
        return f"--compare {a.compare}: the module has no Buffer class (DeepEP V1's API is compared)"
    R = int(os.environ["WORLD_SIZE"]) if _launch.launched_externally() else a.ranks
    if a.compare.split(".")[0] == "deep_ep" and R not in (2, 4, 8):
        return f"--compare {a.compare}: DeepEP's Buffer takes 2, 4 or 8 ranks, not {R}"
    return ""


def report(a, results, R, sharing, backend) -> None:
    gpu = C.on_gpu()
    what = ("GPU: CUDA-event µs of one call, slowest rank's median" if gpu and sharing == 1 else
            f"{R} ranks share {'each GPU' if gpu else 'this CPU'}: functional figures, not speed")
    C.say(f"[bench_calls] {C.device_name()}, {R} ranks ({backend}), hidden {a.hidden}, top-{a.topk} of "
          f"{a.experts}; {what}")
    heads = ["T", "buffer"] + [c + " us" for c in CALLS] + ["host us (l/d/w/c/cb)", "cached GB/s", "combine GB/s"]
    rows = []
    for r in results:
        host = "/".join(f"{r[c + '_host']:.0f}" for c in ("layout", "dispatch", "worst", "cached", "combine"))
        rows.append([r["tokens"], r["buffer"]] + [C.sig(r.get(c), 4) for c in CALLS] +
                    [host, C.sig(r["cached_GBps"]), C.sig(r["combine_GBps"])])
    C.print_table(heads, rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "calls.json")
    C.write_json(path, dict(device=C.device_name(), ranks=R, ranks_per_gpu=sharing if gpu else None,
                            backend=backend, hidden=a.hidden, experts=a.experts, topk=a.topk, iters=a.iters,
                            note=what, results=results))
    labels = [f"T{r['tokens']} {r['buffer']}" for r in results]
    C.bar_chart(os.path.join(a.out, "calls.png"), labels,
                {c: [r.get(c) or 0 for r in results] for c in ("layout", "dispatch", "worst", "cached", "combine")},
                f"triton-ep calls, {R} ranks, {C.device_name()}", "µs per call (slowest rank)")
    C.say(f"[bench_calls] wrote {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    err = peer_error(a) if a.compare else ""
    if err:
        print(err, file=sys.stderr)
        return 2
    return _launch.run(functools.partial(rank_main, a), a.ranks, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
