"""The opt-in programmatic dependent launch of the low-latency kernels (triton_ep/kernels/pdl.py): read from
``TRITON_EP_PDL`` at import, never on under the interpreter, and where it is off the launchers get no
``launch_pdl`` option (the kernels' ``pdl_start`` compiles to nothing). The GPU side (the low-latency GPU tests
with ``TRITON_EP_PDL=1``) ran on an H200: benchmarks/README.md."""
import os
import subprocess
import sys

import pytest

from triton_ep.kernels import interpreted, ll_combine, ll_dispatch, pdl


@pytest.mark.parametrize("value", ["1", "on", "yes", "true"])
def test_pdl_stays_off_under_the_interpreter(value, monkeypatch):
    if not interpreted():
        pytest.skip("interpreter only")
    monkeypatch.setenv("TRITON_EP_PDL", value)
    assert pdl.pdl_enabled() is False


def test_pdl_switch_values(monkeypatch):
    """Only 1 / true / yes / on switch it on (where a GPU runs the kernels); anything else leaves it off."""
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    if pdl.gdc_wait is None:
        pytest.skip("this Triton has no gdc_wait")
    for v, want in (("1", True), ("ON", True), ("yes", True), ("0", False), ("", False), ("2", False), ("off", False)):
        monkeypatch.setenv("TRITON_EP_PDL", v)
        assert pdl.pdl_enabled() is want, v
    monkeypatch.delenv("TRITON_EP_PDL")
    assert pdl.pdl_enabled() is False


def test_off_means_no_launch_option():
    """Off (the default, and always on CPU): the low-latency launchers carry no ``launch_pdl``."""
    if pdl.PDL_ON:
        pytest.skip("TRITON_EP_PDL is on in this process")
    assert pdl.options() == {}
    for la in (ll_dispatch._ll_route_launch, ll_dispatch._ll_dispatch_send_launch, ll_dispatch._ll_dispatch_recv_launch,
               ll_combine._ll_combine_send_launch, ll_combine._ll_combine_reduce_launch):
        assert "launch_pdl" not in la.options


def test_pdl_on_in_the_environment_still_imports_and_stays_off_on_cpu():
    """A process started with ``TRITON_EP_PDL=1`` on this machine imports the kernels with PDL off."""
    if not interpreted():
        pytest.skip("interpreter only")
    env = dict(os.environ, TRITON_EP_PDL="1")
    out = subprocess.run([sys.executable, "-c", "import triton_ep.kernels.pdl as p, triton_ep.kernels.ll_dispatch as d; "
                          "print(p.PDL_ON, 'launch_pdl' in d._ll_route_launch.options)"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split() == ["False", "False"]
