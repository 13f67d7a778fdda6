"""Normal and low-latency mode across hosts (DeepEP's internode modes).

The rooms: :mod:`.normal` (normal mode: :class:`Internode`, the Buffer's normal mode across hosts, its set-up and
the host path's steps), :mod:`.capture` (normal mode's capture path, a part of :class:`Internode`: no host wait, so
it captures in a CUDA graph), :mod:`.forward` (the forwarding leg both paths share), :mod:`.exchange` (the host
path's headers with the RDMA peers), :mod:`.rings` (the records' exchange and the ring kernels' rounds, both
paths), :mod:`.host_ranks` (this host's ranks in the forwarding leg), :mod:`.handle` (the handle both paths build
and their plans), :mod:`.records` (the network leg's records), :mod:`.low_latency` (low-latency mode across hosts,
:class:`LowLatencyAcrossHosts`) and :mod:`.network` (the RDMA transport, scheduler and rings both modes open
between hosts, the network leg's shape and the set-up exchange).
"""
from .low_latency import LowLatencyAcrossHosts
from .handle import InternodeHandle
from .network import DEFAULT_QPS_PER_PEER, ENV_CHUNK, ENV_QPS, ENV_SLOTS, network_shape, traffic_stats
from .normal import Internode
from .records import network_record_bytes
from ...kernels.net import dense
from ...proxy_process import ENV_PROXY, proxy_kind

__all__ = ["DEFAULT_QPS_PER_PEER", "ENV_CHUNK", "ENV_PROXY", "ENV_QPS", "ENV_SLOTS", "Internode", "InternodeHandle",
           "LowLatencyAcrossHosts", "dense", "network_record_bytes", "network_shape", "proxy_kind", "traffic_stats"]
