"""Rank bodies of tests/runtime/test_dead_peer.py: one rank's process dies (SIGKILL) in the middle of a call of
one host, the others time their error."""
import contextlib
import os
import signal
import time
import unittest.mock

import torch

import triton_ep

#: where the victim dies: "notify" (it never calls the dispatch: its peers wait in the count exchange), "dispatch"
#: (after the count exchange, in its send launch), "worst" (it never calls a dispatch with num_worst_tokens: its peers
#: wait on the host for its call card), "combine" (it never calls the combine), "ll_dispatch" (a low-latency dispatch,
#: in its receive launch: after its send), "ll_combine" (it never calls the low-latency combine)
MODES = ("notify", "dispatch", "worst", "combine", "ll_dispatch", "ll_combine")
#: and "ll_shrink": it never calls a low-latency dispatch of a Buffer with enable_shrink (its peers mask it)


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def killed_mid_call(rank, world, mode, timeout_s, victim, device="cpu", stamp=None):
    """Every rank builds a Buffer and runs one correct call of ``mode``'s kind; after a barrier rank ``victim``
    dies at the point ``mode`` names (:data:`MODES`) while the others make the call. Returns, on a survivor,
    ``[error type, message, seconds from the call's start to the error, the next call's error type, its
    seconds, the wall-clock time (time.time()) of the error]``. With ``stamp`` (a folder) the victim writes the
    wall-clock time at which it kills itself into ``stamp/killed`` (benchmarks/bench_dead_peer.py)."""
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    ll = mode.startswith("ll_")
    buf, args = _buffer(rank, world, ll, timeout_s, device, shrink=mode == "ll_shrink")
    try:
        call = _warm_up(buf, mode, *args)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if rank == victim:
            if stamp is not None:
                with open(os.path.join(stamp, "killed"), "w") as f:
                    f.write(repr(time.time()))
            if mode in ("dispatch", "ll_dispatch"):
                if ll:      # (a replayed call launches its plan, not the wrappers patched here: GPU ranks replay)
                    buf._ll.replay_dispatch = None
                with unittest.mock.patch("triton_ep.kernels.dispatch_send", _die), \
                        unittest.mock.patch("triton_ep.modes.intranode.dispatch_fused", _die), \
                        unittest.mock.patch("triton_ep.modes.low_latency.calls.ll_dispatch_recv", _die), \
                        unittest.mock.patch("triton_ep.modes.low_latency.calls.ll_dispatch_fused", _die):
                    call()
                    buf.check()
            _die()
        return _survive_twice(buf, call, mode, world, device)
    finally:
        buf.destroy()


def _survive_twice(buf, call, mode, world, device):
    """A survivor's two calls of ``call`` (each then ``check()``; with "ll_shrink" the mask read): ``[error type (or
    "no error"), message (or the mask), seconds, next call's error type, its seconds, wall-clock time of the first
    error]``."""
    out = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            call()
            if device == "cuda":
                torch.cuda.synchronize()
            buf.check()
            mask = torch.zeros(world, dtype=torch.int32, device=device)
            if mode == "ll_shrink":
                buf.low_latency_query_mask_buffer(mask)
            out += ["no error", str(mask.tolist()), time.monotonic() - t0, time.time()]
        except Exception as ex:     # noqa: BLE001 - reported
            out += [type(ex).__name__, str(ex), time.monotonic() - t0, time.time()]
    return out[:3] + [out[4], out[6], out[3]]


#: what the survivors of :func:`destroyed_mid_call` call while rank ``victim`` destroys its Buffer instead: as
#: :data:`MODES` ("notify": a dispatch, whose count exchange waits for it), and "cached" (a cached dispatch, the
#: warm-up's handle: no host wait, its kernels wait for it)
DESTROYED_MODES = ("notify", "cached", "worst", "combine", "ll_dispatch", "ll_combine")


