"""What a normal-mode call does on the host, counted (not timed): kernel launches, torch ops, Python calls and
the lines it runs, per call, at several token counts. Made to find what grows with T (issue 50, item 1) on a
machine without a GPU, where times say nothing.

    ./run.sh python benchmarks/host_counts.py [--tokens 128 1024 4096] [--tuning gpu] [--calls ...] [--out DIR]

One rank (a gloo group of one), small rows (``--hidden``, 64 by default: the interpreter stays quick), top-8
of 256 experts, random routing. The buffer holds as many rows a round as DeepEP's size hint for the real
hidden (``--real-hidden``, 7168) holds of those real rows (:func:`hint_bytes`), so a call takes the rounds it
would take on a GPU with a buffer of that hint (one rank's ``T`` rows here against ``R * T`` rows at ``R``
ranks in a hint ``R`` times larger: the same rounds). ``--tuning gpu`` decides launches with the GPU's
tuning table (``kernels._util.GPU_TUNING``: which calls run as one launch, the layout's blocks), as a GPU
run would; ``interp`` (the default under the interpreter) with the interpreter's.

Per token count, the layout and a plain dispatch run for real (interpreted kernels) to get a handle; then,
with every kernel launch replaced by a counter (nothing runs: the host's own work is what is counted, and
one rank alone waits for nobody), each call of ``--calls`` is made twice unmeasured (its first call plans,
its second replays the plan) and once measured:

- ``launches``: kernel launches, by kernel (``Launcher``, ``BoundLaunch`` and ``Replay`` calls);
- ``torch_ops``: aten ops the call dispatches on the host (``TorchDispatchMode``), by op;
- ``py_calls``: Python function calls (cProfile's count, launches excluded: they do nothing here);
- ``lines``: Python lines run (``sys.settrace``); a line whose count differs between token counts is a
  loop whose trip count depends on T (or on the rounds): listed under ``growing`` with its counts.

Output: a table, and ``<out>/host_counts.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import tempfile
from collections import Counter
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import triton_ep  # noqa: E402
from triton_ep.kernels import _util  # noqa: E402
from triton_ep.kernels import launch as L  # noqa: E402
from triton_ep.kernels.combine import record_bytes as combine_record_bytes  # noqa: E402
from triton_ep.kernels.geometry import record_words  # noqa: E402
from triton_ep.transport import signals as S  # noqa: E402

#: the calls counted
CALLS = ("layout", "cached", "combine")
_PKG = os.path.dirname(os.path.abspath(triton_ep.__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,1024,4096", help="token counts, comma-separated")
    p.add_argument("--hidden", type=int, default=64, help="row width the calls move (small: the interpreter)")
    p.add_argument("--real-hidden", type=int, default=7168, help="row width the buffer is sized for (DeepEP's hint)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tuning", choices=("gpu", "interp"), default="gpu",
                   help="the table that decides launches while counting (gpu: as a GPU run decides them)")
    p.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS))
    C.add_out_arg(p, "host_counts.json")
    a = p.parse_args(argv)
    a.tokens = C.int_list(p, "tokens", a.tokens, 1)
    C.check_shape_args(p, a, ("hidden", "real_hidden", "experts", "topk"), 8, "rows of whole 16-byte words")
    return a


def hint_bytes(hidden: int, real_hidden: int, ranks: int) -> int:
    """``num_nvl_bytes`` for rows of ``hidden`` bf16 that holds as many rows a round as DeepEP's size hint for rows
    of ``real_hidden`` (``benchmarks/_common.nvl_bytes_hint``) holds of those: the same rounds per call. Sized by
    the cached dispatch's record (the larger of it and the combine's, per row)."""
    def rec(h):
        return max(record_words(h // 2, 0, 0, False) * 4, combine_record_bytes(h, 0))
    rows = C.nvl_bytes_hint(real_hidden, ranks) // rec(real_hidden)
    return rows * rec(hidden)


@contextlib.contextmanager
def no_kernels(counter: Counter):
    """Every kernel launch counted by its kernel's name in ``counter`` and not made (``Launcher``'s launch, a
    ``BoundLaunch``'s and a ``Replay``'s call), and the interpreter's watchdog around launches left out (as on a
    GPU, where ``Signals.watch`` is a shared no-op)."""
    saved = [(L.Launcher, "_launch"), (L.BoundLaunch, "__call__"), (L.Replay, "__call__"), (S.Signals, "watch")]
    saved = [(o, n, o.__dict__[n]) for o, n in saved]

    def launcher(self, grid, *args, **kw):
        counter[self.name] += 1

    def bound_call(self, *args):
        counter[self.launcher.name] += 1

    def replay_call(self, *tensors):
        counter[self.bound.launcher.name] += 1

    def watch(self):
        return S._NO_WATCH
    for (o, n, _), fn in zip(saved, (launcher, bound_call, replay_call, watch)):
        setattr(o, n, fn)
    try:
        yield counter
    finally:
        for o, n, real in saved:
            setattr(o, n, real)


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched while active, by name (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tuning_table(which: str):
    """The interpreter's tuning table holding ``which`` table's entries (``gpu``: ``GPU_TUNING``'s) while active."""
    table = _util.INTERP_TUNING
    saved = {k: dict(v) for k, v in table.items()}
    if which == "gpu":
        for k, v in _util.GPU_TUNING.items():
            table[k] = dict(v)
    try:
        yield
    finally:
        for k, v in saved.items():
            table[k] = v


def lines_run(fn) -> Counter:
    """``(file:line) -> times run`` for the lines of the package's own code ``fn()`` runs."""
    seen: Counter = Counter()

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(_PKG):
            return None
        if event == "line":
            seen[f"{os.path.relpath(frame.f_code.co_filename, _PKG)}:{frame.f_lineno}"] += 1
        return tracer
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen


def count_call(fn) -> dict:
    """One call of ``fn`` (kernels not run: :func:`no_kernels` must be active), counted four ways."""
    launches = Counter()
    with no_kernels(launches):
        fn()
        fn()                        # (the first plans; the second replays)
        launches.clear()
        with OpCounter() as ops:
            fn()
        n_launch = dict(launches)
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        lines = lines_run(fn)
    st = pstats.Stats(prof)
    return dict(launches=n_launch, n_launches=sum(n_launch.values()), torch_ops=dict(ops.ops),
                n_torch_ops=sum(ops.ops.values()), py_calls=st.total_calls, lines=lines, n_lines=sum(lines.values()))


def count_at(a, T: int, dev: torch.device) -> dict:
    """Every call of ``a.calls`` counted at ``T`` tokens: ``{call: counts}``, plus ``rounds_bytes``: the buffer."""
    gen = torch.Generator().manual_seed(7)
    x = C.random_rows(T, a.hidden, gen, dev)
    idx = C.random_topk(T, a.topk, a.experts, gen, dev)
    nbytes = hint_bytes(a.hidden, a.real_hidden, 1)
    buf = triton_ep.Buffer(dist.group.WORLD, nbytes, device=dev)
    try:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, a.experts)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx)
        calls = {"layout": lambda: buf.get_dispatch_layout(idx, a.experts),
                 "cached": lambda: buf.dispatch(x, handle=handle),
                 "combine": lambda: buf.combine(recv_x, handle)}
        out = {"num_nvl_bytes": nbytes, "recv_rows": int(recv_x.shape[0])}
        with tuning_table(a.tuning):
            for name in a.calls:
                out[name] = count_call(calls[name])
        return out
    finally:
        buf.destroy()


