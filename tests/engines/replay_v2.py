"""The DeepEP V2 (``deep_ep.ElasticBuffer``) part of the engine replay (engines/replay.py): the engines' own code
that reads what a V2 dispatch returns, written in plain PyTorch from their source, and the checks against
``triton_ep.reference.elastic_dispatch`` / ``elastic_combine``.

An engine's V2 path does more with the results than a V1 path does: vLLM rebuilds expert ids from
``handle.num_recv_tokens_per_expert_list`` (expanded) or rewrites ``recv_topk_idx`` in place with the real count
``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` (worst case); SGLang slices the worst case to that count, or
cuts the expanded layout into expert segments from ``handle.psum_num_recv_tokens_per_expert``. Each function below
is one such piece of engine code (its lines in the docstring); the replay runs it on what triton-ep returned, and
the combine check runs the same function on the reference's dispatch of every other rank, so a field the engine
reads that differed would show in the combined rows. Between them sit stand-in experts (no engine code): expert
``e`` multiplies a row by ``e + 1``, so rows given to the wrong expert show too. Rows an engine leaves
uninitialised (worst-case padding, alignment gaps) are NaN here: combine must not read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from tests.cases.elastic import _same

Tensor = torch.Tensor


def _align(v, a):
    return (v + a - 1) // a * a


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def _dequant(x: Tensor, sf: Optional[Tensor]) -> Tensor:
    """fp32 rows: bf16 as is, FP8 times its per-128-column fp32 scales."""
    if sf is None:
        return x.float()
    if sf.dtype == torch.int32:                                 # packed UE8M0 (4 scales a word)
        from triton_ep.kernels.fp8 import unpack_ue8m0
        sf = unpack_ue8m0(sf.contiguous())[:, :x.shape[1] // 128]
    return x.float() * sf.contiguous().repeat_interleave(128, dim=-1)


@dataclass
class View:
    """What an engine sees of one rank's V2 dispatch: the returned tensors (copies: engines rewrite them in place)
    and the handle fields it reads."""
    recv_x: Any
    recv_topk_idx: Optional[Tensor]
    recv_topk_weights: Optional[Tensor]
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: Tensor
    psum_num_recv_tokens_per_expert: Tensor
    rank: int
    num_local_experts: int


def _clone(t):
    if isinstance(t, tuple):
        return tuple(_clone(u) for u in t)
    return None if t is None else t.clone()


def view_of_face(v, rank, El) -> View:
    """The view of what triton-ep returned (``recv_x``, ``recv_topk_idx``, ``recv_topk_weights``, ``handle``)."""
    h = v["handle"]
    return View(v["recv_x"], v["recv_topk_idx"], v["recv_topk_weights"], h.num_recv_tokens_per_expert_list,
                h.psum_num_recv_tokens_per_scaleup_rank, h.psum_num_recv_tokens_per_expert, rank, El)


def view_of_reference(d, rank, El) -> View:
    """The same view of ``reference.elastic_dispatch``'s dict for ``rank``."""
    return View(_clone(d["recv_x"]), _clone(d["recv_topk_idx"]), _clone(d["recv_topk_weights"]),
                list(d["num_recv_tokens_per_expert_list"]), d["psum_num_recv_tokens_per_scaleup_rank"],
                d["psum_num_recv_tokens_per_expert"], rank, El)


