"""Helpers shared by the benchmarks (bench_kernels.py, bench_ep8.py, profile_phases.py): shapes, timing,
routing, the combine check, output files, progress bars and what a figure means on this machine.

Importing this module puts the repository root on ``sys.path`` (a checkout that is not installed) and
sets the NVLink-multicast switches off (``NCCL_NVLS_ENABLE=0`` and friends) before anything else uses NCCL.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
from moe_layer import pick_device, timed  # noqa: E402,F401  (re-exported: ranks' devices, collective timing)

#: DeepSeek-V3's shapes as DeepEP benchmarks them: tokens per rank, hidden, top-k, routed experts, ranks.
DSV3 = dict(tokens=4096, hidden=7168, topk=8, experts=256, ranks=8)
#: Tiny shapes for a CPU run under the Triton interpreter (about 0.4 ms per program).
SMALL = dict(tokens=24, hidden=256, topk=4, experts=32, ranks=4)

#: Where output files go without ``--out``: the repository's ignored ``out/`` folder. The committed GPU
#: results in ``benchmarks/results/`` change only when ``--out`` names that folder.
DEFAULT_OUT = os.path.join(ROOT, "out", "benchmarks")

#: What a time measured on CPU means.
CPU_NOTE = ("CPU: kernels run under the Triton interpreter; times are interpreter wall time, GB/s and "
            "fractions are against this CPU's memory: they show the benchmark runs and say nothing about GPU speed")

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # a GPU machine's own Python stack may lack it (run.sh installs nothing there)
    _tqdm = None


def on_gpu() -> bool:
    """True when the benchmarks run compiled kernels on a CUDA device (not the interpreter on CPU)."""
    return torch.cuda.is_available()


def device_name() -> str:
    """The CUDA device's name, or ``"cpu (Triton interpreter)"``."""
    return torch.cuda.get_device_name() if on_gpu() else "cpu (Triton interpreter)"


def add_out_arg(p, files: str) -> None:
    """Add ``--out`` (an output folder, default :data:`DEFAULT_OUT`) to the parser ``p``; ``files``: what
    the script writes there."""
    shown = os.path.relpath(DEFAULT_OUT, ROOT)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for {files} (default {shown}/, ignored by git; the committed GPU results are "
                        f"updated only by naming benchmarks/results here)")


def add_replay_args(p, repeats_help: str) -> None:
    """Add the arguments of a one-rank graph-replay benchmark to the parser ``p``: ``--hidden``, ``--experts``,
    ``--topk`` (DeepSeek-V3's on a GPU, tiny on CPU), ``--repeats`` (``repeats_help``: what alternates) and
    ``--replays``."""
    gpu = on_gpu()
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256,
                   help="bf16 elements per row (default: 7168 on a GPU, 256 on CPU)")
    p.add_argument("--experts", type=int, default=256 if gpu else 16, help="default: 256 on a GPU, 16 on CPU")
    p.add_argument("--topk", type=int, default=8 if gpu else 4, help="default: 8 on a GPU, 4 on CPU")
    p.add_argument("--repeats", type=int, default=5 if gpu else 1, help=f"{repeats_help} (default: 5 on a GPU, 1 on CPU)")
    p.add_argument("--replays", type=int, default=50 if gpu else 2,
                   help="timed replays (CPU: calls) per repeat (default: 50 on a GPU, 2 on CPU)")


def int_list(p, name: str, value: str, lo: int) -> List[int]:
    """``value`` (comma-separated ints) as a list, each at least ``lo``; otherwise an argparse error of parser
    ``p`` naming ``--name``."""
    try:
        out = [int(t) for t in value.split(",")]
    except ValueError:
        p.error(f"--{name} takes comma-separated ints, got {value!r}")
    if min(out) < lo:
        p.error(f"--{name} values must be >= {lo}, got {out}")
    return out


