"""The ``deep_ep`` switch (triton_ep/deep_ep_hook.py, triton_ep_deep_ep.pth): each case runs a fresh interpreter
that executes the ``.pth`` line as Python's ``site`` does (the shared development venv has triton-ep installed
from another checkout, without this file), then imports what an engine imports.

A fresh interpreter costs seconds on a loaded machine, so the default tier runs three: the switch off (every off
value, and a bad one) in one interpreter, the switch on serving every path, and ``missing`` with a DeepEP that does
not import. The others are extended."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PTH = (ROOT / "triton_ep_deep_ep.pth").read_text()

#: what a fresh interpreter runs first: this checkout on sys.path, then the .pth line as site.addpackage runs it
PRELUDE = f"import sys; sys.path.insert(0, {str(ROOT)!r})\nexec({PTH.strip()!r})\n"


def run_py(code: str, switch, extra_path=None, timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_EP_AS_DEEP_EP"}
    if switch is not None:
        env["TRITON_EP_AS_DEEP_EP"] = switch
    env["PYTHONPATH"] = os.pathsep.join([*( [str(extra_path)] if extra_path else []), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.extended
def test_pth_is_one_import_line_that_reads_only_the_switch():
    lines = [ln for ln in PTH.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os, sys;"), lines   # site executes lines starting "import "
    r = run_py("import sys; print(sorted(m for m in ('torch', 'triton_ep', 'triton_ep.deep_ep_hook', 'typing', "
               "'dataclasses', 'logging') if m in sys.modules))", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "['triton_ep.deep_ep_hook']", r.stdout   # the hook alone, no torch


def test_switch_off_or_bad_changes_nothing_in_one_interpreter():
    """Every off value, then a bad one, each through the .pth line in turn: no finder, no hook module, no
    ``deep_ep``; the bad value is named once on stderr."""
    r = run_py(f"""
        import importlib.util, os, sys
        for value in (None, '0', '', 'off', 'no', 'FALSE', 'yes please'):
            if value is None:
                os.environ.pop('TRITON_EP_AS_DEEP_EP', None)
            else:
                os.environ['TRITON_EP_AS_DEEP_EP'] = value
            exec({PTH.strip()!r})
            assert not any(hasattr(f, 'triton_ep_deep_ep') for f in sys.meta_path), value
            assert 'triton_ep.deep_ep_hook' not in sys.modules, value
            assert importlib.util.find_spec('deep_ep') is None, value
            try:
                import deep_ep
            except ModuleNotFoundError:
                pass
            else:
                raise AssertionError(value)
        exec({PTH.strip()!r})     # (some Pythons run a venv's .pth files twice at start-up: the line runs once)
        print('absent')
    """, None)
    assert r.returncode == 0 and r.stdout.strip() == "absent", (r.stdout, r.stderr)
    assert r.stderr.count("not installed") == 1 and "TRITON_EP_AS_DEEP_EP='yes please'" in r.stderr, r.stderr
    # (the message lists every value the switch takes, as docs/engines.md does)
    assert "1 / true / yes / on" in r.stderr and "0 / false / no / off / empty / unset" in r.stderr, r.stderr


@pytest.mark.extended
@pytest.mark.parametrize("switch", [None, "0", "", "off"])
def test_switch_off_changes_nothing(switch):
    r = run_py("""
        import importlib.util, sys
        assert not any(hasattr(f, 'triton_ep_deep_ep') for f in sys.meta_path)
        assert 'triton_ep.deep_ep_hook' not in sys.modules
        assert importlib.util.find_spec('deep_ep') is None
        try:
            import deep_ep
        except ModuleNotFoundError:
            print('absent')
    """, switch)
    assert r.returncode == 0 and r.stdout.strip() == "absent", (r.stdout, r.stderr)


def test_switch_on_serves_every_deep_ep_path_the_engines_import():
    r = run_py(f"""
        import importlib.util, logging, sys
        hook = sys.modules['triton_ep.deep_ep_hook']
        exec({PTH.strip()!r})     # (some Pythons run a venv's .pth files twice at start-up: installed once)
        assert sys.modules['triton_ep.deep_ep_hook'] is hook
        assert sum(hasattr(f, 'triton_ep_deep_ep') for f in sys.meta_path) == 1
        logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')
        spec = importlib.util.find_spec('deep_ep')            # vLLM's has_deep_ep()
        assert spec is not None and spec.origin.endswith('triton_ep/_deep_ep/__init__.py'), spec
        from deep_ep import Buffer, Config, EventOverlap       # SGLang's import (deepep.py:54), vLLM's names
        import deep_ep, triton_ep
        import deep_ep.buffer, deep_ep.utils, deep_ep.buffers.legacy, deep_ep.buffers.elastic, deep_ep.utils.event
        assert issubclass(Buffer, triton_ep.Buffer) and Config is triton_ep.Config and EventOverlap is triton_ep.EventOverlap
        assert deep_ep.buffer.Buffer is Buffer is deep_ep.buffers.legacy.Buffer and deep_ep.topk_idx_t is triton_ep.topk_idx_t
        assert deep_ep.__triton_ep__ and deep_ep.Buffer.num_sms == 20
        assert hasattr(deep_ep, 'ElasticBuffer') == hasattr(triton_ep, 'ElasticBuffer')   # vLLM's V2 probe
        from deep_ep import ElasticBuffer                      # SGLang's deepep_v2.py:42
        assert ElasticBuffer is triton_ep.ElasticBuffer is deep_ep.buffers.elastic.ElasticBuffer
        assert deep_ep.EPHandle is triton_ep.EPHandle          # vLLM's annotations (deepep_v2.py:136)
        assert deep_ep.EventHandle is deep_ep.utils.event.EventHandle is deep_ep.utils.EventHandle is triton_ep.EventHandle
        import torch
        assert deep_ep.utils.event.EventOverlap is EventOverlap
        assert (deep_ep.EventHandle().event is None) == (not torch.cuda.is_available())   # DeepEP 2's no-arg form
        for name, call in (('get_physical_domain_size', lambda: deep_ep.get_physical_domain_size(None)),
                           ('get_logical_domain_size', lambda: deep_ep.get_logical_domain_size(None))):
            try:
                call()
            except NotImplementedError as ex:
                assert name in str(ex), ex
            else:
                raise AssertionError(name)
    """, "1")
    assert r.returncode == 0, r.stderr
    assert "INFO triton_ep deep_ep is triton-ep" in r.stderr, r.stderr


def _fake_deep_ep(tmp_path) -> Path:
    pkg = tmp_path / "real" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return tmp_path / "real"


@pytest.mark.extended
def test_a_real_deep_ep_is_shadowed_loudly_or_left_alone(tmp_path):
    real = _fake_deep_ep(tmp_path)
    r = run_py("import deep_ep; print(getattr(deep_ep, 'REAL', False), deep_ep.__file__)", "1", extra_path=real)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False ") and "triton_ep/_deep_ep" in r.stdout
    assert "WARNING" not in r.stderr      # the last-resort handler prints the message itself
    assert f"the DeepEP at {real / 'deep_ep' / '__init__.py'} is shadowed" in r.stderr, r.stderr
    r = run_py("""
        import deep_ep
        from triton_ep import deep_ep_hook
        print(deep_ep.REAL); print('\\n'.join(deep_ep_hook.describe()))
    """, "missing", extra_path=real)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True\n") and f"a DeepEP at {real / 'deep_ep' / '__init__.py'}" in r.stdout


def test_missing_counts_a_deep_ep_that_does_not_import_as_absent(tmp_path):
    """(A new user's find: from a DeepEP source checkout whose ``deep_ep_cpp`` was never built, ``missing`` took it
    as installed: ``import deep_ep`` raised ModuleNotFoundError, and ``info`` named it without a word.) Installed
    means importable: ``find_spec`` still finds that DeepEP (vLLM's check), the import gives way to triton-ep with a
    WARNING naming it and its error, the failed import's submodules are gone (``deep_ep.utils`` is triton-ep's),
    and ``info``'s lines say it does not import, with the switch ``missing`` and off."""
    pkg = tmp_path / "checkout" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import utils\nimport deep_ep_cpp\n")
    (pkg / "utils.py").write_text("REAL = True\n")
    init = pkg / "__init__.py"
    r = run_py("""
        import importlib.util, sys
        print(importlib.util.find_spec('deep_ep').origin)
        import deep_ep, deep_ep.utils
        from deep_ep import Buffer
        print(deep_ep.__triton_ep__, hasattr(deep_ep.utils, 'REAL'), deep_ep.utils.__file__)
        from triton_ep import deep_ep_hook
        print('\\n'.join(deep_ep_hook.describe()))
        deep_ep_hook.uninstall()
        for name in [n for n in sys.modules if n == 'deep_ep' or n.startswith('deep_ep.')]:
            del sys.modules[name]
        print('\\n'.join(deep_ep_hook.describe({})))
    """, "missing", extra_path=init.parents[1])
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == str(init) and out[1].startswith("True False ") and "triton_ep/_deep_ep/utils" in out[1], out
    why = "ModuleNotFoundError: No module named 'deep_ep_cpp'"
    assert f"the DeepEP at {init} does not import ({why})" in r.stderr, r.stderr
    assert "  deep_ep    triton-ep (" in out[4] and out[5] == f"  not used   the DeepEP at {init}: it does not import " \
                                                             f"({why})", out
    assert out[-1] == f"  deep_ep    a DeepEP at {init}, which does not import ({why}): `import deep_ep` fails here", out


