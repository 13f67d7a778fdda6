"""Launching a Triton kernel through its compiled form: the per-call host cost of a launch, cut.

``kernel[grid](*args, **constexprs)`` costs 20 to 45 µs of host time on an H200 machine (Triton 3.6),
growing with the number of arguments: Triton binds every argument, works out its specialisation, hashes
a cache key and builds launch metadata on every call. Measured there: a kernel of 20 runtime arguments
and 10 constexprs took 43.7 µs per launch through ``kernel[grid]`` and 13.2 µs through its compiled
kernel's launcher.

:class:`Launcher` wraps a ``@triton.jit`` function with the same ``launcher[grid](*args, num_warps=...,
**constexprs)`` syntax. The first launch of a specialisation goes through Triton (which compiles, or loads
its on-disk cache, and launches); later ones call the compiled kernel's launcher directly on the current
stream. The key of a specialisation is everything Triton specialises on: the constexpr values,
``num_warps``, each tensor's dtype and 16-byte alignment, each integer's type (32 or 64 bits) and whether it
is 1 or a multiple of 16. So a launch never runs a kernel compiled for other arguments.

Integer arguments whose value changes from call to call (token counts, round windows, round numbers, call
signatures, ranks) are declared ``do_not_specialize`` on every kernel: otherwise each new combination of
"is 1" / "is a multiple of 16" compiles the kernel again (measured on an H200: one test meeting many such
combinations spent over 90 s compiling on a cold cache, and 3.6 s warm). The key then holds only such an
argument's integer type, as Triton's own.

:meth:`Launcher.bind` fixes a launch's grid, ``num_warps`` and constexprs once (a :class:`BoundLaunch`), so each
call passes only its runtime arguments; the launch wrappers keep one per shape through :func:`bound`. Measured
on an H200 machine: a cached dispatch 83 -> 74 µs and a combine 75 -> 66 µs of host time at 128 tokens
(benchmarks/README.md). Launching through ``cuLaunchKernel`` directly was tried and gave nothing: the driver
call itself is most of a launch there.

Most of a launch's own Python used to go into its key: one function call per runtime argument (measured
on the 2-core development CPU with the launcher itself stubbed out: 5.3 of 8.0 µs for the fused dispatch's 29
arguments). A bound launch now works out key and launch arguments in one generated function per kind of
argument list (:func:`_binder`: which positions hold tensors, specialised or unspecialised integers, other
values), written once in Python source as Triton writes its own binder: each tensor's ``data_ptr()`` is read
once and serves both its alignment and the launch. An argument of another kind than the bound launch's first
call (a tensor where an integer was, ``None`` where a tensor was) takes the general path, which keys every
argument as before.

A tensor argument reaches the compiled kernel's launcher as its address (``data_ptr()``, an integer), which
the launcher passes on as it is. Given the tensor, it calls ``data_ptr()`` itself and then asks the driver to
translate the address (``cuPointerGetAttribute``): one driver call per tensor argument of every launch.
This saves little: on an H200 machine (one rank, ``benchmarks/host_cost.py --against``: both versions in one
process), with this and the low-latency dispatch's single carve together, a combine (one launch) took 0.97
of the host time it took before and a low-latency combine (two launches) 0.97 and 0.90 at T 128 and 4096;
two processes one after another had suggested much more, but on that machine such pairs differ by up to 2x.
Triton's own first launch of a specialisation still gets the tensors (and checks them); the Buffer checks
every tensor's device before it launches anything.

Triton's launch hooks (a profiler such as proton sets them) are honoured: while any is set, every launch
goes through Triton. Under the interpreter (``TRITON_INTERPRET=1``) every launch goes through Triton too.
"""
import contextlib
import functools
import operator
import threading
from typing import Dict, Tuple

import torch

from ..errors import EPError
from ._util import interpreted

try:                                    # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:                     # pragma: no cover - older Triton: always the plain path
    _knobs = None

_I32_LO, _I32_HI = -(1 << 31), 1 << 31


_INTERPRETER_BUSY = threading.Lock()


