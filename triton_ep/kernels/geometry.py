"""Launch geometry shared by the kernels: how many programs a signalling launch gets (capped where ranks share a
GPU and per multiprocessor), the signalling arguments every such launch passes, whether a call runs as one fused
launch, and rows as the 32-bit words the copy kernels move (:func:`as_words`, :func:`row_words`,
:func:`record_words`).
"""
import functools
from typing import Optional

import torch

from ..protocol import records
from ._util import entry, env_switch, interpreted, num_sms, tuning


def sync_args(signals: Optional[dict], rnd: int, sig: int, like: torch.Tensor) -> tuple:
    """The signalling arguments every signalling launch passes, in the kernels' order. ``signals`` None
    runs the kernel alone, without flags (benchmarks and tests of one kernel): ``like`` fills the
    pointer slots."""
    if signals is None:
        return (like, like, like, 0, 0, 0, 0)
    return (signals["hdr"], signals["hdr_delta"], signals["host"], rnd, sig, signals["me"], signals["timeout_ns"])


def programs(blocks: int, signals: Optional[dict], per_sm: bool = True, tune: Optional[dict] = None) -> int:
    """Programs of a signalling launch: one per block, at least one (a launch always releases its round), at
    most ``signals["max_programs"]`` where ranks share a GPU (so spinning programs never take the
    multiprocessors the launches they wait for need), and with ``per_sm`` (normal mode's launches; not
    :func:`grid2`'s low-latency ones) at most the tuning table's ``grid`` / ``programs_per_sm`` per
    multiprocessor (``signals["sms"]``, set by the runtime), and at most the ``grid`` entry's ``max_programs``
    where it has one (a Config's ``num_sms`` bound, :mod:`triton_ep.kernels.params`; ``tune``: the call's table,
    None for the built-in one). The programs loop over the blocks. (A dispatch send with ``split_w`` multiplies
    this by its second grid axis.)

    The ``per_sm`` cap is for speed: every program of a signalling launch checks the round's flags when it
    starts and counts itself done with one system-scope atomic when it ends, so a grid of a program per token
    paid that thousands of times. On an H200, one rank, T 4096, hidden 7168, a CUDA-graph replay of a cached
    dispatch took 104 us with a program per token and 74 with 8 programs per multiprocessor, a combine 94 and
    75 (a probe; benchmarks/grid_cap.py measures it)."""
    cap = None
    if signals is not None:
        cap = signals.get("max_programs")
        g = entry("grid", tune)
        n, sms = int(g["programs_per_sm"]), signals.get("sms")
        if per_sm and n and sms:
            cap = min(cap, n * sms) if cap else n * sms
        bound_ = g.get("max_programs", 0) if per_sm else 0
        if bound_:
            cap = min(cap, bound_) if cap else bound_
    return max(min(blocks, cap) if cap else blocks, 1)


def grid2(rows: int, cols: int, signals: Optional[dict]) -> tuple:
    """A ``(rows, cols)`` grid of a signalling launch (each axis at least 1); where ranks share a GPU,
    :func:`programs`'s cap over the rows and one column (programs loop over the rest)."""
    if signals is not None and signals.get("max_programs"):
        return programs(rows, signals, per_sm=False), 1
    return max(rows, 1), max(cols, 1)


def use_clock(signals: Optional[dict]) -> bool:
    return bool(signals is not None and signals["use_clock"])


def defer(signals: Optional[dict]) -> bool:
    """Whether a split send / receive launch pair of a round skips its end-of-launch counts (the receive publishes
    the round, the next send frees the area: :func:`triton_ep.kernels.flags.defer_send`): ranks that run
    concurrently (``signals["defer"]``), not the lock-step runner, where one rank's whole launch runs before the
    next rank's and no program may wait for a peer's program of the same launch."""
    return bool(signals is not None and signals.get("defer"))


#: dtypes every backend has a Triton pointer type for; float8_e4m3fn and float8_e5m2 join them under the
#: interpreter and on GPUs of compute capability 8.9 and up (:func:`as_words`)
_PLAIN_DTYPES = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                           torch.int16, torch.int32, torch.int64))


