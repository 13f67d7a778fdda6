"""DeepEP 1.x's module path ``deep_ep.buffer``: :class:`Buffer` (triton-ep's, see ``deep_ep.buffers.legacy``)."""
from .buffers.legacy import Buffer

__all__ = ["Buffer"]
