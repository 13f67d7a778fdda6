"""Normal and low-latency mode across hosts (DeepEP's internode modes).

The rooms: :mod:`.normal` (normal mode's host path: :class:`Internode` and the network leg's shape),
:mod:`.capture` (normal mode's capture path, a part of :class:`Internode`: no host wait, so it captures in a CUDA
graph), :mod:`.handle` (the handle both paths build, the received records' fields), :mod:`.low_latency`
(low-latency mode's network leg to every other rank) and :mod:`.network` (the RDMA transport, scheduler and rings
both modes open between hosts).
"""
from .low_latency import open_internode_low_latency
from .handle import InternodeHandle
from .normal import (DEFAULT_QPS_PER_PEER, ENV_CHUNK, ENV_QPS, ENV_SLOTS, Internode, dense, network_record_bytes,
                     network_shape, traffic_stats)

__all__ = ["DEFAULT_QPS_PER_PEER", "ENV_CHUNK", "ENV_QPS", "ENV_SLOTS", "Internode", "InternodeHandle", "dense",
           "network_record_bytes", "network_shape", "open_internode_low_latency", "traffic_stats"]
