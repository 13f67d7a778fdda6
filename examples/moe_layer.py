"""A DeepSeek-V3-style MoE layer across R ranks, through triton-ep's DeepEP-compatible API.

What it shows
    Each rank holds ``T`` tokens. Their rows are embeddings of real English text (the help topics
    that ship with Python, ``pydoc_data.topics``), so word frequencies are Zipf-like and expert load
    is uneven as in a real model. Routing is DeepSeek-V3's gate: sigmoid affinities, a per-expert
    bias that steers selection only, group-limited top-k (experts in ``G`` groups, the best
    ``topk_groups`` groups by the sum of their two best scores, then top-k inside them), weights taken
    from the un-biased scores, normalised over the chosen experts and scaled by 2.5. Experts are small
    SwiGLU FFNs, ``E / R`` per rank. The layer runs the way a vLLM / SGLang user of DeepEP V1 runs it:

        import triton_ep as deep_ep
        buf = deep_ep.Buffer(group, num_nvl_bytes=hint, num_rdma_bytes=0)
        ... = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buf.dispatch(x, ...)
        expert_out = <local experts on recv_x, weighted by recv_topk_weights>        # bf16
        out, _, _ = buf.combine(expert_out, handle)

    and compares ``out`` with a dense single-process computation of the same layer on the same
    tokens (fp32, all experts' weights replicated on every rank): ``max_rel_err`` is
    ``||out - ref|| / ||ref||`` over the whole output of all ranks, and ``ok`` is
    ``max_rel_err <= 1e-2``. It also checks that the per-expert counts the library reports equal the
    histogram of the routing (``counts_ok``), prints the expert-load imbalance, and times ``dispatch``
    and ``combine`` (median of ``--iters`` calls after a warm-up). Bandwidth is DeepEP's measure:
    bytes a rank receives in dispatch (sends back in combine) over the call's time.

How to run
    ./run.sh python examples/moe_layer.py                # starts its own ranks
    ./run.sh python examples/moe_layer.py --ranks 2 --tokens 32
    torchrun --nproc-per-node 8 examples/moe_layer.py    # or let torchrun start them

    On CPU (no GPU visible, or ``--device cpu``) the defaults are 4 ranks and small sizes that finish
    in well under a minute (the kernels run under the Triton interpreter). On a GPU the defaults are
    DeepSeek-V3's shapes: hidden 7168, 256 experts, top-8, 8 groups with top-4 groups, 4096 tokens
    per rank, 8 ranks (tokens are halved until the estimated memory fits). Ranks use NCCL only when
    each has a GPU of its own; ranks sharing a GPU (NCCL refuses that) and CPU ranks use gloo. When
    ranks share one GPU the timings measure the GPU's time-slicing between processes, not bandwidth;
    the output says so.

Output: informational lines, then, as the last line of stdout, one JSON object (ranks,
tokens_per_rank, hidden, num_experts, topk, device, max_rel_err, dispatch_ms, combine_ms,
dispatch_GBps, combine_GBps, ok, note, ...). The exit status is 0 exactly when ``ok`` and
``counts_ok`` hold; a failing or stuck rank makes it nonzero (``--timeout`` bounds the run).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("triton_ep") is None:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
import _launch  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
from triton_ep.argtypes import non_negative_int, positive_int, seconds  # noqa: E402

ROUTED_SCALING = 2.5  # DeepSeek-V3's routed_scaling_factor
TOLERANCE = 1e-2

# Defaults per device kind; flags given on the command line win.
DEFAULTS = {
    "cpu": dict(ranks=4, tokens=128, hidden=256, experts=32, topk=4, groups=4, topk_groups=2,
                intermediate=64, iters=3, timeout=300.0),
    "cuda": dict(ranks=8, tokens=4096, hidden=7168, experts=256, topk=8, groups=8, topk_groups=4,
                 intermediate=256, iters=10, timeout=600.0),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda when a GPU is visible (auto), else cpu")
    p.add_argument("--ranks", type=positive_int, help="ranks to start (ignored under torchrun)")
    p.add_argument("--tokens", type=non_negative_int, help="tokens per rank")
    p.add_argument("--hidden", type=positive_int, help="hidden size H, a multiple of 8")
    p.add_argument("--experts", type=positive_int, help="routed experts E (a multiple of ranks and groups)")
    p.add_argument("--topk", type=positive_int, help="experts per token K")
    p.add_argument("--groups", type=positive_int, help="expert groups G")
    p.add_argument("--topk-groups", type=positive_int, help="groups a token may route to")
    p.add_argument("--intermediate", type=positive_int, help="SwiGLU intermediate size of one expert")
    p.add_argument("--iters", type=positive_int, help="timed dispatch and combine calls (median reported)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed calls before the timed ones")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--timeout", type=seconds, help="seconds: bound on the whole run and on every "
                   "collective of the process group")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if _launch.launched_externally():
        a.ranks = int(os.environ["WORLD_SIZE"])
    check_shapes(p, a)
    return a


def check_shapes(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.experts % a.ranks:
        p.error(f"--experts {a.experts} must be a multiple of the ranks ({a.ranks})")
    if a.experts % a.groups or not 1 <= a.topk_groups <= a.groups:
        p.error(f"--experts {a.experts} must split into --groups {a.groups}, and 1 <= --topk-groups <= groups")
    if not 1 <= a.topk <= a.topk_groups * (a.experts // a.groups):
        p.error(f"--topk {a.topk} must be at least 1 and at most the experts in the chosen groups")
    if a.hidden % 8:
        p.error(f"--hidden {a.hidden} must be a multiple of 8 (16-byte bf16 rows)")


# ---------------------------------------------------------------- inputs: real text, embedded

def corpus_words() -> tuple[list[str], str]:
    """English words of a text that ships with Python, in reading order, and the text's name."""
    try:
        from pydoc_data.topics import topics
        text, name = " ".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"
    except ImportError:  # a stripped Python: the docstrings of its standard modules instead
        text = " ".join(m.__doc__ or "" for m in (argparse, collections, json, re, statistics, torch))
        name = "stdlib docstrings"
    return re.findall(r"[a-z]+", text.lower()), name


