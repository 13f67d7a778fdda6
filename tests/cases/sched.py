"""Rank bodies of the multi-process scheduler tests (importable by spawned ranks): each process is one
emulated host, bootstrapped over gloo.  Shared by test_scheduler_mp.py (CPU) and test_gpu_scheduler.py."""
from __future__ import annotations

import contextlib
import time

import numpy as np


def alltoall_rank(rank, world, fab, sizes, slots, slot_bytes, qps):
    """Host producers/consumers: one all-to-all of ``sizes[(src, dst)]`` bytes; returns per peer whether
    every byte matched."""
    import torch.distributed as dist
    from triton_ep.scheduler import bootstrap, host_alltoall
    from tests.cases.sched_helpers import payload, transport
    t = transport(fab, rank, world, qps=qps, timeout_s=30.0)
    sched = None
    try:
        sched = bootstrap(t, dict(slots=slots, slot_bytes=slot_bytes))
        sched.mem[sched.layout.ctrl_bytes:] = 0xA5
        dist.barrier()      # (every ring filled before any peer writes into it: else a chunk may land first)
        peers = [p for p in range(world) if p != rank]
        got = host_alltoall(sched, {p: payload(rank, p, sizes[(rank, p)]) for p in peers},
                            {p: sizes[(p, rank)] for p in peers})
        return {p: bool(np.array_equal(got[p], payload(p, rank, sizes[(p, rank)]))) for p in peers}
    finally:
        if sched is not None:
            sched.close()
        t.close()


def kernel_rank(rank, world, fab, device, rounds, slots, slot_bytes, timeout_s=30.0):
    """Producer and consumer Triton kernels against the proxy: ``rounds`` rounds of ``slots`` chunks to and
    from every peer, rings in (pinned, device-mapped on GPU) host memory.  Returns ``result.tolist()``
    (per peer: mismatched words, chunks checked)."""
    import torch
    from triton_ep.kernels import chunks
    from triton_ep.kernels._util import interpreted
    from triton_ep.scheduler import RingLayout, bootstrap
    from triton_ep.transport.signals import watchdog
    from triton_ep.kernels import flags as F
    from tests.cases.sched_helpers import transport
    lay = RingLayout(world, slots, slot_bytes)
    t = transport(fab, rank, world, qps=2, timeout_s=timeout_s)
    sched = None
    try:
        mem = torch.zeros(lay.nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        sched = bootstrap(t, dict(slots=slots, slot_bytes=slot_bytes, memory=mem, timeout_s=timeout_s))
        c, r = lay.ctrl_bytes, lay.ring_bytes
        ctrl = mem[:c].view(torch.int64)
        send, recv = mem[c:c + r].view(torch.int32), mem[c + r:c + 2 * r].view(torch.int32)
        recv.fill_(-7)                                   # unwritten words must show
        result = torch.zeros(world, 2, dtype=torch.int32, device=device)
        guard = (watchdog(sched.flags.w, int(F.RING_ABORT), timeout_s) if interpreted()
                 else contextlib.nullcontext())
        with guard:
            for k in range(rounds):
                args = dict(first=k * slots, count=slots, me=rank, world=world, slots=slots, slot_bytes=slot_bytes,
                            timeout_s=timeout_s)
                chunks.produce_chunks(ctrl, send, **args)
                chunks.consume_chunks(ctrl, recv, result, **args)
            if device == "cuda":                     # poll (the proxy thread needs the GIL), bounded
                done = torch.cuda.Event()
                done.record()
                deadline = time.monotonic() + 2 * timeout_s + 10
                while not done.query():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank}: ring kernels did not finish within {2 * timeout_s + 10} s")
                    time.sleep(0.0005)
        sched.check()
        err = sched.flags.error(timeout_s)
        if err is not None:
            raise err
        return result.cpu().tolist()
    finally:
        if sched is not None:
            sched.close()
        t.close()