def check_shape_args(p, a, positive, hidden_multiple: int, why: str) -> None:
    """The checks the benchmarks share, as argparse errors of parser ``p`` (exit 2, one line naming the option) on
    the parsed ``a``, before anything runs: each name in ``positive`` at least 1, ``--topk`` at most ``--experts``,
    ``--hidden`` a multiple of ``hidden_multiple`` (``why``: the reason, for the message); and where ``a`` has them,
    ``--experts`` a multiple of ``--ranks`` (every rank holds as many experts), ``--warmup`` at least 0,
    ``--timeout`` above 0, and ``--out`` (unless ``None``: no file) a folder this process can write in
    (:func:`check_out`)."""
    for name in positive:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk} is more than --experts {a.experts} (a token's experts are distinct)")
    if a.hidden % hidden_multiple:
        p.error(f"--hidden must be a multiple of {hidden_multiple} ({why}), got {a.hidden}")
    if hasattr(a, "ranks") and a.experts % a.ranks:
        p.error(f"--experts {a.experts} is not a multiple of --ranks {a.ranks} (every rank holds as many experts)")
    if getattr(a, "warmup", 0) < 0:
        p.error(f"--warmup must be at least 0, got {a.warmup}")
    if hasattr(a, "timeout") and not a.timeout > 0:
        p.error(f"--timeout must be a number of seconds above 0, got {a.timeout}")
    if getattr(a, "out", None) is not None:
        check_out(p, a.out)


def check_out(p, out: str) -> None:
    """An argparse error of parser ``p`` unless ``out`` can be a folder: not empty, not a file, no file among
    the folders above it, and a folder this process can create and write in (it is created, and a scratch file
    written and removed there: checked before anything is measured)."""
    if not out:
        p.error("--out must name a folder, got ''")
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        p.error(f"--out {out}: {path} is a file, not a folder")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as ex:
        p.error(f"--out {out}: cannot write there ({ex.strerror or ex})")


def progress(iterable=None, **kw):
    """A tqdm progress bar on stderr (``tqdm(iterable, **kw)``); without tqdm installed, a stand-in
    that iterates ``iterable`` and shows nothing."""
    if _tqdm is not None:
        return _tqdm(iterable, **kw)
    return _NoBar(iterable)


class _NoBar:
    """What :func:`progress` gives without tqdm: iterates, and ignores every bar call."""

    def __init__(self, iterable=None):
        self.iterable = iterable if iterable is not None else ()

    def __iter__(self):
        return iter(self.iterable)

    def __getattr__(self, name):
        return lambda *a, **k: None


def stages(names: Sequence[str], desc: str, show: bool = True, leave: bool = True):
    """Yield ``names`` one by one under a progress bar that shows the one now running: call ``next()``
    when a step starts and ``next(it, None)`` after the last, which closes the bar."""
    bar = progress(names, desc=desc, disable=not show, leave=leave)
    for name in bar:
        bar.set_postfix_str(name)
        yield name


def say(msg: str) -> None:
    """Print ``msg`` on stdout without breaking a progress bar that is showing."""
    if _tqdm is not None:
        _tqdm.write(msg)
        sys.stdout.flush()
    else:
        print(msg, flush=True)


def bench_graph_ms(fn: Callable[[], object], rep_ms: float = 100):
    """Median GPU time of one call of ``fn`` in ms, replayed from a CUDA graph
    (``triton.testing.do_bench_cudagraph``), so the host's launch overhead is left out; ``None`` on CPU
    or where ``fn`` cannot be captured."""
    if not on_gpu():
        return None
    import triton.testing
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception as e:  # noqa: BLE001 - reported as "no figure"
        print(f"  (graph replay not measured: {type(e).__name__}: {str(e)[:100]})", flush=True)
        return None


def bench_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    On a GPU: ``triton.testing.do_bench`` (CUDA events around each call; it also overwrites a 256 MB
    buffer before each call, so L2 starts cold). On CPU: the median of a few wall-clock calls after one
    warm-up call (interpreter figures, only to show the script runs)."""
    if on_gpu():
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_topk(tokens: int, topk: int, experts: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[tokens, topk]`` int64 distinct expert ids per token, uniform over ``experts`` (the routing
    DeepEP's own tests draw: ``randn(...).topk``)."""
    scores = torch.rand((tokens, experts), generator=gen)
    return scores.topk(topk, dim=1).indices.to(device)


def random_rows(tokens: int, hidden: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[tokens, hidden]`` bf16 rows of standard normal values, drawn on ``device`` (seeded from ``gen``)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 62, (1,), generator=gen)))
    return torch.randn((tokens, hidden), generator=g, device=device).to(torch.bfloat16)


