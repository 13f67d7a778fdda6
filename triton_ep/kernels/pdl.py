"""Programmatic dependent launch (PDL) for the low-latency kernels and normal mode's within one host (dispatch and
combine, split and one-launch): an opt-in experiment (``TRITON_EP_PDL=1``).

With PDL a launch may start while the launch before it in the stream is still running: its programs become
resident and wait (``griddepcontrol.wait``, Triton's ``gdc_wait``) until the launch before it has completed and
its writes are visible, so the launch's own start-up overlaps the previous launch's tail (Hopper and later, CUDA
12.3+ for graphs). Every kernel launched with PDL waits so before it reads or writes anything, which keeps the
stream's order for everything after it: a later launch waits for this one, which waited for the one before.
When the launch after it may start is each kernel's ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``; a program that ends without it counts as having called it):

- the low-latency kernels call :func:`pdl_start`: wait, then let the next launch start at once;
- normal mode's kernels call :func:`pdl_wait` first and :func:`pdl_release` where their data movement ends
  (before the launch's last program's flags), so the next launch's programs are not made resident beside this
  launch's while it still moves its bytes. Measured on one H100 (one rank, T 4096, hidden 7168, CUDA-graph replay
  of ``benchmarks/grid_cap.py``, two runs alternated in one device call): a cached dispatch took 89.2 µs without
  PDL, 91.0-91.1 with the next launch let in at the start, 88.5-88.6 with it let in at the end; a dispatch and a
  combine replayed together 179.8, 187.0-187.8 and 177.6-177.8 µs.

Off by default, and always off under the interpreter. The switch is read once, when ``triton_ep`` is imported: set
it before. Its values are those of ``TRITON_EP_FUSED`` (1 / 0, true / false, yes / no, on / off, any case, spaces
around ignored). The first low-latency dispatch, and the first normal-mode dispatch or combine within one host, of
a process checks it (:func:`check`): another value, or PDL on for a GPU older than Hopper (or a ROCm one), raises
``ValueError`` before anything is launched.
"""
import os
import warnings

import torch
import triton
import triton.language as tl

from ._util import env_switch, interpreted

try:                                    # Triton >= 3.4 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                     # pragma: no cover - older Triton: PDL stays off
    gdc_wait = gdc_launch_dependents = None


def _switch() -> object:
    """``TRITON_EP_PDL`` as True / False (unset or empty: False), or the raw string where it is no switch value
    (:func:`check` raises for it at the first low-latency call, not at import)."""
    try:
        return bool(env_switch("TRITON_EP_PDL"))
    except ValueError:
        return os.environ["TRITON_EP_PDL"]


def pdl_enabled() -> bool:
    """``TRITON_EP_PDL`` is on (1, true, yes, on), kernels run on a GPU and Triton has ``gdc_wait``."""
    return _switch() is True and not interpreted() and gdc_wait is not None


#: whether the low-latency and normal-mode kernels are compiled and launched with PDL (fixed at import)
PDL_ON = pdl_enabled()
PDL = tl.constexpr(PDL_ON)


#: the switch as it was at import (what :func:`check` judges)
SWITCH = _switch()
_CHECKED: set = set()


def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def check(device: torch.device) -> None:
    """Judge the switch once per process and device, at the first call that launches a kernel taking it (before
    anything launches).

    Raises:
        ValueError: ``TRITON_EP_PDL`` is not a switch value, or PDL is on and ``device`` is a GPU older than Hopper
            (compute capability 9.0) or a ROCm GPU, where the kernels' ``griddepcontrol`` does not compile.
    Warns (once) where the switch is on but this Triton has no ``gdc_wait`` (PDL stays off)."""
    if device in _CHECKED:      # (every low-latency dispatch comes here: a set lookup, no string made)
        return
    if SWITCH not in (True, False):
        raise ValueError(f"TRITON_EP_PDL must be 1 or 0 (or true / false, yes / no, on / off), got {SWITCH!r}")
    if SWITCH and gdc_wait is None and not interpreted():
        warnings.warn("TRITON_EP_PDL is on but this Triton has no gdc_wait: the low-latency kernels launch without "
                      "programmatic dependent launch", stacklevel=3)
    if PDL_ON and device.type == "cuda":
        cap, hip = _capability(device), getattr(torch.version, "hip", None)
        if hip or tuple(cap) < (9, 0):
            raise ValueError(f"TRITON_EP_PDL=1 needs an NVIDIA GPU of compute capability 9.0 (Hopper) or newer; "
                             f"{device} has {cap[0]}.{cap[1]}{' (ROCm)' if hip else ''}: unset it")
    _CHECKED.add(device)


def options() -> dict:
    """The compile option of a PDL launch (``launch_pdl``) where PDL is on, else none."""
    return {"launch_pdl": True} if PDL_ON else {}


@triton.jit
def pdl_start():
    """First thing of a kernel launched with PDL: wait until the launch before it in the stream completed,
    then let the launch after it start (its programs wait here in turn): :func:`pdl_wait`, then
    :func:`pdl_release` at once. Nothing where PDL is off."""
    pdl_wait()
    pdl_release()


@triton.jit
def pdl_wait():
    """First thing of a normal-mode kernel launched with PDL: wait until the launch before it in the stream
    completed and its writes are visible. Nothing where PDL is off."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release():
    """Where a normal-mode kernel's data movement ends: let the launch after it start (its programs then wait in
    :func:`pdl_wait` until this launch completes). Nothing where PDL is off."""
    if PDL:
        gdc_launch_dependents()
