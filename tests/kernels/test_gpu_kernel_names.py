"""On a GPU: DeepEP's profiler lookup (``tests/utils.py``'s ``bench_kineto``, restated in
``names_cases.profiler_lookup``) finds one table line per phase word in every mode, and with receive hooks the
``::dispatch`` / ``::combine`` trace events come two a call (send phase, receive phase)."""
import pytest

from tests.cases import names as names_cases
from triton_ep.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def _one_line_each(found: dict, call: str, absent=()):
    for word, (lines, _) in found.items():
        if word in absent:
            assert lines == [], (call, word, lines)
        else:
            assert len(lines) == 1, (call, word, lines)
            assert "triton_ep::" in lines[0], (call, word, lines)


@pytest.mark.parametrize("across", [False, True], ids=["one host", "two emulated hosts"])
def test_deepep_profiler_lookup_finds_one_kernel_per_phase(across, monkeypatch):
    if across:
        monkeypatch.setenv("TRITON_EP_RANKS_PER_HOST", "1")
        monkeypatch.setenv("TRITON_EP_RDMA", "emulated")
    for out in _values(run_ranks(names_cases.gpu_profiled_calls, 2)):
        _one_line_each(out["dispatch"], "dispatch", absent=("combine",))
        _one_line_each(out["cached dispatch"], "cached dispatch", absent=("combine",))
        _one_line_each(out["combine"], "combine", absent=("dispatch",))
        if not across:
            _one_line_each(out["low-latency"], "low-latency")
            hooked = out["low-latency with hooks"]
            _one_line_each(hooked, "low-latency with hooks")
            for word, (_, events) in hooked.items():
                assert events > 0 and events % 2 == 0, (word, events)
