"""The low-latency area's layout, the same on every rank: where its control block, its two halves (counts
and records) and the zero-copy combine input sit. The modes size and slice the area with it; the kernels take
its sizes (in 32-bit words)."""
import dataclasses
import functools

from . import records
from .signal_header import ll_ctl_words

_ALIGN = 256


def _up(n: int, a: int = _ALIGN) -> int:
    return (int(n) + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte layout of the low-latency area for ``N`` tokens per rank, hidden ``H``, ``R`` ranks and ``E``
    experts (the same on every rank). Sizes in bytes; the ``*_words`` properties in 32-bit words.

    - control block: ``ll_ctl_words(R)`` int64 words (:mod:`triton_ep.protocol.signal_header`);
    - each half: counts int32 ``[R][E/R]``, then ``E * N`` dispatch records (the bf16 record, the larger)
      or, in a combine, ``N * K`` returned bf16 rows;
    - the zero-copy combine input, bf16 ``[E/R, R*N, H]`` (local only).
    """
    num_ranks: int
    n_max: int
    hidden: int
    num_experts: int

    @functools.cached_property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @functools.cached_property
    def ctl_bytes(self) -> int:
        return _up(ll_ctl_words.host(self.num_ranks) * 8)

    @functools.cached_property
    def count_bytes(self) -> int:
        return _up(self.num_experts * 4)

    def record_words(self, fp8: bool) -> int:
        """32-bit words of one dispatch record (:mod:`triton_ep.protocol.records`)."""
        return self._record_words[bool(fp8)]

    @functools.cached_property
    def _record_words(self) -> tuple:
        return records.ll_record_words(self.hidden, False), records.ll_record_words(self.hidden, True)

    @functools.cached_property
    def half_bytes(self) -> int:
        return _up(self.count_bytes + self.num_experts * self.n_max * self.record_words(False) * 4)

    @functools.cached_property
    def zero_copy_bytes(self) -> int:
        return _up(self.num_experts * self.n_max * self.hidden * 2)

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.ctl_bytes + 2 * self.half_bytes + self.zero_copy_bytes

    ctl_words = functools.cached_property(lambda self: self.ctl_bytes // 4)
    half_words = functools.cached_property(lambda self: self.half_bytes // 4)
    count_words = functools.cached_property(lambda self: self.count_bytes // 4)
