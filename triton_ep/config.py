"""``Config`` and ``EventOverlap``: DeepEP V1's tuning record and event wrapper, in Python."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

#: dtype of ``topk_idx`` that DeepEP callers allocate (int32 is accepted as well).
topk_idx_t = torch.int64

# Upper bounds used by the buffer size hints, as DeepEP sizes its buffers (top-k ids and scales per row).
_MAX_TOPK = 128
_MAX_SCALES = 128
#: Config's fields, in DeepEP's positional order, and the largest value each takes (int32)
_FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
           "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")
_MAX_FIELD = 2 ** 31 - 1


def _positive_int(name: str, value, why: str) -> int:
    """``value`` as an int in ``[1, 2^31 - 1]`` (a Python or numpy integer, not a bool); ``ValueError`` naming
    ``name`` and ``why`` (what the bound is) otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= _MAX_FIELD:
        raise ValueError(f"{name} must be an int in [1, {_MAX_FIELD}] ({why}), got {value!r}")
    return int(value)


#: the ``num_warps`` a Config may name (Triton's: a power of two, at most 32)
NUM_WARPS = (1, 2, 4, 8, 16, 32)


class Config:
    """Performance-tuning record with DeepEP's fields and positional order; a dispatch or combine given one
    launches as it says (docs/tuning.md has the whole mapping).

    Args:
        num_sms: SMs the call may occupy: each normal-mode launch runs at most ``num_sms`` times the tuning
            table's programs per SM (1 under the interpreter); at least 2 (one DeepEP channel), else the call
            raises ``ValueError``. Also sizes the buffer hints (``num_sms / 2`` channels, as DeepEP).
        num_max_nvl_chunked_send_tokens: tokens per NVLink send chunk: here the rows each program of normal mode's
            send and receive kernels moves per step (rounded down to a power of two, at most 64).
        num_max_nvl_chunked_recv_tokens: tokens per NVLink receive chunk: here a call moves at most
            ``num_max_nvl_chunked_recv_tokens * (num_sms / 2) * min(R, 8)`` rows per round (what DeepEP's buffer
            of this Config holds), and the NVLink buffer hint.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: the same for RDMA (the RDMA buffer
            hint; the network leg's chunks are set at construction, docs/internode.md).
        num_warps: (keyword only, triton-ep's; ``None``: the tuning table's) ``num_warps`` of those kernels, one
            of 1, 2, 4, 8, 16, 32; a tuned table's Configs carry it (``python -m triton_ep tune``).

    Results never depend on a Config: triton-ep reduces in a fixed order whatever it says; every rank of a call
    must pass the same one (as in DeepEP: ranks that differ fail the call together). Each DeepEP field is an
    int in ``[1, 2^31 - 1]``, as DeepEP's (C++ ``int``) fields.

    Raises:
        ValueError: a field is not an int in that range, or ``num_warps`` not one of the above (the error names it),
            at construction and at any later assignment of a field.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256, *, num_warps: Optional[int] = None) -> None:
        # (each assignment checks its value: __setattr__)
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens
        self.num_warps = num_warps
        #: made by ``Buffer.get_dispatch_config`` / ``get_combine_config`` from the built-in recommendation (no tuned
        #: table, or a table whose measurement kept the built-in tables): a call given it launches with the built-in
        #: tables, as with no Config (its fields still size the buffer hints); not a field, not compared
        self.builtin = False

    def __setattr__(self, name: str, value) -> None:
        """A field assigned after construction is checked as the constructor checks it (``ValueError`` naming it),
        so that no call ever sees a value the constructor refuses (DeepEP's Config has no writable fields)."""
        if name in _FIELDS:
            value = _positive_int(f"Config's {name}", value, "DeepEP's fields are C++ ints")
        elif name == "num_warps" and value is not None:
            if isinstance(value, bool) or value not in NUM_WARPS:
                raise ValueError(f"Config's num_warps must be None or one of {NUM_WARPS}, got {value!r}")
            value = int(value)
        object.__setattr__(self, name, value)

    def launch_key(self) -> tuple:
        """What decides this Config's launches: ``(num_sms, nvl send tokens, nvl recv tokens, num_warps)`` (a call's
        replay plan is kept per key, docs/tuning.md)."""
        return (self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_warps)

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(self.fields())

    def fields(self) -> dict:
        """DeepEP's five fields by name, plus ``num_warps`` (what a tuned table stores)."""
        return dict(zip(_FIELDS + ("num_warps",), (self.num_sms, self.num_max_nvl_chunked_send_tokens,
                                                    self.num_max_nvl_chunked_recv_tokens,
                                                    self.num_max_rdma_chunked_send_tokens,
                                                    self.num_max_rdma_chunked_recv_tokens, self.num_warps)))

    def __repr__(self) -> str:
        warps = f", num_warps={self.num_warps}" if self.num_warps is not None else ""
        return (f"Config({self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}{warps})")

    def _bytes(self, hidden_bytes: int, ranks: int, chunk_tokens: int) -> int:
        channels = max(self.num_sms // 2, 1)
        per_token = int(hidden_bytes) + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4 + 16
        n = channels * ranks * chunk_tokens * per_token + channels * ranks * 64
        return (n + 127) // 128 * 128

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink (intranode) buffer to allocate, computed the DeepEP way: channels (``num_sms/2``)
        x NVLink ranks (at most 8) x ``num_max_nvl_chunked_recv_tokens`` x per-token bytes (row plus room
        for 128 top-k ids, weights and scales). It does not depend on the token count: larger transfers
        go through the buffer in rounds.

        Args:
            hidden_bytes: bytes of one row, e.g. ``hidden * max(x.element_size(), 2)``.
            num_ranks: ranks in the group.

        Raises:
            ValueError: ``hidden_bytes`` or ``num_ranks`` is not an int in ``[1, 2^31 - 1]``.
        """
        hidden_bytes, num_ranks = self._hint_args(hidden_bytes, num_ranks)
        return self._bytes(hidden_bytes, min(num_ranks, 8), self.num_max_nvl_chunked_recv_tokens)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer DeepEP would ask for; 0 within one host (at most 8 ranks).

        Raises:
            ValueError: ``hidden_bytes`` or ``num_ranks`` is not an int in ``[1, 2^31 - 1]``.
        """
        hidden_bytes, num_ranks = self._hint_args(hidden_bytes, num_ranks)
        if num_ranks <= 8:
            return 0
        return self._bytes(hidden_bytes, (num_ranks + 7) // 8, self.num_max_rdma_chunked_recv_tokens)

    @staticmethod
    def _hint_args(hidden_bytes, num_ranks) -> tuple:
        """The size hints' arguments checked: ``(hidden_bytes, num_ranks)`` as ints."""
        return (_positive_int("hidden_bytes", hidden_bytes, "bytes of one row"),
                _positive_int("num_ranks", num_ranks, "ranks in the group"))


#: DeepEP's recommended ``(num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens)`` by group size, for
#: ``Buffer.get_dispatch_config`` and ``Buffer.get_combine_config`` (a group size between two rows takes the larger)
DISPATCH_CONFIGS = {2: (24, 256), 4: (6, 256), 8: (6, 256), 16: (16, 288), 24: (8, 288), 32: (8, 288),
                    64: (20, 288), 128: (20, 560), 144: (32, 720), 160: (28, 720)}
COMBINE_CONFIGS = {2: (10, 256), 4: (9, 256), 8: (4, 256), 16: (2, 288), 24: (1, 288), 32: (1, 288), 64: (1, 288),
                   128: (1, 560), 144: (2, 720), 160: (2, 720)}


def recommended_config(num_ranks: int, table: dict, num_sms: int) -> "Config":
    """The Config of ``table`` (:data:`DISPATCH_CONFIGS` or :data:`COMBINE_CONFIGS`) for ``num_ranks``: the next
    group size up, the largest past the last. ``ValueError`` unless ``num_ranks`` is a positive int."""
    if not isinstance(num_ranks, (int, np.integer)) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    key = min((k for k in table if k >= num_ranks), default=max(table))   # next size up
    send, recv = table[key]
    config = Config(num_sms, send, recv, 6, 128)
    config.builtin = True
    return config


@dataclass
class SmsSetting:
    """``Buffer.set_num_sms``'s value: ``None`` until it is called. Calls without a Config take it as their SM
    bound (as DeepEP's calls without one take ``Buffer.num_sms``); until then they use the built-in tables."""
    value: Optional[int] = None


#: the process's :class:`SmsSetting`
NUM_SMS_SET = SmsSetting()


def num_sms_arg(value) -> int:
    """``Buffer.set_num_sms``'s argument as an int: an even int in ``[2, 2^31 - 2]`` (a Config field, int32);
    ``ValueError`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 < value <= _MAX_FIELD \
            or value % 2:
        raise ValueError(f"the SM count must be an even int in [2, {_MAX_FIELD - 1}] (a Config field, int32), "
                         f"got {value!r}")
    return int(value)


#: what an EventOverlap's event may be (besides None, or an EventHandle holding one)
_EVENT_TYPES = tuple(t for t in (getattr(torch.cuda, "Event", None), getattr(torch, "Event", None))
                     if isinstance(t, type))


class EventOverlap:
    """An optional CUDA event, as DeepEP's ``EventOverlap`` (V1's ``deep_ep/utils.py``, and DeepEP 2.x's
    ``deep_ep/utils/event.py`` at dd758ca, whose extras it has too): ``current_stream_wait()`` makes the current
    stream wait for it; ``with event:`` runs the block and then waits; a hook registered with
    :meth:`register_hook_after_wait` runs once, right after the next wait; ``release_handle=True`` (an argument of
    ``current_stream_wait``, or ``with event(release_handle=True):``) drops the event after the wait. On CPU the
    event is ``None``: the waits are no-ops (every call has finished when it returns), while the check, the hook
    and the release happen as on a GPU.

    Args:
        event: a ``torch.cuda.Event``, an :class:`~triton_ep.EventHandle`, or ``None``.
        extra_tensors: tensors kept alive with this object (DeepEP's, for CUDA graphs; V2 keeps them too).
        check: called before every wait (a Buffer's ``check``: errors its kernels recorded raise here).

    Attributes:
        event: as given; ``None`` after a wait with ``release_handle=True``.
        hook_after_wait: the registered hook, or ``None`` (also once it has run).
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[tuple] = None,
                 check: Optional[Callable[[], None]] = None) -> None:
        """Raises: TypeError: ``event`` is not a CUDA event, an EventHandle (an object whose ``event`` is one or
        ``None``) or ``None`` (found here, not at the first wait); ``check`` is neither callable nor ``None``."""
        inner = getattr(event, "event", event) if not isinstance(event, _EVENT_TYPES) else event
        if not (inner is None or isinstance(inner, _EVENT_TYPES)):
            raise TypeError(f"event must be a torch.cuda.Event, an EventHandle or None, got {type(event).__name__}")
        if check is not None and not callable(check):
            raise TypeError(f"check must be callable or None, got {type(check).__name__}")
        self.event = event
        self.extra_tensors = extra_tensors
        self._check = check
        self.hook_after_wait: Optional[Callable[[], Any]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current CUDA stream wait for the event (no-op without one), after raising any error the Buffer's
        kernels have recorded (``Buffer.check()``); then run the hook registered with
        :meth:`register_hook_after_wait`, once (it is cleared before it runs, so it runs at most once even if it
        raises; its GPU work, on the current stream, is ordered after the event). ``release_handle``: then drop
        the event (``self.event = None``: its memory, and what it keeps alive, can go; later waits are no-ops), as
        DeepEP 2.x does. Returns at once: only work queued later on the stream waits.

        Raises:
            what ``check`` raises (then nothing waits, the hook stays registered and the event is kept); what the
            hook raises (after the wait; the event is then kept).
        """
        if self._check is not None:
            self._check()
        if getattr(self.event, "event", self.event) is not None:  # an EventHandle holds None on CPU
            torch.cuda.current_stream().wait_event(self.event)
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Register ``hook_after_wait`` (a callable of no argument) to run once, on the host, right after the next
        :meth:`current_stream_wait` (or the end of a ``with`` block) made the current stream wait for the event:
        DeepEP 2.x's, where an async dispatch's deterministic sort runs there.

        Raises:
            TypeError: not callable. ValueError: a hook is registered already and has not run yet.
        """
        if not callable(hook_after_wait):
            raise TypeError(f"hook_after_wait must be callable, got {type(hook_after_wait).__name__}")
        if self.hook_after_wait is not None:
            raise ValueError("a hook is already registered on this EventOverlap (it runs after the next wait)")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "WaitBlock":
        """``with event(release_handle=True):``: the wait at the end of that ``with`` block drops the event (DeepEP
        2.x's). Returns a :class:`WaitBlock` whose ``with`` gives this object; the flag is its own, so a call
        outside a ``with`` changes nothing (a later ``with event:`` keeps the event)."""
        return WaitBlock(self, bool(release_handle))

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.current_stream_wait()


@dataclass
class WaitBlock:
    """The ``with`` block of ``event(release_handle=...)`` (:meth:`EventOverlap.__call__`): entering gives the
    EventOverlap ``overlap``; leaving makes the current stream wait for it and, with ``release_handle``, drops its
    event."""
    overlap: EventOverlap
    release_handle: bool

    def __enter__(self) -> EventOverlap:
        return self.overlap

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.overlap.current_stream_wait(release_handle=self.release_handle)
