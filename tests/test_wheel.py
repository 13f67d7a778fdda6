"""triton-ep's wheel carries the ``deep_ep`` switch: built from a copy of this checkout (``pip wheel --no-deps
--no-build-isolation``: offline, with the setuptools of the running environment), it holds ``triton_ep_deep_ep.pth``
at its root (setup.py's ``build_py`` puts it there) and ``triton_ep/deep_ep_hook.py``; installed into a throwaway
``--target`` directory, that directory as a site directory (``site.addsitedir``, which runs its ``.pth`` files as
Python's start-up does for site-packages) makes ``import deep_ep`` resolve to that triton-ep when
``TRITON_EP_AS_DEEP_EP=1``, and changes nothing without it. Nothing is installed into the running environment.

Building a wheel and starting two interpreters costs tens of seconds on a loaded machine: the extended tier."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PTH = "triton_ep_deep_ep.pth"
#: what a wheel build reads from the checkout (pyproject.toml's packages are ``triton_ep*``)
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", PTH, "triton_ep")

pytestmark = pytest.mark.extended


def _pip(*args: str, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_EP_AS_DEEP_EP")}
    env.update(PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"pip {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


def _run_in_site(target: Path, switch: str | None, code: str) -> subprocess.CompletedProcess:
    """A fresh interpreter without the running environment's site processing (``-S``): ``target`` added as a site
    directory (its ``.pth`` files run), then this environment's package directories appended as plain paths (torch,
    triton; their ``.pth`` files, among them an editable triton-ep's, do not run), then ``code``."""
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    prelude = (f"import site, sys\nsite.addsitedir({str(target)!r})\n"
               f"sys.path += [p for p in {sorted(paths)!r} if p not in sys.path]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_EP_AS_DEEP_EP")}
    if switch is not None:
        env["TRITON_EP_AS_DEEP_EP"] = switch
    return subprocess.run([sys.executable, "-S", "-c", prelude + textwrap.dedent(code)], env=env, cwd=target,
                          capture_output=True, text=True, timeout=300)


def test_wheel_carries_the_switch(tmp_path):
    src, out, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src), cwd=tmp_path)
    wheels = list(out.glob("triton_ep-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        assert PTH in names, sorted(n for n in names if "/" not in n)          # at the root: site-packages
        assert z.read(PTH).decode() == (ROOT / PTH).read_text()
        for mod in ("triton_ep/deep_ep_hook.py", "triton_ep/_deep_ep/__init__.py", "triton_ep/_deep_ep/utils/event.py",
                    "triton_ep/_deep_ep/buffers/elastic.py", "triton_ep/elastic/__init__.py",
                    "triton_ep/elastic/layout.py"):
            assert mod in names, mod
    _pip("install", "--no-deps", "--target", str(target), str(wheels[0]), cwd=tmp_path)
    assert (target / PTH).is_file() and (target / "triton_ep" / "deep_ep_hook.py").is_file()

    on = _run_in_site(target, "1", f"""
        import importlib.util
        spec = importlib.util.find_spec('deep_ep')
        assert spec is not None and spec.origin.startswith({str(target)!r}), spec
        hook = sys.modules['triton_ep.deep_ep_hook']         # installed at start-up by the .pth, from the target
        assert hook.__file__.startswith({str(target)!r}), hook.__file__
        import deep_ep, deep_ep.utils.event, triton_ep
        assert deep_ep.__triton_ep__ and triton_ep.__file__.startswith({str(target)!r}), triton_ep.__file__
        assert deep_ep.ElasticBuffer is triton_ep.ElasticBuffer and issubclass(deep_ep.Buffer, triton_ep.Buffer)
        print('deep_ep is', deep_ep.__file__)
    """)
    assert on.returncode == 0, on.stderr
    assert f"deep_ep is {target}" in on.stdout, on.stdout
    off = _run_in_site(target, None, f"""
        import importlib.util
        spec = importlib.util.find_spec('deep_ep')
        assert spec is None or not spec.origin.startswith({str(target)!r}), spec
        assert 'triton_ep.deep_ep_hook' not in sys.modules and 'triton_ep' not in sys.modules
    """)
    assert off.returncode == 0, off.stderr