@contextlib.contextmanager
def interpreter_turn():
    """Around a launch under Triton's interpreter: the process's one turn at it. The interpreter keeps global state
    while it runs a kernel and is not thread-safe (two threads' launches at once fail inside it, and the calls
    around them break), so a launch of another thread while one runs raises at once, before it starts. On a GPU
    (compiled kernels) this does nothing.

    Raises:
        EPError: another thread of this process is running a kernel under the interpreter.
    """
    if not interpreted():
        yield
        return
    if not _INTERPRETER_BUSY.acquire(blocking=False):
        raise EPError("two threads of this process launched triton-ep kernels at once on the CPU: Triton's "
                      "interpreter (TRITON_INTERPRET=1) is not thread-safe; make triton-ep calls from one thread at a "
                      "time there (threads that take turns work)")
    try:
        yield
    finally:
        _INTERPRETER_BUSY.release()


def _hooks_set() -> bool:
    """Whether a Triton launch hook is installed (then launches take Triton's own path)."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and (getattr(h, "calls", True)):
            return True
    return False


def _arg_key(a):
    """What Triton specialises a runtime argument on (a superset of it)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if a.__class__ is int:
        return (a == 1) | ((a & 15) == 0) << 1 | (_I32_LO <= a < _I32_HI) << 2 | (a >= 1 << 63) << 3
    return a.__class__, a           # bool, float, None: keyed by value


def _arg_key_unspecialized(a):
    """:func:`_arg_key` of a ``do_not_specialize`` argument: an integer's type only."""
    if a.__class__ is int:
        return (_I32_LO <= a < _I32_HI) | (a >= 1 << 63) << 1
    return _arg_key(a)


_U63 = 1 << 63

#: a runtime argument's kind, as :func:`_binder` writes code for it: "T" a tensor, "I" an integer Triton
#: specialises, "U" a ``do_not_specialize`` integer, "O" anything else (bool, float, None)
_TENSOR, _INT, _UNSPEC, _OTHER = "T", "I", "U", "O"


def _kinds(args, key_fns) -> str:
    """The kinds of ``args`` (one letter each, see :data:`_TENSOR`...); ``key_fns``: the launcher's."""
    out = []
    for a, f in zip(args, key_fns):
        if isinstance(a, torch.Tensor):
            out.append(_TENSOR)
        elif a.__class__ is int:
            out.append(_UNSPEC if f is _arg_key_unspecialized else _INT)
        else:
            out.append(_OTHER)
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def _binder(kinds: str):
    """A function of runtime arguments of ``kinds`` returning ``(key, launch_args)``: ``key`` tells apart
    what :func:`_arg_key` / :func:`_arg_key_unspecialized` tell apart (positions hold a fixed number of items:
    2 for a tensor or another value, 1 for an integer), ``launch_args`` the arguments as the compiled
    launcher takes them (a tensor's address, other values as they are). An argument of another kind than
    ``kinds`` either raises (``AttributeError``: no ``data_ptr``) or puts its class where the key holds an
    integer's bits; :class:`BoundLaunch` never keeps a key for such an argument list."""
    names = [f"a{i}" for i in range(len(kinds))]
    body, key, out = [], [], []
    for i, (k, a) in enumerate(zip(kinds, names)):
        if k == _TENSOR:
            body.append(f"    p{i} = {a}.data_ptr()")
            key.append(f"{a}.dtype, not p{i} & 15")
            out.append(f"p{i}")
            continue
        if k == _INT:
            key.append(f"(({a} == 1) | (({a} & 15) == 0) << 1 | (_LO <= {a} < _HI) << 2 | ({a} >= _U63) << 3) "
                       f"if {a}.__class__ is int else {a}.__class__")
        elif k == _UNSPEC:
            key.append(f"((_LO <= {a} < _HI) | ({a} >= _U63) << 1) if {a}.__class__ is int else {a}.__class__")
        else:
            key.append(f"{a}.__class__, {a}")
        out.append(a)
    src = (f"def bind({', '.join(names)}):\n" + "".join(line + "\n" for line in body)
           + f"    return ({''.join(k + ', ' for k in key)}), ({''.join(o + ', ' for o in out)})\n")
    scope = {"_LO": _I32_LO, "_HI": _I32_HI, "_U63": _U63}
    exec(compile(src, f"<triton_ep binder {kinds}>", "exec"), scope)     # noqa: S102 - our own source, above
    fn = scope["bind"]
    fn.kinds = kinds
    return fn


