"""run.sh: sets .venv up once, then runs commands at once and silently; repairs a changed or partial .venv.

Runs a copy of run.sh in a temporary folder with a stand-in Python (a shell script that logs each call,
"imports" once something was "pip installed", and makes a venv folder) and a stand-in
scripts/install_pyverbs.sh, so every path is taken in milliseconds without installing anything.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_DIR/log"
case "$1 ${2:-}" in
    "-c "*) [ -e "$FAKE_DIR/installed" ] ;;
    "-m venv") mkdir -p "$3/bin" "$3/lib/python3.11/site-packages" && cp "$0" "$3/bin/python" ;;
    "-m pip") case " $* " in *" --dry-run "*) ;; *) touch "$FAKE_DIR/installed" .venv/lib/python3.11/site-packages ;; esac ;;
esac
"""
FAKE_INSTALL_PYVERBS = """#!/usr/bin/env bash
echo "install_pyverbs $*" >> "$FAKE_DIR/log"
"""


def checkout(tmp_path: Path, installed: bool) -> Path:
    """A folder with copies of run.sh and pyproject.toml, the stand-ins, and the stand-in Python at fake/python3."""
    co = tmp_path / "co"
    (co / "scripts").mkdir(parents=True)
    for f in ("run.sh", "pyproject.toml"):
        shutil.copy2(ROOT / f, co / f)
    for path, text in ((co / "scripts" / "install_pyverbs.sh", FAKE_INSTALL_PYVERBS),
                       (tmp_path / "fake" / "python3", FAKE_PYTHON)):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    if installed:
        (tmp_path / "fake" / "installed").touch()
    return co


def run(co: Path, *cmd: str):
    """``./run.sh CMD`` in ``co`` with the stand-in Python; returns (stdout, stderr, new log lines)."""
    fake = co.parent / "fake"
    log = fake / "log"
    before = log.read_text().splitlines() if log.exists() else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # an outer run.sh may have set it
    env.update(FAKE_DIR=str(fake), PYTHON=str(fake / "python3"))
    r = subprocess.run(["./run.sh", *cmd], cwd=co, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    after = log.read_text().splitlines() if log.exists() else []
    return r.stdout, r.stderr, after[len(before):]


def test_first_setup_shows_steps_then_calls_are_silent_and_skip_the_checks(tmp_path):
    co = checkout(tmp_path, installed=False)
    out, err, calls = run(co, "echo", "hi")
    assert out == "hi\n"
    lines = err.splitlines()
    assert lines[0] == "[run.sh] setting up .venv (no .venv yet)"
    assert [l.split(" ...")[0] for l in lines if l.endswith(" ...")] == [
        "[run.sh] 1/5 creating .venv with " + str(tmp_path / "fake" / "python3"), "[run.sh] 2/5 torch (CPU build)",
        "[run.sh] 4/5 triton-ep (editable install of this checkout)",
        "[run.sh] 5/5 pyverbs (optional; silent when it already imports)"]
    assert "[run.sh] 3/5 triton numpy pytest hypothesis tqdm prometheus-client: already there" in lines
    assert lines[-1].startswith("[run.sh] .venv ready in ")
    assert "python -m pip install -q --disable-pip-version-check torch==2.13.0" in calls
    assert "python -m pip install -q --disable-pip-version-check --no-deps -e ." in calls
    assert calls[-1] == "install_pyverbs .venv/bin/python"
    for _ in range(2):
        t0 = time.perf_counter()
        out, err, calls = run(co, "echo", "hi")
        assert (out, err, calls) == ("hi\n", "", [])   # no import check, no install_pyverbs, nothing said
        assert time.perf_counter() - t0 < 5             # (about 10 ms; the bound only guards against a hang)


def test_a_changed_or_partial_venv_is_checked_again(tmp_path):
    co = checkout(tmp_path, installed=False)
    run(co, "true")
    site = co / ".venv" / "lib" / "python3.11" / "site-packages"
    later = time.time() + 5
    os.utime(site, (later, later))                                  # what a pip install/uninstall does
    _, err, calls = run(co, "true")
    assert err.startswith("[run.sh] setting up .venv (packages in .venv changed)\n[run.sh] 1/5 .venv: already there\n")
    assert "[run.sh] 2/5 torch (CPU build): already there" in err and calls[-1] == "install_pyverbs .venv/bin/python"
    assert run(co, "true")[1:] == ("", [])
    with open(co / "pyproject.toml", "a") as f:
        f.write("\n")
    assert run(co, "true")[1].startswith("[run.sh] setting up .venv (run.sh or pyproject.toml changed)\n")
    (co / ".venv" / ".run.sh-ok").unlink()                         # a setup that was interrupted
    assert run(co, "true")[1].startswith("[run.sh] setting up .venv (first run, or an earlier setup did not finish)\n")
    assert run(co, "true")[1:] == ("", [])


def test_where_torch_already_imports_and_there_is_no_venv_it_is_used_as_is(tmp_path):
    co = checkout(tmp_path, installed=True)
    out, err, calls = run(co, "bash", "-c", 'echo "$PYTHONPATH"; command -v python3')
    assert out.splitlines() == [str(co), str(tmp_path / "fake" / "python3")]
    assert (err, calls) == ("", ["python -c import torch, triton, numpy"])
    assert not (co / ".venv").exists()


def test_the_command_runs_in_the_callers_folder_and_setup_in_the_checkout(tmp_path):
    """Issue 17, item 6: ``path/to/run.sh python script.py ARG`` from another folder runs script.py of that
    folder with ARG resolved against it (it used to cd to the checkout: "can't open file"), whichever path
    run.sh takes (first setup, stamped .venv, torch already importing); .venv is made in the checkout."""
    caller = tmp_path / "elsewhere"
    (caller / "data").mkdir(parents=True)
    (caller / "data" / "in.txt").write_text("payload\n")
    (caller / "script.py").write_text("import os, sys\nprint(os.getcwd()); print(open(sys.argv[1]).read().strip())\n")
    for installed in (False, True):
        base = tmp_path / f"installed_{installed}"
        co = checkout(base, installed=installed)
        fake = base / "fake"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(FAKE_DIR=str(fake), PYTHON=str(fake / "python3"))
        for _ in range(2):   # the first call may set .venv up, the second finds it stamped
            r = subprocess.run([str(co / "run.sh"), sys.executable, "script.py", "data/in.txt"], cwd=caller,
                               env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.splitlines() == [str(caller), "payload"]
        assert (co / ".venv").is_dir() != installed and not (caller / ".venv").exists()