def destroyed_mid_call(rank, world, mode, timeout_s, victim):
    """Every rank builds a Buffer (``timeout_s``) and runs one correct call of ``mode``'s kind
    (:data:`DESTROYED_MODES`, or "ll_shrink": a low-latency dispatch of a Buffer with enable_shrink); after a barrier
    rank ``victim`` destroys its Buffer (its process lives on: it waits for the others at a closing barrier) while the
    others make the call twice. Returns on a survivor what :func:`killed_mid_call` returns (``[error type, message or
    with "ll_shrink" the mask, seconds, next call's error type, its seconds, wall-clock time of the error]``), on the
    victim ``None``."""
    import torch.distributed as dist
    buf, args = _buffer(rank, world, mode.startswith("ll_"), timeout_s, shrink=mode == "ll_shrink")
    try:
        call = _warm_up(buf, mode, *args)
        dist.barrier()
        if rank == victim:
            buf.destroy()
            return None
        return _survive_twice(buf, call, mode, world, "cpu")
    finally:
        buf.destroy()
        dist.barrier()      # (the victim's process lived until every survivor was done)


def destroyed_at_the_end(rank, world, ll, delay_s):
    """Every rank makes correct calls (normal mode: a dispatch, its combine, a cached dispatch and its combine;
    ``ll``: low-latency dispatches and combines, the last pair with receive hooks), then destroys its Buffer at once
    (rank 0) or up to ``delay_s`` seconds later (rank ``r``: ``r * delay_s / (world - 1)``), the normal end of a program
    whose ranks finish at slightly different times. With ``ll``, rank 0 calls its last hooks at once and destroys,
    while the others call their last ``delay_s`` later, once their liveness watcher has marked rank 0 closed (its
    ``DEAD`` word, waited for at most 10 s): their waits were met before rank 0 left. Returns per rank ``(the errors
    seen, [] for none, each "type: message"; rank 0's DEAD word as this rank saw it before its last hook, None where
    not looked at)``."""
    import torch.distributed as dist
    from triton_ep.protocol.signal_header import H_DEAD
    buf, (x, idx, w, N, E) = _buffer(rank, world, ll, 30.0)
    errors, word = [], None
    try:
        try:
            if ll:
                for _ in range(2):
                    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
                    buf.low_latency_combine(rx, idx, w, handle)
                rx, _, handle, _, hook = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, return_recv_hook=True)
                if rank:
                    time.sleep(delay_s)
                hook()
                _, _, hook = buf.low_latency_combine(rx, idx, w, handle, return_recv_hook=True)
                if rank:
                    time.sleep(delay_s)
                    dead_words, end = buf._rt.sig.host, time.monotonic() + 10.0
                    while not dead_words[int(H_DEAD)] and time.monotonic() < end:
                        time.sleep(0.01)
                    word = int(dead_words[int(H_DEAD)])
                hook()
            else:
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
                rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
                buf.combine(rx, handle, topk_weights=rw)
                rx, _, _, _, _, _ = buf.dispatch(x, handle=handle)
                buf.combine(rx, handle)
            buf.check()
        except Exception as ex:     # noqa: BLE001 - reported
            errors.append(f"{type(ex).__name__}: {ex}")
        time.sleep(rank * delay_s / max(1, world - 1))
    finally:
        buf.destroy()
        dist.barrier()
    return errors, word


