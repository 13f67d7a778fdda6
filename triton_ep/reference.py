"""Plain-PyTorch semantics of DeepEP V1 normal mode over ``R`` ranks: the oracle every test uses.

Ranks are held as Python lists of per-rank tensors (index = rank). Nothing here is fast; everything
here is meant to be read. The semantics are DeepEP's (``deep_ep.Buffer.get_dispatch_layout``,
``dispatch`` and ``combine`` in normal mode), as docs/design.md section 1 restates them:

- expert ``e`` lives on rank ``e // (E // R)``; ids outside ``[0, E)`` (``-1`` included) select nothing;
- a token goes once to every rank that holds at least one of its experts;
- received rows are grouped by source rank in rank order, in the source's token order within a group;
- combine sums, in fp32 and in ascending rank order, the rows each destination rank returns for
  a token, adds the optional bias, and rounds once to bf16.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor


def _rank_of(topk_idx: Tensor, num_experts: int, num_ranks: int) -> Tensor:
    """``[T, K]`` int64: the rank holding each id, ``-1`` for ids outside ``[0, E)``."""
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids // (num_experts // num_ranks), torch.full_like(ids, -1))


def get_dispatch_layout(topk_idx: Tensor, num_experts: int, num_ranks: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The routing layout of one rank's tokens.

    Args:
        topk_idx: ``[T, K]`` int32 or int64 expert ids; ``-1`` (and any id outside ``[0, E)``) selects nothing.
        num_experts: ``E``, a multiple of ``num_ranks``.
        num_ranks: ``R``.

    Returns:
        ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_expert`` int32 ``[E]`` (duplicate ids inside
        one token counted each time), ``is_token_in_rank`` bool ``[T, R]``.
    """
    ids = topk_idx.long().cpu()
    valid = (ids >= 0) & (ids < num_experts)
    per_expert = torch.bincount(ids[valid], minlength=num_experts).to(torch.int32)
    rank_of = _rank_of(ids, num_experts, num_ranks)
    in_rank = torch.stack([(rank_of == r).any(dim=1) for r in range(num_ranks)], dim=1) if ids.shape[0] else \
        torch.zeros((0, num_ranks), dtype=torch.bool, device="cpu")
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


XLike = Union[Tensor, Tuple[Tensor, Tensor]]


