"""The opt-in programmatic dependent launch of the low-latency kernels and of normal mode's within one host
(triton_ep/kernels/pdl.py): read from ``TRITON_EP_PDL`` at import, never on under the interpreter, judged at the
first call of either mode (a bad value,
or a GPU older than Hopper, raises ``ValueError`` before anything launches). Compiled for sm_90 here (no GPU
needed), a kernel's first instruction is ``griddepcontrol.wait`` where it is on, and there is none where it is
off. The GPU side (the low-latency GPU tests with ``TRITON_EP_PDL=1``) ran on an H200: benchmarks/README.md."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from triton_ep.kernels import interpreted, pdl


@pytest.mark.parametrize("value", ["1", "on", "yes", "true"])
def test_pdl_stays_off_under_the_interpreter(value, monkeypatch):
    if not interpreted():
        pytest.skip("interpreter only")
    monkeypatch.setenv("TRITON_EP_PDL", value)
    assert pdl.pdl_enabled() is False


def test_pdl_switch_values(monkeypatch):
    """The values of TRITON_EP_FUSED, any case, spaces ignored; unset or empty is off; anything else is no switch
    (kept as the raw string, which the first low-latency call rejects)."""
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    for v, want in (("1", True), (" 1 ", True), ("ON", True), ("yes", True), ("TRUE", True), ("true\n", True),
                    ("0", False), ("", False), ("off", False), ("No", False), ("2", "2"), ("enable", "enable")):
        monkeypatch.setenv("TRITON_EP_PDL", v)
        assert pdl._switch() == want and type(pdl._switch()) is type(want), v
        assert pdl.pdl_enabled() is (want is True and pdl.gdc_wait is not None), v
    monkeypatch.delenv("TRITON_EP_PDL")
    assert pdl._switch() is False and pdl.pdl_enabled() is False


def test_check_rejects_a_value_that_is_no_switch(monkeypatch):
    monkeypatch.setattr(pdl, "_CHECKED", set())
    monkeypatch.setattr(pdl, "SWITCH", "2")
    with pytest.raises(ValueError, match="TRITON_EP_PDL must be 1 or 0"):
        pdl.check(torch.device("cpu"))
    monkeypatch.setattr(pdl, "SWITCH", False)
    pdl.check(torch.device("cpu"))
    assert torch.device("cpu") in pdl._CHECKED


@pytest.mark.parametrize("cap, ok", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_check_needs_hopper_where_pdl_is_on(monkeypatch, cap, ok):
    """PDL on and a GPU below compute capability 9.0: a ValueError naming it (griddepcontrol would not compile);
    Hopper or newer passes. (The capability is stubbed: no GPU is touched.)"""
    monkeypatch.setattr(pdl, "_CHECKED", set())
    monkeypatch.setattr(pdl, "SWITCH", True)
    monkeypatch.setattr(pdl, "PDL_ON", True)
    monkeypatch.setattr(pdl, "_capability", lambda d: cap)
    monkeypatch.setattr(torch.version, "hip", None)
    dev = torch.device("cuda", 0)
    if ok:
        pdl.check(dev)
    else:
        with pytest.raises(ValueError, match=f"compute capability 9.0.*has {cap[0]}.{cap[1]}"):
            pdl.check(dev)
    monkeypatch.setattr(pdl, "PDL_ON", False)       # off: any GPU passes
    monkeypatch.setattr(pdl, "_CHECKED", set())
    pdl.check(dev)


def test_off_means_no_launch_option():
    """Off (the default, and always on CPU): no ``launch_pdl`` compile option."""
    if pdl.PDL_ON:
        pytest.skip("TRITON_EP_PDL is on in this process")
    assert pdl.options() == {}


_PTX = textwrap.dedent('''
    import json
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    import triton_ep.kernels.pdl as pdl
    from triton_ep.kernels import combine, dispatch, ll_combine, ll_dispatch, ll_fused

    @triton.jit
    def k(x_ptr, y_ptr):
        pdl.pdl_start()
        tl.store(y_ptr, tl.load(x_ptr) + 1)

    @triton.jit
    def k_normal(x_ptr, y_ptr):
        pdl.pdl_wait()
        tl.store(y_ptr, tl.load(x_ptr) + 1)
        pdl.pdl_release()

    def ptx_of(fn):
        src = triton.compiler.ASTSource(fn=fn, signature={"x_ptr": "*fp32", "y_ptr": "*fp32"}, constexprs={})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=pdl.options()).asm["ptx"]

    ptx, ptx_n = ptx_of(k), ptx_of(k_normal)
    las = (ll_dispatch._ll_route_launch, ll_dispatch._ll_dispatch_send_launch, ll_dispatch._ll_dispatch_recv_launch,
           ll_combine._ll_combine_send_launch, ll_combine._ll_combine_reduce_launch,
           ll_fused._ll_dispatch_fused_launch, ll_fused._ll_combine_fused_launch,
           ll_fused._ll_combine_fused_logfmt_launch,
           dispatch._dispatch_send_launch, dispatch._dispatch_recv_launch, dispatch._dispatch_fused_launch,
           combine._combine_send_launch, combine._combine_reduce_launch, combine._combine_fused_launch)
    print(json.dumps([pdl.PDL_ON, [la.options.get("launch_pdl", False) for la in las],
                      ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"), ptx.find("ld.global"),
                      [ptx_n.find("griddepcontrol.wait"), ptx_n.find("ld.global"), ptx_n.find("st.global"),
                       ptx_n.find("griddepcontrol.launch_dependents")]]))
''')


@pytest.mark.parametrize("value", ["1", "0"])
def test_compiled_for_sm90_the_kernel_waits_first(value, tmp_path):
    """Outside the interpreter (compiling for sm_90 on this machine, nothing launched): with ``TRITON_EP_PDL=1``
    the eight low-latency launchers (split and one-launch, the LogFMT one-launch combine's own) and the six of normal
    mode within one host (dispatch and combine, split and one-launch) carry ``launch_pdl`` and a kernel starting with
    ``pdl_start`` waits
    (``griddepcontrol.wait``) and lets the next launch start before its first load, where one in normal mode's
    form (``pdl_wait`` first, ``pdl_release`` last) waits before its first load and lets the next launch start
    only after its store; with ``0``, none of these."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_EP_PDL=value)
    script = tmp_path / "ptx_probe.py"           # (a @triton.jit function must live in a file)
    script.write_text(_PTX)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("no ptxas with this Triton")
    assert out.returncode == 0, out.stderr[-1500:]
    on, flags_, wait, launch, load, (n_wait, n_load, n_store, n_launch) = json.loads(out.stdout.strip().splitlines()[-1])
    if value == "1":
        assert on is True and flags_ == [True] * 14
        assert 0 <= wait < load and 0 <= launch < load
        assert 0 <= n_wait < n_load < n_store < n_launch
    else:
        assert on is False and flags_ == [False] * 14 and wait == -1 and launch == -1 and load >= 0
        assert n_wait == -1 and n_launch == -1 and 0 <= n_load < n_store


def test_pdl_on_in_the_environment_still_imports_and_stays_off_on_cpu():
    """A process started with ``TRITON_EP_PDL=1`` under the interpreter imports the kernels with PDL off."""
    if not interpreted():
        pytest.skip("interpreter only")
    env = dict(os.environ, TRITON_EP_PDL="1")
    out = subprocess.run([sys.executable, "-c", "import triton_ep.kernels.pdl as p, triton_ep.kernels.ll_dispatch as d; "
                          "print(p.PDL_ON, p.options())"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split() == ["False", "{}"]


def test_first_low_latency_call_rejects_a_bad_value(monkeypatch):
    """End to end (one rank, a fresh process): ``TRITON_EP_PDL=2`` makes the first low-latency dispatch raise
    ``ValueError`` naming the variable."""
    from tests.cases import ll as ll_cases
    from triton_ep.testing import run_ranks
    monkeypatch.setenv("TRITON_EP_PDL", "2")
    # spawned: the switch is read when triton_ep is imported, and a fork server imported it without the variable
    res = run_ranks(ll_cases.pdl_bad_value, 1, start_method="spawn")
    assert isinstance(res[0], str) and "TRITON_EP_PDL must be 1 or 0" in res[0], res
