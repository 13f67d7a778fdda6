"""triton-ep: expert-parallel dispatch/combine for MoE models in Triton; a drop-in for DeepEP V1.

    import triton_ep as deep_ep
    buffer = deep_ep.Buffer(group, num_nvl_bytes=deep_ep.Buffer.get_dispatch_config(R)
                            .get_nvl_buffer_size_hint(hidden * 2, R))

Public names only: :class:`Buffer`, :class:`Config`, :class:`EventOverlap`, ``topk_idx_t``, the errors
and ``__version__``; DeepEP V2's face: :class:`ElasticBuffer`, :class:`EPHandle` and :class:`EventHandle`.
"""
from . import triton_mode  # noqa: F401 - first: on a CPU it sets TRITON_INTERPRET=1 before anything imports triton
from .config import Config, EventOverlap, topk_idx_t
from .errors import EPCapacityError, EPError, EPRemoteError, EPTimeoutError
from .buffer import Buffer

from .elastic import ElasticBuffer, EPHandle, EventHandle
from ._version import __version__

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "EPError", "EPTimeoutError", "EPCapacityError",
           "EPRemoteError", "__version__", "ElasticBuffer", "EPHandle", "EventHandle"]
