"""Low-latency mode (DeepEP's decode-time dispatch and combine), within one host and, with the network leg of
:mod:`triton_ep.modes.internode.low_latency`, across hosts.

:class:`LowLatency` (:mod:`.calls`) is what :class:`~triton_ep.Buffer` delegates its ``low_latency_*`` methods
to. It owns the low-latency area: the part of each rank's shared buffer sized by ``num_rdma_bytes``, mapped by
every rank (CUDA IPC on GPU, POSIX shared memory on CPU), laid out by :class:`~triton_ep.protocol.ll_area.Layout`::

    [ control block | half 0 | half 1 | zero-copy combine input ]

Every low-latency call (a dispatch or a combine) is numbered on the device (the control block's
``L_SEQ``, advanced by the kernels, so a CUDA graph replays it correctly) and uses half ``n & 1``. Each
call is a *send* launch then a *receive* launch (:mod:`triton_ep.kernels.ll_dispatch`,
:mod:`triton_ep.kernels.ll_combine`); with ``return_recv_hook`` the receive launch is what the hook
runs. No call waits on the host, reads the device or synchronises a stream: every wait is a bounded
device wait that writes an error record, raised by :meth:`Buffer.check` (which every call runs first).

The rooms: :mod:`.handle` (the handle and the outputs' allocation), :mod:`.state` (:class:`~.state.LowLatencyState`:
the area, the call numbers, errors, masking), :mod:`.calls` (:class:`LowLatency`, the calls over that state: a
dispatch's and a combine's general path, the launches and hooks), :mod:`.replay` (a call of the last call's sizes,
replayed from its plan). They import one way: calls -> state, replay -> handle.
"""
from .calls import LowLatency
from .handle import LLHandle, carve, size_hint
from .state import Unavailable

__all__ = ["LLHandle", "LowLatency", "Unavailable", "carve", "size_hint"]
