"""Rank bodies of tests/runtime/test_destroy_frees.py: a rank keeps what its calls returned (events, handles, receive
hooks, the combine's tuple) and the Buffer itself, destroys the Buffer with Python's garbage collector off, and
reports what of the shared memory this process still maps or holds open, then what each kept object does when used."""
import gc
import os

import torch

import triton_ep
from triton_ep.transport.shm import shm_name

#: what each rank body takes as ``kind``: normal mode within one host, low-latency mode within one host, an
#: ElasticBuffer, and across 2 emulated hosts (a Buffer in low-latency mode: normal and low-latency calls)
KINDS = ("normal", "low_latency", "elastic", "hosts")


def shm_held() -> dict:
    """This process's mappings (``/proc/self/maps`` lines) and open descriptors of triton-ep's /dev/shm files of this
    run (named ``triton_ep.<$TRITON_EP_SHM_TAG>.*``: the shared buffers, the liveness lock, the proxy's rings):
    ``{"maps": [file, ...], "fds": [file, ...]}``."""
    prefix = "/dev/shm/" + shm_name("")
    with open("/proc/self/maps") as f:
        maps = sorted({line.split(None, 5)[-1].strip() for line in f if prefix in line})
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:         # (the descriptor listdir used, closed by now)
            continue
        if target.startswith(prefix):
            fds.append(target)
    return {"maps": maps, "fds": sorted(fds)}


def _outcome(use) -> str:
    """What ``use()`` did: ``"ok"``, or ``"<error type>: <message>"``."""
    try:
        use()
        return "ok"
    except Exception as ex:     # noqa: BLE001 - reported
        return f"{type(ex).__name__}: {ex}"


def _inputs(rank: int, world: int):
    """``(x bf16 [4, 128], topk_idx [4, 2], topk_weights fp32 [4, 2], N = 8, E = 2 * world)``, seeded by the rank."""
    E, H, K, T = 2 * world, 128, 2, 4
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g), 8, E


def _normal_calls(buf, x, idx, w, E: int) -> tuple:
    """A layout, a dispatch and its combine, a cached dispatch and its combine (the second pair replays its plans
    within one host): ``(everything returned, the uses of the kept objects after destroy)``."""
    layout = buf.get_dispatch_layout(idx, E)
    per_rank, per_host, per_expert, in_rank, _ = layout
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    handle = out[4]
    combined = buf.combine(out[0], handle, topk_weights=out[2])
    cached = [buf.dispatch(x, handle=handle) for _ in range(2)]
    again = [buf.combine(c[0], handle) for c in cached]
    uses = {"layout event": layout[4].current_stream_wait, "dispatch event": out[5].current_stream_wait,
            "combine event": combined[2].current_stream_wait, "cached dispatch event": cached[1][5].current_stream_wait,
            "cached dispatch": lambda: buf.dispatch(x, handle=handle),
            "combine": lambda: buf.combine(out[0], handle, topk_weights=out[2]),
            "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, E),
            "get_local_buffer_tensor": lambda: buf.get_local_buffer_tensor(torch.uint8)}
    return (layout, out, combined, cached, again), uses


def _low_latency_calls(buf, x, idx, w, N: int, E: int) -> tuple:
    """Two low-latency dispatches and combines, the second pair with receive hooks (run): ``(everything returned, the
    uses of the kept objects after destroy)``."""
    d1 = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    c1 = buf.low_latency_combine(d1[0], idx, w, d1[2])
    d2 = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, return_recv_hook=True)
    d2[4]()
    c2 = buf.low_latency_combine(d2[0], idx, w, d2[2], return_recv_hook=True)
    c2[2]()
    uses = {"low-latency dispatch event": d1[3].current_stream_wait, "low-latency combine event": c1[1].current_stream_wait,
            "dispatch hook": d2[4], "combine hook": c2[2],
            "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False),
            "low_latency_combine": lambda: buf.low_latency_combine(d1[0], idx, w, d1[2]),
            "get_next_low_latency_combine_buffer": lambda: buf.get_next_low_latency_combine_buffer(d1[2]),
            "clean_low_latency_buffer": lambda: buf.clean_low_latency_buffer(N, x.shape[1], E)}
    return (d1, c1, d2, c2), uses


