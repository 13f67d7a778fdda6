"""docs/start.md, "Start the ranks of your own program" (linked from README's quick start): the two scripts it
shows are examples/start_torchrun.py and examples/start_spawn.py word for word, and each makes a correct
dispatch + combine round trip on CPU with 2 ranks (torchrun over gloo, and torch.multiprocessing's spawn over
gloo). README shows the quick start's commands and names no folder outside the checkout."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("start_torchrun.py", "start_spawn.py")


START = ROOT / "docs" / "start.md"


def python_blocks(path: Path) -> list:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("name", SCRIPTS)
def test_start_page_shows_the_script_as_it_is(name):
    assert (ROOT / "examples" / name).read_text() in python_blocks(START)
    assert f"(../examples/{name})" in START.read_text()
    assert f"(examples/{name})" in (ROOT / "README.md").read_text()
    assert "(docs/start.md)" in (ROOT / "README.md").read_text()


def test_readme_quick_start_commands():
    """The commands CI and users run, as the README shows them (.ci/run runs ``./run.sh pytest``)."""
    text = (ROOT / "README.md").read_text()
    for command in ("./run.sh python examples/moe_layer.py", "./run.sh pytest", "./run.sh python -m triton_ep info"):
        assert command in text, command
    assert (ROOT / "examples" / "moe_layer.py").is_file()


def test_readme_names_no_folder_outside_the_checkout():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "../shared" not in page.read_text(), page


def run_cpu(args, tmp_path) -> subprocess.CompletedProcess:
    """``python ARGS`` from a folder outside the checkout, with no GPU visible (CPU ranks over gloo)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", [["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                     str(ROOT / "examples" / "start_torchrun.py")],
                                    [str(ROOT / "examples" / "start_spawn.py"), "2"]],
                         ids=["torchrun", "spawn"])
def test_start_script_round_trip_is_correct_on_cpu(launch, tmp_path):
    r = run_cpu(launch, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    said = re.findall(r"^rank (\d+)/2 \(gloo, cpu\): sent 8 tokens, received \d+, round trip (\w+)$", r.stdout, re.M)
    assert sorted(said) == [("0", "correct"), ("1", "correct")], r.stdout + r.stderr