def text_tokens(a: argparse.Namespace, rank: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """This rank's ``T`` rows: a passage of real text, each word's (seeded) embedding plus noise."""
    words, name = corpus_words()
    freq = collections.Counter(words)
    vocab = {w: i for i, w in enumerate(sorted(freq, key=lambda w: (-freq[w], w)))}
    start = torch.randint(len(words), (1,), generator=torch.Generator().manual_seed(a.seed)).item()
    pos = [(start + rank * a.tokens + i) % len(words) for i in range(a.tokens)]
    ids = torch.tensor([vocab[words[i]] for i in pos], dtype=torch.int64, device=device)
    table = torch.randn(len(vocab), a.hidden, dtype=torch.float32, device=device,
                        generator=torch.Generator(device).manual_seed(a.seed + 1))
    noise = torch.randn(a.tokens, a.hidden, dtype=torch.float32, device=device,
                        generator=torch.Generator(device).manual_seed(a.seed + 1000 + rank))
    return (table[ids] + 0.1 * noise).to(torch.bfloat16), name


# ---------------------------------------------------------------- the layer's weights and math

class MoEWeights:
    """Gate, bias and all experts' SwiGLU weights, seeded: identical on every rank."""

    def __init__(self, a: argparse.Namespace, device: torch.device) -> None:
        g = torch.Generator(device).manual_seed(a.seed + 2)
        E, H, I = a.experts, a.hidden, a.intermediate

        def randn(*shape, scale):
            return torch.randn(*shape, dtype=torch.float32, device=device, generator=g) * scale

        self.gate = randn(E, H, scale=H ** -0.5)
        self.bias = randn(E, scale=0.1)  # DeepSeek-V3's e_score_correction_bias
        self.w1 = torch.empty(E, I, H, dtype=torch.bfloat16, device=device)  # gate projection
        self.w3 = torch.empty(E, I, H, dtype=torch.bfloat16, device=device)  # up projection
        self.w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)  # down projection
        for e in range(E):  # expert by expert: no fp32 copy of all weights at once
            self.w1[e] = randn(I, H, scale=H ** -0.5)
            self.w3[e] = randn(I, H, scale=H ** -0.5)
            self.w2[e] = randn(H, I, scale=I ** -0.5)

    def ffn(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (global id) on fp32 rows ``x``, computed in fp32 from the bf16 weights."""
        h = F.silu(x @ self.w1[e].float().T) * (x @ self.w3[e].float().T)
        return h @ self.w2[e].float().T


def route(x: torch.Tensor, w: MoEWeights, a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc gate: ``topk_idx`` int64 ``[T, K]`` and ``topk_weights`` fp32 ``[T, K]``."""
    T = x.shape[0]
    scores = torch.sigmoid(x.float() @ w.gate.T)                      # [T, E] affinities
    choice = scores + w.bias                                          # the bias steers selection only
    per_group = choice.view(T, a.groups, a.experts // a.groups)
    group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)   # [T, G]
    best_groups = group_score.topk(a.topk_groups, dim=-1).indices
    group_mask = torch.zeros(T, a.groups, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(a.experts // a.groups, dim=1), float("-inf"))
    topk_idx = choice.topk(a.topk, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    weights = weights / weights.sum(-1, keepdim=True) * ROUTED_SCALING
    return topk_idx.to(torch.int64), weights.to(torch.float32)


def apply_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: MoEWeights,
                  first: int, count: int) -> torch.Tensor:
    """fp32 ``[T, H]``: row t is sum over k of ``weights[t, k] * FFN_{first + idx[t, k]}(x[t])``, over
    the entries with ``0 <= idx < count`` (experts ``first .. first + count - 1``); -1 contributes 0."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    rows, slots = ((idx >= 0) & (idx < count)).nonzero(as_tuple=True)
    experts = idx[rows, slots]
    order = torch.argsort(experts, stable=True)
    rows, slots = rows[order], slots[order]
    bounds = torch.bincount(experts, minlength=count).cumsum(0).tolist()
    for e, (lo, hi) in enumerate(zip([0] + bounds, bounds)):
        if hi > lo:
            r, s = rows[lo:hi], slots[lo:hi]
            out.index_add_(0, r, w.ffn(first + e, x[r].float()) * weights[r, s, None])
    return out


# ---------------------------------------------------------------- ranks, devices, timing

def pick_device(a: argparse.Namespace) -> tuple[torch.device, str, int]:
    """This rank's device, the process group's backend, and how many ranks share its GPU."""
    if a.device == "cpu":
        return torch.device("cpu"), "gloo", 1
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", a.ranks))
    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % ngpu)
    torch.cuda.set_device(device)
    sharing = -(-local_world // ngpu)
    return device, ("nccl" if sharing == 1 else "gloo"), sharing


def fit_tokens(a: argparse.Namespace, hint_bytes: int, sharing: int) -> int:
    """Tokens per rank, halved until the estimated memory of the ranks sharing a GPU fits in 85% of
    its free memory: replicated experts, the buffer, the inputs and outputs, the worst-case receive
    (every token of every rank) with the expert outputs for it."""
    tokens = a.tokens
    free = torch.cuda.mem_get_info()[0]

    def need(t):
        per_rank = (3 * a.experts * a.intermediate * a.hidden * 2 + hint_bytes
                    + t * a.hidden * (2 + 4 + 4 + 4) + a.ranks * t * a.hidden * (2 + 2 + 4 + 4))
        return sharing * per_rank

    while tokens > 1 and need(tokens) > 0.85 * free:
        tokens //= 2
    return tokens


def timed(fn, iters: int, warmup: int, device: torch.device, group) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, all ranks starting each call together."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + iters):
        sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def all_reduce_cpu(values: list[float] | torch.Tensor, op=dist.ReduceOp.SUM, device=None) -> torch.Tensor:
    """All-reduce a small fp64 vector (on the backend's device: NCCL needs CUDA tensors)."""
    t = torch.as_tensor(values, dtype=torch.float64).to(device or "cpu")
    dist.all_reduce(t, op=op)
    return t.cpu()


# ---------------------------------------------------------------- one rank

@dataclasses.dataclass
class Rank:
    """This process's place in the run."""
    rank: int                       # its rank in the group
    world: int                      # ranks in the group (R)
    device: torch.device            # where its tensors live
    backend: str                    # the process group's backend: nccl, or gloo (CPU, or ranks sharing a GPU)
    sharing: int                    # ranks per GPU
    group: object                   # the process group
    reduce_device: object           # where the small all-reduces run (NCCL needs CUDA tensors; None: CPU)


def open_rank(a: argparse.Namespace) -> Rank:
    """Join the process group (``RANK``, ``WORLD_SIZE`` from the environment) on the device ``a`` picks."""
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, backend, sharing = pick_device(a)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // R))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=a.timeout))
    return Rank(rank, R, device, backend, sharing, dist.group.WORLD, device if backend == "nccl" else None)


def rank_main(a: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    me = open_rank(a)
    rank, R, device = me.rank, me.world, me.device
    import triton_ep as deep_ep

    hidden_bytes = a.hidden * 2
    hint = max(deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R),
               deep_ep.Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden_bytes, R))
    requested_tokens = a.tokens
    if device.type == "cuda":
        plan = [fit_tokens(a, hint, me.sharing) if rank == 0 else None]
        dist.broadcast_object_list(plan, src=0)
        a.tokens = plan[0]

    weights = MoEWeights(a, device)
    x, corpus = text_tokens(a, rank, device)
    topk_idx, topk_weights = route(x, weights, a)

    buf = deep_ep.Buffer(me.group, num_nvl_bytes=hint, num_rdma_bytes=0)
    layout = buf.get_dispatch_layout(topk_idx, a.experts)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                            topk_weights=topk_weights)

    recv_x, recv_topk_idx, recv_topk_weights, recv_counts, handle, _ = dispatch()
    E_local = a.experts // R
    expert_out = apply_experts(recv_x, recv_topk_idx, recv_topk_weights, weights,
                               rank * E_local, E_local).to(torch.bfloat16)
    out, _, _ = buf.combine(expert_out, handle)
    check = check_layer(me, a, x, out, topk_idx, topk_weights, weights, layout, recv_x, recv_counts)

    layout_ms = timed(lambda: buf.get_dispatch_layout(topk_idx, a.experts), a.iters, a.warmup, device, me.group)
    dispatch_ms = timed(dispatch, a.iters, a.warmup, device, me.group)
    combine_ms = timed(lambda: buf.combine(expert_out, handle), a.iters, a.warmup, device, me.group)
    recv_bytes = recv_x.shape[0] * hidden_bytes  # DeepEP's measure: bf16 rows a rank receives (sends back)
    worst = all_reduce_cpu([layout_ms, dispatch_ms, combine_ms], dist.ReduceOp.MAX, me.reduce_device).tolist()
    gbps = all_reduce_cpu([recv_bytes / dispatch_ms / 1e6, recv_bytes / combine_ms / 1e6],
                          device=me.reduce_device).div(R).tolist()

    buf.destroy()
    dist.barrier(group=me.group)
    if rank == 0:
        report(me, a, corpus, check, worst, gbps, requested_tokens, t_start)
    dist.destroy_process_group()
    return 0 if (check.max_rel_err <= TOLERANCE and check.counts_ok) else 1


@dataclasses.dataclass
class Check:
    """The layer's result against the dense reference, and the library's counts against the routing's."""
    max_rel_err: float              # ||out - ref|| / ||ref|| over every rank (fp32 reference)
    counts_ok: bool                 # per-expert and per-rank counts match the routing's histograms on every rank
    global_hist: torch.Tensor       # int64 [E]: tokens routed to each expert, over every rank
    recv_per_rank: list             # rows each rank received


def check_layer(me: Rank, a: argparse.Namespace, x, out, topk_idx, topk_weights, weights, layout, recv_x,
                recv_counts) -> Check:
    """Compare the layer's output ``out`` with the same layer on this rank's tokens, all experts here, in fp32;
    and the library's per-expert and per-rank figures with the routing's own histograms (collective)."""
    num_tokens_per_rank, _, num_tokens_per_expert, _, _ = layout
    E_local, red_dev = a.experts // me.world, me.reduce_device
    ref = apply_experts(x, topk_idx, topk_weights, weights, 0, a.experts)
    err2, ref2 = all_reduce_cpu([(out.float() - ref).pow(2).sum().item(), ref.pow(2).sum().item()],
                                device=red_dev).tolist()
    hist = torch.bincount(topk_idx[topk_idx >= 0], minlength=a.experts)
    global_hist = all_reduce_cpu(hist.cpu().double(), device=red_dev).long()
    recv_per_rank = all_reduce_cpu(num_tokens_per_rank.cpu().double(), device=red_dev).long().tolist()
    counts_ok = (num_tokens_per_expert.cpu().long().equal(hist.cpu())
                 and list(recv_counts) == global_hist[me.rank * E_local:(me.rank + 1) * E_local].tolist()
                 and recv_x.shape[0] == recv_per_rank[me.rank])
    counts_ok = all_reduce_cpu([float(not counts_ok)], device=red_dev).item() == 0
    return Check((err2 ** 0.5) / max(ref2 ** 0.5, 1e-30), counts_ok, global_hist, recv_per_rank)


def report(me: Rank, a: argparse.Namespace, corpus: str, check: Check, worst: list, gbps: list,
           requested_tokens: int, t_start: float) -> None:
    """Rank 0's lines: the expert load, then the run's figures as one JSON line (``worst``: the slowest rank's
    layout, dispatch and combine ms; ``gbps``: dispatch and combine GB/s averaged over ranks)."""
    device, load = me.device, check.global_hist.double()
    imbalance = load.max().item() / load.mean().item() if load.sum() > 0 else 1.0
    print(f"[moe_layer] {me.world} ranks on {device.type} ({me.backend}), corpus {corpus}: expert load "
          f"max/mean = {imbalance:.2f} (busiest expert "
          f"{int(load.max())} tokens, idlest {int(load.min())}, mean {load.mean().item():.1f}); "
          f"rows received per rank {check.recv_per_rank}")
    if a.tokens != requested_tokens:
        print(f"[moe_layer] tokens per rank scaled down {requested_tokens} -> {a.tokens} to fit memory")
    result = dict(
        ranks=me.world, tokens_per_rank=a.tokens, hidden=a.hidden, num_experts=a.experts, topk=a.topk,
        num_groups=a.groups, topk_groups=a.topk_groups, intermediate=a.intermediate,
        device=device_name(device), backend=me.backend, ranks_per_gpu=me.sharing if device.type == "cuda" else None,
        max_rel_err=check.max_rel_err, counts_ok=check.counts_ok,
        dispatch_ms=sig(worst[1]), combine_ms=sig(worst[2]), layout_ms=sig(worst[0]),
        dispatch_GBps=sig(gbps[0]), combine_GBps=sig(gbps[1]),
        recv_tokens_per_rank=check.recv_per_rank,
        expert_load_max_over_mean=round(imbalance, 3),
        tokens_requested=requested_tokens, iters=a.iters, seed=a.seed,
        elapsed_s=round(time.perf_counter() - t_start, 2),
        note=timing_note(device, me.sharing, me.world),
        ok=check.max_rel_err <= TOLERANCE,
    )
    print(json.dumps(result), flush=True)


def sig(v: float, digits: int = 4) -> float:
    """``v`` rounded to ``digits`` significant digits (small CPU bandwidths stay visible)."""
    return float(f"{v:.{digits}g}")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timing_note(device: torch.device, sharing: int, R: int) -> str:
    common = ("ms: slowest rank's median over iters; GBps: DeepEP's measure, bytes a rank receives "
              "(dispatch) or sends back (combine) over the call's time, averaged over ranks.")
    if device.type == "cpu":
        return ("CPU run: kernels under the Triton interpreter, ranks sharing the host's cores; timings "
                "measure the interpreter, not a fabric. " + common)
    if sharing > 1:
        return (f"{sharing} ranks share each GPU: timings measure the GPU's time-slicing between "
                "processes, not bandwidth, and do not compare with DeepEP's figures. " + common)
    return "one GPU per rank. " + common


def main(argv=None) -> int:
    a = parse_args(argv)
    return _launch.run(functools.partial(rank_main, a), a.ranks, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
