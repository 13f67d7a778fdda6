"""Open the RDMA transport a group of ranks uses between hosts: pyverbs on the machine's devices, or the
emulated fabric (one machine standing in for several hosts). Used by internode mode and the scheduler CLI."""
from __future__ import annotations

import os
import zlib
from typing import Optional, Sequence

from . import emulated as em
from . import topology, verbs
from .rdma import Transport


#: the environment variable that makes the emulated fabric a Buffer builds hold each request a random delay of up
#: to this many seconds (monotone per QP), so QPs overtake each other: for ordering tests (every rank alike)
ENV_REORDER_S = "TRITON_EP_EMULATED_REORDER_S"
#: ... and the one that holds every request to an even-numbered QP this many seconds more
#: (``FabricSpec.skew_s``), so requests on the other QPs overtake them whatever the host's speed
ENV_SKEW_S = "TRITON_EP_EMULATED_SKEW_S"


#: the longest delay either variable may ask for, in seconds (an hour: far beyond any test's timeout, and a
#: range the fabric's deadlines, sums of clock readings and delays, carry exactly)
MAX_DELAY_S = 3600.0


def _seconds(name: str) -> float:
    """The number of seconds in ``[0, MAX_DELAY_S]`` in environment variable ``name`` (0 when unset or blank).

    Raises:
        ValueError: it is set to something else (not a number, nan, negative, too large), naming it and the range.
    """
    raw = os.environ.get(name, "").strip()
    try:
        v = float(raw) if raw else 0.0
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= MAX_DELAY_S:
        raise ValueError(f"{name}={raw!r} must be a number of seconds in [0, {MAX_DELAY_S:g}]")
    return v


def fabric_delays() -> tuple:
    """``(reorder_s, skew_s)``: ``TRITON_EP_EMULATED_REORDER_S`` and ``TRITON_EP_EMULATED_SKEW_S`` as seconds (0.0
    where unset or blank).

    Raises:
        ValueError: either variable is not a non-negative number, naming it and its value.
    """
    return _seconds(ENV_REORDER_S), _seconds(ENV_SKEW_S)


def emulated_fabric(device_names: Sequence[str], token: str, ports_per_device: int = 2,
                    delays: Optional[tuple] = None) -> em.Fabric:
    """The emulated fabric of ``device_names`` (one ``ports_per_device``-port NIC each), shared by every
    process that builds it with the same names and ``token``. With ``TRITON_EP_EMULATED_REORDER_S=s`` (a
    positive number of seconds) it reorders requests across QPs, seeded by ``token``; with
    ``TRITON_EP_EMULATED_SKEW_S=s`` it holds every request to an even-numbered QP ``s`` seconds more.
    ``delays``: ``(reorder_s, skew_s)`` already read (:func:`fabric_delays`; a Buffer's ranks agree on them in
    their set-up exchange), instead of the variables.

    Raises:
        ValueError: either variable is not a non-negative number.
    """
    hold, skew = fabric_delays() if delays is None else delays
    spec = em.FabricSpec([em.DeviceSpec(name, [em.PortSpec() for _ in range(ports_per_device)])
                          for name in device_names], ring_bytes=4 << 20,
                         reorder_seed=zlib.crc32(token.encode()) if hold > 0 else None, reorder_max_s=hold or 0.004,
                         skew_s=skew)
    return em.Fabric(spec, token=token)


def open_transport(backend: str, rank: int, world: int, *, num_qps_per_peer: int, timeout_s: float,
                   fabric: Optional[em.Fabric] = None, device_name: Optional[str] = None,
                   gpu: Optional[int] = None, peers: Optional[Sequence[int]] = None) -> Transport:
    """Rank ``rank``'s transport to the ``world`` ranks it talks to over RDMA.

    Args:
        backend: ``"verbs"`` (pyverbs, the NICs nearest ``gpu`` where given, else every active device) or
            ``"emulated"`` (``fabric``, this rank's NIC ``device_name``).
        num_qps_per_peer: RC QPs per peer, placed over ports and ECMP paths by :mod:`topology`.
        timeout_s: bound of every wait, seconds.
        peers: the ranks to make QPs to (default: every other rank).

    Raises:
        ValueError: an unknown backend, or ``"emulated"`` without ``fabric`` / ``device_name``.
        RdmaUnavailable: pyverbs does not import (``"verbs"``).
    """
    kw = dict(num_qps_per_peer=num_qps_per_peer, timeout_s=timeout_s, peers=peers)
    if backend == "emulated":
        if fabric is None or device_name is None:
            raise ValueError("the emulated transport needs its fabric and this rank's device name")
        kw.update(api=fabric.pyverbs([device_name]), n_paths=fabric.spec.n_paths,
                  path_hash=topology.emulator_path_hash)
    elif backend == "verbs":
        if gpu is not None:
            kw["gpu"] = int(gpu)
    else:
        raise ValueError(f"backend must be 'verbs' or 'emulated', got {backend!r}")
    return verbs.VerbsTransport(rank, world, **kw)
