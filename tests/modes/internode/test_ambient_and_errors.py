"""Across hosts (and, for the ambient defaults, in every mode): ambient torch defaults change nothing, and ranks
that disagree raise ``ValueError`` on every rank naming the field and each rank's value with global rank numbers
(docs/design.md, "Error model")."""
import pytest
import torch

from tests.cases import internode as cases
from triton_ep.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(str(o) for o in bad)
    return out


@pytest.mark.parametrize("mode", sorted(cases.AMBIENT_MODES))
def test_ambient_defaults_change_nothing(mode):
    """Every mode (within one host: normal and low-latency; across 2 hosts of 1 rank: normal mode on the host path
    and on the capture path, low-latency mode) gives bit for bit the plain state's outputs when its Buffer is
    built and called under ``torch.set_default_dtype(torch.bfloat16)`` and a default device other than its own
    ('meta' stands in for DeepEP's 'cuda' on CPU): every tensor it makes names its device and dtype."""
    out = _values(run_ranks(cases.ambient_defaults, 2, {}, mode, "meta", torch.bfloat16, timeout_s=240))
    assert all(n == out[0] and n > 5 for n in out), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", sorted(cases.AMBIENT_MODES))
def test_ambient_defaults_change_nothing_gpu(mode):
    """The GPU twin: 2 processes sharing the GPU, under ``torch.set_default_device('cuda')`` and
    ``torch.set_default_dtype(torch.bfloat16)`` as DeepEP's test_internode.py runs (pinned host memory must be
    made on the CPU by name)."""
    out = _values(run_ranks(cases.ambient_defaults, 2, {}, mode, "cuda", torch.bfloat16, "cuda", timeout_s=240))
    assert all(n == out[0] and n > 5 for n in out), out


@pytest.mark.parametrize("kind,want", [
    # rank 3's x is narrower: its RDMA peer (rank 1) finds it in the header exchange, ranks 0 and 2 hear it from
    # their host's rank in the forwarding leg
    ("dispatch_hidden", "dispatch: hidden: rank 1 passed 64, rank 3 passed 32"),
    # rank 3 combines narrower rows: host 1's reduce finds it, the header exchange tells host 0
    ("combine_hidden", "combine: hidden: rank 2 passed 64, rank 3 passed 32"),
    pytest.param("dispatch_hidden_in_host",
                 "dispatch: record bytes (16 + hidden times the element size of x): rank",
                 marks=pytest.mark.extended),
    pytest.param("dispatch_topk", "dispatch: top-k (topk_idx columns): rank 0 passed 2, rank 2 passed 3",
                 marks=pytest.mark.extended),
    pytest.param("combine_weights", "combine: topk_weights columns: rank 0 passed 0, rank 1 passed 2",
                 marks=pytest.mark.extended),
    pytest.param("cached_hidden", "cached dispatch: hidden: rank 1 passed 32, rank 3 passed 64",
                 marks=pytest.mark.extended),
])
def test_disagreement_is_a_value_error_on_every_rank(kind, want):
    """2 hosts of 2 ranks on the host path; one rank's call differs from the others' (its hidden size, its top-k,
    combine weights given or not; found between RDMA peers or inside a host): every rank raises ValueError naming
    the field and both values with global rank numbers (docs/design.md: "ranks disagree" is a ValueError on every
    rank, not EPRemoteError), and a correct dispatch + combine works afterwards."""
    env = {"TRITON_EP_RANKS_PER_HOST": "2", "TRITON_EP_RDMA": "emulated"}
    out = _values(run_ranks(cases.disagreement, 4, env, kind, timeout_s=240))
    for r, (err, after) in enumerate(out):
        assert err is not None and err[0] == "ValueError" and want in err[1], (r, err)
        assert "within the host" not in err[1], (r, err)
        assert after is True, (r, out)
    if kind == "dispatch_hidden_in_host":       # (rank 1 and rank 3 pass 32: each host names its own two ranks)
        assert all("rank 0 passed 144, rank 1 passed 80" in out[r][0][1] for r in (0, 1)), out
        assert all("rank 2 passed 144, rank 3 passed 80" in out[r][0][1] for r in (2, 3)), out


def test_a_host_runtime_message_gets_global_rank_numbers():
    """A host's own runtime numbers its ranks from 0 (host 1 of 2 ranks: global ranks 2 and 3); what internode
    mode raises from it names global ranks, wherever a rank number appears."""
    from triton_ep.runtime.hosts import global_ranks
    text = ("rank 0: rank 1 failed the call at 'dispatch/send' (rank 1 raised the details); ranks 0 and 1 disagree; "
            "peers 0, 1; waited for rank(s) 1; ranks [0, 1]; round 12; chunk 1; host 1; rank 7")
    assert global_ranks(text, [2, 3]) == (
        "rank 2: rank 3 failed the call at 'dispatch/send' (rank 3 raised the details); ranks 2 and 3 disagree; "
        "peers 2, 3; waited for rank(s) 3; ranks [2, 3]; round 12; chunk 1; host 1; rank 7")