# ---------------------------------------------------------------------------------------------------- vLLM
def vllm_receiver(view: View, num_experts: int) -> dict:
    """vLLM's ``DeepEPV2PrepareAndFinalize._receiver`` (deepep_v2.py:262-328), what it reads: expanded
    (``recv_topk_idx is None``): one global expert id per row, ``repeat_interleave`` of this rank's expert ids by
    ``handle.num_recv_tokens_per_expert_list`` (:288-303); worst case: ``_globalize_recv_topk_idx`` (:319, kernel
    :552-574) rewrites ``recv_topk_idx`` in place to global ids, ``-1`` for other ranks' experts and for every row
    at or past ``psum_num_recv_tokens_per_scaleup_rank[-1]``; 1-D weights become ``[M, 1]`` (:327)."""
    x, sf = _split(view.recv_x)
    lst, El, off = view.num_recv_tokens_per_expert_list, view.num_local_experts, view.rank * view.num_local_experts
    psum_r = view.psum_num_recv_tokens_per_scaleup_rank
    if view.recv_topk_idx is None:
        assert lst, "expanded dispatch without the per-expert list (vLLM asserts expert_tokens_meta)"
        total = sum(lst)
        ids = torch.repeat_interleave(torch.arange(El, dtype=torch.int64, device="cpu") + off,
                                      torch.tensor(lst, dtype=torch.int64, device="cpu"), output_size=total)
        ids = ids.unsqueeze(1)
    else:
        ids = view.recv_topk_idx
        n = int(psum_r[-1])                        # the kernel loads psum[P - 1] on the device
        row = torch.arange(ids.shape[0], dtype=torch.int64, device="cpu").unsqueeze(1)
        g = ids + off
        valid = (ids >= 0) & (g < num_experts) & (row < n)
        ids.copy_(torch.where(valid, g, torch.full_like(g, -1)))
    w = view.recv_topk_weights
    if w is not None and w.ndim == 1:
        w = w.unsqueeze(1)
    return dict(x=x, sf=sf, ids=ids, w=w, num_recv=int(psum_r[-1]), expanded=view.recv_topk_idx is None)


def vllm_experts(r: dict) -> dict:
    """Stand-in experts, then vLLM's ``TopKWeightAndReduceContiguous`` (deepep_v2.py:468-477): per row the sum over
    its slots of ``row * (id + 1) * weight`` in fp32, rounded to bf16 once; worst-case padding rows (at or past the
    real count) NaN. Returns ``y``, the combine input (``topk_weights=None``, deepep_v2.py:488)."""
    x, ids, w = _dequant(r["x"], r["sf"]), r["ids"], r["w"]
    valid = ids >= 0
    f = torch.where(valid, (ids + 1).float() * w, torch.zeros_like(w))
    y = (x * f.sum(1, keepdim=True)).to(torch.bfloat16)
    if not r["expanded"]:
        y[r["num_recv"]:] = float("nan")
    return dict(y=y, w=None)


