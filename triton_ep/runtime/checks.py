"""Argument checks every mode shares: tensors, events, configs, sizes, timeouts (docs/design.md: shapes and dtypes
are checked before any launch, and an error names the argument, what was expected and what was given)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import Config, EventOverlap
from ..protocol.limits import MAX_TIMEOUT_S, MIN_TIMEOUT_S
from ..triton_mode import interpreted, problem

#: the default bound on every wait for a peer, in seconds
DEFAULT_TIMEOUT_S = 100.0
#: the environment variable that sets ``timeout_s`` when the argument is not given
ENV_TIMEOUT_S = "TRITON_EP_TIMEOUT_S"
#: the largest expert count a call takes
MAX_EXPERTS = 16384
#: The largest int32 a kernel argument or a stored count carries (``2^31 - 1``).
MAX_INT32 = 2 ** 31 - 1
#: The largest ``hidden`` (values per bf16 row) where a row's bytes, ``2 * hidden``, are taken as an int32 count
#: (the size hints): ``(2^31 - 1) // 2``.
MAX_HIDDEN = MAX_INT32 // 2
#: The largest buffer size in bytes (``num_nvl_bytes``, ``num_rdma_bytes``): ``2^62``. Sizes and byte offsets
#: are int64 (kernels, torch, the shared-memory files); a size at the int64 limit would overflow once the
#: signal header and the 4 KiB rounding are added.
MAX_BUFFER_BYTES = 1 << 62


def isint(v) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype], shape: Sequence[Optional[int]], device: torch.device,
                 why: str = "") -> torch.Tensor:
    """``t`` checked (a tensor, one of ``dtypes``, ``shape`` with ``None`` for any size, on ``device``) and made
    contiguous (an empty tensor is replaced by fresh zeros: an empty view may keep odd strides and a null
    data pointer) and 4-byte aligned (the kernels move rows as 32-bit words: a tensor of 1- or 2-byte
    elements starting between two words, e.g. ``x[1:]`` of a flat buffer, is copied). ``why`` says where the
    expected sizes come from (e.g. ``"T = 5 rows of x"``), so the error names which of two disagreeing
    arguments to look at.

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: another shape or device.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    ts = t.shape
    bad = len(ts) != len(shape)
    if not bad:
        for s, d in zip(shape, ts):     # (a loop, not all() over a generator: a call's hot path)
            if s is not None and s != d:
                bad = True
                break
    if bad:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}{f' ({why})' if why else ''}, got {list(ts)}")
    td = t.device
    if td != device and (td.type != device.type or device.index is not None):
        raise ValueError(f"{name} is on {td}, but this Buffer works on {device}")
    if t.numel() == 0:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    t = t.contiguous()
    if t.data_ptr() & 3:
        t = t.clone()           # (a fresh allocation: aligned)
    return t


@dataclass(frozen=True)
class HandleField:
    """One entry of a handle as DeepEP lays it out: its ``name`` (DeepEP's) and ``dtypes``, those its tensor may have
    (``None``: the entry is an int, as the low-latency handle's ``hidden``)."""
    name: str
    dtypes: Optional[Tuple[torch.dtype, ...]] = None