def _call_py(f, a):
    return f(a)


#: ``f(a)``, in C where Python has it (3.11+): one Python frame less per argument of every launch
_call = getattr(operator, "call", _call_py)


class Launcher:
    """A ``@triton.jit`` function launched through its compiled kernel once that is known.

    Args:
        fn: the ``triton.jit`` function. Its constexpr parameters must come after its runtime ones and be
            passed by keyword; runtime arguments are passed by position.
        options: compile options for every launch on GPU (e.g. ``enable_fp_fusion=False``); the
            interpreter takes none. A launch given other keywords than the constexprs always goes
            through Triton.

    ``Launcher(fn)[grid](*args, num_warps=w, **constexprs)`` behaves as ``fn[grid](...)``: same kernels,
    same results, on the current stream. Raises what Triton raises (compilation errors on the first
    launch of a specialisation; a missing constexpr raises ``KeyError`` naming it).
    """

    def __init__(self, fn, **options) -> None:
        self.fn = fn
        #: the kernel's name without its leading ``_`` and trailing ``_kernel``: by the kernels' convention, the
        #: name of the launch wrapper that launches it (``_dispatch_send_kernel`` -> ``dispatch_send``)
        self.name = getattr(getattr(fn, "fn", fn), "__name__", "kernel").lstrip("_").removesuffix("_kernel")
        self._cache: Dict[tuple, tuple] = {}
        #: (grid, num_warps, constexpr values) -> the bound launch a plain launch goes through
        self._binds: Dict[tuple, "BoundLaunch"] = {}
        self._driver = None
        self._interp = interpreted()
        self.constexprs: Tuple[str, ...] = ()
        self.options = {} if self._interp else options
        #: per runtime argument, the function giving its part of the key
        self._key_fns: Tuple = ()
        if not self._interp:
            self.constexprs = tuple(p.name for p in fn.params if p.is_constexpr)
            self._key_fns = tuple(_arg_key_unspecialized if getattr(p, "do_not_specialize", False) else _arg_key
                                  for p in fn.params if not p.is_constexpr)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, num_warps: int = 4, **meta) -> None:
        if self._interp or _hooks_set() or len(meta) != len(self.constexprs):
            with interpreter_turn():
                self.fn[grid](*args, num_warps=num_warps, **meta, **self.options)
            return
        cvals = tuple(map(meta.__getitem__, self.constexprs))
        grid = tuple(grid)
        bkey = (grid, num_warps, cvals)
        b = self._binds.get(bkey)
        if b is None:
            b = bound(self._binds, bkey, lambda: self.bind(grid, num_warps, **meta))
        b(*args)

    def _first(self, grid, args, num_warps: int, meta: dict, key: tuple) -> tuple:
        """Launch through Triton (which compiles, or loads its on-disk cache) and keep the compiled kernel's
        launcher for ``key``; returns the entry kept."""
        kernel = self.fn[grid](*args, num_warps=num_warps, **meta, **self.options)   # compile and launch
        if self._driver is None:        # the GPU driver, known once a kernel has launched through Triton
            from triton.runtime import driver
            self._driver = (driver.active.get_current_stream, driver.active.get_current_device)
        # the tensors' positions (the key tells them apart from integers): their addresses go to the launcher
        # as integers, which it takes as they are (a tensor costs it a data_ptr() call and a driver query)
        tpos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        entry = self._cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, key[0], tpos)
        return entry

    def _run(self, entry: tuple, grid, args) -> None:
        run, function, packed, cvals, tpos = entry
        if tpos:
            args = list(args)
            for i in tpos:
                args[i] = args[i].data_ptr()
        stream, device = self._driver
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream(device()), function,
            packed, None, None, None, *args, *cvals)

    def bind(self, grid, num_warps: int = 4, **meta) -> "BoundLaunch":
        """This launcher with its grid, ``num_warps`` and constexprs fixed: calling the result with the runtime
        arguments launches as ``launcher[grid](*args, num_warps=num_warps, **meta)`` does, minus the per-call
        work on the fixed parts (the constexprs' part of the key, the keyword arguments). A launch wrapper
        keeps one per shape (:func:`bound`).

        Raises:
            KeyError: on GPU, ``meta`` has as many keywords as the kernel has constexprs but misses one (it
                names it); other keyword sets go through Triton on every call, which raises its own error.
        """
        return BoundLaunch(self, tuple(grid), num_warps, meta)


