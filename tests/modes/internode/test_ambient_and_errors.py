"""Across hosts (and, for the ambient defaults, in every mode): ambient torch defaults change nothing, and ranks
that disagree raise ``ValueError`` on every rank naming the field and each rank's value with global rank numbers
(docs/design.md, "Error model")."""
import pytest
import torch

import internode_cases as cases
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