@pytest.mark.extended
def test_bad_switch_value_is_named_and_installs_nothing():
    r = run_py("import sys; print(any(hasattr(f, 'triton_ep_deep_ep') for f in sys.meta_path))", "yes please")
    assert r.returncode == 0 and r.stdout.strip() == "False"
    assert "TRITON_EP_AS_DEEP_EP='yes please'" in r.stderr and "not installed" in r.stderr, r.stderr


@pytest.mark.extended
def test_info_says_which_deep_ep_is_in_use(tmp_path):
    r = run_py("from triton_ep.__main__ import print_deep_ep; import sys; print_deep_ep(sys.stdout)", "1")
    assert r.returncode == 0, r.stderr
    assert "hook       installed by pth, mode 'on'" in r.stdout and "deep_ep    triton-ep (" in r.stdout, r.stdout
    r = run_py("from triton_ep.__main__ import print_deep_ep; import sys; print_deep_ep(sys.stdout)", "1",
               extra_path=_fake_deep_ep(tmp_path))
    assert "shadowed   the DeepEP at" in r.stdout, r.stdout
    r = run_py("from triton_ep.__main__ import print_deep_ep; import sys; print_deep_ep(sys.stdout)", None)
    assert "unset (off)" in r.stdout and "hook       not installed\n" in r.stdout, r.stdout
