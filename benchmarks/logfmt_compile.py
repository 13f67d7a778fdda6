"""Compile the low-latency combine kernels (the split send and reduce, the one-launch combine; with and without
LogFMT) and optionally the low-latency dispatch for an NVIDIA GPU without one: no GPU needed, nothing launched.

Each kernel is compiled as its launch wrapper (``ll_combine_send``, ``ll_combine_reduce``, ``ll_combine_fused``,
``ll_dispatch_fused``...) would launch it on that GPU, with the GPU tuning table, for two ranks of T 128 tokens,
top-8 of 32 experts (``--tokens``, ``--topk``, ``--experts``) at each ``--hidden``, with ranks sharing a GPU
(``--max-programs 33``: two ranks on a 132-multiprocessor H100, as the GPU tests run) or not (``none``). Per
kernel: the compile wall time (Triton's front end, LLVM and ptxas, cache off), the TTGIR and PTX sizes, and from
ptxas (``-v``, the ptxas Triton itself runs) the registers a thread and the spill stores and loads in bytes; for the
one-launch kernels also the programs that fit on a multiprocessor (:func:`triton_ep.kernels.launch.resident_per_sm`
worked out from those registers). ``--check``: exit 1 when a LogFMT kernel spills or takes all 255 registers.

    ./run.sh python benchmarks/logfmt_compile.py                          # hidden 1024 and 7168, sm_90
    ./run.sh python benchmarks/logfmt_compile.py --hidden 7168 --kernels reduce --logfmt 1 --check
    ./run.sh python benchmarks/logfmt_compile.py --dispatch --arch 100    # also the dispatch kernels, for sm_100

Measured on the 2-core development CPU (load 4-8, so times vary by 2x), sm_90, hidden 7168, ranks sharing a GPU:
the LogFMT reduce 255 registers, 272 B spilled, 10 s before its loop over ``k``, 128 and none, 2 s after; the
LogFMT one-launch combine 250 registers and 20 s before, 186 and 3 s after (kernels/ll_combine.py,
kernels/ll_fused.py). Times are this CPU's; registers and spills are what the GPU gets from the same Triton.

Uses Triton's compiler internals (``ASTSource``, ``GPUTarget``, the JIT function's argument binder): written for
Triton 3.x (checked with 3.9); another version may need this script changed, never the library.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"            # (before triton_ep: it compiles, never interprets, here)
os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")     # (every compile timed, none from Triton's cache)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from triton_ep.kernels import geometry as _geometry  # noqa: E402
from triton_ep.kernels import launch as _launch  # noqa: E402
from triton_ep.kernels import ll_combine, ll_dispatch, ll_fused  # noqa: E402
from triton_ep.protocol.ll_area import Layout  # noqa: E402

#: a multiprocessor of an H100 / H200: registers, shared memory, threads; and their count
SM_REGS, SM_SHARED, SM_THREADS, SMS = 65536, 233472, 2048, 132


def _ptxas(arch: int) -> str:
    """The ptxas Triton runs for ``arch`` (its wheel's, or ``TRITON_PTXAS_PATH``...)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(arch).path


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers a thread, spill stores / loads and stack bytes of one kernel's PTX, from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        r = subprocess.run([_ptxas(arch), "-v", f"--gpu-name=sm_{arch}{suffix}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {out[-1500:]}")
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    stack = re.search(r"(\d+) bytes stack frame", out)
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                stack=int(stack.group(1)) if stack else 0)


