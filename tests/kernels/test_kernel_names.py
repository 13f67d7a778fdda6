"""The names kernels show in a profiler (``triton_ep.kernels.names``): DeepEP's programs look a call's kernels up
by ``dispatch`` / ``combine`` / ``notify`` (one line of the profiler's table per word) and, with a receive hook,
split the ``::dispatch`` launches into a send and a receive phase. On CPU the launch log under the interpreter
stands in for the profiler; on a GPU the same lookup runs on ``torch.profiler``'s table."""
import os
import shutil
import subprocess

import pytest

from tests.cases import names as names_cases
from triton_ep.kernels import names
from triton_ep.testing import run_ranks

D, C, N = names.PHASE_WORDS

#: per call, launches whose name holds each word, in the one-launch form and in the split form; words not
#: listed must not appear. Within one host a cached dispatch and a combine exchange no counts: no notify there.
NORMAL = {
    "get_dispatch_layout": ({}, {}),
    "dispatch": ({N: 1, D: 1}, {N: 2, D: 2}),
    "cached dispatch 0": ({D: 1}, {D: 2}),
    "cached dispatch 1": ({D: 1}, {D: 2}),
    "combine 0": ({C: 1}, {C: 2}),
    "combine 1": ({C: 1}, {C: 2}),
}
#: across hosts every call's network leg posts its streams' headers (counts, status) under the notify name
INTERNODE = {
    "get_dispatch_layout": ({}, {}),
    "dispatch": ({N: 2, D: 1}, {N: 3, D: 2}),
    "cached dispatch 0": ({N: 1, D: 1}, {N: 1, D: 2}),
    "cached dispatch 1": ({N: 1, D: 1}, {N: 1, D: 2}),
    "combine 0": ({N: 1, C: 1}, {N: 1, C: 2}),
    "combine 1": ({N: 1, C: 1}, {N: 1, C: 2}),
}
LOW_LATENCY = {
    "dispatch 0": ({D: 1}, {D: 2}),
    "dispatch 1": ({D: 1}, {D: 2}),
    "dispatch with hook": ({D: 1}, {D: 1}),
    "dispatch with hook: hook": ({D: 1}, {D: 1}),
    "combine 0": ({C: 1}, {C: 2}),
    "combine 1": ({C: 1}, {C: 2}),
    "combine with hook": ({C: 1}, {C: 1}),
    "combine with hook: hook": ({C: 1}, {C: 1}),
}


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def _check(by_form: dict, expected: dict, prefix: str) -> None:
    """Every call launched, per word, the expected number of kernels (one launch / split); across all calls each
    word is held by one name only (one line of a profiler's table), a qualified ``triton_ep::`` name."""
    for form, steps in by_form.items():
        assert set(steps) == set(expected), (form, sorted(steps))
        seen = {w: set() for w in names.PHASE_WORDS}
        for call, launched in steps.items():
            want = expected[call][0 if form == "one launch" else 1]
            got = {w: sum(w in n for n in launched) for w in names.PHASE_WORDS}
            assert got == {w: want.get(w, 0) for w in names.PHASE_WORDS}, (form, call, launched)
            assert all(n.startswith("triton_ep::") and n.endswith("()") for n in launched), (form, call, launched)
            for w in names.PHASE_WORDS:
                seen[w] |= {n for n in launched if w in n}
        for w, found in seen.items():
            assert len(found) <= 1, (form, w, found)
            assert all(n.startswith(prefix) for n in found), (form, w, found)


def test_mangled_names_read_back_as_the_qualified_names():
    """The symbol is the Itanium ABI's name of ``triton_ep::...()``; where binutils' c++filt exists, it demangles
    the symbol to the name the docs list (CUPTI demangles kernel names the same way)."""
    assert names.mangle("triton_ep", "intranode", "dispatch") == "_ZN9triton_ep9intranode8dispatchEv"
    assert names.demangled("triton_ep", "layout") == "triton_ep::layout()"
    with pytest.raises(ValueError, match="C identifier"):
        names.mangle("triton_ep", "low-latency")
    tool = shutil.which("c++filt")
    if tool is None:
        pytest.skip("no c++filt here to demangle with")
    parts = [("triton_ep", "low_latency", "dispatch"), ("triton_ep", "fp8_cast")]
    out = subprocess.run([tool] + [names.mangle(*p) for p in parts], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [names.demangled(*p) for p in parts]


@pytest.mark.multiprocess
def test_normal_mode_within_one_host():
    """Layout, dispatch, cached dispatch (replayed too) and combine on 2 ranks, both launch forms."""
    out = _values(run_ranks(names_cases.normal_mode_calls, 2))
    for r in out:
        _check(r, NORMAL, "triton_ep::")


@pytest.mark.multiprocess
def test_normal_mode_across_hosts(monkeypatch):
    """The same calls on 2 emulated hosts of one rank: the network leg's kernels carry the notify name or a name
    of no phase (``triton_ep::internode::forward()``)."""
    monkeypatch.setenv("TRITON_EP_RANKS_PER_HOST", "1")
    monkeypatch.setenv("TRITON_EP_RDMA", "emulated")
    out = _values(run_ranks(names_cases.normal_mode_calls, 2))
    for r in out:
        _check(r, INTERNODE, "triton_ep::")


@pytest.mark.multiprocess
def test_low_latency_within_one_host():
    """Low-latency dispatch and combine without and with a receive hook, both launch forms: one dispatch and one
    combine name, launched once a call in one launch and once per phase with a hook."""
    out = _values(run_ranks(names_cases.low_latency_calls, 2))
    for r in out:
        _check(r, LOW_LATENCY, "triton_ep::low_latency::")


def test_every_kernel_carries_a_name():
    """Every ``@triton.jit`` kernel that a launcher launches is declared through :func:`names.jit` (a kernel
    declared with plain ``triton.jit`` would show its Python name, which may hold a phase word)."""
    root = os.path.join(os.path.dirname(names.__file__))
    plain = []
    for f in sorted(os.listdir(root)):
        if not f.endswith(".py"):
            continue
        lines = open(os.path.join(root, f)).read().split("\n")
        for i, line in enumerate(lines[:-1]):
            nxt = lines[i + 1] if not lines[i + 1].startswith(" ") else lines[i + 2]
            if line.startswith("@triton.jit") and "_kernel(" in nxt:
                plain.append(f"{f}:{i + 1}")
    assert not plain, plain