def expected_combine(x: torch.Tensor, is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """What combining the dispatched rows unchanged gives: each row times the number of ranks it went
    to, summed in fp32 and rounded once (exact: a sum of at most a few hundred equal bf16 values)."""
    return (x.float() * is_token_in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)


def sig(v: Optional[float], digits: int = 4) -> Optional[float]:
    """``v`` rounded to ``digits`` significant digits (``None`` stays ``None``)."""
    return None if v is None else float(f"{v:.{digits}g}")


#: a same-bytes copy's length is a multiple of this. On one H100 (torch 2.11, 2026-12-06) graph-replayed copy_ of
#: about 177 and 298 MiB, not whole MiB, ran at 2.43-2.44 TB/s; of 117, 186 and 312 whole MiB at 2.97-3.02, as the
#: eager copies of every size from 117 MiB to 1 GiB (2.85-3.02); of 512 MiB again at 2.45
COPY_GRAIN = 1 << 20


def same_bytes_copy_length(nbytes: float) -> int:
    """The length of the ``Tensor.copy_`` that stands for a call moving ``nbytes`` (read plus written): about
    ``nbytes / 2``, rounded to whole :data:`COPY_GRAIN` (at least one). Its time scales to the call's bytes by
    ``nbytes / (2 * length)``: the rate compares, not the time."""
    return max(COPY_GRAIN, round(nbytes / 2 / COPY_GRAIN) * COPY_GRAIN)


def gbps(nbytes: float, ms: float) -> float:
    """``nbytes`` over ``ms`` milliseconds, in GB/s (1e9 bytes per second)."""
    return nbytes / ms / 1e6


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``headers`` as an aligned text table (``None`` shows as ``-``)."""
    cells = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def source_digest() -> str:
    """sha256 (16 hex digits) of the ``triton_ep`` package's Python sources, in path order: which code a result
    file was measured with (a machine's copy of the tree may carry no reliable git metadata; ``git`` users match
    it with this function on a checkout)."""
    import hashlib
    h = hashlib.sha256()
    pkg = os.path.join(ROOT, "triton_ep")
    for d, dirs, files in sorted(os.walk(pkg)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(os.path.relpath(os.path.join(d, f), pkg).encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]


def write_json(path: str, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` (making its folder) and say so. A dict gets ``recorded``: the UTC
    time and :func:`source_digest`."""
    if isinstance(obj, dict) and "recorded" not in obj:
        obj = dict(obj, recorded=dict(utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                      triton_ep_sources=source_digest()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


def bar_chart(path: str, labels: List[str], series: Dict[str, List[float]], title: str, ylabel: str,
              hline: Optional[float] = None) -> None:
    """A PNG bar chart (matplotlib, headless): one group of bars per label, one bar per series, an
    optional dashed target line; says so and carries on when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no chart {path}")
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels) + 2), 4.5))
    width = 0.8 / max(len(series), 1)
    for s, (name, values) in enumerate(series.items()):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(values))]
        bars = ax.bar(xs, values, width, label=name)
        for b, v in zip(bars, values):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=6)
    if hline is not None:
        ax.axhline(hline, color="tab:red", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def nvl_bytes_hint(hidden: int, ranks: int) -> int:
    """The buffer size DeepEP's configs ask for (the larger of dispatch's and combine's hints)."""
    import triton_ep
    hb = hidden * 2
    return max(triton_ep.Buffer.get_dispatch_config(ranks).get_nvl_buffer_size_hint(hb, ranks),
               triton_ep.Buffer.get_combine_config(ranks).get_nvl_buffer_size_hint(hb, ranks))


def dispatch_combine(buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: int, iters: int,
                     warmup: int, group=None, show_progress: bool = False):
    """Normal-mode dispatch then combine (of the received rows unchanged) through ``buf``, checked and timed.

    Returns ``(stats, outs)``: ``stats`` holds this rank's median ``dispatch_ms``/``combine_ms`` over
    ``iters`` calls (each started together over ``group``: ``examples/moe_layer.timed``), ``recv_rows``,
    ``recv_bytes`` (bf16 rows received: DeepEP's byte count for both directions),
    ``dispatch_GBps``/``combine_GBps`` (recv_bytes over the median time) and ``combine_ok`` (combine
    equals :func:`expected_combine`); ``outs`` is the first dispatch's return value plus the combined
    tensor and ``is_token_in_rank``. ``show_progress``: a progress bar over the four steps (first calls,
    then the timed ones; it never runs inside a timed call)."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    steps = stages(("first dispatch", "first combine", "timed dispatch", "timed combine"), "dispatch/combine",
                   show=show_progress, leave=False)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    def combine():
        return buf.combine(recv_x, handle)

    next(steps)
    first = dispatch()
    recv_x, handle = first[0], first[4]
    next(steps)
    combined = combine()[0]
    ok = torch.equal(combined, expected_combine(x, in_rank))
    next(steps)
    t_d = timed(dispatch, iters, warmup, buf.device, group)
    next(steps)
    t_c = timed(combine, iters, warmup, buf.device, group)
    next(steps, None)
    nbytes = recv_x.shape[0] * recv_x.shape[1] * 2
    stats = dict(dispatch_ms=t_d, combine_ms=t_c, recv_rows=int(recv_x.shape[0]), recv_bytes=nbytes,
                 dispatch_GBps=gbps(nbytes, t_d), combine_GBps=gbps(nbytes, t_c), combine_ok=bool(ok))
    return stats, tuple(first) + (combined, in_rank)
