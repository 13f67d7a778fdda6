"""Argument checks every mode shares: tensors, events, configs, sizes (DESIGN: shapes and dtypes are checked
before any launch, and an error names the argument, what was expected and what was given)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import Config, EventOverlap

#: the default bound on every wait for a peer, in seconds
DEFAULT_TIMEOUT_S = 100.0
#: the largest expert count a call takes
MAX_EXPERTS = 16384


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


def check_event(ev) -> None:
    """``previous_event`` is ``None`` or an :class:`EventOverlap` (``TypeError`` otherwise)."""
    if ev is not None and not isinstance(ev, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (e.g. from Buffer.capture()), got {type(ev).__name__}")


def check_config(config) -> None:
    """``config`` is ``None`` or a :class:`Config` (``TypeError`` otherwise)."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a triton_ep.Config or None, got {type(config).__name__}")


def check_num_experts(num_experts, num_ranks: int) -> None:
    """``num_experts`` is a positive multiple of the group size, at most :data:`MAX_EXPERTS` (``ValueError``)."""
    if not isint(num_experts) or num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts must be an int, a positive multiple of the group size {num_ranks}, got "
                         f"{num_experts!r}{' (not an int)' if not isint(num_experts) else ''}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts} exceeds the supported maximum {MAX_EXPERTS}")


def timeout_arg(timeout_s) -> float:
    """``timeout_s`` checked, or ``TRITON_EP_TIMEOUT_S``, or :data:`DEFAULT_TIMEOUT_S` (seconds).

    Raises:
        ValueError: not a finite positive number.
    """
    if timeout_s is None:
        env = os.environ.get("TRITON_EP_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
        try:
            timeout_s = float(env)
        except ValueError:
            raise ValueError(f"TRITON_EP_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a finite positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def device_arg(device) -> torch.device:
    """The Buffer's device: the given one (a CUDA device without index means the current one), else the
    current CUDA device, else CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
