"""The names kernels carry in a profiler: one name per phase of a call, as DeepEP's programs look them up.

DeepEP's test programs time a call with ``torch.profiler`` and find its kernels by a substring of their names
(``tests/utils.py``, ``bench_kineto``): exactly one line of the profiler's table may contain ``dispatch``, one
``combine`` and, in normal mode, one ``notify``; with a receive hook they also pick the kernels out of the trace
by ``"::dispatch"`` / ``"::combine"`` and split them into a send phase and a receive phase, two launches a call.
So every kernel a phase launches carries that phase's name, every kernel of another job a name that contains
none of those words, and all of them a C++-style qualified name (``triton_ep::low_latency::dispatch()``):

- A Triton kernel is named in its compiled code by the ``repr`` of :func:`triton.jit` (by default the Python
  function's name). :func:`jit` gives it the Itanium-mangled form of the qualified name
  (``_ZN9triton_ep11low_latency8dispatchEv``); CUDA profilers (CUPTI, hence ``torch.profiler``, Nsight) show
  kernel names demangled, so the table reads ``triton_ep::low_latency::dispatch()``.
- Kernels that make one phase (a split launch's send and receive, the one-launch kernel) share one name, so the
  table has one line per phase, whichever launches a call takes.

The names, by phase (docs/design.md, *Kernel names*, lists them with the calls that launch them):

========================================  ==========================================================
``triton_ep::layout()``                   ``get_dispatch_layout`` (and a dispatch routed by ``topk_idx`` alone)
``triton_ep::intranode::notify()``        normal mode's count exchange; across hosts also the network leg's
                                          pack (it posts each stream's header: counts and status)
``triton_ep::intranode::dispatch()``      normal-mode dispatch: send and receive, or both in one launch
``triton_ep::intranode::combine()``       normal-mode combine: send and reduce, or both in one launch
``triton_ep::internode::forward()``       across hosts: the network leg's receive and the host's own records
``triton_ep::low_latency::route()``       low-latency dispatch's routing part when it is a launch of its own
``triton_ep::low_latency::dispatch()``    low-latency dispatch: send (with its route in one launch), receive
``triton_ep::low_latency::combine()``     low-latency combine: send, reduce
``triton_ep::low_latency::fence()``       the first low-latency call of new sizes
``triton_ep::low_latency::unpack()``      low-latency across hosts: a receive's network records into the area
``triton_ep::fp8_cast()``                 FP8 block quantisation (a utility, not on a call's path)
``triton_ep::scheduler_test::*()``        the scheduler's stand-in producer and consumer (tests, benchmarks)
========================================  ==========================================================

Under Triton's interpreter (CPU) names do not matter to anything but the tests, which read
:attr:`profile_name` of each launched kernel.
"""
from typing import Tuple

import triton

#: the words DeepEP's programs look kernels up by; a kernel of another job carries none of them
PHASE_WORDS: Tuple[str, ...] = ("dispatch", "combine", "notify")


def mangle(*parts: str) -> str:
    """The Itanium C++ ABI name of the function ``parts[0]::...::parts[-1]()`` (no arguments), e.g.
    ``mangle("triton_ep", "intranode", "dispatch") == "_ZN9triton_ep9intranode8dispatchEv"``.

    Raises:
        ValueError: a part that is not a C identifier (letters, digits, ``_``; not starting with a digit).
    """
    for p in parts:
        if not p or not (p.replace("_", "a").isalnum() and p.isascii()) or p[0].isdigit():
            raise ValueError(f"a kernel name part must be a C identifier, got {p!r}")
    if len(parts) == 1:
        return f"_Z{len(parts[0])}{parts[0]}v"
    return "_ZN" + "".join(f"{len(p)}{p}" for p in parts) + "Ev"


def demangled(*parts: str) -> str:
    """How a profiler shows :func:`mangle` ``(*parts)``: ``"triton_ep::intranode::dispatch()"``."""
    return "::".join(parts) + "()"


def jit(*parts: str, **jit_options):
    """``triton.jit(**jit_options)`` for a kernel that profilers show as ``triton_ep::<parts>()``.

    Args:
        parts: the name's components after ``triton_ep`` (``"low_latency", "dispatch"``).
        jit_options: passed to :func:`triton.jit` (``do_not_specialize=...``).

    The returned kernel carries ``profile_name`` (the demangled name). Raises ``ValueError`` for a part that is not
    a C identifier.
    """
    full = ("triton_ep",) + parts
    symbol, shown = mangle(*full), demangled(*full)

    def decorate(fn):
        kernel = triton.jit(fn, repr=lambda _: symbol, **jit_options)
        kernel.profile_name = shown
        return kernel
    return decorate


__all__ = ["PHASE_WORDS", "demangled", "jit", "mangle"]