def _elastic_calls(buf, x, idx, w, E: int) -> tuple:
    """An ElasticBuffer's dispatch and combine, then a cached dispatch and its combine."""
    out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    handle = out[3]
    combined = buf.combine(out[0], handle)
    cached = buf.dispatch(x, handle=handle)
    again = buf.combine(cached[0], handle)
    uses = {"dispatch event": out[4].current_stream_wait, "combine event": combined[2].current_stream_wait,
            "cached dispatch": lambda: buf.dispatch(x, handle=handle),
            "combine": lambda: buf.combine(out[0], handle), "barrier": buf.barrier}
    return (out, combined, cached, again), uses


def destroyed_while_held(rank: int, world: int, kind: str, strict: bool = True):
    """Build a Buffer of ``kind`` (:data:`KINDS`; "hosts": ``TRITON_EP_RDMA=emulated``, ``TRITON_EP_RANKS_PER_HOST=1``,
    the RDMA proxy as the environment says), make its calls and keep everything they returned and the Buffer, then
    destroy it with the garbage collector off (``gc.disable()`` from the start: nothing of it is collected). Returns
    ``(what this process held of the shm files just before destroy(), what it held after, {use: outcome})``: each kept
    object used after destroy (an event waited on, a hook run, a call with a kept handle, ``check()``,
    ``get_rdma_stats()``, ``destroy()`` again), as :func:`_outcome` reports it.

    Triton's CPU interpreter keeps the storages of every launch's arguments in reference cycles of its own (the
    recursive closures of ``GridExecutor._init_args_hst``), which a GPU has not, and destroy() does not collect them.
    With ``strict`` one ``gc.collect()`` runs right before destroy() (while the caller's objects, the Buffer
    included, are still referenced, so it frees nothing of theirs): from then on only what the library and the
    caller hold counts, as on a GPU, and a reference cycle of the library's own that holds the memory fails the
    check. Without ``strict`` the collection runs right after destroy(), as a CPU user's next collection does (the
    objects still kept: before, an event kept pinned the memory through any number of collections)."""
    import torch.distributed as dist
    gc.disable()
    try:
        if kind == "hosts":
            os.environ.update(TRITON_EP_RDMA="emulated", TRITON_EP_RANKS_PER_HOST="1")
        x, idx, w, N, E = _inputs(rank, world)
        if kind == "elastic":
            buf = triton_ep.ElasticBuffer(None, num_bytes=1 << 20, num_max_tokens_per_rank=N, device="cpu")
            kept, uses = _elastic_calls(buf, x, idx, w, E)
        elif kind == "normal":
            buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=60.0)
            kept, uses = _normal_calls(buf, x, idx, w, E)
        else:
            hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, x.shape[1], world, E)
            buf = triton_ep.Buffer(None, 1 << 20, hint, low_latency_mode=True, num_qps_per_rank=1, device="cpu",
                                   timeout_s=60.0)
            kept, uses = _low_latency_calls(buf, x, idx, w, N, E)
            if kind == "hosts":
                more, normal_uses = _normal_calls(buf, x, idx, w, E)
                kept, uses = kept + more, dict(uses, **normal_uses)
        dist.barrier()
        before = shm_held()
        if strict:
            gc.collect()        # (the interpreter's cycles only: see the docstring)
        buf.destroy()
        if not strict:
            gc.collect()        # (a CPU user's next collection, everything still kept)
        after = shm_held()
        uses.update(check=buf.check)
        if kind != "elastic":
            uses.update(get_rdma_stats=buf.get_rdma_stats)
        outcomes = {name: _outcome(use) for name, use in uses.items()}
        outcomes["destroy again"] = _outcome(buf.destroy)
        dist.barrier()
        del kept
        return before, after, outcomes
    finally:
        gc.enable()
