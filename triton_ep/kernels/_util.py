"""Helpers shared by the launchers: backend detection and the block-size table.

``GPU_TUNING`` holds the launch parameters used on a GPU (block sizes, ``num_warps``); the benchmark's
sweep (benchmarks/bench_kernels.py) measures alternatives on the H200 and the chosen values are the ones
written here. Results never depend on these values (fixed-order reductions), only speed does.
``INTERP_TUNING`` favours few, large programs: the interpreter costs about 0.4 ms per program.
"""
import functools
import os
from typing import Dict, Optional

import torch

from ..triton_mode import interpreted  # noqa: F401 - (the launchers read it from here)

# Best of the sweep on one H200 (benchmarks/results/tuning_h200.json: T=4096, H=7168, top-8, 256 experts,
# 8 ranks). ``layout``: ``block_t`` tokens per program, ``block_b`` blocks per tile of the prefix sums, up to
# ``one_launch_tokens`` tokens in one block (one launch), atomics past ``histogram_max_bins`` histogram bins.
# ``dispatch_send``: ``split_w`` 1 gives each row slice of ``block_w`` words its own program (a second grid
# axis); ``store_cache`` / ``store_evict`` are Triton's store hints for the row copies ("" = none);
# ``programs_per_sm`` > 0 caps the grid at that many programs per multiprocessor, each looping over blocks;
# ``record_align_words`` rounds the record width (a multiple of 4; every rank must use the same value).
# The ``num_warps`` of dispatch_send / dispatch_recv / combine_send and the block_w of dispatch_recv /
# combine_send were swept again on one H200 once the grid cap was in (benchmarks/grid_cap.py --vary, one rank,
# CUDA-graph replays; docs/history.md, 98fc3cd:benchmarks/results/grid_cap_h200_launch_params.json): a cached dispatch took 0.61x /
# 0.84x / 0.83x / 0.95x the GPU time of the old parameters at T 128 / 1024 / 2048 / 4096, a combine 0.89x / 1.00x /
# 0.95x / 0.97x.
#: changes made to either tuning table so far (:class:`_Table` counts them): a call that replays a launch
#: planned at an earlier call (``launch.Replay``) replans when this moved
_TUNING_CHANGES = [0]


class _Table(dict):
    """A tuning table, or one of its entries: a dict that counts its changes in :data:`_TUNING_CHANGES` (tests
    and sweeps change entries in place, ``monkeypatch.setitem`` or plain assignment); an entry stored in a
    table becomes a ``_Table`` too, so changes to it count as well."""

    def __setitem__(self, k, v) -> None:
        super().__setitem__(k, _Table(v) if isinstance(v, dict) and not isinstance(v, _Table) else v)
        _TUNING_CHANGES[0] += 1

    def __delitem__(self, k) -> None:
        super().__delitem__(k)
        _TUNING_CHANGES[0] += 1

    def update(self, *args, **kw) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, k, v=None):
        if k not in self:
            self[k] = v
        return self[k]

    def pop(self, *args):
        _TUNING_CHANGES[0] += 1
        return super().pop(*args)

    def popitem(self):
        _TUNING_CHANGES[0] += 1
        return super().popitem()

    def clear(self) -> None:
        _TUNING_CHANGES[0] += 1
        super().clear()

    def __ior__(self, other):
        self.update(other)
        return self


def tuning_changes() -> int:
    """How many changes the tuning tables have had in this process (a plan made before a change is stale)."""
    return _TUNING_CHANGES[0]