def handle_error(handle, kind: type, made_by: str) -> Exception:
    """The error for ``handle`` given where a ``kind`` belongs (a handle class of a mode, whose ``FIELDS`` are its
    entries in DeepEP's order, :class:`HandleField`, and ``DESCRIPTION`` says what it is), made by ``made_by``:

    - a handle of another mode: ``TypeError`` naming it;
    - a tuple or list (a handle taken apart and rebuilt, or made by hand), its entries checked in order: another
      number of them is a ``ValueError``; an entry of another type a ``TypeError`` naming its index, its field and
      its type (``handle[3] (recv_src_idx) must be a torch.Tensor, got float``), or its dtype; where every entry
      is right, a ``TypeError`` all the same (a handle also keeps, on the host, what its cached calls need);
    - anything else: ``TypeError`` naming its type.

    Returns:
        The exception, for the caller to raise.
    """
    want = f"handle must be a handle this Buffer's {made_by} returned"
    fields = kind.FIELDS
    if isinstance(handle, tuple) and hasattr(type(handle), "DESCRIPTION"):
        return TypeError(f"{want}, got {type(handle).__name__}, {type(handle).DESCRIPTION}")
    what = type(handle).__name__
    if not isinstance(handle, (tuple, list)):
        return TypeError(f"{want}, got {what}")
    if len(handle) != len(fields):
        return ValueError(f"{want}; a {what} of {len(handle)} entries is not one (it holds {len(fields)}: "
                          f"{', '.join(f.name for f in fields)})")
    for i, (f, v) in enumerate(zip(fields, handle)):
        where = f"handle[{i}] ({f.name})"
        if f.dtypes is None:
            if not isint(v):
                return TypeError(f"{where} must be an int, got {type(v).__name__}")
        elif not isinstance(v, torch.Tensor):
            return TypeError(f"{where} must be a torch.Tensor, got {type(v).__name__}")
        elif v.dtype not in f.dtypes:
            return TypeError(f"{where} must have dtype {' or '.join(map(str, f.dtypes))}, got {v.dtype}")
    return TypeError(f"{want}, got a {what} of its entries: the handle itself also keeps, on the host, what its "
                     f"cached calls need; pass it as it was returned")


