"""triton-ep as ``deep_ep``: the package an ``import deep_ep`` gets when ``TRITON_EP_AS_DEEP_EP`` is on
(:mod:`triton_ep.deep_ep_hook`; docs/engines.md).

It carries DeepEP's public names and module paths, each served by triton-ep:

- V1 (DeepEP 1.x, ``deep_ep/buffer.py``, ``deep_ep/utils.py``) and DeepEP 2.x's legacy face
  (``deep_ep/buffers/legacy.py``): :class:`Buffer`, :class:`Config`, :class:`EventOverlap`, ``topk_idx_t``.
- V2 (DeepEP 2.x, ``deep_ep/buffers/elastic.py``): ``ElasticBuffer`` and ``EPHandle`` where triton-ep has them.
  Where it does not, the names are absent (not stand-ins), so vLLM's ``hasattr(deep_ep, "ElasticBuffer")`` and
  SGLang's ``from deep_ep import ElasticBuffer`` see no V2 and keep their V1 paths.
- DeepEP 2.x's ``EventHandle`` (triton-ep's: made with no argument, it records an event on the current CUDA stream).
- DeepEP 2.x's ``get_physical_domain_size`` / ``get_logical_domain_size``: names that raise ``NotImplementedError``
  on use.

The first import writes one log line on the ``triton_ep`` logger saying this is triton-ep (a WARNING naming the
real DeepEP it shadows, if one is installed).
"""
import triton_ep
from triton_ep import Config, EventOverlap, topk_idx_t
from triton_ep.deep_ep_hook import announce

from .buffers.legacy import Buffer
from .buffers import elastic as _elastic
from .utils.envs import get_logical_domain_size, get_physical_domain_size
from .utils.event import EventHandle

__version__ = triton_ep.__version__
#: True on triton-ep's ``deep_ep`` (a real DeepEP has no such attribute).
__triton_ep__ = True

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "get_physical_domain_size",
           "get_logical_domain_size", "__version__"]
for _name in _elastic.__all__:
    globals()[_name] = getattr(_elastic, _name)
    __all__.append(_name)

announce(__version__)
