"""DeepEP's environment helpers under ``deep_ep.utils.envs`` (2.x) that engines may import.

``get_physical_domain_size`` / ``get_logical_domain_size`` (2.x) ask NCCL for its RDMA / NVLink domains; triton-ep
has no NCCL communicator behind a group, so they raise ``NotImplementedError``. ``check_nvlink_connections``
(1.x ``deep_ep.utils``) checks nothing: triton-ep needs no NVLink between a host's GPUs (CUDA IPC over PCIe works).
"""


def get_physical_domain_size(group) -> tuple:
    """DeepEP 2.x: ``(num_rdma_ranks, num_nvlink_ranks)`` from NCCL's topology.

    Raises:
        NotImplementedError: always (triton-ep groups ranks by host identity, docs/internode.md).
    """
    raise NotImplementedError("deep_ep.get_physical_domain_size needs NCCL's topology query (DeepEP 2); "
                              "triton-ep groups ranks into hosts by host identity or TRITON_EP_RANKS_PER_HOST")


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> tuple:
    """DeepEP 2.x: ``(num_scaleout_ranks, num_scaleup_ranks)`` from NCCL's topology.

    Raises:
        NotImplementedError: always (see :func:`get_physical_domain_size`).
    """
    raise NotImplementedError("deep_ep.get_logical_domain_size needs NCCL's topology query (DeepEP 2); "
                              "triton-ep groups ranks into hosts by host identity or TRITON_EP_RANKS_PER_HOST")


def check_nvlink_connections(group) -> None:
    """DeepEP 1.x's check that a host's GPUs are connected by NVLink (it asserts on PCIe-only pairs).
    triton-ep reaches its peers through CUDA IPC whatever the link, so there is nothing to check: returns None."""
    return None