def growing(per_t: Dict[int, dict], call: str) -> list:
    """The lines of ``call`` whose count differs between token counts: ``[(line, [count at each T])]``."""
    ts = sorted(per_t)
    keys = set().union(*(per_t[t][call]["lines"] for t in ts))
    rows = [(k, [per_t[t][call]["lines"].get(k, 0) for t in ts]) for k in sorted(keys)]
    return [r for r in rows if len(set(r[1])) > 1]


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    per_t = {}
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            for T in C.progress(a.tokens, desc="host_counts"):
                per_t[T] = count_at(a, T, dev)
        finally:
            dist.destroy_process_group()
    C.say(f"[host_counts] {C.device_name()}, 1 rank, hidden {a.hidden} (buffer as DeepEP's hint for {a.real_hidden}), "
          f"top-{a.topk} of {a.experts}, launches decided by the {a.tuning} tuning table; counts per call")
    rows = []
    for call in a.calls:
        for T in a.tokens:
            c = per_t[T][call]
            rows.append([call, T, c["n_launches"], ", ".join(f"{k} {v}" for k, v in c["launches"].items()),
                         c["n_torch_ops"], ", ".join(f"{k} {v}" for k, v in sorted(c["torch_ops"].items())),
                         c["py_calls"], c["n_lines"]])
    C.print_table(["call", "T", "launches", "by kernel", "torch ops", "by op", "py calls", "lines"], rows)
    grow = {call: growing(per_t, call) for call in a.calls}
    for call, g in grow.items():
        for line, counts in g:
            print(f"  {call}: {line} runs {counts} times at T {a.tokens}")
    doc = dict(device=C.device_name(), hidden=a.hidden, real_hidden=a.real_hidden, experts=a.experts, topk=a.topk,
               tuning=a.tuning, tokens=a.tokens,
               results={T: {k: ({kk: vv for kk, vv in v.items() if kk != "lines"} if isinstance(v, dict) else v)
                            for k, v in per_t[T].items()} for T in a.tokens},
               growing={call: [dict(line=line, counts=counts) for line, counts in g] for call, g in grow.items()})
    os.makedirs(a.out, exist_ok=True)
    C.write_json(os.path.join(a.out, "host_counts.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