class BoundLaunch:
    """One :class:`Launcher` with its grid, ``num_warps`` and constexprs fixed (:meth:`Launcher.bind`).

    Calling it with the runtime arguments (by position) launches on the current stream, with the same kernels
    and results as the launcher's own call: the key of a specialisation still includes each runtime argument's
    part (dtype, alignment, integer kind), and its entries are the launcher's (one compilation serves both).
    Under the interpreter, while a Triton launch hook is set, or where the number of keywords differs from the
    kernel's constexprs, every call goes through Triton. Raises what Triton raises.
    """

    __slots__ = ("launcher", "grid", "num_warps", "meta", "cvals", "_entries", "_bind", "_grid3")

    def __init__(self, launcher: Launcher, grid: tuple, num_warps: int, meta: dict) -> None:
        self.launcher, self.grid, self.num_warps, self.meta = launcher, grid, num_warps, meta
        generic = launcher._interp or len(meta) != len(launcher.constexprs)
        self.cvals = None if generic else tuple(map(meta.__getitem__, launcher.constexprs))
        #: the key :func:`_binder` gives for the runtime arguments -> the launcher's entry
        self._entries: Dict[tuple, tuple] = {}
        self._bind = None               # the binder of the first call's kinds of arguments
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))

    def __call__(self, *args) -> None:
        la = self.launcher
        if self.cvals is None or _hooks_set():
            with interpreter_turn():
                la.fn[self.grid](*args, num_warps=self.num_warps, **self.meta, **la.options)
            return
        bind = self._bind
        if bind is None:
            bind = self._bind = _binder(_kinds(args, la._key_fns))
        try:
            key, cargs = bind(*args)
        except (AttributeError, TypeError):     # arguments of other kinds (or number) than the first call's
            self._general(args)
            return
        entry = self._entries.get(key)
        if entry is None:
            if _kinds(args, la._key_fns) != bind.kinds:
                self._general(args)
                return
            gkey = (self.cvals, self.num_warps, tuple(map(_call, la._key_fns, args)))
            entry = la._cache.get(gkey)
            if entry is None:       # compile (or load Triton's cache) and launch through Triton
                self._entries[key] = la._first(self.grid, args, self.num_warps, self.meta, gkey)
                return
            self._entries[key] = entry
        stream, device = la._driver
        g = self._grid3
        entry[0](g[0], g[1], g[2], stream(device()), entry[1], entry[2], None, None, None, *cargs, *self.cvals)

    def replay(self, args: tuple, vary: tuple) -> "Replay":
        """A :class:`Replay` of the launch just made with ``args``: later launches pass only the tensors of
        ``vary`` (tensors among ``args``, by identity; every position holding one of them, dummy slots too,
        takes the new tensor), the rest of ``args`` stays as it was. Call it right after launching with
        ``args``: on GPU it keeps the compiled kernel that launch used and the other arguments' addresses. It
        keeps references to the other arguments, never to a tensor of ``vary``."""
        where = {}                      # a tensor's first place in vary, by identity (every argument is alive here)
        for j, v in enumerate(vary):
            where.setdefault(id(v), j)
        slots = tuple(where.get(id(a), -1) for a in args)
        entry = cargs = None
        if self.cvals is not None and self._bind is not None and not _hooks_set():
            try:
                key, cargs = self._bind(*args)
                entry = self._entries.get(key)
            except (AttributeError, TypeError):
                entry = None
        if entry is not None:
            cargs = tuple(0 if j >= 0 else a for a, j in zip(cargs, slots))
        targs = tuple(None if j >= 0 else a for a, j in zip(args, slots))
        return Replay(self, entry, cargs, targs, slots, tuple(not (v.data_ptr() & 15) for v in vary),
                      tuple(v.dtype for v in vary))

    def _general(self, args) -> None:
        """Launch keying every argument on its own (arguments of other kinds than the binder's)."""
        la = self.launcher
        key = (self.cvals, self.num_warps, tuple(map(_call, la._key_fns, args)))
        entry = la._cache.get(key)
        if entry is None:
            la._first(self.grid, args, self.num_warps, self.meta, key)
            return
        la._run(entry, self.grid, args)


