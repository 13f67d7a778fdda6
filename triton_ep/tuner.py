"""``python -m triton_ep tune``: time candidate Configs for this GPU and these shapes, save the fastest as the tuned
table (:mod:`triton_ep.tuned`) that ``Buffer.get_dispatch_config`` / ``get_combine_config`` return.

For each token count it starts ``num_ranks`` rank processes (one GPU each where there are enough, else sharing
GPU 0; interpreted kernels on CPU tensors without a GPU), bootstrapped over gloo, builds a Buffer of ``num_nvl_bytes``
(default: DeepEP's size hint for the built-in Configs), makes one dispatch of random top-k routing and then times,
for the built-in tables (no Config) and each candidate Config, a cached dispatch and a combine of that handle:
``warmup`` calls, then ``iters`` calls each between a barrier and a device synchronisation (CUDA events around
the call on GPU, ``perf_counter`` on CPU), median per rank, slowest rank. Every candidate's outputs are checked
bit for bit against the built-in tables' (``RuntimeError`` otherwise). Without a GPU the defaults are ``--quick``'s
(tiny shapes, two candidates); options given still apply. Progress goes to stderr: a line as each token count
starts and one per Config measured (rank 0's). docs/tuning.md has the whole story.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from . import tuned
from .argtypes import non_negative_int, positive_int, positive_int_list, seconds
from .config import COMBINE_CONFIGS, DISPATCH_CONFIGS, Config, recommended_config

#: the candidates' axes on a GPU: SMs, rows per block (the NVLink send chunk), num_warps (a full run tries every
#: combination up to the device's SM count, plus DeepEP's recommended Config with 20 SMs)
GPU_SMS, GPU_ROWS, GPU_WARPS = (16, 24, 32, 48, 64, 96, 128), (1, 2, 4), (4, 8)
#: ``--quick``'s candidates (and the candidates under the interpreter): few, so that a CPU run stays short
#: (16-30 s seen on a loaded 2-core machine)
QUICK = (Config(2, 1, 4096), Config(4, 64, 256, num_warps=8))


@dataclass
class TuneSpec:
    """What one tuning run measures: ``num_ranks`` ranks, rows of ``hidden`` bf16 values, ``num_tokens`` tokens per
    rank, ``num_topk`` of ``num_experts`` experts, a buffer of ``num_nvl_bytes``, each timing the median of
    ``iters`` calls after ``warmup``; ``candidates``: the Configs' :meth:`Config.fields`; ``seed`` of the routing;
    ``label``: where not empty, rank 0 prints a progress line on stderr per Config measured, starting with it."""
    num_ranks: int
    hidden: int
    num_tokens: int
    num_experts: int
    num_topk: int
    num_nvl_bytes: int
    iters: int
    warmup: int
    candidates: List[dict]
    seed: int = 0
    label: str = ""


def quick_defaults(quick: bool) -> bool:
    """Whether a run takes ``--quick``'s defaults (tiny shapes, few iterations, :data:`QUICK`'s two candidates):
    with ``quick``, or without a GPU (the interpreter runs DeepSeek-V3 shapes for many minutes)."""
    return bool(quick) or not torch.cuda.is_available()


def candidates(quick: bool, num_ranks: int) -> List[Config]:
    """The Configs a run tries: :data:`QUICK` with ``quick`` or without a GPU (:func:`quick_defaults`); else every
    combination of :data:`GPU_SMS` (up to this GPU's SM count, which is added), :data:`GPU_ROWS` and
    :data:`GPU_WARPS` with DeepEP's receive chunk for ``num_ranks``, plus DeepEP's recommended dispatch and combine
    Configs (20 SMs)."""
    if quick_defaults(quick):
        return list(QUICK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2
    recv = max(recommended_config(num_ranks, DISPATCH_CONFIGS, 20).num_max_nvl_chunked_recv_tokens, 256)
    out = [recommended_config(num_ranks, t, 20) for t in (DISPATCH_CONFIGS, COMBINE_CONFIGS)]
    for n in sorted({s for s in GPU_SMS if s <= sms} | {sms}):
        out += [Config(n, rows, recv, num_warps=w) for rows in GPU_ROWS for w in GPU_WARPS]
    return out


def config_of(fields: dict) -> Config:
    """The Config of :meth:`Config.fields`' dict (DeepEP's five fields and ``num_warps``)."""
    f = dict(fields)
    warps = f.pop("num_warps", None)
    return Config(**f, num_warps=warps)


def _timed(call, iters: int, warmup: int, dev: torch.device) -> float:
    """Median microseconds of ``call()`` over ``iters`` calls after ``warmup``, each after a barrier and a device
    synchronisation (CUDA events around it on GPU)."""
    import torch.distributed as dist
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _slowest(us: float) -> float:
    import torch.distributed as dist
    t = torch.tensor([us], dtype=torch.float64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def rank_main(rank: int, world: int, spec: TuneSpec) -> dict:
    """One rank of a tuning run (:func:`triton_ep.testing.run_ranks`): the slowest rank's median microseconds of a
    cached dispatch and a combine (``"dispatch"``, ``"combine"``: lists of the built-in tables, then each candidate in
    ``spec.candidates``' order). The built-in tables are timed first and again last, and their figure is the faster
    of the two (``"builtin_runs"``: both, per call).

    Raises:
        RuntimeError: a candidate's output differs from the built-in tables' (results must not depend on a Config).
    """
    from .buffer import Buffer
    dev = torch.device("cpu")
    if torch.cuda.is_available():
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    g = torch.Generator(device="cpu").manual_seed(spec.seed * 1000 + rank)
    T, H, E, K = spec.num_tokens, spec.hidden, spec.num_experts, spec.num_topk
    x = torch.randn(T, H, generator=g, dtype=torch.float32, device="cpu").to(dtype=torch.bfloat16, device=dev)
    idx = torch.rand(T, E, generator=g, dtype=torch.float32, device="cpu").topk(K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g, dtype=torch.float32, device="cpu").to(dev)
    buf = Buffer(None, spec.num_nvl_bytes, device=dev)
    try:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        configs = [None] + [config_of(c) for c in spec.candidates]
        out = {"dispatch": [], "combine": []}

        def timed(cfg) -> dict:     # the slowest rank's median µs of a cached dispatch and a combine with cfg
            return {"dispatch": _slowest(_timed(lambda: buf.dispatch(x, handle=handle, config=cfg), spec.iters,
                                                spec.warmup, dev)),
                    "combine": _slowest(_timed(lambda: buf.combine(recv_x, handle, config=cfg), spec.iters,
                                               spec.warmup, dev))}
        want = None
        for i, cfg in enumerate(configs):
            got = (buf.dispatch(x, handle=handle, config=cfg)[0], buf.combine(recv_x, handle, config=cfg)[0])
            if want is None:
                want = got
            elif not (_same(got[0], want[0]) and _same(got[1], want[1])):
                raise RuntimeError(f"{cfg}: outputs differ from the built-in tables' (a bug: results must not "
                                   f"depend on a Config)")
            for call, us in timed(cfg).items():
                out[call].append(us)
            if spec.label and rank == 0:
                print(f"{spec.label}: {i + 1}/{len(configs)} {cfg if cfg is not None else 'the built-in tables'}: "
                      f"dispatch {out['dispatch'][-1]:.1f} us, combine {out['combine'][-1]:.1f} us",
                      file=sys.stderr, flush=True)
        # the built-in tables once more, last: timed first only, they were up to 1.5x slower than candidates of
        # the same launches (one H100, 2026-12-06), so the faster of their two medians is theirs
        again = timed(None)
        out["builtin_runs"] = {call: [out[call][0], again[call]] for call in again}
        for call in again:
            out[call][0] = min(out[call][0], again[call])
        return out
    finally:
        buf.destroy()


def entries_of(spec: TuneSpec, times: dict) -> List[dict]:
    """The tuned table's entries for one run's ``times`` (:func:`rank_main`'s): per call, the fastest candidate."""
    out = []
    for call in tuned.CALLS:
        ts = times[call]
        best = min(range(len(ts)), key=ts.__getitem__)     # (0: the built-in tables stay: "config" None)
        out.append({"call": call, "num_ranks": spec.num_ranks, "hidden": spec.hidden, "num_tokens": spec.num_tokens,
                    "num_experts": spec.num_experts, "num_topk": spec.num_topk,
                    "config": spec.candidates[best - 1] if best else None, "time_us": round(ts[best], 2),
                    "builtin_time_us": round(ts[0], 2),
                    **({"builtin_runs_us": [round(t, 2) for t in times["builtin_runs"][call]]}
                       if "builtin_runs" in times else {}),
                    "candidates": [{"config": c, "time_us": round(t, 2)} for c, t in zip(spec.candidates, ts[1:])]})
    return out




def rank_bytes(num_ranks: int, hidden: int, num_tokens: int, num_experts: int) -> tuple:
    """What one rank of a run (:func:`rank_main`) may hold at once, in bytes: ``(host, device)``. Host: the fp32
    ``[T, H]`` and ``[T, E]`` drawn on the CPU. Device: ``x`` (bf16 ``[T, H]``), and each dispatch's received rows
    (at most ``R * T``) and combine's ``[T, H]``, twice (the built-in tables' outputs are kept to compare each
    candidate's with). On the CPU both are host memory."""
    T, H = num_tokens, hidden
    return 4 * T * (H + num_experts), 2 * T * H * (1 + 2 * (num_ranks + 1))


def host_memory_bytes() -> int:
    """This host's physical memory in bytes (``sysconf``), or 0 where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0


def check_memory(num_ranks: int, hidden: int, num_tokens: int, num_experts: int) -> None:
    """Refuse a run whose ranks could not hold their tensors (:func:`rank_bytes`) in this host's memory, or, with
    GPUs, in one GPU's memory (ranks share the GPUs as :func:`rank_main` places them, rank ``r`` on GPU
    ``r % count``): it would die in a rank with the allocator's error, after starting the ranks.

    Raises:
        ValueError: naming ``--tokens`` (with ``--hidden`` and ``--ranks``), the bytes needed and those there.
    """
    host, dev = rank_bytes(num_ranks, hidden, num_tokens, num_experts)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = [("this host's memory", num_ranks * (host + (0 if gpus else dev)), host_memory_bytes())]
    if gpus:
        need.append((f"one GPU's memory ({-(-num_ranks // gpus)} of the ranks on it)", -(-num_ranks // gpus) * dev,
                     torch.cuda.get_device_properties(0).total_memory))
    for where, n, have in need:
        if have and n > have:
            raise ValueError(f"--tokens {num_tokens}: the tensors of --ranks {num_ranks} ranks at --hidden {hidden} "
                             f"would need about {n / 2**30:.1f} GiB of {where}, more than its {have / 2**30:.1f} GiB")


def default_nvl_bytes(hidden: int, num_ranks: int) -> int:
    """DeepEP's buffer for these sizes: the larger size hint of the built-in dispatch and combine Configs."""
    return max(recommended_config(num_ranks, t, 20).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
               for t in (DISPATCH_CONFIGS, COMBINE_CONFIGS))


def table_file(text: str) -> str:
    """An argparse type: a file the tuned table may be written to (``tune --output``; here, not in
    :mod:`triton_ep.argtypes`, whose layer imports nothing of the package), checked by
    :func:`triton_ep.tuned.check_target` when the option is parsed, before any measuring: not empty, not a
    symlink, absent or a regular file that may be written (never a device, FIFO, socket, directory or read-only
    file), in an existing directory that takes a new file (the directory is not made). Whether an existing file is
    a tuned table (else ``--force`` is needed) is checked by :func:`resolve`, which knows ``--force``.

    Returns:
        The text as given.
    Raises:
        argparse.ArgumentTypeError: the reason, naming the path.
    """
    try:
        tuned.check_target(text, force=True)     # (the table check waits for --force: resolve)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text



def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tune`` subcommand's options, each checked as it is parsed (:mod:`triton_ep.argtypes`)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p.add_argument("--ranks", type=positive_int, default=max(gpus, 2),
                   help="ranks (processes; one GPU each where there are enough, else sharing GPU 0); "
                        "default: the GPUs here, at least 2")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="bf16 values per row, a multiple of 8 (default 7168; --quick or no GPU: 64)")
    p.add_argument("--tokens", type=positive_int_list, default=None,
                   help="comma-separated tokens per rank, each once, one table entry each (default 128,1024,4096; "
                        "--quick 8)")
    p.add_argument("--num-experts", type=positive_int, default=None,
                   help="experts, a multiple of --ranks (default 256; --quick or no GPU: 8)")
    p.add_argument("--num-topk", type=positive_int, default=None,
                   help="experts per token, at most --num-experts (default 8; --quick or no GPU: 2)")
    p.add_argument("--num-nvl-bytes", type=positive_int, default=None,
                   help="each rank's buffer, rounded up to 4 KiB (at least 4 KiB) as a Buffer does; it must hold one "
                        "row's record (default: DeepEP's size hint of the built-in Configs)")
    p.add_argument("--iters", type=positive_int, default=None, help="timed calls per candidate (default 20; --quick or no GPU: 2)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="untimed calls first (default 3; --quick or no GPU: 1)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and two candidates, the defaults without a GPU (a CPU run: 16-30 s seen on a loaded 2-core "
                        "machine); options given still apply")
    p.add_argument("--output", type=table_file, default=None,
                   help="the table's file: absent or a writable triton-ep tuned table (any GPU or version), never a "
                        "symlink, in an existing writable directory (checked before any measuring; default: "
                        f"${tuned.ENV_FILE}, else $XDG_CACHE_HOME/triton_ep/tuning.json, whose directory is made)")
    p.add_argument("--force", action="store_true",
                   help="replace the file at the table's path even where it is not a tuned table (without it such "
                        "a file is refused before any measuring, exit 2)")
    p.add_argument("--timeout-s", type=seconds, default=600.0, help="bound on each shape's run, seconds (default 600)")


@dataclass
class TuneArgs:
    """The ``tune`` options with their defaults filled in (``--quick``'s where given or without a GPU) and checked
    together by :func:`resolve`; ``path``: the table's file (``--output``, else :func:`triton_ep.tuned.default_path`)."""
    hidden: int
    tokens: List[int]
    num_experts: int
    num_topk: int
    iters: int
    warmup: int
    num_nvl_bytes: int
    path: str


def _named(flag: str, value, given) -> str:
    return f"{flag} {value}" if given is not None else f"{flag} {value} (the default)"


def resolve(a: argparse.Namespace) -> TuneArgs:
    """The run's :class:`TuneArgs` from the parsed options ``a``, checked together before any work (each option
    alone was checked as it was parsed, :mod:`triton_ep.argtypes`), with the rules a Buffer's calls would apply
    later: bf16 rows of a multiple of 16 bytes (DeepEP's) and at most :data:`~triton_ep.runtime.checks.MAX_HIDDEN`
    values, ``--ranks`` x each ``--tokens`` at most :data:`~triton_ep.runtime.checks.MAX_INT32` (a rank may receive
    every rank's tokens: an int32 row count, as a Buffer's ``num_worst_tokens``), experts a multiple of the ranks
    (each rank holds as many), at most :data:`~triton_ep.runtime.checks.MAX_EXPERTS`, top-k at most the experts
    (``torch.topk``), the ranks' tensors within this host's (and a GPU's) memory (:func:`check_memory`), and a
    buffer (rounded up to 4 KiB, as a Buffer does) that holds one dispatch and one combine record of a row.
    The table's file is checked by :func:`triton_ep.tuned.check_target` (an existing file must be a tuned table
    unless ``--force``). The default table location's directory is made here (a ``--output`` directory never is).

    Raises:
        ValueError: one line naming the option, its value and the rule broken.
    """
    from .modes.intranode import combine_record_bytes, dispatch_record_words   # (the records the mode sizes)
    from .runtime.checks import MAX_BUFFER_BYTES, MAX_EXPERTS, MAX_HIDDEN, MAX_INT32
    q = quick_defaults(a.quick)
    hidden = a.hidden or (64 if q else 7168)
    tokens = list(a.tokens or ((8,) if q else (128, 1024, 4096)))
    E, K = a.num_experts or (8 if q else 256), a.num_topk or (2 if q else 8)
    iters, warmup = a.iters or (2 if q else 20), a.warmup if a.warmup is not None else (1 if q else 3)
    if hidden % 8:
        raise ValueError(f"{_named('--hidden', hidden, a.hidden)}: bf16 rows must be a multiple of 16 bytes, so "
                         f"hidden must be a multiple of 8")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"--hidden {hidden}: must be at most {MAX_HIDDEN} (a row of bf16 values is 2 * hidden "
                         f"bytes, an int32 count of bytes)")
    for T in tokens:
        if a.ranks * T > MAX_INT32:
            raise ValueError(f"--tokens {T}: must be at most {MAX_INT32 // a.ranks} with --ranks {a.ranks} (a rank "
                             f"may receive every rank's tokens: --ranks x --tokens rows, an int32 count as a "
                             f"Buffer's num_worst_tokens)")
    if E % a.ranks:
        raise ValueError(f"{_named('--num-experts', E, a.num_experts)}: must be a multiple of --ranks {a.ranks} "
                         f"(each rank holds as many experts)")
    if E > MAX_EXPERTS:
        raise ValueError(f"--num-experts {E}: must be at most {MAX_EXPERTS} (a Buffer's maximum)")
    if K > E:
        raise ValueError(f"{_named('--num-topk', K, a.num_topk)}: must be at most --num-experts {E} (a token's "
                         f"top-k experts are distinct)")
    check_memory(a.ranks, hidden, max(tokens), E)
    nvl = a.num_nvl_bytes or default_nvl_bytes(hidden, a.ranks)
    if nvl > MAX_BUFFER_BYTES:
        raise ValueError(f"--num-nvl-bytes {nvl}: must be at most {MAX_BUFFER_BYTES} (a Buffer's maximum)")
    held = max(4096, -(-nvl // 4096) * 4096)
    need = max(dispatch_record_words(hidden // 2, 0, K, with_src=True) * 4, combine_record_bytes(hidden, K))
    if held < need:
        raise ValueError(f"{_named('--num-nvl-bytes', nvl, a.num_nvl_bytes)}: a Buffer rounds it up to 4 KiB "
                         f"({held} bytes), which must hold one record of a row of --hidden {hidden} with --num-topk "
                         f"{K} ({need} bytes)")
    force = bool(getattr(a, "force", False))
    if a.output is not None:
        try:
            path = tuned.check_target(a.output, force=force)    # (argparse checked the rest: main may be called
        except ValueError as e:                                 # directly)
            raise ValueError(f"--output {e}") from None
    else:
        try:
            path = tuned.check_target(tuned.default_path(), create_dir=True, force=force)
        except ValueError as e:
            raise ValueError(f"the table's file at {tuned.path_source()}: {e}") from None
    return TuneArgs(hidden, tokens, E, K, iters, warmup, nvl, path)


def main(a: argparse.Namespace, out) -> int:
    """Run the tuner with the parsed options ``a`` (:func:`add_arguments`), print a table of built-in against tuned
    microseconds per call and shape to ``out`` (a row per call as each token count finishes; progress lines on
    stderr: one as each token count starts, and rank 0's per Config measured) and save the tuned table: the new
    entries, plus those of other calls and shapes of a table already there that this process could use
    (:func:`triton_ep.tuned.save` with ``merge``, under its lock; a table it could not use is replaced whole, said
    on stderr before any measuring and again when saving). Returns 0; 2 where the options do not go together or
    the table's file cannot be written or is not a table without ``--force`` (:func:`resolve`: one line on stderr,
    before any work); 1 when a rank failed (its error printed), the ranks ran past ``--timeout-s`` or the save
    failed (one line on stderr, nothing saved); 130 on Ctrl-C (``KeyboardInterrupt``: one line, nothing saved; the
    ranks are ended by :func:`triton_ep.testing.run_ranks` as on a timeout)."""
    try:
        r = resolve(a)
    except ValueError as e:
        print(f"triton-ep tune: error: {e}", file=sys.stderr)
        return 2
    hidden, E, K, path = r.hidden, r.num_experts, r.num_topk, r.path
    _, why = tuned.kept_entries(path, [])      # (said before any measuring, not only at the end)
    if why:
        print(f"triton-ep tune: replacing the table {path} whole: {why}", file=sys.stderr, flush=True)
    try:
        return _measure_and_save(a, r, why, out)
    except KeyboardInterrupt:       # (run_ranks has ended the ranks on its way out)
        print("triton-ep tune: interrupted (Ctrl-C); nothing saved", file=sys.stderr, flush=True)
        return 130


def _measure_and_save(a: argparse.Namespace, r: TuneArgs, said: Optional[str], out) -> int:
    """:func:`main`'s work after its checks: measure each token count, print the rows, save (``said``: the reason
    the table there is replaced whole, as :func:`main` printed it before measuring)."""
    from .testing import run_ranks
    hidden, E, K, path = r.hidden, r.num_experts, r.num_topk, r.path
    cands = [c.fields() for c in candidates(a.quick, a.ranks)]
    entries = []
    if quick_defaults(a.quick) and not a.quick:
        print("triton-ep tune: no GPU: --quick's defaults (tiny shapes, two candidates; options given still apply)",
              file=sys.stderr, flush=True)
    print(f"{'call':8} {'ranks':>5} {'hidden':>6} {'tokens':>6} {'built-in us':>11} {'tuned us':>9} {'ratio':>6}  "
          f"best Config", file=out)
    for n, T in enumerate(r.tokens):
        label = f"triton-ep tune: tokens {T} ({n + 1}/{len(r.tokens)})"
        print(f"{label}: {a.ranks} ranks, hidden {hidden}, top-{K} of {E} experts, the built-in tables and "
              f"{len(cands)} candidates, {r.warmup} + {r.iters} calls each", file=sys.stderr, flush=True)
        spec = TuneSpec(a.ranks, hidden, T, E, K, r.num_nvl_bytes, r.iters, r.warmup, cands, label=label)
        try:
            res = run_ranks(rank_main, a.ranks, spec, timeout_s=a.timeout_s)
        except TimeoutError as e:   # (the ranks were killed)
            print(f"triton-ep tune: error: tokens {T}: {e} (--timeout-s {a.timeout_s}); nothing saved",
                  file=sys.stderr, flush=True)
            return 1
        bad = [r for r in res if hasattr(r, "traceback")]
        if bad:
            print(bad[0].traceback or bad[0].message, file=out)
            return 1
        for e in entries_of(spec, res[0]):
            entries.append(e)
            print(f"{e['call']:8} {a.ranks:5d} {hidden:6d} {T:6d} {e['builtin_time_us']:11.1f} {e['time_us']:9.1f} "
                  f"{e['time_us'] / e['builtin_time_us']:6.2f}  "
                  f"{repr(config_of(e['config'])) if e['config'] is not None else 'the built-in tables'}", file=out,
                  flush=True)
    try:
        kept, why, bak = tuned.save(path, entries, "python -m triton_ep tune " + " ".join(_argv(a)), merge=True,
                                    force=bool(getattr(a, "force", False)), backup=True)
    except (ValueError, TimeoutError) as e:     # (the file changed during the run; another save held its lock)
        print(f"triton-ep tune: error: not saved: {e}", file=sys.stderr, flush=True)
        return 1
    if why and why != said:         # (the file changed during the run)
        print(f"triton-ep tune: replacing the table {path} whole: {why}", file=sys.stderr, flush=True)
    print(saved_line(len(entries), path, len(kept), bak), file=out)
    return 0


def readers(path: str) -> str:
    """Which later Buffers read the table at ``path``, for :func:`saved_line`: every one of this user where it is
    the default location (:func:`triton_ep.tuned.default_path` without ``$TRITON_EP_TUNING_FILE``), those of
    processes whose variable names it, or, for another file, only where the variable is set to it."""
    here = os.path.realpath(path) == os.path.realpath(tuned.default_path())
    if here and tuned.path_source() == "the default location":
        return (f"Every later Buffer of this user reads it (get_dispatch_config / get_combine_config), unless its "
                f"process sets ${tuned.ENV_FILE}")
    if here:
        return f"Every later Buffer of a process with ${tuned.ENV_FILE}={os.environ[tuned.ENV_FILE].strip()} reads it"
    return f"A Buffer reads it only where ${tuned.ENV_FILE} names it"


def saved_line(n: int, path: str, kept: int, bak: Optional[str]) -> str:
    """``tune``'s last line: how many entries it saved to which file (``kept``: entries of other calls and shapes
    kept from the table there), who reads that file (:func:`readers`) and how to undo the save: delete the file,
    or, where one was there before (``bak``: its copy, :func:`triton_ep.tuned.save`'s backup), put that back."""
    also = f" (and kept {kept} of other calls and shapes from the table there)" if kept else ""
    if bak is None:
        undo = f"to undo, delete {path}"
    else:
        also += f", replacing the file there (copied first to {bak})"
        undo = f"to undo, move {bak} back to {path} (or delete {path} for the built-in tables)"
    return f"saved {n} entries to {path}{also}. {readers(path)}; {undo}"


def _argv(a: argparse.Namespace) -> Sequence[str]:
    """The options of ``a`` as a command line names them (``--tokens=128,1024``, ``--quick``, ``--warmup=0``: a
    zero is an option given, not one left out)."""
    def text(v):
        return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return [f"--{k.replace('_', '-')}={text(v)}" if v is not True else f"--{k.replace('_', '-')}"
            for k, v in sorted(vars(a).items()) if k != "command" and v is not None and v is not False]


__all__ = ["TuneArgs", "TuneSpec", "add_arguments", "candidates", "entries_of", "main", "quick_defaults", "rank_main",
           "readers", "resolve", "saved_line", "table_file"]
