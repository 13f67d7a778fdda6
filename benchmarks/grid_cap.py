"""GPU time of a cached dispatch and of a combine at one rank for several caps of the normal-mode launches' grid
(and other launch parameters of the tuning table, and split against fused launches), the settings alternated in
one process.

    ./run.sh python benchmarks/grid_cap.py [--tokens 2048,4096] [--caps 0,2,4,8,16] [--repeats 5] [--replays 50]
                                           [--vary KERNEL.KEY=V1,V2 ...] [--config "K.K=V;K.K=V" ...]
                                           [--fused] [--pair] [--out DIR]
    ./run.sh python benchmarks/grid_cap.py --tokens 128,1024,4096 --caps 8 --fused --pair    # split vs fused

The send and receive launches of normal-mode calls of more than one block (not the fused single launch of a
small call, not low-latency mode) take at most ``GPU_TUNING["grid"]["programs_per_sm"]`` programs per
multiprocessor, each looping over blocks; ``0`` gives a program per block (a token or a received row). Every
program of such a launch checks the round's flags when it starts and counts itself done with one
system-scope atomic when it ends, so the cap decides how often that is paid.

One rank (a gloo group of one), hidden 7168 bf16, top-8 of 256 experts on a GPU (tiny shapes on CPU), random
routing, a buffer holding the call in one round. For each token count and cap the script captures a cached
dispatch and, separately, a combine in CUDA graphs, then ``--repeats`` times replays each graph 10 times
unmeasured and ``--replays`` times between two CUDA events, cap after cap: GPU µs per replay (no host time in
it). ``floor_us``: the bytes a call must move at one rank (x read once, each record written once and read once,
the output written once: 4 x T rows) over the copy ceiling measured first (``dst.copy_(src)`` of 512 MiB, read
plus written bytes per second); ``*_frac`` = floor / time; ``*_ratio`` = time / the first cap's time (below 1:
quicker). ``copy_same_bytes_us``: the time ``Tensor.copy_`` takes to move those floor bytes (half read, half written) at
the rate it reached, a copy of whole MiB captured in a graph and replayed like the calls in each repeat (GPU
only); ``*_of_copy`` = that copy's time / the call's (1: the
call as fast as a plain copy of its floor bytes, timed the same way). Every cap's outputs are compared bit for bit
with the first cap's.

``--vary dispatch_recv.num_warps=4,16`` adds a setting per value: the tuning table's defaults with the first cap
(unless the entry is the cap itself, ``grid.programs_per_sm``) and that one entry changed (``GPU_TUNING`` on a GPU, ``INTERP_TUNING`` on CPU; one entry at a time, repeatable);
``--config "dispatch_send.num_warps=8;grid.programs_per_sm=4"`` adds one setting that changes several entries at
once (at the first cap unless it names one). ``env.TRITON_EP_FUSED=0`` / ``=1`` in a setting captures the calls
with that switch (``0``: a send launch and a receive launch; ``1``: one fused launch per call, whatever the token
count: :func:`triton_ep.kernels.dispatch.dispatch_fused`, :func:`triton_ep.kernels.combine.combine_fused`; unset:
the library's own choice, fused up to ``GPU_TUNING["fused"]["data_max_tokens"]`` tokens); ``--fused`` is
``--vary env.TRITON_EP_FUSED=0,1``. ``--pair`` also captures a cached dispatch followed by a combine of its output
in one graph per setting: ``pair_us``, ``pair_ratio`` (what a decode step that replays both pays, the gap between
the two launches included). Each setting is a row (``setting``: what it changes, ``tuning``: those entries), timed, compared and
ratioed as the caps are. Results never depend on these entries (``triton_ep.kernels._util``), only speed does. On CPU (no CUDA graphs) eager
calls run under the Triton interpreter with 4 "multiprocessors" (320 tokens: 5 blocks of the interpreter's 64,
so a cap of 1 makes programs loop): they show that the capped grids agree, nothing about speed. Output: a
table, and ``<out>/grid_cap.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import triton_ep  # noqa: E402
from triton_ep.kernels import _util  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="2048,4096" if gpu else "320",
                   help="comma-separated token counts (one Buffer each; past the fused launch's limit on a GPU)")
    p.add_argument("--caps", default="0,2,4,8,16" if gpu else "0,1",
                   help="comma-separated programs per multiprocessor (0: a program per block); the first is the "
                        "reference of every ratio and of the bitwise check")
    p.add_argument("--vary", action="append", default=[], metavar="KERNEL.KEY=V1,V2",
                   help="a setting per value: the defaults (first cap) with that tuning entry changed; repeatable")
    p.add_argument("--config", action="append", default=[], metavar="K.K=V;K.K=V",
                   help="one setting changing several tuning entries; repeatable")
    p.add_argument("--fused", action="store_true",
                   help="two more settings: split launches (TRITON_EP_FUSED=0) and one fused launch per call (=1)")
    p.add_argument("--pair", action="store_true",
                   help="also time a cached dispatch + combine captured in one graph (pair_us, pair_ratio)")
    C.add_replay_args(p, "alternations of the settings")
    C.add_out_arg(p, "grid_cap.json")
    a = p.parse_args(argv)
    a.tokens = C.int_list(p, "tokens", a.tokens, 1)
    a.caps = C.int_list(p, "caps", a.caps, 0)
    if len(set(a.caps)) < len(a.caps):
        p.error(f"--caps names a cap twice: {a.caps}")
    C.check_shape_args(p, a, ("hidden", "experts", "topk", "repeats", "replays"), 8, "rows of 16 bytes")
    a.settings = [{"grid.programs_per_sm": cap} for cap in a.caps]
    for spec in a.vary:
        if ";" in spec:
            p.error(f"--vary {spec!r}: one entry with its values (KERNEL.KEY=V1,V2); several entries: --config")
        key, _, values = spec.partition("=")
        a.settings += [_setting(p, "--vary", f"{key}={v}") for v in values.split(",")]
    a.settings += [_setting(p, "--config", spec) for spec in a.config]
    if a.fused:
        a.settings += [_setting(p, "--fused", f"env.TRITON_EP_FUSED={v}") for v in (0, 1)]
    first = a.caps[0]           # a setting that leaves the cap alone runs at the first cap, as its label says
    a.settings = [dict(st) if "grid.programs_per_sm" in st else {"grid.programs_per_sm": first, **st}
                  for st in a.settings]
    seen = set()
    for st in a.settings:
        k = tuple(sorted(st.items()))
        if k in seen:
            p.error(f"the setting {_label(st)} comes twice (--caps, --vary and --config together)")
        seen.add(k)
    return a


#: environment switches a setting may set (``env.NAME=value``) and their values
ENV = {"TRITON_EP_FUSED": ("0", "1")}

#: values of the tuning table's string entries (Triton's store cache modifiers and eviction policies)
_STR_VALUES = {"store_cache": ("", ".wb", ".cg", ".cs", ".wt"), "store_evict": ("", "evict_first", "evict_last")}


def _setting(p, opt: str, spec: str) -> dict:
    """``"kernel.key=value;..."`` as ``{"kernel.key": value}``, checked against the tuning table (the value as
    the table's entry's type); otherwise an argparse error of parser ``p`` naming ``opt``."""
    out = {}
    for item in spec.split(";"):
        name, eq, text = item.strip().partition("=")
        kernel, _, key = name.partition(".")
        if kernel == "env":
            if key not in ENV or text.strip() not in ENV.get(key, ()):
                allowed = ", ".join(f"env.{k}={'|'.join(v)}" for k, v in ENV.items())
                p.error(f"{opt} {spec!r}: the switches a setting may set are {allowed}")
            out[name] = text.strip()
            continue
        table = _util.GPU_TUNING
        if not eq or kernel not in table or key not in table[kernel]:
            p.error(f"{opt} {spec!r}: {name!r} is no tuning entry (kernel.key=value; kernels: "
                    f"{', '.join(sorted(table))})")
        if kernel.startswith("ll_") or name == "dispatch_send.record_align_words":
            p.error(f"{opt} {spec!r}: {name} is not a launch parameter of the normal-mode calls this script "
                    f"times (low-latency entries: bench_low_latency.py --sweep; record_align_words changes the "
                    f"records' layout)")
        kind = type(table[kernel][key])
        text = text.strip()
        if kind is bool or kind is int:
            try:
                value = int(text)
            except ValueError:
                p.error(f"{opt} {spec!r}: {name} takes an integer, got {text!r}")
            if kind is bool and value not in (0, 1):
                p.error(f"{opt} {spec!r}: {name} takes 0 or 1, got {text!r}")
            if key == "num_warps" or key.startswith("block_"):
                if value < 1 or value & (value - 1):
                    p.error(f"{opt} {spec!r}: {name} must be a power of two, got {value}")
            elif value < 0:
                p.error(f"{opt} {spec!r}: {name} must be >= 0, got {value}")
            value = kind(value)
        else:
            value = text
            if value not in _STR_VALUES.get(key, (value,)):
                p.error(f"{opt} {spec!r}: {name} takes one of {_STR_VALUES[key]}, got {text!r}")
        out[name] = value
    return out


def copy_ceiling(dev: torch.device):
    """Read plus written bytes per second of ``dst.copy_(src)`` over 512 MiB; ``None`` on CPU."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = C.bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 29) / (ms * 1e-3)


