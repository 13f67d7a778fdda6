"""Which Triton runs the kernels: compiled for the GPU, or Triton's interpreter on CPU tensors.

On a machine without CUDA the kernels run under Triton's interpreter: importing this module sets
``TRITON_INTERPRET=1`` unless the caller set it already. It must run before anything imports ``triton``
(Triton reads the variable as ``triton.language`` is built), so the package imports it first, and
:mod:`triton_ep.kernels` imports it too (a module of the package imported on its own still gets the right Triton).
It imports nothing of the package (a base module: every layer may import it).
"""
import functools
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    import warnings
    # The interpreter adds signed offsets to unsigned addresses (a peer buffer below ours): numpy wraps
    # correctly but warns. Silence just that.
    warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning,
                            module="triton.runtime.interpreter")
    # NaN and infinite inputs (kept NaN by the kernels on purpose): numpy warns as it computes them
    warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning,
                            module="triton.runtime.interpreter")

    import triton.language as _tl
    if type(_tl.zeros).__name__ == "JITFunction":
        # triton.language was imported before TRITON_INTERPRET=1 was set: its standard library (tl.zeros,
        # tl.sum...) was built for compilation and raises "Cannot call @triton.jit'd outside of the scope of
        # a kernel" inside interpreted kernels, later and far from the cause
        raise ImportError("triton was imported before triton_ep on a machine without CUDA, so Triton's standard "
                          "library was built for compilation, not for its interpreter (TRITON_INTERPRET=1, which "
                          "triton_ep sets when no CUDA device exists). Import triton_ep before triton, or set "
                          "TRITON_INTERPRET=1 in the environment before Python starts.")


@functools.lru_cache(maxsize=None)
def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors, ``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
