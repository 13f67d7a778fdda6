"""Kernel benchmark on one GPU: each triton-ep kernel at DeepSeek-V3 shapes against the copy ceiling and
against the same operation written plainly in PyTorch, plus end-to-end dispatch/combine through
``triton_ep.Buffer`` with rank processes sharing the GPU.

    ./run.sh python benchmarks/bench_kernels.py [--out DIR] [--sweep] [--small] [--no-e2e]

Method (benchmarks/README.md says more): count the bytes each kernel must move first, print the
prediction ``bytes / ceiling`` next to the measured median time; the ceiling is a large device-to-device
copy (bytes read plus written per second). One "case" holds the inputs of ``R`` source ranks (8 at
DeepSeek-V3 shapes) and their ``R`` buffers in this one process (``LocalWorld``); each timed call handles
one rank's share and successive calls rotate over the ranks, so L2 does not serve repeated inputs (and
``do_bench`` flushes L2 before every call). Every output is checked against the PyTorch version.

``--sweep`` times a grid of launch parameters per kernel (mutating ``triton_ep.kernels._util.GPU_TUNING``),
checks each configuration's output is bitwise the default's, and writes the best to ``<out>/tuning_h200.json``.
``--small`` (the default without CUDA) uses tiny shapes and runs the kernels under the Triton interpreter:
about 15 s on two CPU cores, figures that show the script runs and say nothing about GPU speed (the H200
targets are then not checked).
Outputs: one table on stdout, ``<out>/kernels.json`` and ``<out>/kernels.png``; ``--out`` defaults to
``out/benchmarks/`` (ignored by git). The committed H200 results are made with ``--out benchmarks/results``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

import triton_ep  # noqa: E402
from triton_ep import kernels  # noqa: E402
from triton_ep.kernels import _util  # noqa: E402
from triton_ep.kernels.combine import record_bytes as combine_record_bytes  # noqa: E402
from triton_ep.kernels.geometry import record_words as dispatch_record_words  # noqa: E402
from triton_ep.transport.ipc import LocalWorld  # noqa: E402

KERNELS = ("layout", "dispatch_send", "dispatch_recv", "combine_send", "combine_reduce")
TARGET_FRACTION = 0.8          # dispatch copy and combine reduction at 4096 tokens: >= 80% of the ceiling
TARGET_LAYOUT_US = 10.0        # layout of 4096 x 8 ids: under 10 us
TARGET_OF_COPY = 0.9           # every data kernel at 4096 tokens: >= 90% of Tensor.copy_ of its bytes (graph replay)
DATA_KERNELS = KERNELS[1:]


def sweep_grid(kernel: str, small: bool) -> List[Dict[str, object]]:
    """The launch configurations ``--sweep`` tries for ``kernel`` (two per kernel with ``small``)."""
    if kernel == "layout":
        grid = [dict(block_t=t, block_b=b, num_warps=w) for t in (64, 128, 256, 512, 1024) for b in (16, 64)
                for w in (2, 4, 8, 16) if t * 8 >= 32 * w]
    elif kernel == "dispatch_send":
        # whole rows per program (or a capped grid of programs looping over tokens), or one row slice per
        # program (split_w); with and without streaming stores
        grid = [dict(block_t=1, block_w=s, num_warps=w, split_w=0, store_cache=c, programs_per_sm=p)
                for s in (2048, 4096) for w in (8, 16, 32) for c in ("", ".cs") for p in (0, 2, 4, 8)]
        grid += [dict(block_t=t, block_w=s, num_warps=w, split_w=1, store_cache="", programs_per_sm=0)
                 for t in (1, 2) for s in (512, 1024, 2048) for w in (4, 8) if s // (32 * w) >= 4]
    else:
        wide = "block_h" if kernel == "combine_reduce" else "block_w"
        sizes = (512, 1024, 2048, 4096) if kernel == "combine_reduce" else (256, 512, 1024, 2048)
        grid = [{"block_t": t, wide: s, "num_warps": w} for t in (1, 2, 4, 8) for s in sizes for w in (4, 8)]
    if small:
        return grid[:: max(1, len(grid) // 2)][:2]
    random.Random(0).shuffle(grid)          # a sweep cut short by its time budget still samples the whole grid
    return grid


def active_table() -> Dict[str, Dict[str, int]]:
    """The tuning table the launchers read now (``INTERP_TUNING`` under the interpreter, else ``GPU_TUNING``)."""
    return _util.INTERP_TUNING if _util.interpreted() else _util.GPU_TUNING


class Case:
    """Inputs of ``R`` source ranks at one shape, their buffers in one process and every kernel's
    arguments, computed the way ``Intranode.dispatch_steps`` / ``combine_steps`` (triton_ep/modes/intranode.py)
    compute them (one round: each buffer holds a whole transfer). Rank ``i``'s routing is drawn with seed ``seed + i``."""

    def __init__(self, tokens: int, hidden: int, topk: int, experts: int, ranks: int, device, seed: int = 0):
        self.T, self.H, self.K, self.E, self.R = tokens, hidden, topk, experts, ranks
        self.dev = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        R, T, K = ranks, tokens, topk
        self.x = [C.random_rows(T, hidden, gen, self.dev) for _ in range(R)]
        self.idx = [C.random_topk(T, K, experts, gen, self.dev) for _ in range(R)]
        self.w = [torch.rand((T, K), generator=gen).to(self.dev) for _ in range(R)]
        self.lay = [kernels.routing_layout(i, experts, R) for i in self.idx]
        counts = np.stack([lay[0].cpu().numpy().astype(np.int64) for lay in self.lay])      # [src, dst]
        self.counts, self.rpm = counts, np.cumsum(counts, axis=0)
        self.recv = self.rpm[-1]                           # rows each rank receives
        self.sent = counts.sum(axis=1)                     # rows each rank sends (= its combine slots)
        self.wx = hidden // 2
        self.rec_words = dispatch_record_words(self.wx, 0, K, with_src=True)
        self.comb_rb = combine_record_bytes(hidden, 0)
        nbytes = max(int(self.recv.max()) * self.rec_words * 4, int(self.sent.max()) * self.comb_rb, 4096)
        self.world = LocalWorld(R, nbytes, device=str(self.dev))
        self.nbytes = self.world.data[0].numel()
        self.cap = self.nbytes // (self.rec_words * 4)
        self.ccap = self.nbytes // self.comb_rb
        self.delta = [self.world.comm(r).delta_bytes // 4 for r in range(R)]
        self.rec = [d.view(torch.int32) for d in self.world.data]
        dev64 = lambda a: torch.tensor(np.ascontiguousarray(a), dtype=torch.int64, device=self.dev)  # noqa: E731
        self.row_base = [dev64(self.rpm[i - 1] if i > 0 else np.zeros(R)) for i in range(R)]
        self.prefix = [dev64(self.rpm[:, j]) for j in range(R)]
        self.comb_base = [dev64(counts[:, :j].sum(axis=1)) for j in range(R)]
        self.send_base = [dev64(np.concatenate([[0], np.cumsum(counts[i])[:-1]])) for i in range(R)]
        # Host-computed token lists per (source, destination): the PyTorch versions get them for free.
        self.tok = [[lay[2][:, r].nonzero().flatten() for r in range(R)] for lay in self.lay]
        self.slot_tok = [torch.cat(t) for t in self.tok]
        self.expert_out = [C.random_rows(int(n), hidden, gen, self.dev) for n in self.recv]
        self.out_x = [torch.empty((int(n), self.wx), dtype=torch.int32, device=self.dev) for n in self.recv]
        self.out_idx = [torch.empty((int(n), K), dtype=torch.int64, device=self.dev) for n in self.recv]
        self.out_w = [torch.empty((int(n), K), dtype=torch.int32, device=self.dev) for n in self.recv]
        self.out_src = [torch.empty(int(n), dtype=torch.int32, device=self.dev) for n in self.recv]
        self.out = [torch.empty((T, hidden), dtype=torch.bfloat16, device=self.dev) for _ in range(R)]
        self.arange = torch.arange(T, dtype=torch.int32, device=self.dev)[:, None]
        self.layout_out: List[Optional[tuple]] = [None] * R

    @property
    def label(self) -> str:
        """``T=4096 H=7168 K=8 E=256 R=8``."""
        return f"T={self.T} H={self.H} K={self.K} E={self.E} R={self.R}"

    def rows(self, r: int, width: int) -> torch.Tensor:
        """Rank ``r``'s buffer as int32 rows of ``width`` words."""
        return self.rec[r][: self.nbytes // (4 * width) * width].view(-1, width)

    # ------------------------------------------------------------------ our kernels, one rank's share each
    def layout(self, i: int) -> None:
        """Routing layout of source rank ``i``'s ids."""
        self.layout_out[i] = kernels.routing_layout(self.idx[i], self.E, self.R)[:4]

    def dispatch_send(self, i: int) -> None:
        """Source rank ``i`` writes its records into every receiver's buffer."""
        kernels.dispatch_send(self.x[i].view(torch.int32), None, self.idx[i], self.w[i].view(torch.int32),
                              self.lay[i][3], self.row_base[i], self.delta[i], self.rec[i], 0, self.cap, self.E,
                              self.rec_words, with_src=True)

    def dispatch_recv(self, j: int) -> None:
        """Receiver ``j`` unpacks the records in its buffer."""
        kernels.dispatch_recv(self.rec[j], int(self.recv[j]), 0, j, self.E // self.R, self.wx, 0, self.K,
                              self.rec_words, self.out_x[j], None, self.out_idx[j], self.out_w[j], self.out_src[j])

    def combine_send(self, j: int) -> None:
        """Receiver ``j`` returns its expert outputs to the sources' combine areas."""
        kernels.combine_send(self.expert_out[j].view(torch.int32), None, int(self.recv[j]), self.prefix[j],
                             self.comb_base[j], self.delta[j], self.rec[j], 0, self.ccap, self.comb_rb // 4)

    def combine_reduce(self, i: int) -> None:
        """Source rank ``i`` sums the rows returned to its combine area per token."""
        kernels.combine_reduce(self.world.data[i], self.lay[i][3], self.send_base[i], 0, self.ccap, self.H, 0,
                               self.comb_rb, None, self.out[i], [], None, None, first=True, last=True)

    # ------------------------------------------------------------------ the same operations in plain PyTorch
    def layout_torch(self, i: int) -> None:
        """bincount for the expert histogram, scatter for ``is_token_in_rank``, cumsum for the positions."""
        ids, E, R = self.idx[i], self.E, self.R
        valid = (ids >= 0) & (ids < E)
        per_expert = torch.bincount(torch.where(valid, ids, E).flatten(), minlength=E + 1)[:E].to(torch.int32)
        rank_of = torch.where(valid, ids // (E // R), R)
        in_rank = torch.zeros((ids.shape[0], R + 1), dtype=torch.bool, device=ids.device)
        in_rank.scatter_(1, rank_of, True)
        in_rank = in_rank[:, :R]
        csum = in_rank.to(torch.int32).cumsum(0, dtype=torch.int32)
        send_pos = torch.where(in_rank, csum - 1, -1)        # int32, as routing_layout (DeepEP's send_head)
        self.layout_out[i] = (csum[-1].to(torch.int32), per_expert, in_rank, send_pos)

    def dispatch_send_torch(self, i: int) -> None:
        """index_select of the rows (and of ids, weights, source index) per destination, copied into place."""
        W, K = self.wx, self.K
        xw = self.x[i].view(torch.int32)
        meta = torch.cat([self.idx[i].to(torch.int32), self.w[i].view(torch.int32), self.arange], dim=1)
        for r in range(self.R):
            t = self.tok[i][r]
            b = int(self.rpm[i - 1, r]) if i > 0 else 0
            v = self.rows(r, self.rec_words)[b:b + t.numel()]
            v[:, :W] = xw.index_select(0, t)
            v[:, W:W + 2 * K + 1] = meta.index_select(0, t)

    def dispatch_recv_torch(self, j: int) -> None:
        """Strided copies out of the records; ids made local with ``where``."""
        W, K, El = self.wx, self.K, self.E // self.R
        v = self.rows(j, self.rec_words)[: int(self.recv[j])]
        self.out_x[j].copy_(v[:, :W])
        g = v[:, W:W + K].to(torch.int64)
        here = (g >= j * El) & (g < (j + 1) * El)
        self.out_idx[j].copy_(torch.where(here, g - j * El, -1))
        self.out_w[j].copy_(torch.where(here, v[:, W + K:W + 2 * K], 0))
        self.out_src[j].copy_(v[:, W + 2 * K])

    def combine_send_torch(self, j: int) -> None:
        """One slice copy per source rank (its rows are contiguous on both sides)."""
        xw = self.expert_out[j].view(torch.int32)
        for i in range(self.R):
            s, e = (int(self.rpm[i - 1, j]) if i > 0 else 0), int(self.rpm[i, j])
            b = int(self.counts[i, :j].sum())
            self.rows(i, self.comb_rb // 4)[b:b + e - s, :self.wx].copy_(xw[s:e])

    def combine_reduce_torch(self, i: int) -> None:
        """index_add_ of every returned row (as fp32) into its token, rounded once to bf16."""
        n = int(self.sent[i])
        slots = self.world.data[i][: n * self.comb_rb].view(torch.bfloat16).view(n, self.comb_rb // 2)[:, :self.H]
        acc = torch.zeros((self.T, self.H), dtype=torch.float32, device=self.dev)
        acc.index_add_(0, self.slot_tok[i], slots.float())
        self.out[i].copy_(acc)

    # ------------------------------------------------------------------ what each kernel writes and must move
    def outputs(self, kernel: str) -> List[torch.Tensor]:
        """The tensors ``kernel`` writes (views of the buffers for the send kernels), all ranks."""
        if kernel == "layout":
            return [t for o in self.layout_out for t in o]
        if kernel == "dispatch_send":
            return [self.world.data[r][: int(self.recv[r]) * self.rec_words * 4] for r in range(self.R)]
        if kernel == "dispatch_recv":
            return self.out_x + self.out_idx + self.out_w + self.out_src
        if kernel == "combine_send":
            return [self.world.data[i][: int(self.sent[i]) * self.comb_rb] for i in range(self.R)]
        return list(self.out)

    def reset(self, kernel: str) -> None:
        """Zero what ``kernel`` writes, so a missing write shows in the check."""
        if kernel == "layout":
            self.layout_out = [None] * self.R
        elif kernel in ("dispatch_send", "combine_send"):
            for d in self.world.data:
                d.zero_()
        else:
            for t in self.outputs(kernel):
                t.zero_()

    def min_rw(self, kernel: str) -> Tuple[float, float]:
        """Bytes one call must read and write at the least, averaged over the ranks (16-byte record
        padding excluded, small per-rank vectors ignored)."""
        T, K, R, W = self.T, self.K, self.R, self.wx
        if kernel == "layout":      # ids in; is_token_in_rank, send_pos, counts out
            return T * K * 8, T * R * (1 + 4) + 4 * (R + self.E)
        if kernel == "dispatch_send":   # rows, ids, weights, send_pos in; records out
            return T * (W * 4 + K * 12 + R * 4), float(self.sent.mean()) * (W + 2 * K + 1) * 4
        if kernel == "dispatch_recv":   # records in; rows, int64 ids, weights, source index out
            return float(self.recv.mean()) * (W + 2 * K + 1) * 4, float(self.recv.mean()) * (W * 4 + K * 12 + 4)
        if kernel == "combine_send":    # rows in, rows out
            return float(self.recv.mean()) * W * 4, float(self.recv.mean()) * W * 4
        return float(self.sent.mean()) * self.H * 2 + T * R * 4, T * self.H * 2   # slots + send_pos in, rows out

    def min_bytes(self, kernel: str) -> float:
        """:meth:`min_rw` read plus written."""
        return sum(self.min_rw(kernel))


def run_all(case: Case, fn: Callable[[int], None]) -> None:
    """Call ``fn`` once for every rank."""
    for i in range(case.R):
        fn(i)


def rotating(case: Case, fn: Callable[[int], None]) -> Callable[[], None]:
    """A no-argument callable that runs ``fn`` for rank 0, 1, ..., R-1, 0, ... on successive calls."""
    it = itertools.cycle(range(case.R))
    return lambda: fn(next(it))


def snapshot(case: Case, kernel: str, fn: Callable[[int], None]) -> List[torch.Tensor]:
    """Reset ``kernel``'s outputs, run ``fn`` for every rank, return copies of the outputs."""
    case.reset(kernel)
    run_all(case, fn)
    return [t.clone() for t in case.outputs(kernel)]


def compare(case: Case, kernel: str, want: List[torch.Tensor], exact: bool) -> str:
    """``"exact"`` when ``kernel``'s current outputs equal ``want`` bitwise; else, where ``exact`` is off,
    ``"close"`` within bf16 rounding (1e-2 relative) or a ``"MISMATCH ..."`` line."""
    got = case.outputs(kernel)
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return "exact"
    if not exact and all(torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-2) for g, w in zip(got, want)):
        return "close"
    bad = sum(not torch.equal(g, w) for g, w in zip(got, want))
    return f"MISMATCH ({bad} of {len(want)} tensors differ)"


def measure_ceiling(small: bool, warmup_ms: float, rep_ms: float) -> dict:
    """A plain device-to-device copy (``dst.copy_(src)``, 1 GiB; 16 MiB on CPU): bytes read plus written
    per second (``GBps``, the ceiling every fraction refers to). On a GPU also the write-only, read-only
    and fan-out rates of ``ceilings.py`` (``write_GBps``, ``read_GBps``, ``fanout_GBps``): what a kernel's
    own mix of reads and writes allows."""
    n = (16 << 20) if small else (1 << 30)
    dev = "cuda" if C.on_gpu() else "cpu"
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = C.bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    out = dict(bytes=2 * n, ms=ms, GBps=C.gbps(2 * n, ms))
    del src, dst
    if C.on_gpu() and not small:
        import ceilings
        bar = C.progress(total=9, desc="write/read/fan-out ceilings", unit="launch shape", leave=False)

        def bench(fn):
            ms = C.bench_ms(fn, warmup_ms, rep_ms)
            bar.update()
            return ms
        rates = ceilings.measure(bench)
        bar.close()
        out.update(write_GBps=rates["write"], read_GBps=rates["read"], fanout_GBps=rates["fanout"])
    return out


def same_bytes_copies(case: Case, nbytes: float) -> Tuple[Callable[[], None], int]:
    """``Tensor.copy_`` of the same bytes as one of ``case``'s kernel calls, and its length: ``nbytes / 2`` bytes
    read and as many written, rounded to whole MiB (``C.same_bytes_copy_length``: the rate, not the time,
    compares: see :func:`graph_against_copy`), over ``R`` source / destination pairs taken in turn as the kernel's
    calls rotate over the ranks, so L2 serves neither from the call before. The callable holds its tensors."""
    n = C.same_bytes_copy_length(nbytes)
    pairs = [(torch.ones(n, dtype=torch.uint8, device=case.dev), torch.empty(n, dtype=torch.uint8, device=case.dev))
             for _ in range(case.R)]
    it = itertools.cycle(pairs)

    def copy() -> None:
        src, dst = next(it)
        dst.copy_(src)
    return copy, n


def graph_against_copy(case: Case, kernel: str, fn: Callable[[int], None], rep_ms: float,
                       alternations: int = 3) -> Tuple[Optional[float], Optional[float]]:
    """GPU ms per call of ``fn`` (rotating over the ranks), and the ms ``Tensor.copy_`` takes to move the same
    bytes (:meth:`Case.min_bytes`) at the rate it reached: a copy of about half as many bytes
    (:func:`same_bytes_copies`) timed, then scaled to the call's bytes. Both replayed from CUDA graphs
    (``C.bench_graph_ms``), alternated ``alternations`` times, the median of each kept, so a drift of the
    GPU's clocks meets both. ``(None, None)`` on CPU or where a graph cannot be captured."""
    if not C.on_gpu():
        return None, None
    nbytes = case.min_bytes(kernel)
    copy, n = same_bytes_copies(case, nbytes)
    ours, plain = [], []
    for _ in range(alternations):
        ours.append(C.bench_graph_ms(rotating(case, fn), rep_ms))
        plain.append(C.bench_graph_ms(copy, rep_ms))
    del copy
    if None in ours or None in plain:
        return None, None
    return float(np.median(ours)), float(np.median(plain)) * nbytes / (2 * n)


def bench_case(case: Case, ceiling: dict, warmup_ms: float, rep_ms: float) -> List[dict]:
    """Every kernel of ``case``: ours and PyTorch's time, bytes, GB/s, fraction of the ceiling, checks.
    Leaves each kernel's outputs as ours made them (the next kernel's inputs)."""
    results = []
    for k in C.progress(KERNELS, desc=case.label, unit="kernel", leave=False):
        ours, plain = getattr(case, k), getattr(case, k + "_torch")
        nbytes = case.min_bytes(k)
        rd, wr = case.min_rw(k)
        ceiling_GBps = ceiling["GBps"]
        want = snapshot(case, k, ours)
        t_ours = C.bench_ms(rotating(case, ours), warmup_ms, rep_ms)
        case.reset(k)
        run_all(case, plain)
        check = compare(case, k, want, exact=k != "combine_reduce")
        t_torch = C.bench_ms(rotating(case, plain), warmup_ms, rep_ms)
        snapshot(case, k, ours)
        # GPU time alone, the host's launch overhead removed (CUDA graph replay), against Tensor.copy_ of the
        # same bytes replayed the same way
        t_graph, t_copy = graph_against_copy(case, k, ours, rep_ms)
        r = dict(shape=case.label, tokens=case.T, kernel=k, bytes=nbytes, ours_graph_us=t_graph and t_graph * 1e3,
                 copy_same_bytes_graph_us=t_copy and t_copy * 1e3,
                 frac_of_copy_same_bytes=t_copy / t_graph if t_graph and t_copy else None,
                 predicted_us=nbytes / ceiling_GBps / 1e3, read_bytes=rd, write_bytes=wr,
                 mix_predicted_us=(rd / ceiling["read_GBps"] + wr / ceiling["write_GBps"]) / 1e3
                 if "read_GBps" in ceiling else None, ours_us=t_ours * 1e3, torch_us=t_torch * 1e3,
                 ours_GBps=C.gbps(nbytes, t_ours), torch_GBps=C.gbps(nbytes, t_torch),
                 ours_frac=C.gbps(nbytes, t_ours) / ceiling_GBps, torch_frac=C.gbps(nbytes, t_torch) / ceiling_GBps,
                 ours_over_torch=t_ours / t_torch,
                 ours_frac_of_fanout=C.gbps(nbytes, t_ours) / ceiling["fanout_GBps"]
                 if k == "dispatch_send" and "fanout_GBps" in ceiling else None,
                 check_vs_torch=check, tuning=dict(active_table()[k]))
        results.append(r)
        mix = "" if r["mix_predicted_us"] is None else \
            f" (from read/write-only rates {C.sig(r['mix_predicted_us'], 3)})"
        graph = "" if t_graph is None or t_copy is None else \
            f"  graph {t_graph * 1e3:.2f} us against copy_ {t_copy * 1e3:.2f} ({t_copy / t_graph:.3f})"
        C.say(f"  {k:15s} {nbytes / 1e6:9.2f} MB  predicted {r['predicted_us']:9.2f} us{mix}  ours "
              f"{r['ours_us']:9.2f} us ({r['ours_frac']:.2f} of ceiling){graph}  torch {r['torch_us']:9.2f} us  "
              f"[{check}]")
    return results


def sweep(case: Case, small: bool, budget_s: float, only: Optional[List[str]] = None) -> dict:
    """Time every configuration of :func:`sweep_grid` per kernel on ``case`` (do_bench warmup 10 ms,
    rep 40 ms; graph replay for layout), check its outputs bitwise against the default configuration's, and return per kernel the
    default, the best correct configuration and every row. Each kernel gets an equal share of what is
    left of ``budget_s``; configurations past it are skipped (and counted). ``only``: the kernels to sweep
    (default all)."""
    table = active_table()
    out = {}
    t_end = time.monotonic() + budget_s
    names = [k for k in KERNELS if not only or k in only]
    for n_left, k in zip(range(len(names), 0, -1), names):
        default = dict(table[k])
        fn = getattr(case, k)
        want = snapshot(case, k, fn)
        # layout is launch-bound: its configurations are compared by GPU time (graph replay)
        timer = (lambda f: C.bench_graph_ms(f, 40)) if k == "layout" and C.on_gpu() else \
            (lambda f: C.bench_ms(f, 10, 40))
        t_default = timer(rotating(case, fn))
        k_end = time.monotonic() + (t_end - time.monotonic()) / n_left
        rows, skipped = [], 0
        for cfg in C.progress(sweep_grid(k, small), desc=f"sweep {k}", unit="config", leave=False):
            if time.monotonic() > k_end:
                skipped += 1
                continue
            table[k] = {**default, **cfg}
            try:
                case.reset(k)
                run_all(case, fn)
                check = compare(case, k, want, exact=True)
                ms = timer(rotating(case, fn)) if check == "exact" else None
                rows.append(dict(config=cfg, us=None if ms is None else ms * 1e3, check=check))
            except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses is a result too
                rows.append(dict(config=cfg, us=None, check=f"error: {type(e).__name__}: {str(e)[:120]}"))
            finally:
                table[k] = default
        snapshot(case, k, fn)                  # leave the default's outputs as the next kernel's inputs
        ok = [r for r in rows if r["us"] is not None]
        best = min(ok, key=lambda r: r["us"]) if ok else dict(config=default, us=t_default * 1e3)
        if best["us"] > t_default * 1e3:
            best = dict(config=default, us=t_default * 1e3)
        out[k] = dict(default=default, default_us=t_default * 1e3, best=best["config"], best_us=best["us"],
                      speedup=t_default * 1e3 / best["us"], tried=len(rows), skipped=skipped,
                      failed=[r for r in rows if r["us"] is None], rows=rows)
        C.say(f"  sweep {k:15s} default {default} {t_default * 1e3:.2f} us -> best {best['config']} "
              f"{best['us']:.2f} us ({len(rows)} tried, {skipped} skipped, {len(out[k]['failed'])} failed)")
    return out


def compare_record_align(shape: dict, warmup_ms: float, rep_ms: float) -> List[dict]:
    """dispatch_send at ``shape`` with records rounded to 4 words (16 bytes) and to 32 (128 bytes: every
    row starts on a cache line), the rest of the tuning as it is: median us and GB/s of each."""
    table = active_table()["dispatch_send"]
    default = table.get("record_align_words", 4)
    out = []
    try:
        for align in C.progress((4, 32), desc="record alignment", leave=False):
            table["record_align_words"] = align
            case = Case(shape["tokens"], shape["hidden"], shape["topk"], shape["experts"], shape["ranks"], "cuda")
            ms = C.bench_ms(rotating(case, case.dispatch_send), warmup_ms, rep_ms)
            out.append(dict(record_align_words=align, record_words=case.rec_words, us=ms * 1e3,
                            GBps=C.gbps(case.min_bytes("dispatch_send"), ms)))
            C.say(f"  dispatch_send, records rounded to {align} words ({case.rec_words} words): {ms * 1e3:.1f} us, "
                  f"{out[-1]['GBps']:.0f} GB/s")
            del case
    finally:
        table["record_align_words"] = default
    return out


def e2e_rank(rank: int, world: int, shape: dict, iters: int, warmup: int) -> dict:
    """One rank process of the end-to-end run (for ``triton_ep.testing.run_ranks``): its own inputs,
    a Buffer on the shared GPU (or CPU), timed dispatch and combine."""
    import torch.distributed as dist
    dev = torch.device("cuda", 0) if C.on_gpu() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    gen = torch.Generator().manual_seed(1000 + rank)
    x = C.random_rows(shape["tokens"], shape["hidden"], gen, dev)
    idx = C.random_topk(shape["tokens"], shape["topk"], shape["experts"], gen, dev)
    w = torch.rand(idx.shape, generator=gen).to(dev)
    buf = triton_ep.Buffer(dist.group.WORLD, C.nvl_bytes_hint(shape["hidden"], world), device=dev)
    try:
        stats, _ = C.dispatch_combine(buf, x, idx, w, shape["experts"], iters, warmup, show_progress=rank == 0)
    finally:
        buf.destroy()
    return stats


def bench_e2e(shape: dict, ranks: int, iters: int, warmup: int) -> dict:
    """Dispatch and combine through ``triton_ep.Buffer`` with ``ranks`` processes on this one GPU (gloo
    bootstrap): slowest rank's median ms, DeepEP's GB/s per rank (mean over ranks), combine check."""
    from triton_ep.testing import RankFailure, run_ranks
    t0 = time.perf_counter()
    res = run_ranks(e2e_rank, ranks, shape, iters, warmup, backend="gloo", timeout_s=240.0)
    fails = [r for r in res if isinstance(r, RankFailure)]
    if fails:
        print(f"  e2e failed: {fails[0]!r}\n{fails[0].traceback}")
        return dict(ranks=ranks, error=repr(fails[0]))
    out = dict(ranks=ranks, shape=shape, iters=iters, wall_s=time.perf_counter() - t0, note=e2e_note(ranks))
    for op in ("dispatch", "combine"):
        out[f"{op}_ms"] = max(r[f"{op}_ms"] for r in res)
        out[f"{op}_GBps"] = sum(r[f"{op}_GBps"] for r in res) / ranks
    out["recv_rows"] = [r["recv_rows"] for r in res]
    out["combine_ok"] = all(r["combine_ok"] for r in res)
    return out


def e2e_note(ranks: int) -> str:
    """What the end-to-end figures of ``ranks`` processes on this machine mean."""
    if not C.on_gpu():
        return (f"CPU functional figures: {ranks} rank processes share this CPU, kernels under the Triton "
                "interpreter; they say nothing about GPU speed")
    if ranks > 1:
        return "single-GPU functional figures: the rank processes time-slice one GPU; not bandwidth"
    return "one rank process on one GPU: functional figures, nothing crosses NVLink; not bandwidth"


def figures_note(small: bool) -> Optional[str]:
    """What this run's kernel figures mean, where they are not the GPU figures at DeepSeek-V3 shapes."""
    if not C.on_gpu():
        return C.CPU_NOTE
    if small:
        return "small shapes on a GPU: launch-bound times, not comparable with the DeepSeek-V3 figures"
    return None


def targets_skipped(small: bool) -> Optional[str]:
    """Why the H200 targets do not apply to this run (``None`` where they do: a GPU at DeepSeek-V3 shapes)."""
    if not C.on_gpu():
        return "CPU, Triton interpreter"
    return "small shapes" if small else None


def summarise_targets(results: List[dict], big_tokens: int) -> List[dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    at = {(r["kernel"], r["tokens"]): r for r in results}
    rows = []
    for k in ("dispatch_send", "combine_reduce"):
        r = at.get((k, big_tokens))
        if r:
            rows.append(dict(target=f"{k} at T={big_tokens}: >= {TARGET_FRACTION:.0%} of copy ceiling",
                             value=r["ours_frac"], met=r["ours_frac"] >= TARGET_FRACTION))
    for k in DATA_KERNELS:
        r = at.get((k, big_tokens))
        if r and r.get("frac_of_copy_same_bytes") is not None:
            rows.append(dict(target=f"{k} at T={big_tokens}: >= {TARGET_OF_COPY:.0%} of Tensor.copy_ of the same "
                             "bytes, both CUDA-graph replays", value=r["frac_of_copy_same_bytes"],
                             met=r["frac_of_copy_same_bytes"] >= TARGET_OF_COPY))
    r = at.get(("layout", big_tokens))
    if r:
        rows.append(dict(target=f"layout at T={big_tokens}: < {TARGET_LAYOUT_US} us", value=r["ours_us"],
                         met=r["ours_us"] < TARGET_LAYOUT_US))
        if r.get("ours_graph_us") is not None:
            rows.append(dict(target=f"layout at T={big_tokens}, GPU time (graph replay): < {TARGET_LAYOUT_US} us",
                             value=r["ours_graph_us"], met=r["ours_graph_us"] < TARGET_LAYOUT_US))
    for r in results:
        rows.append(dict(target=f"{r['kernel']} at T={r['tokens']}: no slower than PyTorch",
                         value=r["ours_over_torch"], met=r["ours_over_torch"] <= 1.0))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """Command line: ``--out``, ``--sweep``, ``--small``, ``--no-e2e`` and timing knobs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_out_arg(p, "kernels.json, kernels.png and, with --sweep, tuning_h200.json")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configurations; writes tuning_h200.json")
    p.add_argument("--sweep-kernels", type=lambda v: v.split(","), help="comma-separated kernels to sweep (default all)")
    p.add_argument("--sweep-budget-s", type=float, default=180.0, help="time bound of the sweep (default 180 s)")
    p.add_argument("--small", action="store_true", help="tiny shapes (the default without CUDA)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end Buffer run")
    p.add_argument("--e2e-ranks", type=int, help="rank processes of the end-to-end run (default: the shape's 8, or 4 small)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up per measurement")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement")
    a = p.parse_args(argv)
    a.small = a.small or not C.on_gpu()
    if a.e2e_ranks is not None and a.e2e_ranks < 1:
        p.error(f"--e2e-ranks must be at least 1, got {a.e2e_ranks}")
    C.check_out(p, a.out)
    return a


def print_results(results: list, e2e, note: str, small: bool, first_tokens: int):
    """The kernels' table, the targets and the end-to-end line on stdout. Returns ``(targets, skipped)``:
    :func:`summarise_targets` at ``first_tokens`` tokens (``None`` where they do not apply) and why they do not."""
    headers = ["shape", "kernel", "MB", "pred_us", "mix_us", "ours_us", "GB/s", "frac", "graph_us", "copy_us", "of_copy",
               "torch_us", "ours/torch", "check"]
    print()
    if note:
        print(f"({note})")
    C.print_table(headers, [[f"T={r['tokens']}", r["kernel"], C.sig(r["bytes"] / 1e6), C.sig(r["predicted_us"], 3),
                             C.sig(r["mix_predicted_us"], 3),
                             C.sig(r["ours_us"], 3), C.sig(r["ours_GBps"], 4), C.sig(r["ours_frac"], 3),
                             C.sig(r["ours_graph_us"], 3), C.sig(r["copy_same_bytes_graph_us"], 3),
                             C.sig(r["frac_of_copy_same_bytes"], 3),
                             C.sig(r["torch_us"], 3), C.sig(r["ours_over_torch"], 3), r["check_vs_torch"]]
                            for r in results])
    print()
    skipped = targets_skipped(small)
    targets = None if skipped else summarise_targets(results, first_tokens)
    if skipped:
        print(f"  targets (H200 at DeepSeek-V3 shapes): not applicable to this run ({skipped}), not checked")
    for t in targets or ():
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {C.sig(t['value'], 3)}")
    if e2e is not None and "error" not in e2e:
        print(f"\nend-to-end ({e2e['ranks']} processes, {e2e['note']}): dispatch {e2e['dispatch_ms']:.3f} ms "
              f"({e2e['dispatch_GBps']:.2f} GB/s per rank), combine {e2e['combine_ms']:.3f} ms "
              f"({e2e['combine_GBps']:.2f} GB/s per rank), combine check {'ok' if e2e['combine_ok'] else 'FAILED'}")
    return targets, skipped


def main(argv=None) -> int:
    """Run the benchmark; exit status 1 when any output check fails (missed targets do not fail it)."""
    a = parse_args(argv)
    t_start = time.perf_counter()
    shape = dict(C.SMALL if a.small else C.DSV3)
    token_counts = (shape["tokens"], 8) if a.small else (4096, 128)
    dev = "cuda" if C.on_gpu() else "cpu"
    note = figures_note(a.small)
    print(f"bench_kernels on {C.device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; shape {shape}, tokens {token_counts}; output to {a.out}", flush=True)
    if note:
        print(note, flush=True)
    ceiling = measure_ceiling(a.small, a.warmup_ms, a.rep_ms)
    print(f"copy ceiling{'' if C.on_gpu() else ' (this CPU, torch copy_)'}: {ceiling['GBps']:.1f} GB/s "
          f"({ceiling['bytes'] / 1e6:.0f} MB read+written in {ceiling['ms'] * 1e3:.1f} us)", flush=True)
    if "write_GBps" in ceiling:
        print(f"write-only {ceiling['write_GBps']:.1f} GB/s, read-only {ceiling['read_GBps']:.1f} GB/s, "
              f"fan-out copy (1 read, 5 writes) {ceiling['fanout_GBps']:.1f} GB/s", flush=True)
    results, tuning = [], None
    for T in token_counts:
        case = Case(T, shape["hidden"], shape["topk"], shape["experts"], shape["ranks"], dev)
        print(f"{case.label}: rows sent per rank {case.sent.tolist()}, buffer {case.nbytes / 1e6:.1f} MB per rank",
              flush=True)
        results += bench_case(case, ceiling, a.warmup_ms, a.rep_ms)
        if a.sweep and T == token_counts[0]:
            big_case = case
        else:
            del case
    align = compare_record_align(shape, a.warmup_ms, a.rep_ms) if C.on_gpu() and not a.small else None
    e2e = None
    a.e2e_ranks = a.e2e_ranks or shape["ranks"]
    if not a.no_e2e:
        print(f"end-to-end: {a.e2e_ranks} rank processes on one {'GPU' if C.on_gpu() else 'CPU'}", flush=True)
        e2e = bench_e2e(shape, a.e2e_ranks, iters=3 if a.small else 10, warmup=1 if a.small else 3)
    if a.sweep:
        print(f"sweep (budget {a.sweep_budget_s:.0f} s) on {big_case.label}", flush=True)
        tuning = sweep(big_case, a.small, a.sweep_budget_s, a.sweep_kernels)
        C.write_json(os.path.join(a.out, "tuning_h200.json"), dict(
            device=C.device_name(), shape=big_case.label,
            best={k: v["best"] for k, v in tuning.items()}, detail=tuning))
        del big_case

    targets, skipped = print_results(results, e2e, note, a.small, token_counts[0])
    ok = all(r["check_vs_torch"] in ("exact", "close") for r in results) and \
        (e2e is None or e2e.get("combine_ok", False))
    C.write_json(os.path.join(a.out, "kernels.json"), dict(
        device=C.device_name(), torch=torch.__version__, triton=__import__("triton").__version__, small=a.small,
        shape=shape, note=note, ceiling=ceiling, kernels=results, targets=targets, targets_skipped=skipped,
        e2e=e2e, record_align=align,
        sweep_best=None if tuning is None else {k: v["best"] for k, v in tuning.items()},
        checks_ok=ok, elapsed_s=time.perf_counter() - t_start))
    labels = [f"{r['kernel']} T={r['tokens']}" for r in results]
    C.bar_chart(os.path.join(a.out, "kernels.png"), labels,
                {"triton-ep": [r["ours_frac"] for r in results], "PyTorch": [r["torch_frac"] for r in results]},
                f"fraction of the copy ceiling ({ceiling['GBps']:.0f} GB/s), {C.device_name()}"
                + ("" if C.on_gpu() else "\ninterpreter time: says nothing about GPU speed"),
                "achieved / copy GB/s", hline=TARGET_FRACTION)
    print(f"done in {time.perf_counter() - t_start:.0f} s; checks {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
