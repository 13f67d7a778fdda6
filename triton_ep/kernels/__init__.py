"""Triton kernels of triton-ep and their thin launchers; no communication logic lives here.

One module per operation: :mod:`.layout` (routing layout and send positions), :mod:`.dispatch`
(copy rows into receivers' buffers, unpack them there), :mod:`.combine` (return rows, reduce them).

On a machine without CUDA the kernels run under Triton's interpreter on CPU tensors: this package
sets ``TRITON_INTERPRET=1`` before any kernel is defined unless the caller set it already.
"""
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

from .layout import routing_layout  # noqa: E402
from .dispatch import dispatch_send, dispatch_recv  # noqa: E402
from .combine import combine_send, combine_reduce  # noqa: E402
from ._util import interpreted  # noqa: E402
from .notify import notify_send, notify_recv  # noqa: E402

__all__ = ["routing_layout", "dispatch_send", "dispatch_recv", "combine_send", "combine_reduce", "interpreted", "notify_send",
           "notify_recv"]
