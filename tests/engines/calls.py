"""The form of an engine's call sequence: what it calls on ``deep_ep``, with which arguments, what it reads back,
and where in the engine's source each call is (``path@version:line``).

A :class:`Sequence` is the Buffer's construction plus :class:`Step` s (a prefill step, a decode step, ...), each a
tuple of :class:`Call` s run in order on every rank by ``engines.replay``. Argument values are the engine's
literals, or :class:`Ref` s to values of the replay: its sizes (``E``, ``H``, ``N``, ``R``), the step's inputs
(``x``, ``topk_idx``, ``topk_weights``) and what earlier calls returned (bound by ``Call.out``). Calls of two
sub-batches (SGLang's two-batch overlap) keep their values apart by ``Call.sub``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

#: the engines' versions these sequences were read from (the wheels on PyPI)
VLLM = "vllm@v0.33.0(4ba787ec9)"
SGLANG = "sglang@v0.5.23"


@dataclass(frozen=True)
class Ref:
    """A value of the replay: a size (``E``, ``H``, ``N``, ``R``, ``K``), an input of the step (``x``,
    ``topk_idx``, ``topk_weights``) or an earlier call's output, by name; ``group`` is the process group."""
    name: str


@dataclass(frozen=True)
class Call:
    """One call the engine makes.

    Attributes:
        op: the call: a ``deep_ep.Buffer`` method or static (``dispatch``, ``low_latency_dispatch``,
            ``set_num_sms``, ...), ``Buffer`` (construction), ``wait`` (``EventOverlap.current_stream_wait`` of
            ``args["event"]``), ``hook`` (calling the receive hook ``args["hook"]``), ``rdma_zero`` (vLLM's
            ``get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()``), ``size_hints`` (SGLang's
            sizing from the configs' hints); for DeepEP V2: ``ElasticBuffer`` (construction), the ElasticBuffer's
            methods, ``read`` (the engine's own code on what a call returned or on its inputs: ``args["what"]``
            names it in ``engines.replay_v2``), ``drop`` (the engine lets go of its last reference, no
            ``destroy()``); or the replay's own ``expert`` (the stand-in for the experts between dispatch and
            combine: no engine call) and ``check`` (compare with the reference).
        args: keyword arguments as the engine passes them (literals or :class:`Ref`).
        cite: ``path@version:line`` of the call in the engine (empty for the replay's own ops).
        out: names bound to the call's results, in order (``None`` entries: results the engine drops).
        sub: the sub-batch (0, or 1 for SGLang's second two-batch-overlap sub-batch).
        note: what the engine does around the call that the replay does not (a GEMM, a DBO stream switch).
    """
    op: str
    args: Dict[str, Any] = field(default_factory=dict)
    cite: str = ""
    out: Tuple[Optional[str], ...] = ()
    sub: int = 0
    note: str = ""


@dataclass(frozen=True)
class Step:
    """A forward step's DeepEP calls (one MoE layer): ``name`` ("prefill", "decode", ...), ``calls``, and the
    tokens per rank ``tokens`` as a function of the rank count in the replay (index = rank; a shorter list
    repeats)."""
    name: str
    calls: Tuple[Call, ...]
    tokens: Tuple[int, ...] = (5, 3)


@dataclass(frozen=True)
class Sequence:
    """An engine backend's sequence: ``engine`` (vLLM / SGLang at its version), ``backend`` (the engine's flag
    value), ``setup`` (the Buffer's sizing and construction calls), ``steps``, ``teardown``, and ``deviations``:
    where the replay's values differ from the engine's (sizes scaled down for the CPU interpreter)."""
    engine: str
    backend: str
    setup: Tuple[Call, ...]
    steps: Tuple[Step, ...]
    teardown: Tuple[Call, ...] = ()
    deviations: Tuple[str, ...] = ()

    @property
    def v2(self) -> bool:
        """Whether the sequence is of DeepEP V2's face (it builds an ``ElasticBuffer``)."""
        return any(c.op == "ElasticBuffer" for c in self.setup)

    def calls(self):
        """Every call in order (setup, each step's, teardown)."""
        yield from self.setup
        for s in self.steps:
            yield from s.calls
        yield from self.teardown
