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
import re
import socket
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from ..protocol import call_card
from ..protocol.records import HOST_DISAGREEMENT_WORDS
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


# ------------------------------------------------------------------ disagreements across hosts
#: call-card codes of the forwarding leg's intranode dispatches (records, not the caller's rows): their fields
#: name what the caller passed as it reaches the forwarding leg
FORWARDED_DISPATCH, FORWARDED_CACHED = 101, 102
_FORWARDED = {
    FORWARDED_DISPATCH: ("dispatch", (("x dtype (records)", "dtype"),
                                      ("record bytes (16 + hidden times the element size of x)", "int"),
                                      ("scales dtype", "dtype"), ("scale columns", "int"),
                                      ("top-k (topk_idx columns)", "int"), ("topk_weights given", "bool"),
                                      ("num_experts of the host", "int"))),
    FORWARDED_CACHED: ("cached dispatch", (("x dtype (records)", "dtype"),
                                           ("record bytes (16 + hidden times the element size of x)", "int"),
                                           ("scales dtype", "dtype"), ("scale columns", "int"),
                                           ("the forwarding leg's dispatch number", "int"))),
}
#: the words of a call card nothing else uses (after the longest operation's values, before ``MODES_WORD``):
#: a rank that found a disagreement writes it there for its host's ranks (:meth:`Disagreement.post`)
_SPARE = slice(2 + max(len(f) for _, f in call_card.FIELDS.values()), call_card.MODES_WORD)
assert _SPARE.stop - _SPARE.start >= 4, "a call card needs 4 spare words for a disagreement"


def _operation(code: int):
    return call_card.FIELDS.get(code) or _FORWARDED.get(code)


@dataclass(frozen=True)
class Disagreement:
    """Two ranks of the group (global rank numbers) that made different calls: the operation's call-card code
    (:mod:`triton_ep.protocol.call_card`), the index of the first field that differs in its field table (``-1``:
    they called different operations, and the values are the two operation codes) and each rank's value.

    Raised as a ``ValueError`` on every rank of the group (docs/design.md, "Error model"): the rank that finds it
    tells its RDMA peers in the header exchange (:meth:`words`) and its host's ranks through its call card
    (:meth:`post`)."""

    op: int
    field: int
    rank_a: int
    value_a: int
    rank_b: int
    value_b: int

    #: int64 words of :meth:`words` (the host path's header carries them: protocol/records.py)
    WORDS = HOST_DISAGREEMENT_WORDS

    @classmethod
    def of_cards(cls, a: Sequence[int], b: Sequence[int], rank_a: int, rank_b: int) -> Optional["Disagreement"]:
        """The first difference between two calls ``(code, value, ...)`` of ranks ``rank_a`` and ``rank_b``
        (the lower rank first); ``None`` when they agree or a code is unknown."""
        a, b = [int(v) for v in a], [int(v) for v in b]
        if rank_b < rank_a:
            a, b, rank_a, rank_b = b, a, rank_b, rank_a
        if _operation(a[0]) is None or _operation(b[0]) is None:
            return None
        if a[0] != b[0]:
            return cls(a[0], -1, rank_a, a[0], rank_b, b[0])
        n = len(_operation(a[0])[1])
        for i, (u, v) in enumerate(zip(a[1:1 + n], b[1:1 + n])):
            if u != v:
                return cls(a[0], i, rank_a, u, rank_b, v)
        return None

    def words(self) -> List[int]:
        return [self.op, self.field, self.rank_a, self.value_a, self.rank_b, self.value_b]

    @classmethod
    def of_words(cls, w: Sequence[int]) -> Optional["Disagreement"]:
        d = cls(*(int(v) for v in w[:cls.WORDS]))
        return d if _operation(d.op) is not None and -1 <= d.field < len(_operation(d.op)[1]) else None

    def text(self) -> str:
        """E.g. ``"dispatch: hidden: rank 1 passed 64, rank 3 passed 32"``."""
        name, fields = _operation(self.op)
        if self.field < 0:
            return (f"the operation: rank {self.rank_a} called {_operation(self.value_a)[0]}, rank {self.rank_b} "
                    f"called {_operation(self.value_b)[0]}")
        field, kind = fields[self.field]
        show = call_card._show
        return (f"{name}: {field}: rank {self.rank_a} passed {show(kind, self.value_a)}, rank {self.rank_b} passed "
                f"{show(kind, self.value_b)}")

    def error(self, rank: int) -> ValueError:
        """The ``ValueError`` rank ``rank`` raises (it carries this disagreement: ``ex.disagreement``)."""
        ex = ValueError(f"rank {rank}: ranks disagree: {self.text()}; every rank must make the same "
                        f"call (the same sizes, dtypes and handle); nothing was returned")
        ex.disagreement = self
        return ex

    def post(self, card, stamp: int) -> None:
        """Write this disagreement into the spare words of this rank's call card (``card``: its int64 view,
        which every rank of the host maps), for call ``stamp``: a rank of the host that hears of this rank's
        failure reads it there (:meth:`posted`) and raises the same ``ValueError``."""
        w = card[_SPARE]
        w[1] = (self.op << 48) | ((self.field + 1) << 40) | (self.rank_a << 20) | self.rank_b
        w[2], w[3] = self.value_a, self.value_b
        w[0] = stamp

    @classmethod
    def posted(cls, card, stamp: int) -> Optional["Disagreement"]:
        """The disagreement a rank of this host posted in its call card for call ``stamp``, or ``None``."""
        w = [int(v) for v in card[_SPARE]]
        if w[0] != stamp:
            return None
        return cls.of_words([w[1] >> 48, ((w[1] >> 40) & 0xFF) - 1, (w[1] >> 20) & 0xFFFFF, w[2], w[1] & 0xFFFFF,
                             w[3]])


#: a rank number in a message: "rank 3", "ranks 0 and 1", "peers 0, 1", "rank(s) 2, 3", "ranks [0, 1]"
_RANK_REF = re.compile(r"\b(ranks?|peers?|rank\(s\))( \[?)(\d+(?:(?:, | and |, and )\d+)*)")


def global_ranks(text: str, ranks: Sequence[int]) -> str:
    """``text`` (a message of a host's own runtime, which numbers that host's ranks ``0..n-1``) with each rank
    number replaced by the global rank ``ranks[i]``."""
    def number(m) -> str:
        nums = re.sub(r"\d+", lambda d: str(ranks[int(d.group())]) if int(d.group()) < len(ranks) else d.group(),
                      m.group(3))
        return m.group(1) + m.group(2) + nums
    return _RANK_REF.sub(number, text)
