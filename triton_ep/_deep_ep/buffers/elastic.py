"""DeepEP 2.x's module path ``deep_ep.buffers.elastic``: ``ElasticBuffer`` and ``EPHandle`` where triton-ep
provides them (DeepEP V2's face); otherwise this module has neither name, so engines that probe for V2
(``hasattr(deep_ep, "ElasticBuffer")``, ``from deep_ep import ElasticBuffer`` in a ``try``) see none."""
import triton_ep

__all__ = [name for name in ("ElasticBuffer", "EPHandle") if hasattr(triton_ep, name)]
for _name in __all__:
    globals()[_name] = getattr(triton_ep, _name)
