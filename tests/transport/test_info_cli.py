"""`python -m triton_ep info`: the device/GID table and the QP plan."""
from __future__ import annotations

import io
import subprocess
import sys

from triton_ep.__main__ import info, main


def test_info_emulated_prints_gids_and_a_balanced_plan():
    out = io.StringIO()
    assert info(["--emulated", "--num-qps", "6", "--n-paths", "3"], out=out) == 0
    text = out.getvalue().splitlines()
    marked = [l.split() for l in text if l.rstrip().endswith("*")]
    assert [(r[0], r[1], r[7], r[9]) for r in marked] == [("mlx5_0", "1", "3", "RoCEv2"), ("mlx5_0", "2", "3", "RoCEv2")]
    start = next(i for i, l in enumerate(text) if l.startswith("QP plan per peer: 6 QPs over 2 port(s), 3 paths"))
    rows = [l.split() for l in text[start + 3:start + 9]]
    assert [r[2] for r in rows] == ["1", "2"] * 3
    assert sorted(r[6] for r in rows) == ["0", "0", "1", "1", "2", "2"]
    assert len({r[5] for r in rows}) == 6


def test_info_without_rdma_says_why(capsys):
    rc = info([])
    if rc == 0:
        return   # a host with an RDMA device: the table printed is the real one
    assert rc == 1
    err = capsys.readouterr().err
    assert "no RDMA device" in err or "pyverbs does not import" in err


def test_module_entry_point_and_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "triton_ep", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "python -m triton_ep info" in r.stdout
