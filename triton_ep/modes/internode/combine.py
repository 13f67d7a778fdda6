"""Combine across hosts in internode normal mode: its checked arguments and this host's part (both paths), and
the host path's sum over hosts. Rows are summed inside each host first (the intranode combine: fp32 in ascending
local rank order, rounded once to bf16), cross the network once as bf16 partial sums, and are summed on the source
rank in ascending host order in fp32 (plus the biases), rounded once more to bf16."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from ...config import EventOverlap
from ...kernels import net
from ...protocol import call_card
from ...protocol.records import NetRecord
from ...runtime.checks import check_event
from .handle import CapturePlan, HostPlan
from .records import Streams, record_field, row_sums

Tensor = torch.Tensor


@dataclasses.dataclass
class Combine:
    """A combine's checked arguments (both paths)."""
    plan: Union[HostPlan, CapturePlan]      # the dispatch's plan
    x: Tensor                       # bf16 [N, H]
    topk_weights: Optional[Tensor]  # fp32 [N, K], or None
    hidden: int                     # H
    num_topk: int                   # K (0 without topk_weights)
    biases: tuple                   # bf16 [T, H] each, up to two
    local_started: bool = False     # this rank entered its host's forwarding leg


def sum_over_hosts(leg, prep: Combine, rec: NetRecord, got: Tensor, counts: List[int]) -> tuple:
    """The returned partial sums (``got``, uint8 ``[n, rec.nbytes]``, ``counts[h]`` records from each host)
    summed per source token in ascending host order (fp32, plus the biases), rounded once to bf16."""
    plan, H, K = prep.plan, prep.hidden, prep.num_topk
    dev = prep.x.device
    acc = torch.zeros(plan.num_tokens, H, dtype=torch.float32, device=dev)
    wacc = torch.zeros(plan.num_tokens, K, dtype=torch.float32, device=dev) if K else None
    starts = np.cumsum([0] + counts)
    for h in range(leg.num_hosts):          # ascending host order; each token at most once per host
        t = plan.to_host[h].to(dev)
        blk = got[int(starts[h]):int(starts[h + 1])]
        acc.index_add_(0, t, row_sums(rec, blk, H))
        if K:
            wacc.index_add_(0, t, record_field(rec, blk, "weights", torch.float32))
    for b in prep.biases:
        acc += b.float()
    return (acc.to(torch.bfloat16), wacc, EventOverlap(None))


def combine_args(leg, x, handle, topk_weights, bias, previous_event) -> Combine:
    """Check a combine's arguments (both paths)."""
    check_event(previous_event)
    plan = leg.check_handle(handle)
    N = plan.num_rows
    xv = leg.rt.check_tensor("x", x, (torch.bfloat16,), (N, None), f"N = {N} rows the dispatch delivered")
    H = xv.shape[1]
    wv, K = None, 0
    if topk_weights is not None:
        wv = leg.rt.check_tensor("topk_weights", topk_weights, (torch.float32,), (N, None), f"N = {N} rows")
        K = wv.shape[1]
    biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
    for b in biases:
        leg.rt.check_tensor("bias", b, (torch.bfloat16,), (plan.num_tokens, H), f"T = {plan.num_tokens}, H = {H}")
    return Combine(plan, xv, wv, H, K, biases)


def reduce_in_host(leg, prep: Combine) -> Tuple[Streams, net.Sources]:
    """The intranode combine of this host's rows (per forwarded token: the fp32 sum over the host's ranks,
    rounded to bf16), as record streams to each source host (rows padded to 4 bytes), and the kernels' view of
    the sums they are built from."""
    plan = prep.plan
    rec, src, rows = combine_in_host(leg, prep)
    starts = np.cumsum([0] + plan.from_host)
    tokens = [rows[int(starts[h]):int(starts[h + 1])] for h in range(leg.num_hosts)]
    return Streams(rec, tokens, card=(call_card.COMBINE, prep.hidden, prep.num_topk, plan.seq)), src


def combine_in_host(leg, prep: Combine):
    """The intranode combine of a combine's rows (both paths) back to the rows this rank forwarded (per row:
    the fp32 sum over the host's ranks, rounded to bf16; padded to 4 bytes). Returns their record layout (the
    partial sum, then the weights' sums), the records' sources and the forwarded rows' indices (int64
    ``[F]``, on the device); no host synchronisation."""
    plan, K = prep.plan, prep.num_topk
    inv = torch.empty_like(plan.order)
    inv.scatter_(0, plan.order, torch.arange(plan.num_rows, dtype=torch.int64, device=plan.order.device))
    x_int = prep.x[inv]
    w_int = prep.topk_weights[inv] if K else None
    prep.local_started = True
    comb, comb_w, _ = leg.host_ranks.run(leg.local.combine_steps(x_int, plan.local_handle, w_int))
    if prep.hidden % 2:
        comb = torch.nn.functional.pad(comb, (0, 1))
    rec = NetRecord(2 * comb.shape[1], 0, 0, K, 0)
    rows = torch.arange(comb.shape[0], dtype=torch.int64, device=comb.device)
    return rec, leg.row_sources(rec, comb.shape[0], comb, w=comb_w if K else None), rows
