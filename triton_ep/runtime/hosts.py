"""Which ranks share a host, and which RDMA transport joins the hosts: found once, at construction.

A *host* is the set of ranks that reach each other over NVLink / IPC; ranks on different hosts need RDMA
(internode modes). The ranks of the group exchange a host identity (hostname and kernel boot id) at
construction; ranks with the same identity form a host, hosts numbered in the order of their lowest rank.
``TRITON_EP_RANKS_PER_HOST=n`` overrides it (ranks ``[0, n)``, ``[n, 2n)``, ... form hosts), so that one
machine can stand in for several hosts in tests and examples. DeepEP assumes 8 ranks per host; triton-ep
takes what it finds, but every host must hold the same number of ranks.

The transport between hosts (``rdma_backend``, or ``TRITON_EP_RDMA`` when the keyword is not given):

- ``"auto"`` (default): pyverbs on the machine's RDMA devices; none there is an error when ranks span
  several hosts;
- ``"verbs"``: the same, asked for explicitly;
- ``"emulated"``: the emulated fabric (:mod:`triton_ep.transport.emulated`), for one machine standing in
  for several hosts.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from ..transport import verbs

ENV_RANKS_PER_HOST = "TRITON_EP_RANKS_PER_HOST"
ENV_RDMA = "TRITON_EP_RDMA"
RDMA_BACKENDS = ("auto", "verbs", "emulated")


def host_identity() -> str:
    """This machine's identity: ``hostname/boot id`` (the boot id tells apart two machines with one name,
    and a machine from itself after a reboot; empty where ``/proc`` does not give it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Hosts:
    """The group's ranks grouped into hosts.

    Attributes:
        host_of: ``[R]``: the host of each rank (hosts numbered by their lowest rank).
        names: ``[num_hosts]``: what each host is called in errors (its identity, or the override's range).
        source: how the grouping was found: ``"host identity"`` or ``"TRITON_EP_RANKS_PER_HOST=n"``.
    """

    host_of: Tuple[int, ...]
    names: Tuple[str, ...]
    source: str

    @property
    def num_hosts(self) -> int:
        return len(self.names)

    @property
    def ranks_per_host(self) -> int:
        return len(self.host_of) // self.num_hosts

    def ranks(self, host: int) -> Tuple[int, ...]:
        """The ranks of ``host``, ascending."""
        return tuple(r for r, h in enumerate(self.host_of) if h == host)

    def local_index(self, rank: int) -> int:
        """``rank``'s index among the ranks of its host (DeepEP's NVL rank)."""
        return self.ranks(self.host_of[rank]).index(rank)

    @property
    def rank_order(self) -> Tuple[int, ...]:
        """The ranks host by host (each host's ranks ascending): ``rank_order[h * n + i]`` is local rank ``i``
        of host ``h``, ``n`` the ranks per host. Equal to ``range(R)`` where hosts hold consecutive ranks."""
        return tuple(r for h in range(self.num_hosts) for r in self.ranks(h))


def first_error(values: Sequence) -> None:
    """After a set-up exchange in which a rank sent the text of its own error instead of a value (a bad
    environment value: raised here, on every rank alike, instead of on that rank alone while its peers wait out
    their timeout): raise the first such text.

    Raises:
        ValueError: the first ``str`` among ``values``.
    """
    for v in values:
        if isinstance(v, str):
            raise ValueError(v)


def agreed(what: str, values: Sequence) -> None:
    """Check that every rank gave the same value (``values``: one per rank).

    Raises:
        ValueError: naming ``what`` and each rank's value.
    """
    if len(set(values)) > 1:
        who = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise ValueError(f"ranks disagree on {what} ({who}); set it alike on every rank")


def _ranks_per_host_arg(value: Optional[str], num_ranks: int) -> Optional[int]:
    """``TRITON_EP_RANKS_PER_HOST``'s value as an int dividing ``num_ranks``, or ``None`` when unset."""
    if value is None or value.strip() == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1 or num_ranks % n:
        raise ValueError(f"{ENV_RANKS_PER_HOST}={value!r} must be a positive integer dividing the group size "
                         f"{num_ranks}")
    return n


