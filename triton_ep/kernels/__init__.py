"""Triton kernels of triton-ep and their thin launchers; no communication logic lives here.

One module per operation: :mod:`.layout` (routing layout and send positions), :mod:`.dispatch`
(copy rows into receivers' buffers, unpack them there), :mod:`.combine` (return rows, reduce them).

On a machine without CUDA the kernels run under Triton's interpreter on CPU tensors: :mod:`triton_ep.triton_mode`,
imported first, sets ``TRITON_INTERPRET=1`` before any kernel is defined unless the caller set it already.
"""
from .. import triton_mode  # noqa: F401 - first: on a CPU it sets TRITON_INTERPRET=1 before triton is imported

from .layout import routing_layout
from .dispatch import dispatch_send, dispatch_recv
from .combine import combine_send, combine_reduce
from ._util import interpreted
from .notify import notify_send, notify_recv

__all__ = ["routing_layout", "dispatch_send", "dispatch_recv", "combine_send", "combine_reduce", "interpreted", "notify_send",
           "notify_recv"]