GPU_TUNING: Dict[str, Dict[str, object]] = {
    # up to scan_tokens (past one_launch_tokens) one launch whose programs each read all the ids, in tiles of
    # scan_block_t tokens (kernels/layout.py); past it two launches. One H100, top-8 of 256, R 8, GPU µs per
    # CUDA-graph replay two launches / one scan launch, and host µs of a hot loop: T 512 5.5 / 7.3 and 76 / 50,
    # T 1024 5.5 / 10.9 and 81 / 49, T 2048 5.9 / 17.9 and 79 / 55, T 4096 5.9 / 30.7 and 84 / 54 (R 2 alike): the
    # scan costs GPU time in proportion to T, so it stops at 1024 tokens (a probe, 2026-12-06 at fc519e2:
    # benchmarks/results/layout_forms_h100_probe.json)
    "layout": dict(block_t=64, block_b=64, one_launch_tokens=256, histogram_max_bins=512, num_warps=4,
                   scan_tokens=1024, scan_block_t=256),
    "dispatch_send": dict(block_t=1, block_w=4096, num_warps=4, split_w=0, store_cache="", store_evict="",
                          programs_per_sm=0, record_align_words=32),
    "dispatch_recv": dict(block_t=1, block_w=2048, num_warps=4),
    # normal mode's send and receive launches (not the fused ones, not low-latency): at most this many
    # programs per multiprocessor, each looping over blocks (kernels.geometry.programs; 0: a program per block;
    # a dispatch send with split_w multiplies it by its row slices)
    "grid": dict(programs_per_sm=8),
    # a call of at most max_tokens tokens runs the send and receive of all its rounds as one launch
    # (kernels.dispatch.dispatch_fused, kernels.combine.combine_fused); the fused combine's reduce part takes
    # reduce_block_h (the split reduce's 2048 made a fused T 1024 combine about 6% slower, benchmarks/README.md)
    # programs_per_sm: at most this many fused programs per multiprocessor, and no more than fit there at once
    # (geometry.fused_per_sm). max_tokens bounds low-latency calls and a dispatch's count exchange, data_max_tokens
    # normal mode's data calls (dispatch, cached dispatch, combine). On one H100 on 2026-12-06 (grid_cap.py, one
    # rank, a buffer of one round, GPU µs per graph replay; benchmarks/results/grid_cap_h100_*): with the waits'
    # bursts (flags.SPIN_BURST) a fused T 1024 cached dispatch takes 26.3 µs at 1 program per multiprocessor, 24.7
    # at 2, 27.0 at 4, 31.6 at 8 (split: 19.8), a combine 38.0 / 30.2 / 28.9 / 33.2 (split 21.6); at T 4096
    # 111.5 / 95.6 / 95.1 / 100.9 against 88.4 split, combine 173.1 / 119.9 / 100.6 / 100.5 against 91.1 (before
    # the bursts: 1058-1140 µs at T 1024). Fused costs GPU time but saves a launch of host time (one rank, hint-sized
    # buffer, bench_calls.py: cached dispatch 35-41 host µs fused against 94-99 split at T 128 and 1024).
    # data_max_tokens 1024: at T 4096 a fused call at 4 per multiprocessor took 1100-1180 µs in two of seven
    # settings over five processes (95-110 in the others; none such at T 128 or 1024), so larger calls stay split
    # until that is found; TRITON_EP_FUSED=1 forces fused
    "fused": dict(max_tokens=1024, data_max_tokens=1024, reduce_block_h=4096, programs_per_sm=4),
    "combine_send": dict(block_t=1, block_w=2048, num_warps=4),
    # (4 warps, blocks of 2048: a T 4096 combine 69.0 -> 65.8 us on one H200, T 2048 unchanged;
    # benchmarks/results/grid_cap_h200_r1.json)
    "combine_reduce": dict(block_t=1, block_h=2048, num_warps=4),
    # low-latency kernels: benchmarks/bench_low_latency.py --sweep on one H200 (T 128, H 7168, top-8 of 256;
    # benchmarks/results/low_latency_h200_r1_sweep.json). ``programs_per_expert``: a second grid axis over
    # each expert's rows; ``expert_programs`` > 0 caps the programs over experts (they loop).
    # ll_route: a program per ``experts`` experts, token blocks of ``block_t`` tokens at top-8 or less (fewer at a
    # larger top-k; both rounded up to powers of two); one H200, 20 launches in a CUDA graph: 2.9 us a launch
    # (torch.profiler in a dispatch + combine replay: 2.8) against 5.6-6.0 for the kernel it replaced (4 experts a
    # program, [T, K, K] duplicate tiles); 98fc3cd:benchmarks/results/low_latency_h200_r1_launch_floor_probe.json
    "ll_route": dict(block_t=128, experts=1, num_warps=8),
    "ll_send": dict(block_t=1, block_h=1024, num_warps=4),
    "ll_recv": dict(block_r=8, block_w=2048, block_f=128, expert_programs=0, programs_per_expert=1, num_warps=4),
    "ll_combine_send": dict(block_r=2, block_w=4096, programs_per_expert=4, num_warps=4),
    "ll_reduce": dict(block_t=1, block_h=1024, num_warps=2),
    # a low-latency call as one launch (kernels/ll_fused.py): at most this many programs per multiprocessor, and
    # no more than fit there at once (launch.resident_per_sm); each part takes its split launch's blocks
    "ll_fused": dict(programs_per_sm=4),
}