def dispatch(xs: Sequence[XLike], topk_idxs: Sequence[Tensor], topk_weights: Optional[Sequence[Tensor]],
             num_experts: int, expert_alignment: int = 1) -> List[dict]:
    """What ``Buffer.dispatch`` must give on every rank.

    Args:
        xs: per source rank, ``[T_i, H]`` rows of any dtype, or a pair (``[T_i, H]`` rows, ``[T_i, S]`` scales
            of any dtype, width and layout); rows and scales are copied bit for bit (scales row-major).
        topk_idxs: per rank, ``[T_i, K]`` int ids.
        topk_weights: per rank, ``[T_i, K]`` fp32, or ``None``.
        num_experts: ``E``.
        expert_alignment: each per-expert count is rounded up to a multiple of it.

    Returns:
        per receiving rank ``j`` a dict with ``recv_x`` (or ``(recv_x, recv_x_scales)``), ``recv_topk_idx``
        ``[N_j, K]`` of rank ``j``'s ``topk_idx`` dtype (local ids, ``-1`` where the expert lives elsewhere), ``recv_topk_weights`` fp32
        (0 where the id is ``-1``; ``None`` if no weights were given), ``num_recv_tokens_per_expert_list``,
        ``rank_prefix_matrix`` int32 ``[R, R]``, ``recv_src_idx`` int32 ``[N_j]``.
    """
    R = len(xs)
    El = num_experts // R
    pairs = [x if isinstance(x, tuple) else (x, None) for x in xs]
    layouts = [get_dispatch_layout(t, num_experts, R) for t in topk_idxs]
    counts = torch.stack([lay[0] for lay in layouts]).long()           # [R src, R dst]
    prefix = counts.cumsum(0).to(torch.int32)
    out = []
    for j in range(R):
        rows, scales, idx, wts, src = [], [], [], [], []
        for i in range(R):
            sel = layouts[i][2][:, j].nonzero().flatten()
            x_i, s_i = pairs[i]
            rows.append(x_i.cpu()[sel])
            if s_i is not None:
                scales.append(s_i.cpu()[sel])
            ids = topk_idxs[i].long().cpu()[sel]
            on_j = _rank_of(ids, num_experts, R) == j
            idx.append(torch.where(on_j, ids - j * El, torch.full_like(ids, -1)))
            if topk_weights is not None:
                w = topk_weights[i].cpu()[sel]
                wts.append(torch.where(on_j, w, torch.zeros_like(w)))
            src.append(sel.to(torch.int32))
        per_expert = sum(lay[1][j * El:(j + 1) * El].long() for lay in layouts)
        align = max(int(expert_alignment), 1)
        recv_x = torch.cat(rows)
        out.append(dict(
            recv_x=(recv_x, torch.cat(scales)) if scales else recv_x,
            recv_topk_idx=torch.cat(idx).to(topk_idxs[j].dtype),     # DeepEP: the dtype of topk_idx
            recv_topk_weights=torch.cat(wts) if topk_weights is not None else None,
            num_recv_tokens_per_expert_list=[int((c + align - 1) // align * align) for c in per_expert.tolist()],
            rank_prefix_matrix=prefix.clone(),
            recv_src_idx=torch.cat(src),
        ))
    return out


def combine(recv_xs: Sequence[Tensor], dispatched: Sequence[dict], num_tokens: Sequence[int],
            recv_topk_weights: Optional[Sequence[Tensor]] = None,
            biases: Optional[Sequence[Sequence[Tensor]]] = None,
            ranks_per_host: Optional[int] = None) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """What ``Buffer.combine`` must give on every rank.

    Args:
        recv_xs: per rank ``j``, ``[N_j, H]`` bf16 rows in the order ``dispatch`` delivered them.
        dispatched: per rank, the dict :func:`dispatch` returned (its ``rank_prefix_matrix`` and ``recv_src_idx``).
        num_tokens: ``T_i`` per source rank.
        recv_topk_weights: per rank ``[N_j, K]`` fp32 to be summed back the same way, or ``None``.
        biases: per source rank, a sequence of ``[T_i, H]`` bf16 tensors added after the sum.
        ranks_per_host: ``n`` to model internode mode's two-level sum (hosts of ranks ``[0, n)``, ``[n, 2n)``,
            ...): per host, the fp32 sum over its ranks in ascending order rounded to bf16 (weights: kept in
            fp32), then the fp32 sum of those partials over hosts in ascending order, plus the biases, rounded
            once more. ``None``: one level.

    Returns:
        per source rank ``(combined_x bf16 [T_i, H], combined_topk_weights fp32 [T_i, K] or None)``: the fp32
        sum, over destination ranks in ascending order, of the rows returned for each token, plus the biases
        (in order), rounded once to bf16.
    """
    R = len(recv_xs)
    H = recv_xs[0].shape[1]
    n = ranks_per_host or R
    results = []
    for i in range(R):
        acc = torch.zeros((num_tokens[i], H), dtype=torch.float32, device="cpu")
        wacc = None
        if recv_topk_weights is not None:
            wacc = torch.zeros((num_tokens[i], recv_topk_weights[0].shape[1]), dtype=torch.float32, device="cpu")
        for h0 in range(0, R, n):
            part, wpart = torch.zeros_like(acc), None if wacc is None else torch.zeros_like(wacc)
            for j in range(h0, h0 + n):
                m = dispatched[j]["rank_prefix_matrix"].long()
                lo = int(m[i - 1, j]) if i > 0 else 0
                hi = int(m[i, j])
                src = dispatched[j]["recv_src_idx"][lo:hi].long()
                part[src] += recv_xs[j].cpu()[lo:hi].float()
                if wpart is not None:
                    wpart[src] += recv_topk_weights[j].cpu()[lo:hi].float()
            acc += part.to(torch.bfloat16).float() if ranks_per_host else part
            if wacc is not None:
                wacc += wpart
        for b in (biases[i] if biases is not None else ()):
            acc += b.cpu().float()
        results.append((acc.to(torch.bfloat16), wacc))
    return results


# ---------------------------------------------------------------------------------------------------------------
# LogFMT-10: the encoding of a low-latency combine with use_logfmt=True (DeepEP's LogFMT-10 size; docs/low_latency.md)
#
# Blocks of magnitude under 1 are coded by the log of their magnitudes as DeepEP codes them; DeepEP sends the
# others as bf16 (their group of 512 or 1024 channels), which would not fit a record of this size: here they are
# coded linearly against their largest magnitude (10 bits a channel too).
#
# A row of H bf16 channels (H % 128 == 0) becomes H / 128 scale words, then 40 words per block of 128 channels:
# the low bytes of the 9-bit codes (4 a word, channel c at bits 8 (c % 4) of word c // 4), their ninth bits and
# their signs (channel c at bit c % 32 of word c // 32 of each 4-word plane). Every step below is one fp32
# operation rounded to nearest (no fused multiply-add), so any implementation that makes the same steps gets the
# same bits.

def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32, device="cpu"))


