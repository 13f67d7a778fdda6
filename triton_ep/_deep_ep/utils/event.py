"""DeepEP 2.x's module path ``deep_ep.utils.event``: ``EventOverlap`` (triton-ep's) and ``EventHandle``."""
from triton_ep import EventOverlap

__all__ = ["EventOverlap", "EventHandle"]


class EventHandle:
    """DeepEP 2.x's C++ event handle (``deep_ep._C.EventHandle``). triton-ep's events are
    :class:`EventOverlap` holding a ``torch.cuda.Event``; there is no C++ handle.

    Raises:
        NotImplementedError: always, on construction.
    """

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("deep_ep.EventHandle (DeepEP 2's C++ event handle) is not provided by triton-ep; "
                                  "its calls return EventOverlap objects holding a torch.cuda.Event")
