"""Which Triton runs the kernels: compiled for the GPU, or Triton's interpreter on CPU tensors.

On a machine without CUDA the kernels run under Triton's interpreter: importing this module sets
``TRITON_INTERPRET=1`` unless the caller set it already. It must run before anything imports ``triton``
(Triton reads the variable as ``triton.language`` is built), so the package imports it first, and
:mod:`triton_ep.kernels` imports it too (a module of the package imported on its own still gets the right Triton).
It imports nothing of the package (a base module: every layer may import it).
"""
import functools
import os
from typing import Optional

import torch

# The values of TRITON_INTERPRET that Triton itself reads as on and as off (its getenv_bool, case-insensitive;
# Triton takes every other value as off, but a value such as '2' or 'junk' was meant as something, so triton-ep
# names it rather than guess)
ON = ("1", "true", "yes", "y", "on")
OFF = ("", "0", "false", "no", "n", "off")

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _value() -> str:
    return os.environ.get("TRITON_INTERPRET", "0")


def problem() -> Optional[str]:
    """What is wrong with ``TRITON_INTERPRET`` as set (``None``: nothing): a value Triton reads neither as on nor
    as off. A Buffer raises ``ValueError`` with it (:func:`triton_ep.runtime.checks.device_arg`) and
    ``triton-ep info`` prints it; importing the package does not fail on it (``triton-ep info`` runs)."""
    v = _value()
    if v.lower() in ON + OFF:
        return None
    return (f"TRITON_INTERPRET={v!r} is neither on nor off: set it to 1 (Triton's interpreter, CPU tensors) or "
            f"0 (kernels compiled for the GPU), or unset it, before Python starts (Triton also reads true / yes / "
            f"on and false / no / off; it takes any other value as off)")


@functools.lru_cache(maxsize=None)
def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors, ``TRITON_INTERPRET=1``): the variable as
    Triton reads it (:data:`ON`, case-insensitive; any other value is off, :func:`problem` names one that is
    neither)."""
    return _value().lower() in ON


if interpreted():
    import warnings
    # The interpreter adds signed offsets to unsigned addresses (a peer buffer below ours): numpy wraps
    # correctly but warns. Silence just that.
    warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning,
                            module="triton.runtime.interpreter")
    # NaN and infinite inputs (kept NaN by the kernels on purpose): numpy warns as it computes them, and as it
    # reduces a row of NaN only (an FP8 cast's amax of such a row)
    for message in ("invalid value encountered", "All-NaN slice encountered"):
        warnings.filterwarnings("ignore", message=message, category=RuntimeWarning, module="triton.runtime.interpreter")

    import sys
    first = "triton.language" in sys.modules
    import triton.language as _tl
    if type(_tl.zeros).__name__ == "JITFunction":
        # triton.language was built for compilation: its standard library (tl.zeros, tl.sum...) raises "Cannot
        # call @triton.jit'd outside of the scope of a kernel" inside interpreted kernels, later and far from the
        # cause. Either it was imported before TRITON_INTERPRET=1 was set, or this Triton does not read the value
        # (one of ON other than 1) as on
        if not first:
            import triton
            raise ImportError(f"TRITON_INTERPRET={_value()!r}: Triton {triton.__version__} does not read this value "
                              f"as on (its kernels would be compiled); set TRITON_INTERPRET=1 before Python starts.")
        raise ImportError("triton was imported before triton_ep on a machine without CUDA, so Triton's standard "
                          "library was built for compilation, not for its interpreter (TRITON_INTERPRET=1, which "
                          "triton_ep sets when no CUDA device exists). Import triton_ep before triton, or set "
                          "TRITON_INTERPRET=1 in the environment before Python starts.")
