"""Rank bodies of the RDMA proxy-process tests across emulated hosts (module-level: rank processes import
them; ``TRITON_EP_PROXY=process`` in their environment)."""
import os
import signal
import time

import torch

import triton_ep


def proxy_killed(rank, world, env, timeout_s):
    """2 hosts of 1 rank, the proxy in a process of its own: one dispatch, a barrier, then rank 1's proxy process
    is SIGKILLed. Each rank polls its scheduler's ``check()`` from the barrier on until it raises (rank 1: its own
    proxy's end; rank 0: rank 1's notice through the group's store, ``proxy_process.FaultNotices``), then
    dispatches again. Returns ``[seconds until check() raised, its type and text, the next dispatch's error type and
    text, whether destroy reaped the proxy process]`` on both ranks."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 8 << 20, timeout_s=timeout_s)
    out = []
    proc = None
    try:
        T, H, E = 16, 128, 2 * world
        idx = torch.tensor([[(1 - rank) * 2, (1 - rank) * 2 + 1]]).repeat(T, 1)
        x = torch.randn(T, H).to(torch.bfloat16)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx)
        buf.dispatch(x, **kw)
        sched = buf._modes.internode.sched
        assert type(sched).__name__ == "ProcessScheduler", type(sched)
        proc = sched.proc
        torch.distributed.barrier()
        t0 = time.monotonic()
        if rank == 1:
            os.kill(proc.pid, signal.SIGKILL)
        while time.monotonic() - t0 < timeout_s:
            try:
                sched.check()
            except Exception as ex:   # noqa: BLE001
                out += [time.monotonic() - t0, type(ex).__name__, str(ex)]
                break
            time.sleep(0.01)
        else:
            out += [None, None, ""]
        try:
            buf.dispatch(x, **kw)
            out += [None, ""]
        except Exception as ex:   # noqa: BLE001
            out += [type(ex).__name__, str(ex)]
    finally:
        buf.destroy()
    return out + [proc.returncode is not None if proc is not None else None]


def proxy_without_room(rank, world, env, timeout_s):
    """2 hosts of 1 rank, the proxy in a process of its own; rank 1's /dev/shm has no room for its rings
    (``posix_fallocate`` raises ``ENOSPC`` there, as in a container's 64 MiB /dev/shm). Returns ``[seconds until
    the Buffer's construction raised, its type, its text]`` (``None``s where it did not raise)."""
    import errno
    os.environ.update(env)
    if rank == 1:
        real = os.posix_fallocate

        def no_room(fd, offset, length):    # (the rings' files only: the CPU buffers are reserved the same way)
            if ".proxy." in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, offset, length)
        os.posix_fallocate = no_room
    t0 = time.monotonic()
    try:
        buf = triton_ep.Buffer(None, 8 << 20, timeout_s=timeout_s)
    except Exception as ex:   # noqa: BLE001
        return [time.monotonic() - t0, type(ex).__name__, str(ex)]
    buf.destroy()
    return [None, None, ""]


def forked_child_destroys(rank, world, env, timeout_s):
    """2 hosts of 1 rank: after one round trip rank 0 forks; the child makes a layout, a dispatch and a check on the
    Buffer it inherited (each must raise ``EPError`` naming the fork: else exit status 3), calls ``destroy()`` and
    exits. Returns ``[the child's exit status or -signal, whether a second round trip after it is exact]`` (rank 1:
    ``[None, ...]``)."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 8 << 20, timeout_s=timeout_s)
    try:
        T, H, E = 8, 64, 2 * world
        idx = torch.tensor([[(1 - rank) * 2, (1 - rank) * 2 + 1]]).repeat(T, 1)

        def round_trip():
            x = torch.randn(T, H).to(torch.bfloat16)
            per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                    topk_idx=idx)
            back, _, _ = buf.combine(recv, handle)
            return torch.equal(back, x)       # (one copy of each token, on the other host)

        ok = round_trip()
        status = None
        if rank == 0:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    for call in (lambda: buf.get_dispatch_layout(idx, E), buf.check,
                                 lambda: buf.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), topk_idx=idx,
                                                      num_tokens_per_rank=torch.zeros(world, dtype=torch.int32))):
                        try:
                            call()
                            code = 3
                        except triton_ep.EPError as e:
                            code = code if "was forked from it and may not call it" in str(e) else 3
                    buf.destroy()
                finally:
                    os._exit(code)
            st = os.waitpid(pid, 0)[1]
            status = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
        torch.distributed.barrier()
        return [status, ok and round_trip()]
    finally:
        buf.destroy()
