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


def test_readme_tree_and_install_list_are_the_checkouts():
    """(A new user's find: the README's tree left out a dozen parts of the package, and its install list
    prometheus-client.) Every file and folder of triton_ep/ is in "How it works"; every package run.sh installs
    in its setup is in "Install"."""
    text = (ROOT / "README.md").read_text()
    tree = text.split("## How it works\n\n```\n")[1].split("```")[0]
    parts = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "triton_ep").iterdir()
             if p.name != "__pycache__" and p.name != "__init__.py" and not p.name.endswith(".egg-info")}
    assert not {p for p in parts if p not in tree}, parts
    install = text.split("## Install")[1].split("## ")[0].replace("\n", " ")
    step = re.search(r'pip install "\$\{pip_q\[@\]\}" (triton numpy [^\n]*)', (ROOT / "run.sh").read_text()).group(1)
    assert not [p for p in step.split() if p not in install], step


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


def _example_module(name: str, monkeypatch):
    """``examples/NAME.py`` imported as a module (its ``sys.path`` and environment changes undone afterwards)."""
    import importlib.util
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", os.environ.get("NCCL_NVLS_ENABLE", "0"))
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)      # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv,why", [
    (["--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["--hosts", "0"], "argument --hosts: must be at least 1, got 0"),
    (["--ranks", "two"], "argument --ranks: must be an int at least 1, got 'two'"),
    (["--hosts", "3"], "--ranks 2 must be a multiple of --hosts 3 (hosts of equal size)"),
    (["--ranks", "6", "--hosts", "4"], "--ranks 6 must be a multiple of --hosts 4"),
])
def test_replay_examples_check_their_arguments_before_any_rank_starts(argv, why, no_ranks, capsys):
    """(A new user's find: ``replay_vllm.py --ranks 0`` gave an IndexError traceback; ``--hosts 3`` with 2 ranks a
    traceback naming TRITON_EP_RANKS_PER_HOST='0', never set.) The replays' options are positive ints and the
    ranks split evenly into the hosts, checked at parse time: exit 2, argparse's line."""
    from tests.engines.replay import replay_main
    with pytest.raises(SystemExit) as ex:
        replay_main("vllm_calls", "vLLM", "deepep_low_latency", "test", argv)
    assert ex.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.parametrize("argv,why", [
    (["--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["--tokens", "-1"], "argument --tokens: must be at least 0, got -1"),
    (["--iters", "0"], "argument --iters: must be at least 1, got 0"),
    (["--timeout", "nan"], "argument --timeout: must be seconds in (0, 1e9], got 'nan'"),
    (["--hidden", "7"], "--hidden 7 must be a multiple of 8"),
    (["--device", "cpu", "--ranks", "3"], "--experts 32 must be a multiple of the ranks (3)"),
])
def test_moe_layer_example_checks_its_arguments(argv, why, monkeypatch, capsys):
    """examples/moe_layer.py's options use triton_ep.argtypes and are checked together at parse time: exit 2."""
    mod = _example_module("moe_layer", monkeypatch)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as ex:
        mod.parse_args(argv)
    assert ex.value.code == 2 and why in capsys.readouterr().err
    assert mod.parse_args(["--device", "cpu", "--ranks", "2", "--tokens", "0"]).tokens == 0


def test_start_spawn_refuses_a_bad_rank_count(tmp_path):
    """``start_spawn.py 0`` (or text): argparse's error, exit 2, before any process starts."""
    r = run_cpu([str(ROOT / "examples" / "start_spawn.py"), "0"], tmp_path)
    assert r.returncode == 2 and "argument ranks: must be at least 1, got 0" in r.stderr, r.stderr
