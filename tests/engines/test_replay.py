"""The engines' DeepEP call sequences (engines/vllm_calls.py, engines/sglang_calls.py) replayed against triton-ep
through ``import deep_ep`` on CPU ranks, every result checked against the reference (engines/replay.py).
Default tier: vLLM's low-latency backend with its fault-tolerance clean between decode steps, SGLang's normal
mode, and SGLang's deepep_v2 (DeepEP V2's ElasticBuffer: expanded prefill with a host wait, masked decode without),
2 ranks on one host; the rest (every sequence, V1 and V2, 2 ranks on one host and 4 ranks on 2 emulated hosts) is
extended."""
from __future__ import annotations

import pytest

from tests.engines import sglang_calls, vllm_calls
from tests.engines.replay import Shape, replay_rank
from triton_ep.testing import run_ranks

EMULATED = {"TRITON_EP_RANKS_PER_HOST": "2", "TRITON_EP_RDMA": "emulated"}
ALL = [("vllm_calls", s.backend) for s in vllm_calls.SEQUENCES] + \
      [("sglang_calls", s.backend) for s in sglang_calls.SEQUENCES]
DEFAULT = {("vllm_calls", "deepep_low_latency", 2), ("sglang_calls", "deepep_normal", 2),
           ("sglang_calls", "deepep_v2", 2)}


def _replay(module, backend, world, env):
    shape = Shape(H=512 if "ue8m0" in backend else 256)
    out = run_ranks(replay_rank, world, module, backend, shape, env, timeout_s=900)
    for r, o in enumerate(out):
        assert hasattr(o, "checks"), f"rank {r}: {o!r}\n{getattr(o, 'traceback', '')}"
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("module,backend", ALL)
def test_engine_sequence_replays(module, backend, world, request):
    if (module, backend, world) not in DEFAULT:
        request.applymarker(pytest.mark.extended)
        if not request.config.getoption("--extended"):
            pytest.skip("extended tier: pytest --extended")
    out = _replay(module, backend, world, EMULATED if world == 4 else {})
    seq = next(s for s in (vllm_calls.SEQUENCES + sglang_calls.SEQUENCES) if s.backend == backend)
    n_checks = sum(1 for st in seq.steps for c in st.calls if c.op == "check")
    for o in out:
        assert len(o.checks) == n_checks, o.checks
        assert o.deep_ep_file.endswith("triton_ep/_deep_ep/__init__.py")
        assert all("@" in c for c in o.calls if not c.split("/")[-1].startswith(("expert", "check"))), o.calls


def test_every_engine_call_cites_its_source_line():
    for seq in vllm_calls.SEQUENCES + sglang_calls.SEQUENCES:
        for c in seq.calls():
            if c.op in ("expert", "check"):
                assert not c.cite
                continue
            path, _, line = c.cite.rpartition(":")
            assert "@" in path and line.isdigit(), (seq.backend, c)
