"""Bandwidth ceilings for the kernel benchmark, each the best of a few launch shapes of a trivial Triton
kernel over the same bytes: write-only, read-only, and the fan-out copy that dispatch_send's traffic
resembles (read a row once, write it ``F`` times into rows of another buffer).

A kernel's fraction of the copy ceiling says how far it is from a plain copy; these say what its own mix
of reads and writes allows (on the H200 a write-only pass runs slower than a copy counted as bytes read
plus written).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.full([BLOCK], 7, tl.int32), mask=offs < n)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v, axis=0))


@triton.jit
def _fanout_kernel(src_ptr, dst_ptr, WX: tl.constexpr, F: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for w0 in range(0, WX, BLOCK_W):
        ow = w0 + tl.arange(0, BLOCK_W)
        v = tl.load(src_ptr + t * WX + ow, mask=ow < WX)
        for j in tl.static_range(F):
            tl.store(dst_ptr + (t * F + j) * WX + ow, v, mask=ow < WX)


def measure(bench_ms: Callable[[Callable[[], object]], float], nbytes: int = 1 << 30, rows: int = 4096,
            row_words: int = 3584, fanout: int = 5) -> Dict[str, float]:
    """GB/s (1e9 bytes per second) of ``write`` (``nbytes`` written), ``read`` (``nbytes`` read) and
    ``fanout`` (``rows`` rows of ``row_words`` int32 words read once and each written ``fanout`` times:
    read plus written bytes), the best over the launch shapes tried. ``bench_ms(fn)`` times one call in
    ms. CUDA only."""
    n = nbytes // 4
    buf = torch.empty(n, dtype=torch.int32, device="cuda")
    out = {}
    best = 0.0
    for block, warps in ((4096, 8), (8192, 16), (2048, 4)):
        ms = bench_ms(lambda: _write_kernel[(triton.cdiv(n, block),)](buf, n, BLOCK=block, num_warps=warps))
        best = max(best, nbytes / ms / 1e6)
    out["write"] = best
    part = torch.empty(triton.cdiv(n, 2048), dtype=torch.int32, device="cuda")
    best = 0.0
    for block, warps in ((4096, 8), (8192, 16), (2048, 4)):
        ms = bench_ms(lambda: _read_kernel[(triton.cdiv(n, block),)](buf, part, n, BLOCK=block, num_warps=warps))
        best = max(best, nbytes / ms / 1e6)
    out["read"] = best
    del buf, part
    src = torch.ones((rows, row_words), dtype=torch.int32, device="cuda")
    dst = torch.empty((rows * fanout, row_words), dtype=torch.int32, device="cuda")
    moved = rows * row_words * 4 * (1 + fanout)
    best = 0.0
    for bw, warps in ((4096, 16), (2048, 8), (1024, 4)):
        ms = bench_ms(lambda: _fanout_kernel[(rows,)](src, dst, WX=row_words, F=fanout, BLOCK_W=bw, num_warps=warps))
        best = max(best, moved / ms / 1e6)
    out["fanout"] = best
    out["fanout_ratio"] = fanout
    return out
