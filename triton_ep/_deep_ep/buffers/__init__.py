"""DeepEP 2.x's module path ``deep_ep.buffers``: ``legacy`` (V1's ``Buffer``) and ``elastic`` (V2)."""
from . import elastic, legacy  # noqa: F401