class _Tuned:
    """The tuning table's entries (``GPU_TUNING``, the interpreter's on CPU) and the environment switches set to
    ``setting`` (``{"kernel.key": value}``, ``{"env.NAME": value}``) inside, restored on exit."""

    def __init__(self, setting: dict) -> None:
        self.setting = setting

    def __enter__(self):
        self.saved = {}
        for name, value in self.setting.items():
            kernel, key = name.split(".")
            if kernel == "env":
                self.saved[name] = os.environ.get(key)
                os.environ[key] = value
                continue
            table = _util.tuning(kernel)
            self.saved[name] = table[key]
            table[key] = value

    def __exit__(self, *exc) -> None:
        for name, value in self.saved.items():
            kernel, key = name.split(".")
            if kernel != "env":
                _util.tuning(kernel)[key] = value
            elif value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _timer(step, dev: torch.device):
    """``(run, out)``: ``run(n)`` gives the µs per call of ``n`` calls of ``step`` (GPU: replays of its graph, by
    CUDA events, after 10 unmeasured; CPU: eager calls, by the wall clock), ``out()`` the outputs of the last one."""
    if dev.type != "cuda":
        last = [step()]                 # (a first call, unmeasured, as the GPU's capture: no one-time cost timed)

        def run_cpu(n):
            t0 = time.perf_counter()
            for _ in range(n):
                last[:] = [step()]
            return (time.perf_counter() - t0) * 1e6 / n
        return run_cpu, lambda: last[0]
    step()
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()

    def run_gpu(n):
        for _ in range(10):
            g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            g.replay()
        e.record()
        torch.cuda.synchronize(dev)
        return s.elapsed_time(e) * 1000 / n
    return run_gpu, lambda: out