_LOGFMT_LOG2 = torch.tensor([math.log2(1 + m / 128) for m in range(128)], dtype=torch.float64,
                            device="cpu").to(torch.float32)
_LOGFMT_STEP = _f32(1 / 510)
_LOGFMT_ROUND = _f32(math.log(2) / 8)
_LOGFMT_EXP2 = [_f32(math.log(2) ** k / math.factorial(k)) for k in range(8)]


def _logfmt_log2(m: Tensor) -> Tensor:
    """fp32 log2 of bf16 magnitudes given by their bits ``m`` (int32, normal, finite): exponent + table."""
    return ((m >> 7) - 127).to(torch.float32) + _LOGFMT_LOG2[(m & 127).long()]


def _logfmt_scale(amax: Tensor, amin: Tensor) -> Tuple[Tensor, Tensor]:
    """A block's ``(lmin, s)``: ``lmax = log2(amax)``, ``lmin = max(log2(amin), lmax - 32)`` (``lmax - 32``
    where ``amin`` is 0), ``s = (lmax - lmin) / 510`` (times fp32(1/510))."""
    lmax = _logfmt_log2(amax.clamp_min(0x80))
    lmin = torch.maximum(_logfmt_log2(amin.clamp_min(0x80)), lmax - 32.0)
    lmin = torch.where(amin == 0, lmax - 32.0, lmin)
    return lmin, (lmax - lmin) * _LOGFMT_STEP


def _logfmt_log_mode(amax: Tensor, amin: Tensor) -> Tensor:
    """Blocks coded by the log of their magnitudes: ``amax < 1`` and ``amin < amax`` (DeepEP's LogFMT condition,
    ``log2(amax) < 0`` and ``lmin < lmax``); the others are coded linearly."""
    return (amax < 0x3F80) & (amin < amax)