class Replay:
    """A launch made again with the same grid and arguments but for a few tensors (:meth:`BoundLaunch.replay`):
    what a call whose shapes did not change since its last call launches, with no key worked out and no
    argument rebuilt but the tensors' addresses.

    ``replay(*tensors)`` (one per ``vary`` tensor of the planned launch) launches on the current stream with the
    compiled kernel the planned launch used, the tensors' addresses in their positions. Where that kernel cannot
    stand for these tensors (another dtype, or an address not 16-byte aligned where the planned one was: the
    kernel may assume it), while a Triton launch hook is set, and under the interpreter, it launches through
    the bound launch with the arguments rebuilt (same results). Raises what Triton raises.
    """

    __slots__ = ("bound", "entry", "cargs", "targs", "aligned", "dtypes", "pos")

    def __init__(self, bound: BoundLaunch, entry, cargs, targs: tuple, slots: tuple, aligned: tuple,
                 dtypes: tuple) -> None:
        self.bound, self.entry, self.cargs, self.targs = bound, entry, cargs, targs
        self.aligned, self.dtypes = aligned, dtypes
        #: per vary tensor, the positions it fills
        self.pos = tuple(tuple(i for i, j in enumerate(slots) if j == k) for k in range(len(dtypes)))

    def __call__(self, *tensors) -> None:
        entry = self.entry
        if entry is not None and not _hooks_set():
            args, aligned, dtypes = list(self.cargs), self.aligned, self.dtypes
            for k, t in enumerate(tensors):
                p = t.data_ptr()
                if t.dtype is not dtypes[k] or (p & 15 and aligned[k]):
                    break
                for i in self.pos[k]:
                    args[i] = p
            else:
                run, function, packed, cvals, _ = entry
                stream, device = self.bound.launcher._driver
                g = self.bound._grid3
                run(g[0], g[1], g[2], stream(device()), function, packed, None, None, None, *args, *cvals)
                return
        args = list(self.targs)
        for k, t in enumerate(tensors):
            for i in self.pos[k]:
                args[i] = t
        self.bound(*args)


def resident_per_sm(launcher: Launcher, args: tuple, num_warps: int, meta: dict, device: torch.device) -> int:
    """How many programs of ``launcher``'s kernel, specialised for the runtime arguments ``args`` with
    ``num_warps`` and the constexprs ``meta``, fit on one multiprocessor of ``device`` at once (by registers,
    shared memory and threads, as the CUDA occupancy rules count them). Compiles the kernel without launching it
    (Triton's ``warmup``; the launch that follows finds it in Triton's cache) and loads it to learn its registers.
    A launch whose programs wait for each other sizes its grid with this (every program must be resident).
    GPU only; raises what Triton raises for the compilation."""
    kernel = launcher.fn.warmup(*args, grid=(1,), num_warps=num_warps, **meta, **launcher.options)
    kernel._init_handles()          # (loads it: its register count is known from here)
    props = torch.cuda.get_device_properties(device)
    warp_regs = -(-max(int(kernel.n_regs), 1) * 32 // 256) * 256      # registers go to warps 256 at a time
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // (int(kernel.metadata.shared) + 1024)   # 1 KiB a program
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(0, min(by_regs, by_shared, by_threads, 32))


def bound(cache: Dict[tuple, BoundLaunch], key: tuple, make) -> BoundLaunch:
    """``cache[key]``, made by ``make()`` (a :meth:`Launcher.bind`) the first time; a launch wrapper keys its
    cache by everything that decides its grid and constexprs (shapes, flags, its tuning entry's items, which
    tests and sweeps may change). Past 256 entries the cache starts again, so shapes that keep changing
    cost a bind each, never unbounded memory."""
    b = cache.get(key)
    if b is None:
        if len(cache) >= 256:
            cache.clear()
        b = cache[key] = make()
    return b


__all__ = ["BoundLaunch", "Launcher", "Replay", "bound", "resident_per_sm"]
