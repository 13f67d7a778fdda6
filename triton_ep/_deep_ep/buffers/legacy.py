"""DeepEP's V1 ``Buffer`` under its 2.x module path ``deep_ep.buffers.legacy`` (1.x: ``deep_ep.buffer``).

:class:`Buffer` is :class:`triton_ep.Buffer` with the keyword arguments that the pinned engines pass to their
DeepEP forks (vLLM v0.33.0, SGLang v0.5.23; docs/engines_vllm.md, docs/engines_sglang.md) accepted by name:
where the value asks for nothing (``use_nvfp4=False``, ``x_global_scale=None``, ``overlap=False``) the call goes
on as triton-ep's; where it asks for a feature triton-ep lacks it raises ``NotImplementedError`` naming it,
before anything is sent (a plain ``TypeError`` "unexpected keyword" would not say what is missing), and the peers,
which make the call, raise ``EPRemoteError`` at once, as for any argument error.
"""
from __future__ import annotations

import triton_ep

__all__ = ["Buffer"]

#: SGLang's single-batch-overlap combine arguments (fzyzcjy/DeepEP's SM90 signal, and the SM100 form).
_OVERLAP_ARGS = ("packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms", "src_signals",
                 "src_signal_expect_value")


class Buffer(triton_ep.Buffer):
    """triton-ep's :class:`triton_ep.Buffer` as ``deep_ep.Buffer``; every method and argument is triton-ep's
    (see its docstrings), plus the engine-fork arguments of :meth:`low_latency_dispatch` and
    :meth:`low_latency_combine` below."""

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *args,
                             use_nvfp4: bool = False, x_global_scale=None, **kwargs):
        """triton-ep's ``low_latency_dispatch``, plus the NVFP4 arguments of DeepEP's hybrid-ep branch that
        vLLM (``VLLM_DEEPEPLL_NVFP4_DISPATCH=1``) and SGLang (NVFP4 dispatch output) pass.

        Args:
            use_nvfp4: NVFP4 (e2m1 + block scales) dispatch; only ``False`` is served.
            x_global_scale: NVFP4's global scale; only ``None`` is served.
            others: as :meth:`triton_ep.Buffer.low_latency_dispatch`.

        Raises:
            NotImplementedError: ``use_nvfp4=True`` or an ``x_global_scale`` (before anything is sent; the peers'
            calls raise ``EPRemoteError`` at once and the next call goes on, as for any argument error); otherwise
            as :meth:`triton_ep.Buffer.low_latency_dispatch`.
        """
        if use_nvfp4 or x_global_scale is not None:
            self._refuse(NotImplementedError(
                f"low_latency_dispatch(use_nvfp4={use_nvfp4!r}, x_global_scale="
                f"{'given' if x_global_scale is not None else None}): NVFP4 dispatch (DeepEP's hybrid-ep branch) is "
                f"not in triton-ep; dispatch bf16 or FP8 (use_fp8=True) instead"))
        return super().low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *args,
                                            **kwargs)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *args, overlap: bool = False, **kwargs):
        """triton-ep's ``low_latency_combine``, plus SGLang's single-batch-overlap arguments (DeepEP fork
        fzyzcjy/DeepEP: ``overlap``, ``packed_recv_count``, ``comp_signal``, ``block_m``, ``threshold``,
        ``num_sms``; on SM100 ``src_signals``, ``src_signal_expect_value``).

        Args:
            overlap: start sending each expert's rows as the GEMM signals them; only ``False`` is served (the
                other overlap arguments are then ignored, as the fork ignores them).
            others: as :meth:`triton_ep.Buffer.low_latency_combine`.

        Raises:
            NotImplementedError: ``overlap=True`` (SGLang's ``--enable-single-batch-overlap``), before anything
            is sent (the peers' calls raise ``EPRemoteError`` at once, as for any argument error); otherwise as
            :meth:`triton_ep.Buffer.low_latency_combine`.
        """
        given = [k for k in _OVERLAP_ARGS if k in kwargs]
        if overlap:
            self._refuse(NotImplementedError(
                f"low_latency_combine({', '.join(['overlap=True'] + given)}): combine overlapped with the expert "
                f"GEMM's signals (SGLang's single-batch overlap, DeepEP fork fzyzcjy/DeepEP) is not in triton-ep; run "
                f"without --enable-single-batch-overlap"))
        for k in given:
            del kwargs[k]
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, *args, **kwargs)

    def _refuse(self, err: NotImplementedError) -> None:
        """Raise ``err`` for a low-latency call this rank cannot serve, as an argument error: its peers, which make
        the call, are told at once (``EPRemoteError``) and the group goes on (the Buffer's low-latency mode refuses
        it; a Buffer without one raises ``err`` alone, as its peers' calls raise too)."""
        refuse = getattr(self._ll, "refuse", None)
        if refuse is None:
            raise err
        refuse(err)
        raise err       # (refuse raises it: not reached)
