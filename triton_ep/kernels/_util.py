"""Small helpers shared by the launchers (block sizes per backend)."""
import os

import triton


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors, ``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two ``>= max(n, lo)``."""
    return max(triton.next_power_of_2(max(int(n), 1)), lo)