def check_event(ev) -> None:
    """``previous_event`` is ``None`` or an :class:`EventOverlap` (``TypeError`` otherwise)."""
    if ev is not None and not isinstance(ev, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (e.g. from Buffer.capture()), got {type(ev).__name__}")


def check_config(config) -> None:
    """``config`` is ``None`` or a :class:`Config` (``TypeError`` otherwise)."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a triton_ep.Config or None, got {type(config).__name__}")


def check_config_num_sms(config: Optional[Config]) -> None:
    """``ValueError`` when ``config.num_sms`` is below the minimum of any normal mode's calls
    (:data:`triton_ep.kernels.params.MIN_NUM_SMS`, the message naming both): a Config every call takes (a tuned
    table's entries are held to it)."""
    from ..kernels.params import MIN_NUM_SMS, check_num_sms
    for mode in MIN_NUM_SMS:
        check_num_sms(config, mode)


def check_num_experts(num_experts, num_ranks: int) -> None:
    """``num_experts`` is a positive multiple of the group size, at most :data:`MAX_EXPERTS` (``ValueError``)."""
    if not isint(num_experts) or num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts must be an int, a positive multiple of the group size {num_ranks}, got "
                         f"{num_experts!r}{' (not an int)' if not isint(num_experts) else ''}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts} exceeds the supported maximum {MAX_EXPERTS}")


@dataclass(frozen=True)
class Rejected:
    """A rank's rejection of its own set-up values (a bad constructor argument or environment value), carried in
    a set-up exchange so that every rank raises it at once (its peers would otherwise wait out their timeout).

    Attributes:
        kind: ``"ValueError"`` or ``"TypeError"``. message: the error's text, starting ``rank <r>: ``.
    """

    kind: str
    message: str

    @classmethod
    def of(cls, error: Exception, rank: int) -> "Rejected":
        """The rejection of ``rank`` that ``error`` (a ``ValueError`` or ``TypeError``) states."""
        return cls("TypeError" if isinstance(error, TypeError) else "ValueError", f"rank {rank}: {error}")

    def error(self) -> Exception:
        """The exception to raise: a ``TypeError`` or a ``ValueError`` with :attr:`message`."""
        return (TypeError if self.kind == "TypeError" else ValueError)(self.message)


def raise_rejected(values: Sequence) -> None:
    """After a set-up exchange: raise the first :class:`Rejected` among every rank's ``values`` (``None`` where a
    rank rejected nothing).

    Raises:
        ValueError, TypeError: the first rank's rejection, the same on every rank.
    """
    for v in values:
        if isinstance(v, Rejected):
            raise v.error()


def int_arg(name: str, value, lo: int, hi: int, why: str = "") -> int:
    """``value`` as an int in ``[lo, hi]`` (a Python or numpy integer, not a bool).

    Args:
        name: the argument's name, for the error. why: what the bound is (e.g. ``"int32 in the kernels"``).

    Raises:
        ValueError: not an integer, or out of range (the message names ``name``, the range and ``why``).
    """
    if not isint(value) or not lo <= value <= hi:
        extra = f"; {why}" if why else ""
        kind = "" if isint(value) else f" ({type(value).__name__}, not an int)"
        raise ValueError(f"{name} must be an int in [{lo}, {hi}]{extra}, got {value!r}{kind}")
    return int(value)


def bytes_arg(name: str, value) -> int:
    """A buffer size in bytes (``num_nvl_bytes``, ``num_rdma_bytes``): an int in ``[0, MAX_BUFFER_BYTES]``.

    Raises:
        ValueError: naming ``name`` and the range.
    """
    return int_arg(name, value, 0, MAX_BUFFER_BYTES, "sizes and offsets are int64")


def timeout_arg(timeout_s, env: Optional[Mapping[str, str]] = None) -> float:
    """``timeout_s`` checked, or ``TRITON_EP_TIMEOUT_S`` (from ``env``, default ``os.environ``; decimal, spaces
    around ignored), or :data:`DEFAULT_TIMEOUT_S`, in seconds: a number in ``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]``
    (one nanosecond to 1e9 s).

    Raises:
        ValueError: not a number, not finite (nan, inf), below :data:`MIN_TIMEOUT_S` or above
            :data:`MAX_TIMEOUT_S`; the message names the argument or the variable it came from.
    """
    name = "timeout_s"
    if timeout_s is None:
        raw = (os.environ if env is None else env).get(ENV_TIMEOUT_S, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        name = f"{ENV_TIMEOUT_S}={raw!r}"
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = None
    number = isinstance(timeout_s, (int, float, np.integer, np.floating)) and not isinstance(timeout_s, bool)
    # (compared before any conversion: an int too large for a float would raise OverflowError there)
    if not number or not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:
        got = f", got {timeout_s!r}" if name == "timeout_s" else ""
        raise ValueError(f"{name} must be a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] (kernels "
                         f"carry it as int64 nanoseconds){got}")
    return float(timeout_s)


def device_arg(device) -> torch.device:
    """The Buffer's device: the given one (a CUDA device without index means the current one), else the
    current CUDA device, else CPU.

    Raises:
        ValueError: not a device (or a string naming one), a type other than ``cpu`` and ``cuda``, a CUDA
            device this process has not got (no CUDA, or an index past the device count), or the CPU where
            Triton's interpreter is off (``TRITON_INTERPRET`` 0 or empty: the kernels could not run on it); on
            any device, a ``TRITON_INTERPRET`` that is neither on nor off (``'2'``, ``'junk'``:
            :func:`triton_ep.triton_mode.problem`).
    """
    bad = problem()
    if bad is not None:
        raise ValueError(bad)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a string such as 'cuda:0' or 'cpu', got {device!r}") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CUDA device or the CPU, got {device}")
    if device.type == "cpu" and not interpreted():
        raise ValueError(
            f"device cpu: triton-ep's kernels run on CPU tensors only under Triton's interpreter, and "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r} here ("
            + ("set in the environment: unset it, or set it to 1, before Python starts)" if not torch.cuda.is_available()
               else "this process has CUDA: use a CUDA device, or set TRITON_INTERPRET=1 before Python starts)"))
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"device {device}: this process has no CUDA device (use device='cpu')")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif not 0 <= device.index < n:
            raise ValueError(f"device {device}: this process has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return device


def plain(t, shape: tuple, dtype, device) -> bool:
    """Whether ``t`` is a plain contiguous tensor of ``shape``, ``dtype`` and ``device``, 4-byte aligned (what the
    general path's checks take as it is, without a copy)."""
    return (t.__class__ is torch.Tensor and t.shape == shape and t.dtype is dtype and t.device == device
            and t.is_contiguous() and not t.data_ptr() & 3)