def group_hosts(identities: Sequence[str], ranks_per_host: Sequence[Optional[str]] = ()) -> Hosts:
    """Group ranks into hosts from every rank's :func:`host_identity` (``identities``, ``[R]``) and its
    ``TRITON_EP_RANKS_PER_HOST`` value (``ranks_per_host``, ``[R]``, ``None`` where unset; empty: unset
    everywhere).

    Raises:
        ValueError: the ranks disagree on ``TRITON_EP_RANKS_PER_HOST``, its value does not divide ``R``, or
            hosts hold different numbers of ranks (the error names each host and its ranks).
    """
    R = len(identities)
    values = list(ranks_per_host) or [None] * R
    agreed(ENV_RANKS_PER_HOST, values)
    n = _ranks_per_host_arg(values[0], R)
    if n is not None:
        host_of = tuple(r // n for r in range(R))
        names = tuple(f"host {h} (ranks {h * n}-{h * n + n - 1})" for h in range(R // n))
        return Hosts(host_of, names, f"{ENV_RANKS_PER_HOST}={n}")
    order: List[str] = []
    for ident in identities:
        if ident not in order:
            order.append(ident)
    host_of = tuple(order.index(ident) for ident in identities)
    hosts = Hosts(host_of, tuple(order), "host identity")
    sizes = {len(hosts.ranks(h)) for h in range(hosts.num_hosts)}
    if len(sizes) > 1:
        what = "; ".join(f"{order[h]!r}: ranks {list(hosts.ranks(h))}" for h in range(hosts.num_hosts))
        raise ValueError(f"every host must hold the same number of ranks; the group's hosts hold {what}")
    return hosts


def rdma_backend_arg(value: Optional[str], env: Mapping[str, str] = os.environ) -> str:
    """The ``rdma_backend`` asked for: the keyword, else ``TRITON_EP_RDMA``, else ``"auto"``.

    Raises:
        ValueError: not one of ``"auto"``, ``"verbs"``, ``"emulated"``.
    """
    chosen = value if value is not None else (env.get(ENV_RDMA) or "auto")
    if chosen not in RDMA_BACKENDS:
        where = "rdma_backend" if value is not None else ENV_RDMA
        raise ValueError(f"{where} must be one of {', '.join(map(repr, RDMA_BACKENDS))}, got {chosen!r}")
    return chosen


def rdma_devices() -> Tuple[List[str], str]:
    """The RDMA devices pyverbs lists here, and why there are none (empty when there are some)."""
    try:     # pyverbs is optional: load_pyverbs imports it only now
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                 for d in verbs.load_pyverbs().get_device_list()]
    except Exception as ex:   # noqa: BLE001 - ImportError, PyverbsRDMAError (no RDMA in the kernel), ...
        return [], f"{type(ex).__name__}: {ex}"
    return names, ("" if names else "pyverbs lists no RDMA device")


def choose_transport(backend: str, hosts: Hosts, devices=rdma_devices) -> Optional[str]:
    """The transport between hosts: ``None`` for one host, ``"emulated"`` or ``"verbs"``.

    Raises:
        ValueError: ranks span several hosts, ``backend`` is ``"auto"`` or ``"verbs"``, and pyverbs finds no
            RDMA device here (the message says both ways out).
    """
    if hosts.num_hosts == 1:
        return None
    if backend == "emulated":
        return "emulated"
    names, why = devices()
    if names:
        return "verbs"
    raise ValueError(
        f"the group's ranks span {hosts.num_hosts} hosts ({hosts.source}) and rdma_backend is {backend!r}, but "
        f"this machine has no usable RDMA device ({why}). Either run on machines with RDMA NICs and pyverbs "
        f"(docs/rdma.md), or use the emulated fabric: set {ENV_RDMA}=emulated or pass "
        f"Buffer(..., rdma_backend='emulated') (one machine standing in for several hosts).")
