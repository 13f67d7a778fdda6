"""The fence before a low-latency call whose sizes differ from the last call's.

Call ``n`` uses half ``n & 1`` of every rank's area, and its send launch waits until every peer has received
call ``n - 2`` (the half's last user). The halves' places follow from the sizes (``N``, hidden,
``num_experts``: :class:`triton_ep.protocol.ll_area.Layout`), so a call of other sizes puts its half partly
over the *other* half of the last call's layout, which a slower peer may still be reading. Before such a
call, :func:`ll_fence` (one program, launched only then) waits until every peer has received call ``n - 1``
too (its ``CONS[1 - half] >= n - 1``); the send launch that follows in stream order then waits as usual.
Calls of unchanged sizes launch nothing more.
"""
import torch
import triton
import triton.language as tl

from . import names
from . import flags, ll_flags
from . import ll_net
from .launch import Launcher


@names.jit('low_latency', 'fence', do_not_specialize=['me', 'timeout_ns', 'stage'])
def _ll_fence_kernel(ctl, hdr, hdr_delta, host, me, timeout_ns, stage, ring_ctl, R: tl.constexpr, SHRINK: tl.constexpr,
                     USE_CLOCK: tl.constexpr, NET: tl.constexpr):
    ll_flags.ll_release_cons(ctl)                  # (before the wait: the peers' fences wait for it)
    n = tl.load(ctl + flags.L_SEQ) + 1          # the call about to be sent
    ll_flags.ll_wait_peers(ctl, hdr, hdr_delta, host, flags.L_CONS + 1 - (n & 1), n - 1, 0, me, stage, timeout_ns,
                        R=R, REMOTE=True, CHECK_SIG=False, SHRINK=SHRINK, USE_CLOCK=USE_CLOCK, COST=False, ahead=1,
                        abort=ll_net.abort_word(ring_ctl, NET))


_ll_fence_launch = Launcher(_ll_fence_kernel)


def ll_fence(ctl: torch.Tensor, num_ranks: int, combine: bool, shrink: bool, signals: dict, net=None) -> None:
    """Wait on the device until every peer has received this rank's last low-latency call (before a call of
    other sizes). ``ctl``: int64 control block of the low-latency area; ``combine``: the next call is a
    combine (the stage an error record names). A peer that does not arrive within the timeout is masked with
    ``shrink``, else the wait writes an error record (raised by ``Buffer.check()``), as the send's own wait.
    ``net``: the network leg (the wait ends once its RDMA proxy failed), or None."""
    stage = flags.STAGE_LL_COMBINE_SEND if combine else flags.STAGE_LL_DISPATCH_SEND
    _ll_fence_launch[(1,)](ctl, signals["hdr"], signals["hdr_delta"], signals["host"], signals["me"],
                           signals["timeout_ns"], int(stage), ll_net.ring_arg(net, ctl), R=num_ranks, SHRINK=shrink,
                           USE_CLOCK=signals["use_clock"], NET=net is not None, num_warps=1)
