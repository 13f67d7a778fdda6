"""DeepEP 2.x's module path ``deep_ep.utils.event``: ``EventOverlap`` and ``EventHandle`` (both triton-ep's: an
``EventHandle()`` records an event on the current CUDA stream, as DeepEP's C++ one does)."""
from triton_ep import EventHandle, EventOverlap

__all__ = ["EventOverlap", "EventHandle"]