class Compiler:
    """Stands in for the GPU at the launch wrappers: a bound launch compiles (for ``arch``) instead of launching,
    and the one-launch wrappers' residency query compiles too. ``rows``: one dict per compiled kernel."""

    def __init__(self, arch: int) -> None:
        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.rows = []
        self.label = ""
        self._done = {}

    def compile(self, fn, args, num_warps, meta, options) -> tuple:
        kwargs = dict(meta, num_warps=num_warps, **options)
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, opts = binder(*args, **kwargs)
        opts, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization, opts)
        key = (fn, str(signature), str(sorted(constexprs.items(), key=str)), str(attrs), str(opts))
        if key not in self._done:
            t0 = time.perf_counter()
            k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=self.target, options=opts.__dict__)
            seconds = time.perf_counter() - t0
            use = ptxas_usage(k.asm["ptx"], self.arch)
            row = dict(kernel=self.label, compile_s=round(seconds, 2), ttgir_kib=len(k.asm["ttgir"]) // 1024,
                       ptx_kib=len(k.asm["ptx"]) // 1024, **use, shared=int(k.metadata.shared), num_warps=num_warps)
            self.rows.append(row)
            print(json.dumps(row), flush=True)
            self._done[key] = (k, row)
        return self._done[key]

    def resident_per_sm(self, launcher, args, num_warps, meta, device) -> int:
        """:func:`triton_ep.kernels.launch.resident_per_sm` from the compiled kernel's registers (an H100's
        multiprocessor)."""
        k, row = self.compile(launcher.fn, args, num_warps, meta, launcher.options)
        warp_regs = -(-max(row["regs"], 1) * 32 // 256) * 256
        fit = max(0, min(SM_REGS // (warp_regs * num_warps), SM_SHARED // (row["shared"] + 1024),
                         SM_THREADS // (32 * num_warps), 32))
        row["resident_per_sm"] = fit
        return fit

    def install(self) -> None:
        me = self

        def call(bound, *args):
            la = bound.launcher
            me.compile(la.fn, args, bound.num_warps, bound.meta, la.options)
        _launch.BoundLaunch.__call__ = call
        ll_fused.resident_per_sm = self.resident_per_sm
        _geometry.num_sms = lambda device: SMS


def _signals(R: int, max_programs) -> dict:
    i64 = torch.int64
    return dict(hdr=torch.empty(256, dtype=i64), hdr_delta=torch.empty(R, dtype=i64), host=torch.empty(64, dtype=i64),
                me=0, timeout_ns=60 * 10 ** 9, use_clock=True, max_programs=max_programs)


def combine(c: Compiler, kernels, H: int, use_logfmt: bool, max_programs, T: int, K: int, E: int, R: int = 2) -> None:
    """Compile the low-latency combine's ``kernels`` (of ``send``, ``reduce``, ``fused``) for these sizes."""
    El, i32, i64 = E // R, torch.int32, torch.int64
    lay = Layout(R, T, H, E)
    x = torch.empty(El, R * T, H, dtype=torch.bfloat16)
    tabs = (torch.empty(El, R * T, dtype=i32), torch.empty(El, dtype=i32), torch.empty(El, R, dtype=i64))
    area, delta, ctl = torch.empty(1 << 16, dtype=i32), torch.empty(R, dtype=i64), torch.empty(4096, dtype=i64)
    idx, w = torch.empty(T, K, dtype=i64), torch.empty(T, K, dtype=torch.float32)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    sig = _signals(R, max_programs)
    tag = f"H {H}, logfmt {int(use_logfmt)}, max_programs {max_programs}"
    if "send" in kernels:
        c.label = f"combine send ({tag})"
        ll_combine.ll_combine_send(x, *tabs, K, area, delta, ctl, lay, 1, False, sig, use_logfmt=use_logfmt)
    if "reduce" in kernels:
        c.label = f"combine reduce ({tag})"
        ll_combine.ll_combine_reduce(area, ctl, idx, w, out, None, 0, lay, 1, False, sig, use_logfmt=use_logfmt)
    if "fused" in kernels:
        c.label = f"combine one launch ({tag})"
        ll_fused.ll_combine_fused(x, *tabs, idx, w, out, None, area, delta, ctl, lay, 1, False, sig,
                                  use_logfmt=use_logfmt)


def dispatch(c: Compiler, H: int, use_fp8: bool, max_programs, T: int, K: int, E: int, R: int = 2) -> None:
    """Compile the low-latency dispatch (one launch; route, send, receive) for these sizes."""
    El, i32, i64 = E // R, torch.int32, torch.int64
    lay = Layout(R, T, H, E)
    x, idx = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, K, dtype=i64)
    slots, counts = torch.empty(T, K, dtype=i32), torch.empty(E, dtype=i32)
    area, delta, ctl = torch.empty(1 << 16, dtype=i32), torch.empty(R, dtype=i64), torch.empty(4096, dtype=i64)
    if use_fp8:
        rx = torch.empty(El, R * T, H, dtype=torch.float8_e4m3fn)
        sc = torch.empty_strided((El, R * T, H // 128), (H // 128 * R * T, 1, R * T), dtype=torch.float32)
    else:
        rx, sc = torch.empty(El, R * T, H, dtype=torch.bfloat16), None
    tabs = (torch.empty(El, R * T, dtype=i32), torch.empty(El, R * T, dtype=i32), torch.empty(El, R, dtype=i64),
            torch.empty(El, dtype=i32))
    sig = _signals(R, max_programs)
    tag = f"H {H}, fp8 {int(use_fp8)}, max_programs {max_programs}"
    c.label = f"dispatch one launch ({tag})"
    ll_fused.ll_dispatch_fused(x, idx, slots, counts, area, delta, ctl, lay, 1, use_fp8, False, False, False, sig,
                               True, rx, sc, *tabs, None, None)
    c.label = f"dispatch route ({tag})"
    ll_dispatch.ll_route(idx, slots, counts, ctl, E, R, sig)
    c.label = f"dispatch send ({tag})"
    ll_dispatch.ll_dispatch_send(x, idx, slots, counts, area, delta, ctl, lay, 1, use_fp8, False, False, sig, True)
    c.label = f"dispatch receive ({tag})"
    ll_dispatch.ll_dispatch_recv(area, ctl, lay, 0, K, use_fp8, False, rx, sc, *tabs, None, None, 1, False, sig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="1024,7168", help="hidden sizes, comma-separated (multiples of 128)")
    p.add_argument("--kernels", default="send,reduce,fused", help="combine kernels: send, reduce, fused")
    p.add_argument("--logfmt", default="1,0", help="use_logfmt values: 1, 0 or both")
    p.add_argument("--max-programs", default="33", help="grid cap of ranks sharing a GPU, or none (comma-separated)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--arch", type=int, default=90, help="compute capability as an int: 90 (H100/H200), 100...")
    p.add_argument("--dispatch", action="store_true", help="also the dispatch kernels (bf16 and FP8)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--check", action="store_true", help="exit 1 if a LogFMT kernel spills or takes 255 registers")
    a = p.parse_args(argv)
    kernels = [k for k in a.kernels.split(",") if k]
    if not set(kernels) <= {"send", "reduce", "fused"}:
        p.error(f"--kernels takes send, reduce, fused; got {a.kernels}")
    hiddens = [int(h) for h in a.hidden.split(",")]
    if any(h <= 0 or h % 128 for h in hiddens):
        p.error(f"--hidden takes positive multiples of 128, got {a.hidden}")
    caps = [None if v == "none" else int(v) for v in a.max_programs.split(",")]
    c = Compiler(a.arch)
    c.install()
    for H in hiddens:
        for lf in (bool(int(v)) for v in a.logfmt.split(",")):
            for cap in caps:
                combine(c, kernels, H, lf, cap, a.tokens, a.topk, a.experts)
        if a.dispatch:
            for fp8 in (False, True):
                for cap in caps:
                    dispatch(c, H, fp8, cap, a.tokens, a.topk, a.experts)
    print(f"\n{'kernel':58} {'compile s':>9} {'regs':>5} {'spill st/ld B':>13} {'PTX KiB':>8} {'per SM':>6}")
    for r in c.rows:
        print(f"{r['kernel']:58} {r['compile_s']:9.2f} {r['regs']:5d} {r['spill_stores']:6d}/{r['spill_loads']:<6d} "
              f"{r['ptx_kib']:8d} {r.get('resident_per_sm', ''):>6}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(triton=triton.__version__, arch=a.arch, rows=c.rows), f, indent=1)
    bad = [r["kernel"] for r in c.rows if "logfmt 1" in r["kernel"] and (r["spill_stores"] or r["regs"] >= 255)]
    if a.check and bad:
        print("spilling or at 255 registers: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
