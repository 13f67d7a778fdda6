"""Low-latency failure words (``LFAILED``) carry the rank that failed first: a rank whose wait ended on a peer's
word records, and passes on, that word's root rather than the peer that relayed it (kernels.flags.post_error under
the interpreter on CPU tensors; the protocol's host forms read what the kernel wrote)."""
import pytest
import torch
import triton
import triton.language as tl

from triton_ep.kernels import flags as F
from triton_ep.protocol import signal_header as P


@triton.jit
def _post(hdr, hdr_delta, host, ctl, kind, peer, me, lcall, R: tl.constexpr):
    F.post_error(hdr, hdr_delta, host, kind, peer, F.STAGE_LL_DISPATCH_RECV, 1, me, R, ctl, lcall)


def _ranks(R, me):
    """One int64 area per rank (its header, then its low-latency control block), seen from rank ``me``."""
    hw, cw = P.header_words.host(R), P.ll_ctl_words.host(R)
    size = hw + cw
    area = torch.zeros(R * size, dtype=torch.int64)
    delta = torch.tensor([(r - me) * size for r in range(R)], dtype=torch.int64)
    host = torch.zeros(int(P.H_WORDS) + R, dtype=torch.int64)
    return area, delta, host, size, hw


def _lfailed(area, size, hw, R, r, s):
    return int(area[r * size + hw + P.off_ll_failed.host(R) + s])


@pytest.mark.parametrize("R,me,peer,word_call,word_kind,word_root,kind", [
    (4, 2, 3, 7, int(P.E_FAILED), 0, int(P.E_FAILED)),       # relayed: rank 3 failed because rank 0 did
    (4, 2, 3, 6, int(P.E_FAILED), 0, int(P.E_FAILED)),       # the peer's word names another call: not relayed
    (4, 2, 1, 7, int(P.E_MISMATCH), 3, int(P.E_MISMATCH)),   # a disagreement found first on rank 3
    (4, 2, 3, 7, 0, 0, int(P.E_FAILED)),                     # no word: the failure is this rank's own
    (6, 0, 5, 9, int(P.E_FAILED), 4, int(P.E_FAILED)),
])
def test_a_failure_names_and_passes_on_the_rank_that_failed_first(R, me, peer, word_call, word_kind, word_root,
                                                                     kind):
    area, delta, host, size, hw = _ranks(R, me)
    lcall = 7 if R == 4 else 9
    if word_kind:
        area[me * size + hw + P.off_ll_failed.host(R) + peer] = P.ll_failure_word_of(word_call, word_kind, word_root)
    hdr, ctl = area[me * size:], area[me * size + hw:]
    _post[(1,)](hdr, delta, host, ctl, kind, peer, me, lcall, R=R)
    relayed = word_kind != 0 and word_call == lcall
    root = word_root if relayed else me
    assert int(host[int(P.H_KIND)]) == kind
    assert int(host[int(P.H_PEER)]) == (root if relayed else peer)
    for r in range(R):
        if r == me:
            continue
        w = _lfailed(area, size, hw, R, r, me)
        assert w == P.ll_failure_word_of(lcall, kind, root), (r, w)
        assert (P.ll_failure_call(w), P.ll_failure_root(w), w & 7) == (lcall, root, kind)
    assert int(area[me * size + int(P.W_ERR)]) == kind


def test_host_forms_round_trip_large_calls_and_ranks():
    """The call field keeps call numbers past 2**40 and the root field ranks up to 2**16 - 1, as int and tensor."""
    for call, kind, root in ((0, 3, 0), (1, 4, 65535), (2 ** 40 + 3, 3, 1234)):
        w = P.ll_failure_word_of(call, kind, root)
        assert (P.ll_failure_call(w), P.ll_failure_root(w), w & 7) == (call, root, kind)
        t = torch.tensor([w], dtype=torch.int64)
        assert int(P.ll_failure_call(t)) == call and int(P.ll_failure_root(t)) == root
