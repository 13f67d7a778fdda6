"""What a DeepEP ``Config`` sets here: the launch parameters of normal mode's send and receive kernels.

DeepEP's kernels take ``num_sms`` blocks (``num_sms / 2`` channels, each a sending and a receiving SM), move
``num_max_nvl_chunked_send_tokens`` tokens per step and hold ``num_max_nvl_chunked_recv_tokens`` per channel and
rank in the buffer. Normal mode's launches here (``dispatch_send``, ``dispatch_recv``, ``combine_send``,
``combine_reduce`` and the fused ones) have the same three knobs, and :func:`of_config` sets them from a Config:

- **programs**: at most ``num_sms * P`` per launch, ``P`` the built-in table's programs per SM (``grid`` /
  ``programs_per_sm``; 1 where it has none, as under the interpreter). ``num_sms`` below the mode's
  :data:`MIN_NUM_SMS` raises ``ValueError`` naming both.
- **rows per block**: every one of those kernels moves ``rows = min(pow2_floor(num_max_nvl_chunked_send_tokens),
  64)`` rows per step; its row slice shrinks (or grows) so that a step's tile keeps the built-in entry's size
  (``block_t * block_w``, at least 16 wide).
- **chunking**: a round moves at most ``num_max_nvl_chunked_recv_tokens * max(num_sms // 2, 1) * min(R, 8)``
  rows (the rows DeepEP's buffer of this Config holds), and never more than the buffer holds.
- **num_warps**: the Config's ``num_warps`` (triton-ep's keyword, a tuned table's), else the built-in table's.

The RDMA pair does not reach a launch (the network leg's chunk and ring sizes are fixed at construction). A call
without a Config uses the built-in tables, bounded by ``Buffer.set_num_sms``'s value once it was called. None of
this changes a result: the kernels reduce in a fixed order whatever the blocks, grids and rounds.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional

from ..config import NUM_SMS_SET, Config
from ._util import entry, interpreted, tuning_changes

#: the least ``num_sms`` a Config may give each normal mode: one DeepEP channel (a sending and a receiving SM)
MIN_NUM_SMS = {"intranode": 2, "internode": 2}
#: normal mode's send and receive kernels, each with its row-width key (a step's tile is ``block_t`` x that)
ROW_KERNELS = {"dispatch_send": "block_w", "dispatch_recv": "block_w", "combine_send": "block_w",
               "combine_reduce": "block_h"}
#: the most rows per block a Config gives (DeepEP's send chunks are at most a few dozen tokens)
MAX_ROWS = 64
_MIN_WIDTH = 16


@dataclass(frozen=True)
class LaunchParams:
    """The launch parameters of one Config for a group of ``R`` ranks (:func:`of_config`).

    Attributes:
        key: what decides them (``Config.launch_key()``, or ``("set_num_sms", n)`` for a call without a Config
            after ``Buffer.set_num_sms(n)``); replay plans are kept per key.
        table: kernel name -> entry, as ``tuning()`` has them (the launchers' ``tune=``); normal mode's
            entries changed, the others the built-in ones.
        max_programs: programs per launch at most. rows_per_block: rows a program moves per step (0: the built-in
            entries'). round_rows: rows a round moves at most (0: as many as the buffer holds). num_warps: or None.
    """
    key: tuple
    table: Dict[str, Dict[str, object]]
    max_programs: int
    rows_per_block: int
    round_rows: int
    num_warps: Optional[int]


def config_key(config: Optional[Config]) -> Optional[tuple]:
    """The key of the launch parameters a call with ``config`` uses: ``config.launch_key()``, or for ``None``
    ``("set_num_sms", n)`` once ``Buffer.set_num_sms(n)`` was called, else ``None`` (the built-in tables). A plan
    made under one key serves only calls of the same key."""
    if config is None or config.builtin:      # (a recommendation: the built-in tables, as without a Config)
        n = NUM_SMS_SET.value
        return None if n is None else ("set_num_sms", n)
    return config.launch_key()


def check_num_sms(config: Optional[Config], mode: str) -> None:
    """``ValueError`` when ``config.num_sms`` is below ``mode``'s :data:`MIN_NUM_SMS` (naming both values)."""
    if config is not None and config.num_sms < MIN_NUM_SMS[mode]:
        raise ValueError(f"config.num_sms is {config.num_sms}, below the {mode} normal mode's minimum of "
                         f"{MIN_NUM_SMS[mode]} (one channel: a sending and a receiving SM)")


def of_config(config: Optional[Config], num_ranks: int, mode: str = "intranode") -> Optional[LaunchParams]:
    """The launch parameters a normal-mode call of ``num_ranks`` ranks with ``config`` uses (the module's docstring
    says how each field maps), or ``None`` for the built-in tables (no Config and no ``Buffer.set_num_sms``).
    Worked out once per Config key, group size, backend and state of the built-in tables.

    Raises:
        ValueError: ``config.num_sms`` below ``mode``'s minimum (naming both).
    """
    check_num_sms(config, mode)
    key = config_key(config)
    if key is None:
        return None
    return _derive(key, int(num_ranks), interpreted(), tuning_changes())


@functools.lru_cache(maxsize=256)
def _derive(key: tuple, num_ranks: int, _interp: bool, _changes: int) -> LaunchParams:
    base_grid = entry("grid")
    per_sm = max(int(base_grid["programs_per_sm"]), 1)
    table = {}
    if key[0] == "set_num_sms":
        sms, rows, recv, warps = key[1], 0, 0, None
    else:
        sms, send, recv, warps = key
        rows = min(1 << (int(send).bit_length() - 1), MAX_ROWS)
    table["grid"] = dict(base_grid, max_programs=sms * per_sm)
    scale = {}
    for name, wkey in ROW_KERNELS.items():
        e = dict(entry(name))
        if rows:
            tile = int(e["block_t"]) * int(e[wkey])
            scale[name] = rows / int(e["block_t"])
            e["block_t"], e[wkey] = rows, max(_MIN_WIDTH, 1 << (max(tile // rows, 1).bit_length() - 1))
        if warps is not None:
            e["num_warps"] = warps
        table[name] = e
    fused = dict(entry("fused"))
    if rows:        # (the fused combine's reduce part: the same tile as combine_reduce's)
        w = int(fused["reduce_block_h"] / scale["combine_reduce"])
        fused["reduce_block_h"] = max(_MIN_WIDTH, 1 << (max(w, 1).bit_length() - 1))
    table["fused"] = fused
    round_rows = int(recv) * max(sms // 2, 1) * min(num_ranks, 8) if recv else 0
    return LaunchParams(key, table, sms * per_sm, rows, round_rows, warps)


def table_of(params: Optional[LaunchParams]) -> Optional[dict]:
    """``params.table``, or ``None`` (the built-in tables) for ``None``."""
    return None if params is None else params.table


def round_cap(cap: int, params: Optional[LaunchParams]) -> int:
    """Rows a round moves: ``cap`` (what the buffer holds), at most ``params.round_rows`` where it sets one."""
    if params is None or not params.round_rows:
        return cap
    return min(cap, params.round_rows)


__all__ = ["LaunchParams", "MIN_NUM_SMS", "check_num_sms", "config_key", "of_config", "round_cap", "table_of"]
