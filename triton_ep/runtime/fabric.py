"""What the modes across hosts take of ``transport/`` (docs/design.md, section 2, "Layers": the modes reach the
transport through ``runtime/``), under the names they use:

- :func:`gather_objects` (``transport.bootstrap``): every rank's picklable object, in rank order, bounded by a
  timeout; :func:`group_store`: a process group's key-value store (the error paths' call cards);
- :func:`stall_watchdog`, :class:`RingFlags` and :func:`header_bytes` (``transport.signals``): the bound of the ring
  kernels' waits under the interpreter, the ring's control words, the size of the signal header;
- :mod:`ipc <triton_ep.transport.ipc>` (the shared buffers of a host's ranks) and
  :mod:`factory <triton_ep.transport.factory>` (the RDMA transport a Buffer opens, the emulated fabric's delays);
- :func:`dead_error` (``transport.liveness``): the error naming a rank whose process is gone.
"""
from ..transport import factory, ipc
from ..transport.bootstrap import _group_store as group_store
from ..transport.bootstrap import gather_objects
from ..transport.liveness import dead_error
from ..transport.signals import RingFlags, header_bytes, stall_watchdog

__all__ = ["RingFlags", "dead_error", "factory", "gather_objects", "group_store", "header_bytes", "ipc",
           "stall_watchdog"]