def logfmt_encode(x: Tensor) -> Tensor:
    """LogFMT-10 records of the rows ``x`` (bf16 ``[M, H]``, ``H % 128 == 0``): int32 ``[M, 41 * H / 128]``.

    Per block of 128 channels: magnitudes of exponent 0 count as 0; the scale word holds the bf16 bits of the
    largest magnitude ``amax`` (low half) and the smallest ``amin`` (high half). A block with ``amax < 1`` and
    ``amin < amax`` (:func:`_logfmt_log_mode`) codes a channel, with ``(lmin, s)`` of :func:`_logfmt_scale`, as
    ``min(floor(max((log2|x| - lmin) * (1 / s) + r, 0)), 511)``, ``r = 1.5 - s * ln2 / 8``; any other block as
    ``min(floor(|x| * (511 / amax) + 0.5), 511)`` (divisions correctly rounded); a zero channel as 0. The sign
    bit is the bf16 sign bit."""
    M, H = x.shape
    nb = H // 128
    bits = (x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF).view(M, nb, 128)
    mag = bits & 0x7FFF
    mag = torch.where(mag < 0x80, torch.zeros_like(mag), mag)
    amax, amin = mag.amax(-1), mag.amin(-1)
    lmin, s = _logfmt_scale(amax, amin)
    inv = torch.where(s > 0, torch.div(torch.ones_like(s), torch.where(s > 0, s, torch.ones_like(s))),
                      torch.zeros_like(s))
    r = 1.5 - s * _LOGFMT_ROUND
    u = (_logfmt_log2(mag.clamp_min(0x80)) - lmin[..., None]) * inv[..., None] + r[..., None]
    lcode = u.clamp_min(0.0).floor().clamp_max(511.0)
    finite = (amax > 0) & (amax < 0x7F80)
    af = torch.where(finite, (amax << 16).view(torch.float32), torch.ones_like(s))
    linv = torch.where(finite, torch.div(torch.full_like(af, 511.0), af), torch.zeros_like(af))
    xf = torch.where(mag < 0x7F80, (mag << 16).view(torch.float32), torch.zeros_like(u))
    ncode = (xf * linv[..., None] + 0.5).floor().clamp_max(511.0)
    code = torch.where(_logfmt_log_mode(amax, amin)[..., None], lcode, ncode).to(torch.int32)
    code = torch.where(mag == 0, torch.zeros_like(code), code)

    def pack(v: Tensor, per_word: int, width: int) -> Tensor:     # [M, nb, 128] -> [M, nb, 128 / per_word]
        shifts = torch.arange(per_word, dtype=torch.int64, device=v.device) * width
        return ((v.long().view(M, nb, 128 // per_word, per_word) << shifts).sum(-1) & 0xFFFFFFFF)

    planes = torch.cat([pack(code & 255, 4, 8), pack(code >> 8, 32, 1), pack(bits >> 15, 32, 1)], dim=-1)
    planes = torch.where(planes >= 2 ** 31, planes - 2 ** 32, planes).to(torch.int32)
    meta = (amax | (amin << 16)).to(torch.int32)
    return torch.cat([meta, planes.view(M, nb * 40)], dim=1)


def _logfmt_exp2(y: Tensor) -> Tensor:
    """``2 ** y`` (fp32): ``2 ** f``, ``f = y - floor(y + 0.5)``, by the Horner form of its degree-7 Taylor
    polynomial, times ``2 ** a * 2 ** b`` (``a = floor(n / 2)``, ``b = n - a``); 0 where ``y < -126``."""
    n = (y + 0.5).floor()
    f = y - n
    c = _LOGFMT_EXP2
    p = f * c[7]
    for k in (6, 5, 4, 3, 2, 1):
        p = (p + c[k]) * f
    p = p + 1.0
    ni = n.to(torch.int32)
    a = torch.div(ni, 2, rounding_mode="floor")
    b = ni - a
    v = (p * ((a + 127) << 23).view(torch.float32)) * ((b + 127) << 23).view(torch.float32)
    return torch.where(y < -126.0, torch.zeros_like(v), v)


def logfmt_decode(records: Tensor, hidden: int) -> Tensor:
    """The fp32 values ``[M, hidden]`` of LogFMT-10 records (int32 ``[M, >= 41 * hidden / 128]``,
    :func:`logfmt_encode`'s): code 0 is 0, code 511 the block's ``amax``, code ``c`` otherwise
    ``2 ** ((c - 1) * s + lmin)`` (0 below ``2 ** -126``) in a log-coded block, ``c * (amax / 511)`` in a
    linear one; negated where the sign bit is set; NaN in every channel of a block whose ``amax`` is not
    finite."""
    M = records.shape[0]
    nb = hidden // 128
    rec = records[:, :41 * nb].long() & 0xFFFFFFFF
    meta = rec[:, :nb]
    amax, amin = (meta & 0xFFFF).to(torch.int32), ((meta >> 16) & 0xFFFF).to(torch.int32)
    lmin, s = _logfmt_scale(amax, amin)
    planes = rec[:, nb:].view(M, nb, 40)
    ch = torch.arange(128, dtype=torch.int64, device=records.device)
    code = (planes[:, :, ch // 4] >> (ch % 4 * 8)) & 255
    code = (code | (((planes[:, :, 32 + ch // 32] >> (ch % 32)) & 1) << 8)).to(torch.int32)
    neg = ((planes[:, :, 36 + ch // 32] >> (ch % 32)) & 1) != 0
    top = (amax << 16).view(torch.float32)
    vlog = _logfmt_exp2((code - 1).to(torch.float32) * s[..., None] + lmin[..., None])
    vlin = code.to(torch.float32) * torch.div(top, torch.full_like(top, 511.0))[..., None]
    v = torch.where(_logfmt_log_mode(amax, amin)[..., None], vlog, vlin)
    v = torch.where(code == 511, top[..., None].expand_as(v), v)
    v = torch.where(code == 0, torch.zeros_like(v), v)
    v = torch.where(neg, -v, v)
    v = torch.where((amax >= 0x7F80)[..., None], torch.full_like(v, float("nan")), v)
    return v.reshape(M, hidden)


def logfmt_round_trip(x: Tensor) -> Tensor:
    """fp32 ``[M, H]``: the values a low-latency combine with ``use_logfmt=True`` reduces for the rows ``x``
    (bf16 ``[M, H]``): ``logfmt_decode(logfmt_encode(x))``. The combine then sums ``w[t, k] * value`` in fp32 in
    ascending ``k`` (one multiply, then one add) and rounds once to bf16, as without LogFMT."""
    return logfmt_decode(logfmt_encode(x), x.shape[1])


# ---------------------------------------------------------------------------------------------------------------
# DeepEP V2's ElasticBuffer (deep_ep/buffers/elastic.py and its kernels, commit dd758ca): dispatch and combine in its
# two layouts. Non-expanded: one row per (token, destination rank), as V1's normal mode above. Expanded: one row per
# (token, local expert) entry, each local expert's entries contiguous in (received row, top-k slot) order, expert
# e's segment starting at the sum of the earlier experts' counts each rounded up to expert_alignment. Receive order:
# by source rank, then source token (V2's deterministic order). Where V2's source leaves a value open (padding rows,
# weights of experts elsewhere, the reduction order), the choice is the one docs/api_v1_v2.md lists.


def _pad_rows(t: Tensor, rows: int, fill: int = 0) -> Tensor:
    """``t`` (``[n, ...]``) followed by ``rows - n`` rows of ``fill`` (zero bits by default)."""
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device="cpu")
    return torch.cat([t, pad.fill_(fill) if fill else pad])


def elastic_dispatch(xs: Sequence[XLike], topk_idxs: Sequence[Tensor], topk_weights: Optional[Sequence[Tensor]],
                     num_experts: int, num_max_tokens_per_rank: int, expert_alignment: int = 1,
                     do_expand: bool = False, do_cpu_sync: bool = True) -> List[dict]:
    """What ``ElasticBuffer.dispatch`` must give on every rank.

    Args:
        xs, topk_idxs, topk_weights, num_experts: as :func:`dispatch` (rows, or (rows, scales) pairs, per rank).
        num_max_tokens_per_rank: ``N_max``: the worst case is ``R * N_max`` received tokens, and a token's global
            index is ``src_rank * N_max + src_token``.
        expert_alignment: each local expert's count rounded up to a multiple of it.
        do_expand: the expanded layout. do_cpu_sync: exact sizes (else the worst case, padded).

    Returns:
        per rank a dict: ``recv_x`` (or ``(rows, scales)``), ``recv_topk_idx`` (``None`` expanded),
        ``recv_topk_weights`` (``[rows, K]``, or ``[rows]`` expanded; ``None`` without weights),
        ``num_recv_tokens``, ``num_expanded_tokens``, ``num_recv_tokens_per_expert_list`` (aligned counts, ``[]``
        without ``do_cpu_sync``), ``psum_num_recv_tokens_per_scaleup_rank`` int32 ``[R]``,
        ``psum_num_recv_tokens_per_expert`` int32 ``[E_l]``, ``num_unaligned_recv_tokens_per_expert`` int32 ``[E_l]``,
        ``recv_src_metadata`` int32 ``[N, K + 2]``, and ``v1``: :func:`dispatch`'s dict for the same call. Padding
        rows (worst case, alignment gaps): x and scales 0, ids -1, weights 0, metadata -1.
    """
    R = len(xs)
    align = max(int(expert_alignment), 1)
    v1 = dispatch(xs, topk_idxs, topk_weights, num_experts, align)
    return [_elastic_rank(d, j, R, num_experts // R, num_max_tokens_per_rank, align, do_expand, do_cpu_sync)
            for j, d in enumerate(v1)]


def _elastic_rank(d: dict, j: int, R: int, El: int, N_max: int, align: int, do_expand: bool,
                  do_cpu_sync: bool) -> dict:
    """Rank ``j``'s :func:`elastic_dispatch` dict, from its V1 :func:`dispatch` dict ``d`` (``El`` local experts,
    ``N_max`` tokens per rank at most)."""
    rows, scales = d["recv_x"] if isinstance(d["recv_x"], tuple) else (d["recv_x"], None)
    idx, w = d["recv_topk_idx"], d["recv_topk_weights"]
    n_real, K = idx.shape
    N = n_real if do_cpu_sync else R * N_max
    idx = _pad_rows(idx, N, -1)
    unaligned = torch.tensor([int((idx == e).sum()) for e in range(El)], dtype=torch.int64, device="cpu")
    aligned = (unaligned + align - 1) // align * align
    if do_cpu_sync:
        n_exp = int(aligned.sum())
    else:
        per_row = K if El < K else min(K, El)
        n_exp = (R * N_max * per_row + (align - 1) * El + align - 1) // align * align
    m = d["rank_prefix_matrix"][:, j].long()
    meta = _elastic_metadata(d, m, idx[:n_real], N, N_max)
    res = dict(v1=d, num_recv_tokens=N, num_expanded_tokens=n_exp,
               num_recv_tokens_per_expert_list=[int(c) for c in aligned] if do_cpu_sync else [],
               psum_num_recv_tokens_per_scaleup_rank=m.to(torch.int32),
               num_unaligned_recv_tokens_per_expert=unaligned.to(torch.int32), recv_src_metadata=meta)
    if not do_expand:
        res.update(recv_x=(_pad_rows(rows, N, 0), _pad_rows(scales, N, 0)) if scales is not None
                   else _pad_rows(rows, N, 0),
                   recv_topk_idx=idx, recv_topk_weights=None if w is None else _pad_rows(w, N, 0),
                   psum_num_recv_tokens_per_expert=torch.cumsum(aligned, 0).to(torch.int32))
        return res
    x_exp, s_exp, w_exp = _expanded(rows, scales, w, idx[:n_real], aligned, n_exp, meta)
    res.update(recv_x=(x_exp, s_exp) if s_exp is not None else x_exp, recv_topk_idx=None, recv_topk_weights=w_exp,
               psum_num_recv_tokens_per_expert=(torch.cumsum(aligned, 0) - aligned + unaligned).to(torch.int32))
    return res


def _elastic_metadata(d: dict, m: Tensor, idx: Tensor, N: int, N_max: int) -> Tensor:
    """int32 ``[N, K + 2]``: per received token (``idx``: its ``[n, K]`` local ids, ``m``: the rows received from
    ranks ``0..i``), the source's global index ``src_rank * N_max + src_token`` and ``src_rank * K + k0`` (``k0``
    its first slot with a local expert); the slots' expanded rows stay ``-1`` (:func:`_expanded` writes them), as
    do padding rows."""
    n_real, K = idx.shape
    src_rank = torch.tensor([int((m <= n).sum()) for n in range(n_real)], dtype=torch.int64, device="cpu")
    src_tok = d["recv_src_idx"].long()
    first = torch.tensor([next(k for k in range(K) if idx[n, k] >= 0) for n in range(n_real)],
                         dtype=torch.int64, device="cpu")
    meta = torch.full((N, K + 2), -1, dtype=torch.int32, device="cpu")
    meta[:n_real, 0] = (src_rank * N_max + src_tok).to(torch.int32)
    meta[:n_real, 1] = (src_rank * K + first).to(torch.int32)
    return meta


def _expanded(rows: Tensor, scales: Optional[Tensor], w: Optional[Tensor], idx: Tensor, aligned: Tensor, n_exp: int,
              meta: Tensor) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The expanded layout of ``n_exp`` rows: expert ``e``'s entries of ``idx`` (``[n, K]`` local ids) in (row, slot)
    order from the sum of the earlier experts' ``aligned`` counts; ``(rows, scales or None, weights fp32 [n_exp] or
    None)``, zero elsewhere. Writes each entry's row into ``meta[:, 2:]``."""
    n_real, K = idx.shape
    x_exp = torch.zeros((n_exp, *rows.shape[1:]), dtype=rows.dtype, device="cpu")
    s_exp = None if scales is None else torch.zeros((n_exp, scales.shape[1]), dtype=scales.dtype, device="cpu")
    w_exp = None if w is None else torch.zeros(n_exp, dtype=torch.float32, device="cpu")
    start = 0
    for e in range(aligned.shape[0]):
        row = start
        for n in range(n_real):
            for k in range(K):
                if int(idx[n, k]) == e:
                    x_exp[row] = rows[n]
                    if s_exp is not None:
                        s_exp[row] = scales[n]
                    if w_exp is not None:
                        w_exp[row] = w[n, k]
                    meta[n, 2 + k] = row
                    row += 1
        start += int(aligned[e])
    return x_exp, s_exp, w_exp


def elastic_combine(ys: Sequence[Tensor], dispatched: Sequence[dict], num_tokens: Sequence[int],
                    topk_weights: Optional[Sequence[Tensor]] = None, biases: Optional[Sequence[Sequence[Tensor]]] = None,
                    do_expand: bool = False, ranks_per_host: Optional[int] = None
                    ) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """What ``ElasticBuffer.combine`` must give on every rank.

    Args:
        ys: per rank, bf16 rows in the dispatch's layout (``[N, H]``, or ``[num_expanded_tokens, H]`` expanded).
        dispatched: per rank, :func:`elastic_dispatch`'s dict.
        num_tokens: ``T_i`` per source rank.
        topk_weights: per rank, fp32 ``[N, K]`` (``[num_expanded_tokens]`` expanded), or ``None``.
        biases: per source rank, up to two bf16 ``[T_i, H]`` tensors.
        do_expand: the dispatch's layout. ranks_per_host: as :func:`combine` (the two-level sum across hosts).

    Returns:
        per source rank ``(combined_x bf16 [T_i, H], combined_topk_weights fp32 [T_i, K] or None)``. Expanded: each
        rank first sums in fp32, in top-k slot order from 0, the rows of each received token and rounds to bf16.
        Then, as :func:`combine`: the fp32 sum over ranks in ascending order (two levels across hosts), plus the
        biases, rounded once. Weights: slot ``k`` of token ``t`` gets the value the rank holding expert
        ``topk_idx[t, k]`` returned for it (those of the other ranks are 0), 0 where the id is -1.
    """
    rows, ws = [], []
    for j, d in enumerate(dispatched):
        n_real = d["v1"]["recv_topk_idx"].shape[0]
        idx = d["v1"]["recv_topk_idx"]
        K = idx.shape[1]
        y, w = ys[j].cpu(), None if topk_weights is None else topk_weights[j].cpu()
        if do_expand:
            slots = d["recv_src_metadata"][:n_real, 2:].long()
            acc = torch.zeros((n_real, y.shape[1]), dtype=torch.float32, device="cpu")
            for k in range(K):
                for n in range(n_real):
                    if slots[n, k] >= 0:
                        acc[n] += y[slots[n, k]].float()
            y = acc.to(torch.bfloat16)
            if w is not None:
                w = torch.where(slots >= 0, w[slots.clamp(min=0)], torch.zeros((n_real, K), dtype=torch.float32,
                                                                              device="cpu"))
        else:
            y = y[:n_real]
            if w is not None:
                w = torch.where(idx >= 0, w[:n_real], torch.zeros((n_real, K), dtype=torch.float32, device="cpu"))
        rows.append(y)
        ws.append(w)
    return combine(rows, [d["v1"] for d in dispatched], num_tokens, None if topk_weights is None else ws, biases,
                   ranks_per_host)