def _label(setting: dict) -> str:
    return ";".join(f"{k}={v}" for k, v in setting.items())


def _bits(out) -> list:
    """The outputs of a timed step as int16 views (a tensor, or a tuple of them), for a bit-for-bit comparison."""
    return [t.view(torch.int16) for t in (out if isinstance(out, tuple) else (out,))]


def one_size(a, T: int, dev: torch.device, ceiling) -> list:
    """Every setting at ``T`` tokens: µs per cached dispatch, per combine and (``--pair``) per cached dispatch +
    combine over the repeats, outputs compared with the first setting's."""
    gen = torch.Generator().manual_seed(7)
    x = C.random_rows(T, a.hidden, gen, dev)
    idx = C.random_topk(T, a.topk, a.experts, gen, dev)
    w = torch.rand(idx.shape, generator=gen).to(dev)
    buf = triton_ep.Buffer(dist.group.WORLD, max(1 << 22, T * (a.hidden * 2 + 512) * 2), device=dev)
    try:
        pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, a.experts)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                                                num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)

        def pair():
            got = buf.dispatch(x, handle=handle)[0]
            return got, buf.combine(got, handle)[0]
        steps = {"dispatch": lambda: buf.dispatch(x, handle=handle)[0], "combine": lambda: buf.combine(recv, handle)[0]}
        if a.pair:
            steps["pair"] = pair
        timers = []
        for st in a.settings:          # each graph keeps the grid, parameters and switches it was captured with
            with _Tuned(st):
                timers.append({part: _timer(step, dev) for part, step in steps.items()})
        # Tensor.copy_ of a call's floor bytes (4 x T rows: half read, half written), replayed from a graph
        # in the same repeats as the calls (GPU only)
        floor_bytes = (x.numel() + 3 * recv.numel()) * x.element_size()
        copy_timer = None
        copy_n = C.same_bytes_copy_length(floor_bytes)
        if dev.type == "cuda":
            src = torch.ones(copy_n, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy_timer = _timer(lambda: dst.copy_(src), dev)[0]
        us = [{part: [] for part in steps} for _ in a.settings]
        copy_us = []
        for _ in range(a.repeats):
            if copy_timer is not None:
                copy_us.append(copy_timer(a.replays))
            for j, st in enumerate(a.settings):
                with _Tuned(st):
                    for part in steps:
                        us[j][part].append(timers[j][part][0](a.replays))
        ref = {part: _bits(timers[0][part][1]()) for part in steps}
        floor = None if ceiling is None else floor_bytes / ceiling * 1e6
        copy_med = statistics.median(copy_us) * floor_bytes / (2 * copy_n) if copy_us else None
        first = {part: statistics.median(us[0][part]) for part in steps}
        rows = []
        for j, st in enumerate(a.settings):
            row = dict(tokens=T, setting=_label(st), tuning=st, programs_per_sm=st["grid.programs_per_sm"],
                       floor_us=floor, floor_bytes=floor_bytes, copy_same_bytes_us=copy_med)
            for part in steps:
                med = statistics.median(us[j][part])
                row.update({f"{part}_us": med, f"{part}_ratio": med / first[part], f"{part}_all": us[j][part]})
                if part != "pair":
                    row[f"{part}_frac"] = None if floor is None else floor / med
                    row[f"{part}_of_copy"] = None if copy_med is None else copy_med / med
            row["results_equal"] = all(all(torch.equal(p, q) for p, q in zip(_bits(timers[j][part][1]()), ref[part]))
                                       for part in steps)
            rows.append(row)
        return rows
    finally:
        buf.destroy()


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    ceiling = copy_ceiling(dev)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            for T in C.progress(a.tokens, desc="grid_cap"):
                rows += one_size(a, T, dev, ceiling)
        finally:
            dist.destroy_process_group()
    what = ("GPU µs per CUDA-graph replay, median of the repeats; frac = the call's bytes at the copy ceiling / time; "
            "of_copy = Tensor.copy_ of the call's bytes (copy us), replayed in the same repeats, / time"
            if dev.type == "cuda" else
            "CPU: µs per eager call under the Triton interpreter; they say nothing about GPU speed")
    print(f"[grid_cap] {C.device_name()}, one rank, hidden {a.hidden}, top-{a.topk} of {a.experts}: {what}")
    opt = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    C.print_table(["tokens", "setting", "dispatch us", "ratio", "frac", "of_copy", "combine us", "ratio", "frac",
                   "of_copy"] + (["pair us", "ratio"] if a.pair else []) + ["copy us", "equal"],
                  [[r["tokens"], r["setting"], f"{r['dispatch_us']:.1f}", f"{r['dispatch_ratio']:.3f}",
                    opt(r["dispatch_frac"], ".2f"), opt(r["dispatch_of_copy"], ".3f"), f"{r['combine_us']:.1f}",
                    f"{r['combine_ratio']:.3f}", opt(r["combine_frac"], ".2f"), opt(r["combine_of_copy"], ".3f")]
                   + ([f"{r['pair_us']:.1f}", f"{r['pair_ratio']:.3f}"] if a.pair else [])
                   + [opt(r["copy_same_bytes_us"], ".1f"), r["results_equal"]]
                   for r in rows])
    C.write_json(os.path.join(a.out, "grid_cap.json"),
                 dict(device=C.device_name(), ranks=1, hidden=a.hidden, experts=a.experts, topk=a.topk,
                      repeats=a.repeats, replays=a.replays, copy_ceiling_Bps=ceiling,
                      default_programs_per_sm=_util.tuning("grid")["programs_per_sm"],
                      default_tuning={k: dict(v) for k, v in (_util.GPU_TUNING if dev.type == "cuda"
                                                              else _util.INTERP_TUNING).items()},
                      note=what, results=rows))
    return 0 if all(r["results_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
