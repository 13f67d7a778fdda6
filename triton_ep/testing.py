"""Ranks simulated in one process, for tests: ``R`` Buffers over in-process memory, driven in lock step.

Every collective call of :class:`triton_ep.Buffer` is a generator that yields where ranks must meet; in a
real run each yield is a bounded barrier, here :func:`lockstep` advances all ranks to the same yield
before any goes on. The kernels, offsets and rounds are exactly those of the multi-process path.
"""
from __future__ import annotations

from typing import Any, Generator, List, Sequence

from .buffer import Buffer
from .transport.ipc import LocalWorld


def lockstep(gens: Sequence[Generator]) -> List[Any]:
    """Run one generator per rank to completion, meeting at every yield.

    Returns:
        per rank, the generator's return value, or the exception it raised (as an object, not raised).

    Raises:
        AssertionError: the ranks yielded different numbers of times (a protocol bug).
    """
    results: List[Any] = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        stepped, done = [], []
        for r in live:
            try:
                next(gens[r])
                stepped.append(r)
            except StopIteration as stop:
                results[r] = stop.value
                done.append(r)
            except Exception as e:  # noqa: BLE001 - returned to the caller per rank
                results[r] = e
                done.append(r)
        if stepped and done and any(not isinstance(results[r], Exception) for r in done):
            raise AssertionError(f"ranks {stepped} wait at a barrier that ranks {done} skipped")
        live = stepped
    return results


class VirtualGroup:
    """``R`` Buffers of one simulated group on CPU.

    Args:
        num_ranks: ``R``.
        num_nvl_bytes: each rank's buffer size in bytes.

    Use :meth:`call` to run one collective method on all ranks: ``call("dispatch", [kwargs_0, ...])``.
    """

    def __init__(self, num_ranks: int, num_nvl_bytes: int) -> None:
        self.world = LocalWorld(num_ranks, num_nvl_bytes, Buffer._slot_words(num_ranks))
        self.buffers = [Buffer(self.world.comm(r), num_nvl_bytes) for r in range(num_ranks)]

    def call(self, method: str, per_rank_kwargs: Sequence[dict]) -> List[Any]:
        """Run ``Buffer.<method>`` (``dispatch`` or ``combine``) on every rank in lock step; returns per rank
        the result tuple or the exception raised."""
        steps = {"dispatch": "_dispatch_steps", "combine": "_combine_steps"}[method]
        gens = []
        for buf, kw in zip(self.buffers, per_rank_kwargs):
            gens.append(getattr(buf, steps)(**_steps_kwargs(method, kw)))
        return lockstep(gens)


def _steps_kwargs(method: str, kw: dict) -> dict:
    if method == "dispatch":
        names = dict(handle=None, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                     topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                     previous_event=None, async_finish=False)
    else:
        names = dict(handle=None, topk_weights=None, bias=None, previous_event=None, async_finish=False)
    extra = set(kw) - set(names) - {"x", "config", "allocate_on_comm_stream", "num_tokens_per_rdma_rank"}
    if extra:
        raise TypeError(f"{method} got unexpected arguments {sorted(extra)}")
    out = {"x": kw["x"]}
    out.update({k: kw.get(k, v) for k, v in names.items()})
    return out
