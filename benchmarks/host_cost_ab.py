"""Host cost of each call, this checkout against another one, in one process: an A/B for a change of the launch path.

    ./run.sh python benchmarks/host_cost_ab.py --against DIR [--tokens 128] [--iters 20] [--rounds 6] [--out DIR]

``DIR`` is another checkout of triton-ep (the folder holding its ``triton_ep`` package), e.g. a ``git worktree``
of the commit before a change. Both packages are imported into this process (the other one under the same
name, its modules kept apart), each builds the Buffers of ``host_cost.py`` (one rank, a gloo group of one; the
same inputs), and every call is timed in alternating blocks: ``--rounds`` blocks of ``--iters`` calls for each
side, the side that goes first alternating. Per call: a device synchronise, then ``perf_counter`` around the
one call. Reported: the median host µs of each side, ``ratio`` = this checkout's median / the other's, and the
minimums.

Why in one process: on the H200 machine the host cost of the same code measured by ``host_cost.py`` in two
processes one after another differed by up to 2x from process to process (seen: a low-latency dispatch 171 and
280 µs at the same commit), more than most changes of the launch path are worth. In one process, both sides see
the same CPU, clocks and placement, so their ratio holds where their absolute figures drift.

Limits: the other checkout must make the calls asked for with the same arguments as this one (the calls of
``host_cost.py``; the low-latency Buffer is built only when ``--calls`` names a low-latency call), and each
package must import its modules when it is imported (a module imported later inside a function would come
from this checkout). On CPU the kernels run inside the calls under the Triton interpreter: the times say
nothing about a GPU there. Output: a table, and ``<out>/host_cost_ab.json``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)
import host_cost as HC  # noqa: E402  (imports this checkout's triton_ep)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: the calls timed, as host_cost.py names them
CALLS = ("layout", "dispatch", "worst", "cached", "combine", "ll_dispatch", "ll_combine")


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="another checkout of triton-ep (the folder holding triton_ep/)")
    p.add_argument("--tokens", type=int, default=128 if gpu else 16)
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 16)
    p.add_argument("--topk", type=int, default=8 if gpu else 4)
    p.add_argument("--iters", type=int, default=20 if gpu else 2, help="calls per block")
    p.add_argument("--rounds", type=int, default=6 if gpu else 2, help="blocks per side")
    p.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS))
    C.add_out_arg(p, "host_cost_ab.json")
    a = p.parse_args(argv)
    C.check_shape_args(p, a, ("tokens", "hidden", "experts", "topk", "iters", "rounds"), 128,
                       "low-latency mode's rows")
    if not os.path.isdir(a.against):
        p.error(f"--against {a.against!r} is not a folder (give the folder of another checkout)")
    if not os.path.isfile(os.path.join(a.against, "triton_ep", "__init__.py")):
        p.error(f"--against {a.against!r} holds no triton_ep package (give the folder of another checkout)")
    if os.path.realpath(os.path.join(a.against, "triton_ep")) == os.path.realpath(os.path.dirname(HC.triton_ep.__file__)):
        p.error("--against names this checkout itself")
    return a


def load_other(path: str):
    """The ``triton_ep`` package of the checkout at ``path``, imported beside this checkout's: its modules are
    imported under their own names, then this checkout's are put back in ``sys.modules``."""
    mine = {k: v for k, v in sys.modules.items() if k == "triton_ep" or k.startswith("triton_ep.")}
    for k in mine:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(path))
    try:
        other = importlib.import_module("triton_ep")
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if k == "triton_ep" or k.startswith("triton_ep.")]:
            del sys.modules[k]
        sys.modules.update(mine)
    return other


def code_of(lib) -> str:
    """The file the ``Buffer`` class of package ``lib`` runs from (its methods' code, not the module name)."""
    return os.path.abspath(lib.Buffer.__init__.__code__.co_filename)


def time_pair(fns: dict, iters: int, rounds: int, sync) -> dict:
    """``{side: [µs of each call]}``: ``rounds`` blocks of ``iters`` calls per side, alternating which side goes
    first, after 3 calls of each side."""
    ts = {side: [] for side in fns}
    order = list(fns)
    for side in order:
        for _ in range(3):
            fns[side]()
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            fn = fns[side]
            for _ in range(iters):
                sync()
                t0 = time.perf_counter()
                fn()
                ts[side].append((time.perf_counter() - t0) * 1e6)
    sync()
    return ts


def main(argv=None) -> int:
    a = parse_args(argv)
    other = load_other(a.against)
    libs = {"this": HC.triton_ep, "other": other}
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        built = []
        try:
            x, idx, w = HC.inputs(a, dev)
            calls = {}
            ll = any(c.startswith("ll_") for c in a.calls)
            for side, lib in libs.items():
                try:
                    buf, llbuf, fns, _ = HC.make_calls(lib, a, dev, x, idx, w, low_latency=ll)
                except Exception as ex:     # noqa: BLE001 - said in one line: the other checkout lacks a call
                    raise SystemExit(f"host_cost_ab.py: the {'other' if side == 'other' else 'this'} checkout's "
                                     f"Buffer cannot make the calls asked for ({type(ex).__name__}: "
                                     f"{str(ex).splitlines()[0] if str(ex) else ''}); name fewer with --calls") from None
                built += [b for b in (buf, llbuf) if b is not None]
                calls[side] = fns
            for name in C.progress(a.calls, desc="host_cost_ab"):
                ts = time_pair({side: calls[side][name] for side in libs}, a.iters, a.rounds, sync)
                med = {side: statistics.median(v) for side, v in ts.items()}
                out.append(dict(call=name, this_us=med["this"], other_us=med["other"],
                                ratio=med["this"] / med["other"], this_us_min=min(ts["this"]),
                                other_us_min=min(ts["other"])))
        finally:
            for b in built:
                b.destroy()
            dist.destroy_process_group()
    what = ("host µs of one call from Python on this machine, both checkouts in one process" if dev.type == "cuda" else
            "CPU: kernels run inside the call under the Triton interpreter; the times say nothing about a GPU")
    C.say(f"[host_cost_ab] {C.device_name()}, 1 rank, {a.tokens} tokens x {a.hidden}, top-{a.topk} of {a.experts}; "
          f"this checkout against {a.against}; medians of {a.rounds} blocks of {a.iters} calls a side; {what}")
    C.print_table(["call", "this us", "other us", "ratio", "this min", "other min"],
                  [[r["call"], C.sig(r["this_us"]), C.sig(r["other_us"]), C.sig(r["ratio"], 3),
                    C.sig(r["this_us_min"]), C.sig(r["other_us_min"])] for r in out])
    os.makedirs(a.out, exist_ok=True)
    C.write_json(os.path.join(a.out, "host_cost_ab.json"),
                 dict(device=C.device_name(), ranks=1, tokens=a.tokens, hidden=a.hidden, experts=a.experts,
                      topk=a.topk, iters=a.iters, rounds=a.rounds, against=os.path.abspath(a.against), note=what,
                      this_code=code_of(HC.triton_ep), other_code=code_of(other), results=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
