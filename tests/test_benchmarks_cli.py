"""The benchmark scripts as a user runs them on a machine without a GPU (issue 10, item 6).

Each script runs in a subprocess with no size arguments, as the README says to run it: it must finish quickly
(tiny shapes under the Triton interpreter; the DeepSeek-V3 shapes take minutes and would hit the timeout),
write its file where ``--out`` says (by default under the ignored ``out/`` folder), leave the committed GPU
results in ``benchmarks/results/`` exactly as they are, print no H200 target verdicts (``MISS``/``met``), and
say that its figures are interpreter time. Skipped where CUDA is present: there the defaults are the GPU shapes.
"""
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TIMEOUT_S = 180
CPU_NOTE = "say nothing about GPU speed"
VERDICT = re.compile(r"^\s*(MISS|met)\s", re.MULTILINE)

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the defaults are DeepSeek-V3 shapes")]


def results_state(root: str = ROOT) -> dict:
    """Every file under ``<root>/benchmarks/results``: relative path -> sha256 of its bytes."""
    folder = os.path.join(root, "benchmarks", "results")
    state = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                state[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return state


def git_status_results() -> str:
    """``git status --porcelain`` of benchmarks/results in this checkout ("" where git cannot say)."""
    r = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "benchmarks/results"],
                       capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def python(args, cwd: str) -> subprocess.CompletedProcess:
    """This Python on ``args`` in ``cwd``, this checkout importable, output captured, bounded by TIMEOUT_S."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def run_bench(script: str, *args: str, root: str = ROOT) -> subprocess.CompletedProcess:
    """``python <root>/benchmarks/<script> args`` from ``root``; checked exit 0."""
    r = python([os.path.join(root, "benchmarks", script), *args], root)
    assert r.returncode == 0, f"{script} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def bench_module(name: str):
    """The benchmark script ``benchmarks/<name>.py`` imported into this process (to call its argument parser: a
    process each costs seconds of imports)."""
    bench_dir = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(bench_dir)


def assert_parse_error(parse_args, args, why: str, capsys) -> None:
    """``parse_args(args)`` exits with argparse's status 2 and ``why`` on stderr."""
    with pytest.raises(SystemExit) as ex:
        parse_args(list(args))
    err = capsys.readouterr().err
    assert ex.value.code == 2 and why in err, (args, err)


@pytest.fixture
def results_untouched():
    """Asserts, after the test, that the committed results in this checkout are byte for byte as before."""
    before, status = results_state(), git_status_results()
    assert before, "benchmarks/results/ should hold the committed GPU results"
    yield
    assert results_state() == before
    assert git_status_results() == status


def assert_cpu_report(r: subprocess.CompletedProcess, note: str = CPU_NOTE) -> None:
    """No H200 target verdicts, nothing about time-slicing a GPU, and the CPU ``note`` on stdout."""
    assert not VERDICT.search(r.stdout), r.stdout
    assert "MISS" not in r.stdout + r.stderr
    assert "time-slice" not in r.stdout
    assert note in r.stdout


