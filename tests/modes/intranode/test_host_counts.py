"""Host work per call flat in T (issue 50, item 1), counted, not timed: benchmarks/host_counts.py at T 128 and 4096
with a buffer of DeepEP's size hint (for hidden 7168: a T 4096 call takes two rounds) and the GPU's tuning table,
every call as one launch (``TRITON_EP_FUSED=1``, what the GPU table does up to its ``fused`` ``max_tokens``)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytestmark = pytest.mark.multiprocess


def _counts(tmp_path, fused: str) -> dict:
    env = dict(os.environ, TRITON_EP_FUSED=fused,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_counts.py"), "--tokens", "128,4096",
                        "--calls", "cached", "combine", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "host_counts.json").read_text())["results"]


def test_cached_dispatch_and_combine_launch_and_allocate_the_same_at_every_T(tmp_path):
    """A cached dispatch and a combine (both replayed) make one launch at T 128 and at T 4096 (two rounds there: the
    one launch loops over them), and the same torch ops on the host, but for the combine's fp32 sums that a call of
    several rounds carries between rounds (one ``empty`` more, no weights here, and that one Python call more)."""
    res = _counts(tmp_path, "1")
    small, large = res["128"], res["4096"]
    for call, kernel in (("cached", "dispatch_fused"), ("combine", "combine_fused")):
        assert small[call]["launches"] == {kernel: 1} == large[call]["launches"], (call, small[call], large[call])
    assert small["cached"]["torch_ops"] == large["cached"]["torch_ops"] == {"empty": 1}
    assert small["combine"]["torch_ops"] == {"empty": 1} and large["combine"]["torch_ops"] == {"empty": 2}
    assert large["cached"]["py_calls"] == small["cached"]["py_calls"]
    assert large["combine"]["py_calls"] == small["combine"]["py_calls"] + 1


@pytest.mark.extended
def test_split_launches_grow_with_the_rounds(tmp_path):
    """Without the one launch (``TRITON_EP_FUSED=0``) a call makes a send and a receive launch per round: 2 at T 128,
    4 at T 4096 (what the counts above are measured against)."""
    res = _counts(tmp_path, "0")
    for call in ("cached", "combine"):
        assert sum(res["128"][call]["launches"].values()) == 2, res["128"][call]
        assert sum(res["4096"][call]["launches"].values()) == 4, res["4096"][call]
