"""DeepEP's module path ``deep_ep.utils`` (1.x: ``EventOverlap``, ``check_nvlink_connections``; 2.x: the
``event`` and ``envs`` submodules)."""
from triton_ep import EventOverlap

from .envs import check_nvlink_connections
from .event import EventHandle

__all__ = ["EventOverlap", "EventHandle", "check_nvlink_connections"]
