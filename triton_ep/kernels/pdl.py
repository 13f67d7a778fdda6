"""Programmatic dependent launch (PDL) for the low-latency kernels: an opt-in experiment (``TRITON_EP_PDL=1``).

With PDL a launch may start while the launch before it in the stream is still running: its programs become
resident and wait in :func:`pdl_start` (``griddepcontrol.wait``, Triton's ``gdc_wait``) until the launch before
it has completed and its writes are visible, so the launch's own start-up overlaps the previous launch's tail
(Hopper and later, CUDA 12.3+ for graphs). Every kernel launched with PDL calls :func:`pdl_start` before it
reads or writes anything, which keeps the stream's order for everything after it: a later launch waits for this
one, which waited for the one before. Off by default, and always off under the interpreter.
"""
import os

import triton
import triton.language as tl

from ._util import interpreted

try:                                    # Triton >= 3.4 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                     # pragma: no cover - older Triton: PDL stays off
    gdc_wait = gdc_launch_dependents = None


def pdl_enabled() -> bool:
    """``TRITON_EP_PDL`` is 1 (or true / yes / on), kernels run on a GPU and Triton has ``gdc_wait``."""
    on = os.environ.get("TRITON_EP_PDL", "0").strip().lower() in ("1", "true", "yes", "on")
    return on and not interpreted() and gdc_wait is not None


#: whether the low-latency kernels are compiled and launched with PDL (fixed at import)
PDL_ON = pdl_enabled()
PDL = tl.constexpr(PDL_ON)


def options() -> dict:
    """The compile option of a PDL launch (``launch_pdl``) where PDL is on, else none."""
    return {"launch_pdl": True} if PDL_ON else {}


@triton.jit
def pdl_start():
    """First thing of a kernel launched with PDL: wait until the launch before it in the stream completed,
    then let the launch after it start (its programs wait here in turn). Nothing where PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