# ---------------------------------------------------------------------------------------------------- SGLang
def sglang_dispatch_output(view: View, expanded: bool, masked: bool, num_max_tokens_per_rank: int,
                           num_ranks: int) -> dict:
    """SGLang's ``_DeepEPv2Impl.dispatch`` after the call (deepep_v2.py:401-444): expanded: checks the 1-D weights
    have one per row (:410); otherwise slices every output to ``psum_num_recv_tokens_per_scaleup_rank[-1]``
    (:416-423) and keeps the receiver-local ids; masked (decode): ``total_expanded`` = the rows returned, the GEMM
    slab's rows per expert ``masked_max_m`` = ``num_max_tokens_per_rank * R`` (``_masked_token_capacity``'s bound,
    :304-329, with attention DP)."""
    x, sf = _split(view.recv_x)
    ids, w = view.recv_topk_idx, view.recv_topk_weights
    if expanded:
        assert ids is None and tuple(w.shape) == (x.shape[0],), "expanded activations and weights differ in rows"
    else:
        n = int(view.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        ids, w, x = ids[:n], w[:n], x[:n]
        sf = None if sf is None else sf[:n]
    return dict(x=x, sf=sf, ids=ids, w=w, psum_e=view.psum_num_recv_tokens_per_expert, expanded=expanded,
                masked=masked, total_expanded=x.shape[0] if masked else 0,
                masked_max_m=num_max_tokens_per_rank * num_ranks if masked else 0)


def _segments(psum_e: Tensor, align: int):
    """Per local expert ``(start, end)`` as SGLang's kernels read the expanded psum: ``start = align(psum[e-1])``,
    ``end = psum[e]`` (ep_moe_kernels.py:2393-2394, :2424-2428)."""
    p = [int(v) for v in psum_e]
    return [(_align(p[e - 1], align) if e else 0, p[e]) for e in range(len(p))]


def sglang_experts(r: dict, expert_alignment: int = 128) -> dict:
    """SGLang's DeepGEMM runner around stand-in experts (moe_runner/deep_gemm.py:1715-1946):

    - expanded, masked (decode): ``expand_to_masked_slab`` (rows ``start..end`` of expert ``e`` to its slab),
      the GEMM on the slab, ``masked_slab_to_expand`` into a ``torch.empty`` of ``total_expanded`` rows with each
      row's weight fused (ep_moe_kernels.py:2462-2620); combine gets ``topk_weights=None``.
    - expanded, contiguous (prefill): ``fill_m_indices_from_psum`` labels rows ``start..align(end)`` with ``e``
      (:2622-2680; the alignment tail is GEMM junk), then ``hidden_states.mul_(topk_weights)``; combine gets None.
    - not expanded (``SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND=0``): ``ep_scatter_from_psum`` (segments at
      ``psum[e-1]``), the GEMM, ``ep_gather`` (the weighted sum over the token's slots); combine gets the weights.
    """
    x = _dequant(r["x"], r["sf"])
    if r["expanded"]:
        segs = _segments(r["psum_e"], expert_alignment)
        w = r["w"]
        if r["masked"]:
            out = torch.full((r["total_expanded"], x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cpu")
            for e, (s, end) in enumerate(segs):
                n = min(end - s, r["masked_max_m"])
                y = (x[s:s + n] * (e + 1)).to(torch.bfloat16)                          # the masked GEMM
                out[s:s + n] = (y.float() * w[s:s + n, None]).to(torch.bfloat16)      # masked_slab_to_expand
            return dict(y=out, w=None)
        m = torch.full((x.shape[0],), -1, dtype=torch.int64, device="cpu")
        for e, (s, end) in enumerate(segs):
            m[s:_align(end, expert_alignment)] = e
        assert x.shape[0] % expert_alignment == 0, "fill_m_indices_from_psum: rows not a multiple of the alignment"
        y = (x * (m + 1).float()[:, None]).to(torch.bfloat16)
        real = torch.zeros(x.shape[0], dtype=torch.bool, device="cpu")
        for s, end in segs:
            real[s:end] = True
        y[~real] = float("nan")                                                       # GEMM junk in the gaps
        return dict(y=(y.float() * w[:, None]).to(torch.bfloat16), w=None)           # mul_(topk_weights)
    ids, w = r["ids"], r["w"]
    acc = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        yk = (x * (ids[:, k:k + 1] + 1).float()).to(torch.bfloat16)                   # the contiguous GEMM
        acc += torch.where(ids[:, k:k + 1] >= 0, yk.float() * w[:, k:k + 1], torch.zeros_like(acc))
    return dict(y=acc.to(torch.bfloat16), w=w)


READS = {"vllm_receiver": vllm_receiver, "sglang_dispatch_output": sglang_dispatch_output}
EXPERTS = {"vllm": vllm_experts, "sglang": sglang_experts}


# ---------------------------------------------------------------------------------------------------- inputs, outputs
def _vllm_num_max_tokens(rk, v):
    """deepep_v2.py:204-212 (worst case only): ``max(num_tokens_across_dp)`` rounded up to a power of 2, the same
    on every rank."""
    n = max(_split(x)[0].shape[0] for x in v["all_x"])
    return 1 << max(n - 1, 0).bit_length()


def _sglang_pad_empty(rk, v):
    """deepep_v2.py:348-355 (CPU-synced dispatch only): a rank without tokens dispatches one zero row routed to
    experts ``0..K-1`` with zero weights (every rank's inputs change alike: the reference needs them)."""
    K = v["topk_idx"].shape[1]
    v["padded"] = v["x"].shape[0] == 0
    for j, x in enumerate(v["all_x"]):
        if x.shape[0] == 0:
            v["all_x"][j] = torch.zeros((1, x.shape[1]), dtype=x.dtype, device="cpu")
            v["all_idx"][j] = torch.arange(K, dtype=torch.int64, device="cpu").unsqueeze(0)
            v["all_w"][j] = torch.zeros((1, K), dtype=torch.float32, device="cpu")
    v["x"], v["topk_idx"], v["topk_weights"] = v["all_x"][rk.rank], v["all_idx"][rk.rank], v["all_w"][rk.rank]


def _quantize_fp8(rk, v, ue8m0=False):
    """The engines' block FP8 quantisation before a V2 dispatch (vLLM ``moe_kernel_quantize_input`` with
    128-column blocks, SGLang ``sglang_per_token_group_quant_fp8``), on every rank's inputs: ``(fp8 [T, H], fp32
    scales [T, H/128])`` row-major; ``ue8m0`` (SGLang with DeepGEMM's UE8M0 scales, Blackwell): power-of-two scales
    packed 4 to an int32, ``[T, H/512]`` column-major with the token stride 1 and the pack stride ``T`` rounded up
    to 4 (``column_major_scales=scale_tma_aligned=scale_ue8m0=True``, deepep_v2.py:363-369)."""
    from triton_ep.kernels.fp8 import pack_ue8m0, quantize_reference

    def q(x):
        xq, sf = quantize_reference(x, round_scale=ue8m0)
        if not ue8m0:
            return xq, sf
        packed = pack_ue8m0(sf)
        T, S = packed.shape
        cm = torch.empty_strided((T, S), (1, _align(max(T, 1), 4)), dtype=torch.int32, device="cpu")
        return xq, cm.copy_(packed)
    v["all_x"] = [q(x) for x in v["all_x"]]
    v["x"] = v["all_x"][rk.rank]


def _vllm_copy_output(rk, v):
    """deepep_v2.py:504 (or :508): ``output.copy_(combined_x)``."""
    v["output"].copy_(v["combined_x"])
    v["engine_output"] = v["output"]


def _sglang_combine_output(rk, v):
    """deepep_v2.py:482-484: an idle rank's dummy row is cut off (``combined_x[:0]``)."""
    out = v["combined_x"][:0] if v.get("padded") else v["combined_x"]
    assert out.shape[0] == v["output"].shape[0], (out.shape, v["output"].shape)
    v["engine_output"] = out


OTHER_READS = {"vllm_num_max_tokens": _vllm_num_max_tokens, "sglang_pad_empty": _sglang_pad_empty,
               "quantize_fp8": _quantize_fp8, "vllm_copy_output": _vllm_copy_output,
               "sglang_combine_output": _sglang_combine_output}


def run_read(rk, v, what, **args):
    """The replay's ``read`` op: the engine code ``what`` on this rank's values ``v`` (``rk``: the rank's
    interpreter, engines.replay._Rank). Returns what the call binds (``Call.out``)."""
    if what == "attr":
        return getattr(rk.buf, args["name"])
    if what in OTHER_READS:
        return OTHER_READS[what](rk, v, **args)
    v["engine"] = READS[what](view_of_face(v, rk.rank, rk.base["E_local"]), **args)
    v["v2_read"] = (what, args)
    return ()


def run_expert(v, engine, **args):
    """The replay's ``expert`` op of a V2 step: the stand-in experts and the engine's code up to combine's input
    (``y``, and ``combine_w``: the weights the engine passes to combine, or None)."""
    out = EXPERTS[engine](v["engine"], **args)
    v["y"], v["combine_w"] = out["y"], out["w"]
    v["v2_expert"] = (engine, args)


# ---------------------------------------------------------------------------------------------------- checks
def check_dispatch(v, me, world, E, num_max_tokens_per_rank, expert_alignment, do_expand, do_cpu_sync,
                   col_major_sf=False):
    """Every output and handle field of this rank's V2 dispatch bit for bit against ``reference.elastic_dispatch``
    (before the engine's code rewrites anything); ``col_major_sf``: the received scales must be column-major with
    the pack stride the row count rounded up to 4 (DeepGEMM reads them so). The reference's dicts are kept in
    ``v["v2_ref"]``."""
    from triton_ep import reference as ref
    exp = ref.elastic_dispatch(v["all_x"], v["all_idx"], v["all_w"], E, num_max_tokens_per_rank,
                               expert_alignment or 1, do_expand, do_cpu_sync)
    e, h = exp[me], v["handle"]
    if isinstance(e["recv_x"], tuple):
        _same(v["recv_x"][0], e["recv_x"][0], "recv_x")
        _same(v["recv_x"][1], e["recv_x"][1], "recv_x scales")
        n = v["recv_x"][1].shape[0]
        if col_major_sf and n:
            assert v["recv_x"][1].stride() == (1, _align(n, 4)), v["recv_x"][1].stride()
    else:
        _same(v["recv_x"], e["recv_x"], "recv_x")
    _same(v["recv_topk_idx"], e["recv_topk_idx"], "recv_topk_idx")
    _same(v["recv_topk_weights"], e["recv_topk_weights"], "recv_topk_weights")
    assert h.num_recv_tokens == e["num_recv_tokens"] and h.num_expanded_tokens == e["num_expanded_tokens"]
    assert h.num_recv_tokens_per_expert_list == e["num_recv_tokens_per_expert_list"]
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata"):
        _same(getattr(h, name), e[name], name)
    v["v2_ref"] = exp


def check_combine(v, me, world, El, ranks_per_host):
    """The combine's output (the engine's ``output`` when it copies into one, else ``combined_x``; and the
    combined weights where the engine passed weights) against ``reference.elastic_combine``, whose inputs are the
    engine's code and the stand-in experts run on the reference's dispatch of every other rank."""
    from triton_ep import reference as ref
    exp = v["v2_ref"]
    (read, read_args), (expert, expert_args) = v["v2_read"], v["v2_expert"]
    ys, ws = [], []
    for j in range(world):
        if j == me:
            ys.append(v["y"])
            ws.append(v["combine_w"])
            continue
        out = EXPERTS[expert](READS[read](view_of_reference(exp[j], j, El), **read_args), **expert_args)
        ys.append(out["y"])
        ws.append(out["w"])
    Ts = [_split(x)[0].shape[0] for x in v["all_x"]]
    expand = v["handle"].do_expand
    want_x, want_w = ref.elastic_combine(ys, exp, Ts, None if ws[me] is None else ws, None, expand,
                                         ranks_per_host)[me]
    _same(v["combined_x"], want_x, "combined_x")
    if ws[me] is not None:
        _same(v["combined_topk_weights"], want_w, "combined_topk_weights")
    if "engine_output" in v:
        _same(v["engine_output"], want_x[:v["engine_output"].shape[0]], "the engine's output")
        _close_to_moe(v, me, El, expert)


def _close_to_moe(v, me, El, engine):
    """The engine's output is the MoE layer it computes: per token the sum over its top-k slots of
    ``weight * (e + 1) * x`` (``e``: the global expert id in vLLM's stand-in, the local one in SGLang's), within
    bf16 roundings. This is what makes a field the engine misread show even where the reference agrees with it
    (the combine check above runs the same engine code on both sides)."""
    x, sf = _split(v["all_x"][me])
    idx, w = v["all_idx"][me].long(), v["all_w"][me]
    e = idx if engine == "vllm" else idx % El
    terms = torch.where(idx >= 0, w * (e + 1).float(), torch.zeros_like(w)).unsqueeze(-1) * _dequant(x, sf).unsqueeze(1)
    out = v["engine_output"].float()
    want, bound = terms.sum(1)[:out.shape[0]], terms.abs().sum(1)[:out.shape[0]] * 2e-2 + 1e-2
    bad = ~((out - want).abs() <= bound)
    assert not bad.any(), f"the engine's output is not its MoE layer at {bad.nonzero()[:4].tolist()}"