@functools.lru_cache(maxsize=64)
def _word_dtypes(device: torch.device) -> frozenset:
    fp8 = frozenset((torch.float8_e4m3fn, torch.float8_e5m2))
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return _PLAIN_DTYPES | fp8
    return _PLAIN_DTYPES


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the dispatch kernels take it (they move its rows as 32-bit words): itself where Triton has a
    pointer type for its dtype on this device (no view per call), else its int32 view (fnuz FP8, e8m0,
    complex, sub-byte and other dtypes Triton cannot name, or fp8 on a GPU older than compute capability
    8.9). ``t``: contiguous, 4-byte aligned, rows of whole words."""
    return t if t.dtype in _word_dtypes(t.device) else t.view(torch.int32)


def row_words(t: torch.Tensor) -> int:
    """32-bit words per row (last dimension) of a tensor whose rows are whole words (what the kernels move)."""
    return t.shape[-1] * t.element_size() // 4


def record_words(wx: int, s: int, k: int, with_src: bool) -> int:
    """Words (4 bytes) of one dispatch record: ``wx`` row words, ``s`` scale words, ``k`` ids and ``k``
    weight words (``k = 0`` without top-k), and with ``with_src`` the source index; rounded up to the
    tuning table's ``record_align_words`` (4 words = 16 bytes, or more to start rows on whole lines)."""
    return records.dispatch_record_words(wx, s, k, with_src, int(tuning("dispatch_send").get("record_align_words", 4)))


def fused_programs(blocks: int, device: torch.device, signals: dict, per_sm: int = 1,
                   tune: Optional[dict] = None) -> int:
    """Programs of a fused send + receive launch: at most ``per_sm`` per multiprocessor (every program resident
    at once: its receive part waits for its send part's last program; the caller knows how many fit), within
    the shared-GPU cap of :func:`programs` (and its Config bound, ``tune``); one under the interpreter, which runs
    programs one after another."""
    if interpreted():
        return 1
    return min(programs(blocks, signals, tune=tune), max(per_sm, 1) * num_sms(device))


#: programs per multiprocessor that fit at once, per fused launch's key without its grid (:func:`fused_per_sm`)
_FIT: dict = {}


def fused_per_sm(bind_one, key: tuple, args: tuple, device: torch.device, tune: Optional[dict] = None) -> int:
    """Programs per multiprocessor of a fused normal-mode launch (:func:`fused_programs`' ``per_sm``): the tuning
    table's ``fused`` / ``programs_per_sm`` (1 where it has none), at most as many as fit on a multiprocessor at
    once with these arguments (:func:`.launch.resident_per_sm`, asked once per ``key``: the launch's key without
    its grid; ``bind_one()``: the launch bound to one program, for its ``num_warps`` and constexprs). One under
    the interpreter. Its programs must all be resident, since they wait for each other between the parts. On one
    H100 (2026-12-06, T 4096 cached dispatch, one rank, GPU µs per graph replay) 1 per multiprocessor took 111.5,
    2 took 95.6, 4 took 95.1 and 8 took 100.9 (split launches: 88.4); the tuning table's comment has the rest."""
    want = int(entry("fused", tune).get("programs_per_sm", 1))
    if want <= 1 or interpreted():
        return 1
    from .launch import bound, resident_per_sm

    def fit() -> int:
        b = bind_one()
        return resident_per_sm(b.launcher, args, b.num_warps, b.meta, device)
    return max(1, min(want, bound(_FIT, key, fit)))     # (bound: the launch wrappers' capped cache)


def fused_switch() -> Optional[bool]:
    """``TRITON_EP_FUSED`` as a switch (:func:`._util.env_switch`): True / False, or None when unset. Raises
    ``ValueError`` for a value other than 1 / 0, true / false, yes / no, on / off (calls check it with their
    arguments, before anything runs)."""
    return env_switch("TRITON_EP_FUSED")


def use_fused(num_tokens: int, group, force: Optional[bool], limit_key: str = "max_tokens") -> bool:
    """Whether a call with ``num_tokens`` tokens runs the send and receive of all its rounds as one launch: real
    ranks only (``group`` not None: the lock-step runner of simulated ranks needs split launches), and
    ``num_tokens <= tuning("fused")[limit_key]`` (0 on CPU: never): ``max_tokens`` for low-latency calls and a
    dispatch's count exchange (one program, any number of tokens: it asks with ``num_tokens`` 0),
    ``data_max_tokens`` for normal mode's data calls (dispatch, cached dispatch, combine). ``TRITON_EP_FUSED=1`` /
    ``0``: always / never (real ranks; the CPU tests run the fused kernels so, one program a launch). ``force``:
    :func:`fused_switch`, read once per call with its arguments."""
    if group is None:
        return False
    if force is not None:
        return force
    limit = int(tuning("fused")[limit_key])
    return 0 < limit and num_tokens <= limit
