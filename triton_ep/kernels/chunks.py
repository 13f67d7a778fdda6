"""Producer and consumer kernels of the RDMA scheduler's rings: the kernel side of the kernel-to-proxy
interface (the host side is :mod:`triton_ep.scheduler`; the words are ``flags.RING_*``).

- :func:`produce_chunks`: for every peer, chunks ``first .. first + count - 1``: wait (bounded) until the
  send slot is free (``SENT[p] > k - S``), fill it with a known pattern (int32 words), store its length,
  then release ``READY[p] = k + 1`` at system scope (after a system fence in every thread).
- :func:`consume_chunks`: for every peer, acquire ``TAIL[p] > k``, compare every word of the receive slot
  with the pattern the peer wrote, add the mismatched words and the chunks checked into ``result[p]``,
  then release ``HEAD[p] = k + 1`` (the slot is free; the proxy turns heads into credits).

One program per peer.  A wait that ends badly (the bound: ``%globaltimer`` on GPU, the host's watchdog
under the interpreter; or the proxy's abort word) writes a ring error record and the program moves
nothing more.  The control block and rings may be pinned, device-mapped host memory (the GPU writes and
reads it over PCIe; the proxy and the NIC see it as host memory).
"""
import torch
import triton
import triton.language as tl

from . import names
from . import flags as F
from ._util import interpreted, pow2


@triton.jit
def chunk_pattern(src, dst, seq, idx):
    """The int32 word ``idx`` of chunk ``seq`` that rank ``src`` sends rank ``dst`` (never all equal)."""
    z = tl.full([], 0, tl.int64)
    v = ((z + idx) * 31 + (z + seq) * 1000003 + src * 7919 + dst * 104729 + 1) & 0x7FFFFFFF
    return v.to(tl.int32)


@names.jit('scheduler_test', 'produce', do_not_specialize=['first', 'count', 'me', 'timeout_ns'])
def _produce(ctrl, send, first, count, me, S, slot_words, timeout_ns, R: tl.constexpr, BLOCK: tl.constexpr,
             USE_CLOCK: tl.constexpr):
    peer = tl.program_id(0)
    if peer != me:
        offs = tl.arange(0, BLOCK)
        bad = (tl.load(ctrl + F.RING_ABORT, volatile=True) != 0).to(tl.int32)
        for k in range(first, first + count):
            if bad == 0:
                st = F.wait_ge(ctrl + F.ring_word(F.RING_SENT, R, peer), k + 1 - S, ctrl + F.RING_ABORT,
                               timeout_ns, USE_CLOCK)
                if st != 0:
                    F.post_ring_error(ctrl, st, peer, F.STAGE_RING_PRODUCE, k)
                    bad = st
                else:
                    base = send + (tl.full([], 0, tl.int64) + peer * S + k % S) * slot_words
                    for o in range(0, slot_words, BLOCK):
                        idx = o + offs
                        tl.store(base + idx, chunk_pattern(me, peer, k, idx), mask=idx < slot_words)
                    tl.store(ctrl + F.ring_len_word(R, S, peer, k % S),
                             tl.full([], 0, tl.int64) + slot_words * 4)
                    F.fence_all_threads(USE_CLOCK)
                    tl.debug_barrier()
                    F.release(ctrl + F.ring_word(F.RING_READY, R, peer), tl.full([], 0, tl.int64) + k + 1)


@names.jit('scheduler_test', 'consume', do_not_specialize=['first', 'count', 'me', 'timeout_ns'])
def _consume(ctrl, recv, result, first, count, me, S, slot_words, timeout_ns, R: tl.constexpr,
             BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr):
    peer = tl.program_id(0)
    if peer != me:
        offs = tl.arange(0, BLOCK)
        bad = (tl.load(ctrl + F.RING_ABORT, volatile=True) != 0).to(tl.int32)
        for k in range(first, first + count):
            if bad == 0:
                st = F.wait_ge(ctrl + F.ring_word(F.RING_TAIL, R, peer), k + 1, ctrl + F.RING_ABORT,
                               timeout_ns, USE_CLOCK)
                if st != 0:
                    F.post_ring_error(ctrl, st, peer, F.STAGE_RING_CONSUME, k)
                    bad = st
                else:
                    base = recv + (tl.full([], 0, tl.int64) + peer * S + k % S) * slot_words
                    wrong = tl.full([], 0, tl.int32)
                    for o in range(0, slot_words, BLOCK):
                        idx = o + offs
                        v = tl.load(base + idx, mask=idx < slot_words, other=0, volatile=True)
                        miss = (v != chunk_pattern(peer, me, k, idx)) & (idx < slot_words)
                        wrong += tl.sum(miss.to(tl.int32), axis=0)
                    tl.atomic_add(result + peer * 2, wrong)
                    tl.atomic_add(result + peer * 2 + 1, tl.full([], 1, tl.int32))
                    F.fence_all_threads(USE_CLOCK)
                    tl.debug_barrier()
                    F.release(ctrl + F.ring_word(F.RING_HEAD, R, peer), tl.full([], 0, tl.int64) + k + 1)


def _args(ctrl, ring, first, count, me, world, slots, slot_bytes, timeout_s):
    if slot_bytes % 4:
        raise ValueError(f"slot_bytes {slot_bytes} must be a multiple of 4")
    if ctrl.dtype != torch.int64 or ring.dtype != torch.int32:
        raise TypeError("ctrl must be int64 and the ring int32")
    words = slot_bytes // 4
    block = min(pow2(words), 256 if interpreted() else 1024)
    return dict(first=first, count=count, me=me, S=slots, slot_words=words, timeout_ns=int(timeout_s * 1e9),
                R=world, BLOCK=block, USE_CLOCK=not interpreted())


def produce_chunks(ctrl: torch.Tensor, send: torch.Tensor, first: int, count: int, me: int, world: int,
                   slots: int, slot_bytes: int, timeout_s: float) -> None:
    """Produce chunks ``first .. first + count - 1`` for every peer (grid: one program per rank).

    Args:
        ctrl: int64 ``[flags.ring_ctrl_words.host(world, slots)]``, the ring control block (host-visible).
        send: int32 view of the send ring, ``[world * slots * slot_bytes / 4]``.
        me, world: this rank and the group size.  slots, slot_bytes: the ring's shape (bytes, multiple of 4).
        timeout_s: bound of each wait for a free slot (GPU clock; the interpreter's bound is the host's
            watchdog on ``ctrl[RING_ABORT]``).
    Errors end in the ring error record (``RingFlags.error``), never in a hang.
    """
    a = _args(ctrl, send, first, count, me, world, slots, slot_bytes, timeout_s)
    _produce[(world,)](ctrl, send, num_warps=4, **a)


def consume_chunks(ctrl: torch.Tensor, recv: torch.Tensor, result: torch.Tensor, first: int, count: int, me: int,
                   world: int, slots: int, slot_bytes: int, timeout_s: float) -> None:
    """Consume and check chunks ``first .. first + count - 1`` from every peer.

    Args:
        recv: int32 view of the receive ring.  result: int32 ``[world, 2]`` (on the kernels' device): per
            peer, mismatched words and chunks checked are added.  Others as :func:`produce_chunks`.
    """
    a = _args(ctrl, recv, first, count, me, world, slots, slot_bytes, timeout_s)
    _consume[(world,)](ctrl, recv, result, num_warps=4, **a)