def silent_peer(rank, world, how, timeout_s):
    """Rank 1 lives on but never makes the dispatch: ``how`` "stuck" (it holds its Buffer) or "destroyed" (it
    destroyed its Buffer first); it waits in a barrier (alive, holding its Buffer where "stuck") until rank 0's
    dispatch has ended. Rank 0 dispatches; returns there ``[error type, message, seconds]``."""
    import torch.distributed as dist
    E, H, T = 2 * world, 64, 3
    idx = torch.arange(T * 2).reshape(T, 2) % E
    buf = triton_ep.Buffer(None, 1 << 20, device="cpu", timeout_s=timeout_s)
    try:
        if rank == 1:
            if how == "destroyed":
                buf.destroy()
            return None
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        t0 = time.monotonic()
        try:
            buf.dispatch(torch.ones(T, H, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
            return ["no error", "", time.monotonic() - t0]
        except Exception as ex:     # noqa: BLE001 - reported
            return [type(ex).__name__, str(ex), time.monotonic() - t0]
    finally:
        if rank != 1:
            buf.destroy()
        dist.barrier()      # (rank 1 lives on until rank 0's dispatch has ended, not a fixed timeout_s + 3 s)
        buf.destroy()


#: where the victim dies across hosts (2 emulated hosts): "internode" (it never makes the normal-mode dispatch its
#: peers make: they wait for its records), "internode_ll" (likewise a low-latency dispatch), "internode_ll_combine"
#: (it never makes the low-latency combine), "internode_ll_send" (it makes the low-latency dispatch and dies right
#: after its send published its chunks, at the start of its receive: its chunks are on their way; and with 2 ranks per
#: host one survivor, :func:`late_rank`, makes the call only once its own proxy has found the victim gone: every other
#: survivor's proxy fails while it still waits for that live rank's chunk or ``READY``), "internode_held" (as
#: "internode", and with 2 ranks per host the RDMA peer of the victim's host mate, :func:`held_rank`, holds the end of
#: its call's status exchange until that host mate's fault word has landed: :func:`_held_status`)
HOST_MODES = ("internode", "internode_ll", "internode_ll_combine", "internode_ll_send", "internode_held")
#: seconds the late survivor of "internode_ll_send" waits at most for its proxy to fail before it makes the call
LATE_WAIT_S = 30.0


def held_rank(world: int, victim: int):
    """The survivor that holds the end of its status exchange in "internode_held" (2 hosts of ``world // 2`` ranks):
    the RDMA peer of the victim's lowest host mate, on the other host (``None`` with 1 rank per host)."""
    per = world // 2
    if per < 2:
        return None
    host = victim // per
    mate = next(r for r in range(host * per, (host + 1) * per) if r != victim)
    return (mate + per) % world


def _held_status(orig_status):
    """``HostExchange.status`` of the held rank (:func:`held_rank`): its status exchange publishes this rank's header,
    then waits (at most :data:`LATE_WAIT_S`) until a peer's ``FAULT`` word has landed in its rings, and makes the
    exchange loop's next pass as where its proxy had not yet seen that header placed (``SENT`` behind: the loop looks
    at the proxy's error, :meth:`~triton_ep.scheduler.Scheduler.check`, before it goes on). The peer (the victim's host
    mate) has got this rank's header meanwhile, raised its call's error, and at its next call failed its network leg
    for good: that fault word so reaches this rank before the end of the exchange in which the peer's header names the
    dead rank (issue 46, a race seen once in CI: this rank's proxy slower to see its header placed than the peer to
    answer with its fault word)."""
    from triton_ep.scheduler import alltoall
    from triton_ep.transport.ring_flags import RingFlags
    orig_moves = alltoall._host_moves

    def held_moves(sched, xfer, on_idle):
        for p in sched.peers:
            xfer.move(p)
        end = time.monotonic() + LATE_WAIT_S
        while not any(sched.flags.get(RingFlags.FAULT, p) for p in sched.peers) and time.monotonic() < end:
            time.sleep(0.005)
        sched.check()
        return orig_moves(sched, xfer, on_idle)

    def status(self, err):
        with unittest.mock.patch.object(alltoall, "_host_moves", held_moves):
            return orig_status(self, err)
    return status


def late_rank(world: int, victim: int):
    """The survivor that makes the call of "internode_ll_send" late: the highest rank other than 0 and ``victim``
    (``None`` with 1 rank per host, where rank 0 is the only survivor)."""
    others = [r for r in range(1, world) if r != victim]
    return others[-1] if world >= 4 else None


def killed_across_hosts(rank, world, mode, proxy, timeout_s, victim, stamp=None, delay_s=0.3):
    """``world`` ranks on 2 emulated hosts (``TRITON_EP_RDMA=emulated``, ``TRITON_EP_RANKS_PER_HOST=world // 2``),
    the RDMA proxy a ``proxy`` (``TRITON_EP_PROXY``). Every rank builds a Buffer (``timeout_s``) and runs one correct
    call of ``mode``'s kind (:data:`HOST_MODES`); after a barrier rank ``victim`` waits ``delay_s`` (the others are
    inside the call by then) and dies (SIGKILL), or with "internode_ll_send" makes the call and dies in it, after its
    send (then :func:`late_rank` makes its first call only once its proxy failed, within :data:`LATE_WAIT_S`). Returns
    on a survivor what :func:`killed_mid_call` returns (``[error type, message, seconds, next call's error type, its
    seconds, wall-clock time of the error]``), and the proxy processes' pids of this Buffer (``[]`` with proxy
    threads) so that the test checks they are gone, and whether the first error is an ``EPRemoteError``."""
    import torch.distributed as dist
    os.environ.update(TRITON_EP_RDMA="emulated", TRITON_EP_RANKS_PER_HOST=str(world // 2), TRITON_EP_PROXY=proxy)
    ll = mode.startswith("internode_ll")
    buf, args = _buffer(rank, world, ll, timeout_s)
    pids = []
    try:
        call = _warm_up(buf, mode, *args)
        pids = _proxy_pids(buf)
        remote = False
        dist.barrier()
        send = mode == "internode_ll_send"
        if rank == victim:
            if send:        # its receive's first launch (the chunks' unpack) is its death
                with unittest.mock.patch("triton_ep.modes.low_latency.calls.ll_unpack", lambda *a, **k: _die_at(stamp)):
                    call()
            time.sleep(delay_s)
            _die_at(stamp)
        if send and rank == late_rank(world, victim):
            sched, end = buf._ll.net.sched, time.monotonic() + LATE_WAIT_S
            while not sched.flags.aborted and time.monotonic() < end:
                time.sleep(0.01)
        held = contextlib.nullcontext()
        if mode == "internode_held" and rank == held_rank(world, victim):
            from triton_ep.modes.internode.exchange import HostExchange
            held = unittest.mock.patch.object(HostExchange, "status", _held_status(HostExchange.status))
        out = []
        for i in range(2):
            t0 = time.monotonic()
            try:
                with held if i == 0 else contextlib.nullcontext():
                    call()
                buf.check()
                out += ["no error", "", time.monotonic() - t0, time.time()]
            except Exception as ex:     # noqa: BLE001 - reported
                out += [type(ex).__name__, str(ex), time.monotonic() - t0, time.time()]
                if len(out) == 4:       # (the first call's error)
                    remote = isinstance(ex, triton_ep.EPRemoteError)
        return out[:3] + [out[4], out[6], out[3], pids, remote]
    finally:
        buf.destroy()


def _die_at(stamp) -> None:
    """Die (SIGKILL), having written the wall-clock time into ``stamp/killed`` where ``stamp`` (a folder) is given."""
    if stamp is not None:
        with open(os.path.join(stamp, "killed"), "w") as f:
            f.write(repr(time.time()))
    _die()


def rejected_then_dropped(rank, world, ll, timeout_s, victim):
    """Every rank builds a Buffer (``timeout_s``; low-latency with ``ll``) and runs one correct dispatch; after a
    barrier rank ``victim`` passes an int16 ``topk_idx`` to the next dispatch, catches the ``TypeError`` and drops its
    Buffer without ``destroy()`` (collected: what an uncaught error does at its process's exit); the others make the
    dispatch once their liveness watcher saw that Buffer released (at most 10 s). Returns on a survivor ``[error type,
    message, seconds]``, on the victim its own error's ``[type, message]``."""
    import gc

    import torch.distributed as dist
    buf, (x, idx, w, N, E) = _buffer(rank, world, ll, timeout_s)
    try:
        if ll:
            def call(ids):
                return buf.low_latency_dispatch(x, ids, N, E, use_fp8=False)
        else:
            def call(ids):
                per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
                return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
                                    topk_weights=w)
        call(idx)
        dist.barrier()
        if rank != victim:      # (until the victim's Buffer is released: DEAD[victim], set by the liveness watcher)
            from triton_ep.protocol.signal_header import H_DEAD
            dead_words, end = buf._rt.sig.host, time.monotonic() + 10.0
            while not dead_words[int(H_DEAD) + victim] and time.monotonic() < end:
                time.sleep(0.01)
        t0 = time.monotonic()
        try:
            call(idx.to(torch.int16) if rank == victim else idx)
            out = ["no error", "", time.monotonic() - t0]
        except Exception as ex:     # noqa: BLE001 - reported
            out = [type(ex).__name__, str(ex), time.monotonic() - t0]
        if rank == victim:
            del buf, call
            gc.collect()
            buf = None
        return out
    finally:
        if buf is not None:
            buf.destroy()
        dist.barrier()      # (the victim's process lived until every survivor was done)


def _buffer(rank: int, world: int, ll: bool, timeout_s: float, device: str = "cpu", shrink: bool = False):
    """This rank's Buffer (``timeout_s``; low-latency with ``ll``, ``enable_shrink`` with ``shrink``) and its call's
    inputs ``(x, topk_idx, topk_weights, N, E)`` (seeded by the rank; ``E = 2 * world`` experts, top-2 of 4 tokens
    of hidden 128, ``N = 8``)."""
    E, H, K, T, N = 2 * world, 128, 2, 4, 8
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    if ll:
        hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
        buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=E // world, device=device,
                               timeout_s=timeout_s, enable_shrink=shrink)
    else:
        buf = triton_ep.Buffer(None, 1 << 20, device=device, timeout_s=timeout_s)
    return buf, (x, idx, w, N, E)


def _warm_up(buf, mode: str, x, idx, w, N: int, E: int):
    """One correct call of ``mode``'s kind (:data:`MODES`, :data:`HOST_MODES`: its kernels compiled, the network leg
    up): a low-latency dispatch and combine, or a normal-mode dispatch and (within one host) its combine. Returns the
    call the survivors make after the kill: the combine for "ll_combine" and "internode_ll_combine", a dispatch with
    ``num_worst_tokens`` for "worst", the combine for "combine", else the dispatch."""
    if "ll" in mode:
        rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        buf.low_latency_combine(rx, idx, w, handle)
        if mode.endswith("ll_combine"):
            return lambda: buf.low_latency_combine(rx, idx, w, handle)
        return lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    rx, _, rw, _, handle, _ = buf.dispatch(x, **kw)
    if not mode.startswith("internode"):    # (across hosts only the dispatch is timed: its combine is not warmed up)
        buf.combine(rx, handle, topk_weights=rw)
    if mode == "combine":
        return lambda: buf.combine(rx, handle, topk_weights=rw)
    if mode == "worst":
        return lambda: buf.dispatch(x, num_worst_tokens=idx.shape[0] * (E // 2), **kw)
    if mode == "cached":
        return lambda: buf.dispatch(x, handle=handle)
    return lambda: buf.dispatch(x, **kw)


def _proxy_pids(buf) -> list:
    """The pids of this process's children (the Buffer's RDMA proxy processes; none with proxy threads), from
    ``/proc/self/task/*/children`` (a thread that ends meanwhile is skipped)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):     # a thread that ended since the listing
            continue
    return sorted(set(pids))