INTERP_TUNING: Dict[str, Dict[str, object]] = {
    "layout": dict(block_t=1024, block_b=4096, one_launch_tokens=1024, histogram_max_bins=1 << 20,
               num_warps=4, scan_tokens=8192, scan_block_t=1024),
    "dispatch_send": dict(block_t=64, block_w=2048, num_warps=4, split_w=0, store_cache="", store_evict="",
                          programs_per_sm=0, record_align_words=4),
    "dispatch_recv": dict(block_t=64, block_w=2048, num_warps=4),
    "grid": dict(programs_per_sm=0),
    # off (the lock-step runner needs split launches; TRITON_EP_FUSED=1 tests it)
    "fused": dict(max_tokens=0, data_max_tokens=0, reduce_block_h=2048, programs_per_sm=1),
    "combine_send": dict(block_t=64, block_w=2048, num_warps=4),
    "combine_reduce": dict(block_t=64, block_h=2048, num_warps=4),
    "ll_route": dict(block_t=64, experts=32, num_warps=4),     # (the interpreter runs programs one by one: few, large)
    "ll_send": dict(block_t=16, block_h=2048, num_warps=4),
    "ll_recv": dict(block_r=64, block_w=2048, block_f=1024, expert_programs=0, programs_per_expert=1, num_warps=4),
    "ll_combine_send": dict(block_r=64, block_w=2048, programs_per_expert=1, num_warps=4),
    "ll_reduce": dict(block_t=16, block_h=2048, num_warps=4),
    "ll_fused": dict(programs_per_sm=1),
}


GPU_TUNING = _Table({k: _Table(v) for k, v in GPU_TUNING.items()})
INTERP_TUNING = _Table({k: _Table(v) for k, v in INTERP_TUNING.items()})


_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_switch(name: str) -> Optional[bool]:
    """The environment variable ``name`` as a switch: True / False, or None when unset or empty (case and spaces
    around ignored). Raises ``ValueError`` naming it for a value other than 1 / 0, true / false, yes / no, on /
    off. ``TRITON_EP_FUSED`` and ``TRITON_EP_PDL`` are read through it."""
    raw = os.environ.get(name, "")
    if raw in _SWITCH:                  # (the plain spellings: no parsing on the call path)
        return _SWITCH[raw]
    v = raw.strip().lower()
    if not v:
        return None
    if v not in _SWITCH:
        raise ValueError(f"{name} must be 1 or 0 (or true / false, yes / no, on / off), got {raw!r}")
    return _SWITCH[v]


def tuning(kernel: str) -> Dict[str, object]:
    """Launch parameters of ``kernel`` for the current backend (a dict: block sizes, ``num_warps``)."""
    return (INTERP_TUNING if interpreted() else GPU_TUNING)[kernel]


def entry(kernel: str, tune: Optional[Dict[str, Dict[str, object]]] = None) -> Dict[str, object]:
    """``tune[kernel]``: the entry of a call's own table (a Config's, :func:`triton_ep.kernels.params.of_config`),
    or with ``tune`` None the built-in table's (:func:`tuning`)."""
    return tuning(kernel) if tune is None else tune[kernel]


@functools.lru_cache(maxsize=64)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``; 4 for the interpreter's CPU tensors (asked once per device: a fused
    launch asks on every call)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two ``>= max(n, lo)`` (plain integer arithmetic: ``triton.next_power_of_2``
    costs a microsecond a call on the launch path)."""
    n = int(n)
    return max(1 << (n - 1).bit_length() if n > 1 else 1, lo)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``triton.cdiv`` without its call overhead)."""
    return -(-a // b)