@pytest.mark.extended
def test_bench_kernels_default_writes_under_ignored_out(tmp_path, results_untouched):
    """No arguments at all (a copy of the scripts, so the default folder is the copy's ``out/``): the file
    lands in ``out/benchmarks``, the copy's committed results are unchanged, targets are reported as not
    applicable."""
    copy = tmp_path / "checkout"
    for part in ("benchmarks", "examples"):
        shutil.copytree(os.path.join(ROOT, part), copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = results_state(str(copy))
    r = run_bench("bench_kernels.py", root=str(copy))
    assert results_state(str(copy)) == before
    out = json.loads((copy / "out" / "benchmarks" / "kernels.json").read_text())
    assert out["small"] and out["shape"]["tokens"] == 24
    assert out["checks_ok"] and out["targets"] is None and out["targets_skipped"]
    assert CPU_NOTE in out["note"] and CPU_NOTE in out["e2e"]["note"]
    assert_cpu_report(r)
    assert "not applicable to this run" in r.stdout


def test_bench_kernels_out(tmp_path, results_untouched):
    """``--out`` names the folder; nothing else is written there but the JSON (no matplotlib in CI) or the chart."""
    r = run_bench("bench_kernels.py", "--no-e2e", "--out", str(tmp_path / "k"))
    assert set(os.listdir(tmp_path / "k")) <= {"kernels.json", "kernels.png"}
    assert json.loads((tmp_path / "k" / "kernels.json").read_text())["checks_ok"]
    assert_cpu_report(r)


@pytest.mark.extended
def test_bench_ep8_out(tmp_path, results_untouched):
    """Four ranks on CPU, tiny shapes; ``ep8.json`` in ``--out`` with its CPU note; checks pass."""
    r = run_bench("bench_ep8.py", "--out", str(tmp_path / "e"))
    out = json.loads((tmp_path / "e" / "ep8.json").read_text())
    assert out["ok"] and out["ranks"] == 4 and out["tokens"] == 24 and out["device"] == "cpu"
    assert "say nothing about GPU or NVLink speed" in out["note"]
    assert_cpu_report(r, out["note"])


def test_default_out_is_ignored_and_not_results():
    """Both file-writing scripts default to a folder git ignores, outside benchmarks/results."""
    outs = [bench_module(name).parse_args([]).out for name in ("bench_kernels", "bench_ep8")]
    for out in outs:
        rel = os.path.relpath(out, ROOT)
        assert not rel.startswith(os.path.join("benchmarks", "results")) and not rel.startswith("..")
        ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", os.path.join(rel, "kernels.json")])
        if ignored.returncode == 128:
            pytest.skip("not a git checkout")
        assert ignored.returncode == 0, f"{rel} is not ignored by git"


def test_profile_phases_default_is_cpu_sized():
    """No arguments: tiny shapes, every phase row, and a line saying the times are not a GPU's."""
    r = run_bench("profile_phases.py")
    assert "24 tokens x 256" in r.stdout
    assert_cpu_report(r, "say nothing about a GPU")
    rows = [line for line in r.stdout.splitlines() if line.startswith("  ") and " | " in line]
    # the poll of the notify's counts is the one host wait left on the data path (dispatch); combine has none
    assert any("whole call | total" in line for line in rows)
    assert any("dispatch/notify (host wait)" in line for line in rows)


def test_host_cost_out(tmp_path, results_untouched):
    """One rank on CPU: every call's host µs and its launcher calls (a cached dispatch and a combine make two
    launches, a plain dispatch given its layout four: notify, notify receive, send, receive; a low-latency
    dispatch three: route, send, receive; its combine two), in ``host_cost.json`` under ``--out``."""
    r = run_bench("host_cost.py", "--iters", "2", "--out", str(tmp_path / "h"))
    out = json.loads((tmp_path / "h" / "host_cost.json").read_text())
    by = {c["call"]: c for c in out["results"]}
    assert set(by) == {"layout", "dispatch", "worst", "cached", "combine", "ll_dispatch", "ll_combine"}
    assert out["device"].startswith("cpu")
    assert sum(by["cached"]["launches"].values()) == 2 and sum(by["combine"]["launches"].values()) == 2
    assert by["ll_dispatch"]["launches"] == {"ll_route": 1, "ll_dispatch_send": 1, "ll_dispatch_recv": 1}
    assert by["ll_combine"]["launches"] == {"ll_combine_send": 1, "ll_combine_reduce": 1}
    assert sum(by["dispatch"]["launches"].values()) == 4 and "routing_layout" not in by["dispatch"]["launches"]
    assert all(c["host_us"] > 0 for c in out["results"])
    assert_cpu_report(r, "say nothing about a GPU")


@pytest.mark.extended
def test_host_cost_against_a_copy(tmp_path, results_untouched):
    """``host_cost.py --against``: the in-process A/B against another checkout (here a copy of this one's package): both sides timed, the
    other side's Buffer really runs from the copy, ``ratio`` = this / other
    per call in ``host_cost_ab.json``; a call the other checkout cannot make is one line naming what failed."""
    other = tmp_path / "other"
    shutil.copytree(os.path.join(ROOT, "triton_ep"), other / "triton_ep",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = run_bench("host_cost.py", "--against", str(other), "--calls", "cached", "ll_dispatch", "--iters", "1",
                  "--rounds", "2", "--out", str(tmp_path / "ab"))
    out = json.loads((tmp_path / "ab" / "host_cost_ab.json").read_text())
    by = {c["call"]: c for c in out["results"]}
    assert set(by) == {"cached", "ll_dispatch"}
    for c in by.values():
        assert c["this_us"] > 0 and c["other_us"] > 0
        assert c["ratio"] == pytest.approx(c["this_us"] / c["other_us"])
    assert out["other_code"] == str(other / "triton_ep" / "buffer.py")
    assert out["this_code"] == os.path.join(ROOT, "triton_ep", "buffer.py")
    assert_cpu_report(r, "say nothing about a GPU")
    # a checkout without low-latency mode: its normal-mode calls still compare; asking for a low-latency call
    # is one line naming what failed (the suite's leak check covers the /dev/shm files of its processes)
    with open(other / "triton_ep" / "buffer.py", "a") as f:
        f.write("\n\ndef _no_ll(self, *args, **kwargs):\n    raise NotImplementedError('planted: no low-latency mode')\n"
                "\n\nBuffer.low_latency_dispatch = _no_ll\n")
    run_bench("host_cost.py", "--against", str(other), "--calls", "cached", "--iters", "1", "--rounds", "1",
              "--out", str(tmp_path / "ab2"))
    r = python([os.path.join(ROOT, "benchmarks", "host_cost.py"), "--against", str(other), "--calls", "ll_dispatch",
                "--iters", "1", "--rounds", "1", "--out", str(tmp_path / "ab3")], ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "the other checkout's Buffer cannot make the calls asked for" in r.stderr and "planted" in r.stderr


def test_host_cost_refuses_a_bad_against(tmp_path, capsys):
    """``--against`` without a package, naming this checkout, or naming no folder, and ``--against`` with
    ``--diff``: exit status 2 and why."""
    parse_args = bench_module("host_cost").parse_args
    for bad, why in ((str(tmp_path), "holds no triton_ep package"), (ROOT, "names this checkout itself"),
                     (str(tmp_path / "nowhere"), "is not a folder")):
        assert_parse_error(parse_args, ["--against", bad], why, capsys)
    assert_parse_error(parse_args, ["--against", str(tmp_path), "--diff", "a.json", "b.json"], "takes no --against",
                       capsys)


@pytest.mark.extended
def test_grid_cap_fused_pair(tmp_path, results_untouched):
    """``grid_cap.py --fused --pair`` (what fused_replay.py measured): one rank on CPU, a row at the first cap, one
    with split launches (``TRITON_EP_FUSED=0``) and one with a fused launch per call (``=1``), each timing the
    cached dispatch, the combine and the two in one step, outputs bit for bit equal; the switch is unset again
    afterwards; a bad switch value is an argparse error."""
    r = run_bench("grid_cap.py", "--tokens", "16", "--caps", "0", "--fused", "--pair", "--out", str(tmp_path / "f"))
    out = json.loads((tmp_path / "f" / "grid_cap.json").read_text())
    assert [row["setting"] for row in out["results"]] == [
        "grid.programs_per_sm=0", "grid.programs_per_sm=0;env.TRITON_EP_FUSED=0",
        "grid.programs_per_sm=0;env.TRITON_EP_FUSED=1"]
    for row in out["results"]:
        assert row["results_equal"] and row["tokens"] == 16 and row["pair_us"] > 0
        assert math.isclose(row["pair_ratio"], row["pair_us"] / out["results"][0]["pair_us"])
    assert "TRITON_EP_FUSED" not in os.environ
    assert_cpu_report(r, CPU_NOTE)
    bad = python([os.path.join(ROOT, "benchmarks", "grid_cap.py"), "--vary", "env.TRITON_EP_FUSED=2", "--out",
                  str(tmp_path / "g")], ROOT)
    assert bad.returncode == 2 and "env.TRITON_EP_FUSED=0|1" in bad.stderr, bad.stderr
    (tmp_path / "afile").write_text("x")
    for out in (str(tmp_path / "afile" / "sub"), "", "/proc/triton_ep_nu"):   # refused before anything is measured
        bad = python([os.path.join(ROOT, "benchmarks", "grid_cap.py"), "--out", out], ROOT)
        assert bad.returncode == 2 and "--out" in bad.stderr, bad.stderr


def test_grid_cap_out(tmp_path, results_untouched, capsys):
    """One rank on CPU: cached dispatch and combine under two grid caps, timed and bit for bit equal, in
    ``grid_cap.json`` under ``--out`` with each cap's ratio to the first; the tuning table's cap, read after the
    runs, is the default again; bad ``--caps`` are argparse errors."""
    from triton_ep.kernels import _util
    r = run_bench("grid_cap.py", "--out", str(tmp_path / "g"))
    out = json.loads((tmp_path / "g" / "grid_cap.json").read_text())
    assert [(row["tokens"], row["programs_per_sm"]) for row in out["results"]] == [(320, 0), (320, 1)]
    for row in out["results"]:
        assert row["results_equal"] and row["dispatch_us"] > 0 and row["combine_us"] > 0
        assert math.isclose(row["dispatch_ratio"], row["dispatch_us"] / out["results"][0]["dispatch_us"])
    assert out["default_programs_per_sm"] == _util.INTERP_TUNING["grid"]["programs_per_sm"] == 0
    assert_cpu_report(r, CPU_NOTE)
    parse_args = bench_module("grid_cap").parse_args
    for caps, why in (("1,x", "comma-separated ints"), ("-1", ">= 0"), ("0,0", "twice")):
        assert_parse_error(parse_args, ["--caps", caps, "--out", str(tmp_path / "h")], why, capsys)


@pytest.mark.extended
def test_grid_cap_vary(tmp_path, results_untouched):
    """``--vary`` adds a row per value (the defaults at the first cap with that one tuning entry changed) and
    ``--config`` one row changing several; each is timed, bit for bit equal to the first row, ratioed to it, and
    the tuning table is the default again afterwards."""
    from triton_ep.kernels import _util
    before = {k: dict(v) for k, v in _util.INTERP_TUNING.items()}
    run_bench("grid_cap.py", "--caps", "1", "--vary", "dispatch_recv.num_warps=2,8",
              "--config", "combine_send.block_w=1024;grid.programs_per_sm=0", "--out", str(tmp_path / "g"))
    out = json.loads((tmp_path / "g" / "grid_cap.json").read_text())
    assert [row["setting"] for row in out["results"]] == [
        "grid.programs_per_sm=1", "grid.programs_per_sm=1;dispatch_recv.num_warps=2",
        "grid.programs_per_sm=1;dispatch_recv.num_warps=8", "combine_send.block_w=1024;grid.programs_per_sm=0"]
    # a --vary row runs at the first cap (1, not the table's 0), as its label says
    assert out["results"][1]["tuning"] == {"grid.programs_per_sm": 1, "dispatch_recv.num_warps": 2}
    assert [row["programs_per_sm"] for row in out["results"]] == [1, 1, 1, 0]
    for row in out["results"]:
        assert row["results_equal"] and row["dispatch_us"] > 0 and row["combine_us"] > 0
        assert math.isclose(row["combine_ratio"], row["combine_us"] / out["results"][0]["combine_us"])
    assert out["default_tuning"] == before          # (read by the benchmark after its runs)


def test_grid_cap_refuses_bad_settings(tmp_path, capsys):
    """Entries that do not exist, values of the wrong type or out of range, low-latency entries, the record layout
    and a setting given twice are argparse errors of ``grid_cap.py``."""
    grid_cap = bench_module("grid_cap")
    for args, why in ((["--vary", "nokernel.num_warps=4"], "no tuning entry"),
                      (["--vary", "dispatch_recv.nokey=4"], "no tuning entry"),
                      (["--config", "dispatch_recv.num_warps"], "no tuning entry"),
                      (["--vary", "dispatch_recv.num_warps=x"], "takes an integer"),
                      (["--vary", "dispatch_recv.num_warps=3"], "power of two"),
                      (["--vary", "dispatch_recv.block_w=0"], "power of two"),
                      (["--vary", "grid.programs_per_sm=-4"], ">= 0"),
                      (["--vary", "dispatch_send.store_cache=bogus"], "takes one of"),
                      (["--vary", "ll_send.num_warps=8"], "not a launch parameter"),
                      (["--vary", "dispatch_send.record_align_words=8"], "records' layout"),
                      (["--vary", "dispatch_recv.num_warps=4;combine_send.num_warps=8,2"], "several entries"),
                      (["--caps", "0", "--vary", "grid.programs_per_sm=0"], "twice")):
        assert_parse_error(grid_cap.parse_args, [*args, "--out", str(tmp_path / "h")], why, capsys)


def test_bench_internode_out(tmp_path, results_untouched):
    """The internode network-leg benchmark: every exchange byte-exact, the full QP plan over both ports beats
    one QP per peer in the fabric model, and the JSON says what its figures are; the inside-internode runs
    (tiny: 8 tokens, one call) report the proxy's figures from both ranks."""
    run_bench("bench_internode.py", "--tokens", "256", "--inside-tokens", "8", "--calls", "1",
              "--out", str(tmp_path / "i"))
    with open(tmp_path / "i" / "internode.json") as f:
        res = json.load(f)
    assert "virtual time" in res["note"] and len(res["results"]) == 4
    assert all(r["byte_exact"] for r in res["results"])
    full = [r["model_GBps"] for r in res["results"] if r["qps"] == 8]
    one = [r["model_GBps"] for r in res["results"] if r["qps"] == 1]
    assert min(full) > max(one), res["results"]
    inside = res["inside"]["per_rank"]
    assert len(inside) == 2 and all(r["chunks_per_call"] > 0 and r["proxy_us_per_chunk"] > 0 for r in inside), inside


@pytest.mark.extended      # (about 40-55 s on 2 cores; the network leg's own tests are in tests/modes/internode)
@pytest.mark.parametrize("arrival", [False, True])
def test_bench_low_latency_across_hosts(tmp_path, results_untouched, arrival):
    """bench_low_latency.py --hosts 2 (and with --arrival-words): the ranks as 2 hosts over the emulated fabric;
    each rank reports its network leg: one chunk per peer and call, its work requests (one more a call with
    arrival words: the chunk's arrival word), the proxy's µs, bytes on both ports, and which signal ran."""
    run_bench("bench_low_latency.py", "--hosts", "2", "--net-calls", "2", *(["--arrival-words"] if arrival else []),
              "--out", str(tmp_path / "l"))
    with open(tmp_path / "l" / "low_latency.json") as f:
        res = json.load(f)
    nets = res["results"]["network"]
    assert len(nets) == 2, nets
    for n in nets:
        assert n["calls"] == 4 and n["chunks_per_call"] == 1.0 and n["wrs_per_call"] >= (3 if arrival else 2), n
        assert n["arrival_words"] is arrival, n
        assert n["proxy_us_per_call"] > 0 and len(n["port_bytes"]) == 2 and all(v > 0 for v in n["port_bytes"].values())
    if arrival:
        bad = python([os.path.join(ROOT, "benchmarks", "bench_low_latency.py"), "--arrival-words", "--out",
                      str(tmp_path / "m")], ROOT)
        assert bad.returncode != 0 and "--arrival-words needs --hosts" in bad.stderr, bad.stderr


def _slower(src: str, dst, factor: float = 2.0) -> str:
    """A copy of the committed result ``src`` at ``dst`` with every figure ``--diff`` reads times ``factor``
    (the "after" run of a before / after pair); returns its path."""
    host_cost = bench_module("host_cost")
    with open(src) as f:
        doc = json.load(f)
    kind, _ = host_cost.figures(doc)

    def scale(d: dict, keys) -> None:
        for k in keys:
            if isinstance(d.get(k), (int, float)) and not isinstance(d[k], bool):
                d[k] *= factor
    if kind == "bench_low_latency":
        scale(doc["results"], list(doc["results"]))
        for v in (doc.get("kernels_per_replay") or {}).values():
            v[1] *= factor
    else:
        for row in doc["results"]:
            scale(row, [k for k in row if k.endswith("_us")])
            scale(row, [k for k in row if k.endswith("_frac")])
    with open(dst, "w") as f:
        json.dump(doc, f)
    return str(dst)


def test_host_cost_diff_writes_ratios(tmp_path, results_untouched):
    """``host_cost.py --diff`` on the committed low-latency result and a copy with every figure doubled: the
    figures both have, with ratio = after / before, in ``<name>.json`` under ``--out``; files of different
    scripts are refused."""
    res = os.path.join(ROOT, "benchmarks", "results")
    before = os.path.join(res, "low_latency_h200_r1.json")
    assert bench_module("host_cost").main(["--diff", before, _slower(before, tmp_path / "after.json"), "--name", "ll",
                                           "--out", str(tmp_path)]) == 0    # (in this process: a process costs seconds)
    out = json.loads((tmp_path / "ll.json").read_text())
    rows = {r["what"]: r for r in out["rows"]}
    assert rows["graph"]["ratio"] == pytest.approx(2.0)
    assert rows["graph"]["after"] == pytest.approx(2 * rows["graph"]["before"])
    assert rows["graph"]["unit"] == "GPU us" and rows["dispatch_host"]["unit"] == "host us"
    assert any(w.startswith("replay: ") for w in rows)
    with pytest.raises(ValueError, match="different scripts"):       # (in this process: a process costs seconds)
        bench_module("host_cost").main(["--diff", os.path.join(res, "host_cost_h200_r1_t128.json"), before,
                                        "--out", str(tmp_path)])


def test_host_cost_diff_reads_grid_cap_results(tmp_path, results_untouched):
    """``host_cost.py --diff`` on the committed grid_cap.py result and a copy with its figures doubled: GPU µs and
    the fraction of the copy ceiling per token count, setting and call."""
    res = os.path.join(ROOT, "benchmarks", "results", "grid_cap_h200_r1.json")
    assert bench_module("host_cost").main(["--diff", res, _slower(res, tmp_path / "after.json"), "--name", "gc",
                                           "--out", str(tmp_path)]) == 0
    rows = {r["what"]: r for r in json.loads((tmp_path / "gc.json").read_text())["rows"]}
    with open(res) as f:
        settings = json.load(f)["results"]
    row = settings[0]
    d = rows[f"T={row['tokens']} {row['setting']} dispatch"]
    assert d["unit"] == "GPU us" and d["ratio"] == pytest.approx(2.0)
    assert rows[f"T={row['tokens']} {row['setting']} combine frac"]["unit"] == "of the copy ceiling"
    assert len(rows) == 4 * len(settings)      # per row: 2 calls x (µs, frac)


@pytest.mark.extended      # (about 35 s on 2 cores: two ranks, both sides' calls interpreted)
def test_bench_calls_compare_with_itself(tmp_path, results_untouched):
    """``--compare triton_ep`` (the library against itself, two CPU ranks, tiny shapes): a row per compared
    call with finite positive figures for both sides, after a barrier and hot (host µs and µs), ratio = ours /
    peer host µs and hot_ratio = ours / peer hot host µs, one pair per repeat of each, the peer module named,
    and the CPU note; the table's header names both measurements."""
    r = run_bench("bench_calls.py", "--compare", "triton_ep", "--tokens", "16", "--iters", "1", "--warmup", "0",
                  "--repeats", "2", "--out", str(tmp_path / "c"))
    out = json.loads((tmp_path / "c" / "calls_compare.json").read_text())
    assert set(os.listdir(tmp_path / "c")) <= {"calls_compare.json", "calls_compare.png"}
    rows = {row["call"]: row for row in out["results"]}
    assert set(rows) == {"layout", "dispatch", "cached", "combine"} and len(out["results"]) == 4
    for row in rows.values():
        assert row["tokens"] == 16
        for k in ("ours_host_us", "peer_host_us", "ours_us", "peer_us",
                  "ours_hot_host_us", "peer_hot_host_us", "ours_hot_us", "peer_hot_us", "ratio", "hot_ratio"):
            assert isinstance(row[k], float) and math.isfinite(row[k]) and row[k] > 0, (k, row)
        assert row["ratio"] == pytest.approx(row["ours_host_us"] / row["peer_host_us"])
        assert row["hot_ratio"] == pytest.approx(row["ours_hot_host_us"] / row["peer_hot_host_us"])
        for key, ours, peer in (("repeats", "ours_host_us", "peer_host_us"), ("repeats_us", "ours_us", "peer_us"),
                                ("repeats_hot", "ours_hot_host_us", "peer_hot_host_us")):
            assert len(row[key]) == 2 and all(len(pair) == 2 and min(pair) > 0 for pair in row[key]), (key, row)
            assert row[ours] == pytest.approx(statistics.median(pair[0] for pair in row[key])), (key, row)
            assert row[peer] == pytest.approx(statistics.median(pair[1] for pair in row[key])), (key, row)
    assert out["ranks"] == 2 and out["backend"] == "gloo" and out["peer"]["module"] == "triton_ep"
    assert out["peer"]["file"] and out["peer"]["version"]
    assert out["hot_calls_max"] == bench_module("bench_calls").HOT_CALLS_MAX
    assert "ours hot host us" in r.stdout and "hot ratio" in r.stdout and "back to back" in r.stdout
    assert_cpu_report(r, out["note"])
    assert CPU_NOTE in out["note"]


def test_bench_calls_compare_hot_loop_bounded(capsys):
    """``--compare`` refuses more than ``HOT_CALLS_MAX`` calls per hot loop (``--warmup`` + ``--iters``): more
    could fill the GPU's launch queue and time the wait for room in it; without ``--compare`` any count goes."""
    bench_calls = bench_module("bench_calls")
    n = bench_calls.HOT_CALLS_MAX
    assert_parse_error(bench_calls.parse_args, ["--compare", "triton_ep", "--iters", str(n), "--warmup", "1"],
                       f"--warmup + --iters is at most {n}", capsys)
    assert bench_calls.parse_args(["--compare", "triton_ep", "--iters", str(n - 1), "--warmup", "1"]).iters == n - 1
    assert bench_calls.parse_args(["--iters", str(n), "--warmup", "1"]).iters == n


def test_bench_calls_compare_module_not_importable(tmp_path, capsys):
    """``--compare`` of a module that does not import: exit status 2 and the reason, before any rank starts
    (``main`` in this process: it returns before starting any)."""
    code = bench_module("bench_calls").main(["--compare", "no_such_module", "--out", str(tmp_path)])
    assert code == 2
    assert "--compare no_such_module: module not importable: " in capsys.readouterr().err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("args,want", [
    (["--ranks", "0"], "--ranks must be at least 1, got 0"),
    (["--tokens", "16,-3"], "--tokens must be comma-separated token counts of at least 1, got '16,-3'"),
    (["--tokens", ""], "--tokens must be comma-separated token counts of at least 1"),
    (["--iters", "0"], "--iters must be at least 1"), (["--repeats", "0"], "--repeats must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"), (["--timeout", "0"], "--timeout must be a number"),
    (["--buffers", "hint,0"], "--buffers must be comma-separated 'hint' or byte counts of at least 1, got '0'"),
    (["--experts", "15"], "--experts 15 is not a multiple of --ranks 2"),
    (["--topk", "99"], "--topk 99 is more than --experts 16"),
    (["--hidden", "12"], "--hidden must be a multiple of 8")])
def test_bench_calls_refuses_bad_arguments(args, want, capsys):
    """(A new user's find: ``--ranks 0`` ran nothing and exited 0, the others ended in tracebacks from the ranks.)
    Every bad count, list or size is an argparse error (exit status 2) naming it, before any rank starts."""
    assert_parse_error(bench_module("bench_calls").parse_args,
                       args + (["--ranks", "2", "--experts", "16"] if "--ranks" not in args and "--experts" not in args
                               else []), want, capsys)


@pytest.mark.parametrize("script,args,want", [
    ("bench_low_latency", ["--out", "FILE"], "FILE is a file, not a folder"),
    ("bench_low_latency", ["--out", "FILE/sub"], "FILE is a file, not a folder"),
    ("bench_low_latency", ["--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("bench_low_latency", ["--ranks", "0"], "--ranks must be at least 1, got 0"),
    ("bench_low_latency", ["--hidden", "100"], "--hidden must be a multiple of 128 (the FP8 dispatch casts"),
    ("bench_low_latency", ["--experts", "3"], "--experts 3 is not a multiple of --ranks 2"),
    ("bench_low_latency", ["--topk", "9"], "--topk 9 is more than --experts 8"),
    ("bench_low_latency", ["--timeout", "0"], "--timeout must be a number of seconds above 0, got 0.0"),
    ("bench_low_latency", ["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    ("bench_low_latency", ["--net-calls", "0"], "--net-calls must be at least 1, got 0"),
    ("bench_low_latency", ["--hosts", "3"], "--hosts 3 must divide --ranks 2"),
    ("bench_low_latency", ["--arrival-words"], "--arrival-words needs --hosts 2 or more"),
    ("bench_low_latency", ["--sweep"], "--sweep runs at --ranks 1"),
    ("bench_ep8", ["--out", "FILE"], "FILE is a file, not a folder"),
    ("bench_ep8", ["--ranks", "0"], "--ranks must be at least 1, got 0"),
    ("bench_ep8", ["--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("bench_ep8", ["--hidden", "12"], "--hidden must be a multiple of 8"),
    ("bench_ep8", ["--experts", "30"], "--experts 30 is not a multiple of --ranks 4"),
    ("bench_ep8", ["--topk", "33"], "--topk 33 is more than --experts 32"),
    ("bench_ep8", ["--timeout", "-1"], "--timeout must be a number of seconds above 0"),
    ("bench_internode", ["--out", "FILE"], "FILE is a file, not a folder"),
    ("bench_internode", ["--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("bench_internode", ["--hidden", "12"], "--hidden must be a multiple of 8"),
    ("bench_internode", ["--topk", "257"], "--topk 257 is more than --experts 256"),
    ("bench_kernels", ["--out", "FILE"], "FILE is a file, not a folder"),
    ("bench_kernels", ["--e2e-ranks", "0"], "--e2e-ranks must be at least 1, got 0"),
    ("profile_phases", ["--ranks", "0"], "--ranks must be at least 1, got 0"),
    ("profile_phases", ["--hidden", "12"], "--hidden must be a multiple of 8"),
    ("profile_phases", ["--experts", "31"], "--experts 31 is not a multiple of --ranks 2"),
    ("profile_phases", ["--topk", "33"], "--topk 33 is more than --experts 32"),
    ("bench_calls", ["--out", "FILE"], "FILE is a file, not a folder"),
    ("bench_scheduler", ["--out", "FILE"], "FILE is a file, not a folder"),
])
def test_benchmarks_refuse_bad_shapes_and_out_before_running(script, args, want, tmp_path, capsys):
    """(A new user's find: bench_low_latency.py ran the whole benchmark and then failed on ``--out <a file>``, gave
    raw tracebacks for ``--tokens 0``, ``--hidden 100``, ``--experts 3`` and exited 0 with no output for
    ``--ranks 0``.) Every benchmark taking shape options or ``--out`` refuses bad ones with the shared checks
    (``_common.check_shape_args`` / ``check_out``): argparse's error, exit status 2, one line naming the option, before
    anything runs (the parser alone, in this process)."""
    (tmp_path / "afile").write_text("x")
    args = [a.replace("FILE", str(tmp_path / "afile")) for a in args]
    mod = bench_module(script)
    parse = mod.main if script == "bench_scheduler" else mod.parse_args      # (bench_scheduler parses in main)
    assert_parse_error(parse, args, want.replace("FILE", str(tmp_path / "afile")), capsys)
    assert os.listdir(tmp_path) == ["afile"]


def test_bench_calls_compare_module_without_buffer(tmp_path, capsys):
    """``--compare`` of a module with no ``Buffer``: exit status 2 and the reason, before any rank starts."""
    assert bench_module("bench_calls").main(["--compare", "os", "--out", str(tmp_path)]) == 2
    assert "--compare os: the module has no Buffer class" in capsys.readouterr().err
