"""`triton-ep info` / `python -m triton_ep info`: versions, devices, same-host IPC, the RDMA table and the QP plan,
and the exit statuses (0 report printed with RDMA present or absent, 1 RDMA query failed, 2 bad usage)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton_ep
from triton_ep import __main__ as cli
from triton_ep.__main__ import info, main
from triton_ep.runtime import machine
from triton_ep.transport import rdma, verbs


#: the head of the report's tuned-table section
TUNED_HEAD = "Tuned table (get_dispatch_config / get_combine_config, docs/tuning.md):"


def report(argv=(), rc=0):
    out = io.StringIO()
    assert info(list(argv), out=out) == rc
    return out.getvalue()


def test_info_emulated_prints_gids_and_a_balanced_plan():
    text = report(["--emulated", "--num-qps", "6", "--n-paths", "3"]).splitlines()
    marked = [l.split() for l in text if l.rstrip().endswith("*")]
    assert [(r[0], r[1], r[7], r[9]) for r in marked] == [("mlx5_0", "1", "3", "RoCEv2"), ("mlx5_0", "2", "3", "RoCEv2")]
    start = next(i for i, l in enumerate(text) if l.startswith("QP plan per peer: 6 QPs over 2 port(s), 3 paths"))
    rows = [l.split() for l in text[start + 3:start + 9]]
    assert [r[2] for r in rows] == ["1", "2"] * 3
    assert sorted(r[6] for r in rows) == ["0", "0", "1", "1", "2", "2"]
    assert len({r[5] for r in rows}) == 6


def check_sections(text: str) -> None:
    """The versions, deep_ep switch, devices, tuned table, same-host IPC, internode and RDMA sections of a report
    from this host, in that order."""
    heads = [l for l in text.splitlines() if l and not l.startswith(" ")]
    assert heads[:5] == ["Versions:", "deep_ep (serving engines' import, docs/engines.md):", "Devices:", TUNED_HEAD,
                         "Same-host IPC:"]
    assert heads[5].startswith("Internode (")
    assert heads[6].startswith(("RDMA: absent", "RDMA devices ("))
    deep_ep = text.split("\n\n")[1].splitlines()[1:]
    assert [l.split()[0] for l in deep_ep[:3]] == ["switch", "hook", "deep_ep"]
    versions = dict(l.split(None, 1) for l in text.split("\n\n")[0].splitlines()[1:])
    assert versions["triton-ep"].startswith(triton_ep.__version__ + " ")
    assert versions["torch"] == torch.__version__
    assert set(versions) == {"triton-ep", "python", "torch", "triton", "numpy", "pyverbs"}
    if not torch.cuda.is_available():
        assert "  cuda      none (" in text
        assert "  kernels   interpreted: Triton's interpreter on CPU tensors (TRITON_INTERPRET=1: no CUDA device)" in text
        assert "  no GPU: ranks share buffers through POSIX shared memory in /dev/shm (writable, " in text


def test_info_prints_every_section_and_exits_0_on_this_host():
    check_sections(report())


def test_info_without_rdma_says_absent_and_exits_0(monkeypatch):
    def no_pyverbs():
        raise rdma.RdmaUnavailable("pyverbs does not import (ModuleNotFoundError); run scripts/install_pyverbs.sh")
    monkeypatch.setattr(verbs, "load_pyverbs", no_pyverbs)
    text = report()
    assert text.endswith("RDMA: absent\n  triton-ep RDMA: pyverbs does not import (ModuleNotFoundError); "
                         "run scripts/install_pyverbs.sh\n")
    check_sections(text)


def test_info_exits_1_when_a_device_fails_a_query_or_is_not_there(monkeypatch, capsys):
    def broken(api, names=None):
        raise rdma.RdmaError("query port failed: [Errno 5]", device="mlx5_0", port=1)
    text = report(["--emulated", "--devices", "mlx5_7"], rc=1)
    assert text.endswith("RDMA: query failed (the error is on stderr)\n")
    assert "['mlx5_7'] not among ['mlx5_0']" in capsys.readouterr().err
    monkeypatch.setattr(verbs, "discover", broken)
    report(["--emulated"], rc=1)
    assert capsys.readouterr().err == "triton-ep RDMA: query port failed: [Errno 5] (device mlx5_0 port 1)\n"


def test_peer_access_matrix_and_shm_fallback(monkeypatch):
    out = io.StringIO()
    machine.print_ipc(out, 3, can_access=lambda i, j: (i, j) != (2, 0))
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("  control blocks (barriers, small exchanges) in /dev/shm (writable, ")
    assert [l.split() for l in lines[-3:]] == [["cuda:0", "-", "yes", "yes"], ["cuda:1", "yes", "-", "yes"],
                                               ["cuda:2", "NO", "yes", "-"]]
    out = io.StringIO()
    machine.print_ipc(out, 1)
    assert "one GPU: ranks sharing it map each other's buffers through CUDA IPC" in out.getvalue()
    assert machine.shm_state("/proc").startswith("NOT writable (")


def test_usage_errors_exit_2_and_help_exits_0(capsys):
    assert main(["frobnicate"]) == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
    assert info(["--num-qps", "0"]) == 2
    assert "--num-qps: must be an integer in 1..1024, got 0" in capsys.readouterr().err
    assert main([]) == 0 and main(["--help"]) == 0 and info(["--help"]) == 0
    assert capsys.readouterr().out.count("Exit status:\n  0  the report was printed") == 3


@pytest.mark.parametrize("argv,usage", [
    (["info", "--bogus"], "usage: triton-ep info [-h]"),
    (["info", "stray"], "usage: triton-ep info [-h]"),
    (["tune", "--quick", "--bogus"], "usage: triton-ep tune [-h]"),
])
def test_an_unknown_argument_of_a_subcommand_prints_that_subcommands_usage(argv, usage, capsys):
    """(A new user's find: ``info --bogus`` printed the top-level usage, ``triton-ep [-h] COMMAND ...``.) An
    argument a subcommand does not know is that subcommand's usage error: exit 2 before any work, its usage and
    ``triton-ep CMD: error: unrecognized arguments: ...`` on stderr; one before the command stays the top level's."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(usage), err
    assert f"triton-ep {argv[0]}: error: unrecognized arguments: {argv[-1]}" in err and "COMMAND ..." not in err, err
    assert main(["--bogus", "info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: triton-ep [-h] COMMAND ...") and "unrecognized arguments: --bogus" in err, err


def clean_env():
    """The environment of a fresh shell: no run.sh PATH/PYTHONPATH, no TRITON_INTERPRET set by conftest."""
    keep = ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", **{k: os.environ[k] for k in keep if k in os.environ}}


def test_console_script_works_without_run_sh(tmp_path):
    script = Path(sys.executable).parent / "triton-ep"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (triton-ep not pip-installed here)")
    r = subprocess.run([str(script), "info"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    check_sections(r.stdout)
    r = subprocess.run([sys.executable, "-m", "triton_ep", "--help"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "python -m triton_ep info" in r.stdout and "Exit status:" in r.stdout


def test_info_marks_the_routable_gid_of_an_ipv6_only_table(monkeypatch):
    """Issue 12: GID 0 link-local, GID 1 2001:db8::1 (both RoCEv2) -- "use" marks index 1 and the plan uses it."""
    from triton_ep.transport import emulated as em
    port = em.PortSpec(gids=[("fe80::200:ff:fe00:1", "RoCEv2"), ("2001:db8::1", "RoCEv2")])
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [port])]))
    monkeypatch.setattr(machine, "emulated_api", fab.pyverbs)
    text = report(["--emulated", "--num-qps", "2"]).splitlines()
    rows = [l.split() for l in text if l.startswith("mlx5_0 ")]
    assert [(r[7], r[8], r[-1]) for r in rows[:2]] == [("0", "fe80:0000:0000:0000:0200:00ff:fe00:0001", "RoCEv2"),
                                                       ("1", "2001:0db8:0000:0000:0000:0000:0000:0001", "*")]


def test_info_shows_the_qos_and_rejects_bad_values(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_EP_RDMA_TC", "106")
    monkeypatch.delenv("TRITON_EP_RDMA_SL", raising=False)
    assert ("\nQoS of every QP: traffic class 106 (DSCP 26, ECN 2; TRITON_EP_RDMA_TC), service level 0 (default)\n"
            in report(["--emulated"]))
    assert ("QoS of every QP: traffic class 8 (DSCP 2, ECN 0; --traffic-class), service level 3 (--service-level)"
            in report(["--emulated", "--traffic-class", "8", "--service-level", "3"]))
    assert info(["--service-level", "16"]) == 2
    assert "--service-level: must be an integer in 0..15, got 16" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_EP_RDMA_SL", "high")
    assert report(["--emulated"], rc=2).endswith("RDMA: bad QoS setting (the error is on stderr)\n")
    assert capsys.readouterr().err == ("triton-ep info: TRITON_EP_RDMA_SL='high': the RDMA service level must be "
                                       "an integer in 0..15\n")


#: Every option of ``info`` with a value, and the text that shows its effect in the report.
OPTION_EFFECTS = {
    "--num-qps 3": "QP plan per peer: 3 QPs over ",
    "--n-paths 2": ", 2 paths, ",
    "--hash crc": ", crc path hash ",
    "--traffic-class 106": "traffic class 106 (DSCP 26, ECN 2; --traffic-class)",
    "--service-level 3": "service level 3 (--service-level)",
}


@pytest.mark.parametrize("situation", ["present", "no active port", "no GID", "absent", "query failed"])
def test_every_info_option_shows_its_effect_or_says_why_not(monkeypatch, capsys, situation):
    """Issue 17, item 7: whatever the host, each option given to ``info`` either shows in the report or gets a
    line ``  OPTION VALUE: not applied: WHY`` (``--traffic-class 106`` on a host without RDMA printed nothing)."""
    from triton_ep.transport import emulated as em
    monkeypatch.delenv("TRITON_EP_RDMA_TC", raising=False)
    monkeypatch.delenv("TRITON_EP_RDMA_SL", raising=False)
    port = {"no active port": em.PortSpec(active=False), "no GID": em.PortSpec(gids=[])}.get(situation, em.PortSpec())
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [port]), em.DeviceSpec("mlx5_1", [em.PortSpec()])]))
    monkeypatch.setattr(machine, "emulated_api", fab.pyverbs)

    def no_rdma():
        raise rdma.RdmaUnavailable("no RDMA device: listing devices failed (test)")
    monkeypatch.setattr(verbs, "load_pyverbs", no_rdma)
    if situation == "query failed":
        def broken(api, names=None):
            raise rdma.RdmaError("query port failed: [Errno 5]", device="mlx5_0", port=1)
        monkeypatch.setattr(verbs, "discover", broken)
    argv = " ".join(OPTION_EFFECTS).split()
    if situation != "absent":
        argv = ["--emulated", "--devices", "mlx5_0", *argv]
    text = report(argv, rc=1 if situation == "query failed" else 0)
    unapplied = {
        "present": set(), "no GID": {"--n-paths 2", "--hash crc"},
        "no active port": {"--num-qps 3", "--n-paths 2", "--hash crc"},
        "absent": set(OPTION_EFFECTS), "query failed": set(OPTION_EFFECTS)}[situation]
    why = {"absent": "RDMA is absent on this machine (use --emulated to see the plan)",
           "query failed": "the RDMA query failed (the error is on stderr)",
           "no active port": "no active port, so no QP plan",
           "no GID": "no flows planned (a port has no GID to hash)"}.get(situation)
    for opt, effect in OPTION_EFFECTS.items():
        line = f"\n  {opt}: not applied: {why}\n"
        assert (line in text, effect in text) == ((True, False) if opt in unapplied else (False, True)), (opt, text)
    if situation in ("present", "no active port", "no GID"):   # --emulated and --devices: the table's devices
        rows = [l.split()[0] for l in text.split("RDMA devices (emulated):\n")[1].splitlines()[2:] if l.strip()]
        assert rows and rows[0] == "mlx5_0" and "mlx5_1" not in rows
    capsys.readouterr()
    # --devices where RDMA is absent: absent, exit 0, and --devices says it was not applied (issue 46, item 9)
    text = report(["--devices", "mlx5_0"])
    assert "\nRDMA: absent\n  triton-ep RDMA: no RDMA device: listing devices failed (test)\n" in text, text
    assert text.endswith("\n  --devices mlx5_0: not applied: RDMA is absent on this machine (use --emulated to see "
                         "the plan)\n"), text
    assert capsys.readouterr().err == ""
    # QoS values from the environment are reported the same way; no option, no such line
    monkeypatch.setenv("TRITON_EP_RDMA_TC", "8")
    if situation == "absent":
        assert report().endswith("(test)\n  TRITON_EP_RDMA_TC=8: not applied: RDMA is absent on this machine "
                                 "(use --emulated to see the plan)\n")
        monkeypatch.delenv("TRITON_EP_RDMA_TC")
        assert "not applied" not in report()


def test_info_option_audit_covers_every_option():
    """OPTION_EFFECTS (above) plus --emulated, --devices and --help are every option ``info`` takes."""
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["info"]
    flags = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
    assert flags == {o.split()[0] for o in OPTION_EFFECTS} | {"--emulated", "--devices", "--help"}


def test_devices_on_a_host_without_any_rdma_device_is_absent_not_a_failure(monkeypatch, capsys):
    """(A new user's find: ``info --devices X`` exited 1 where the machine has no RDMA device.) An empty device
    list with --devices: absent, exit 0; a device list without the named device: still a failed query, exit 1."""
    from triton_ep.transport import emulated as em
    monkeypatch.setattr(machine, "emulated_api", em.Fabric(em.FabricSpec([])).pyverbs)
    text = report(["--emulated", "--devices", "mlx5_0"])
    assert "RDMA: absent\n  triton-ep RDMA: no RDMA device: the device list is empty" in text, text
    assert "--devices mlx5_0: not applied: RDMA is absent" in text and capsys.readouterr().err == ""
    monkeypatch.setattr(machine, "emulated_api", em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0")])).pyverbs)
    report(["--emulated", "--devices", "mlx5_0,mlx5_9"], rc=1)
    assert "no such RDMA device: ['mlx5_9'] not among ['mlx5_0']" in capsys.readouterr().err


def test_the_default_qp_plan_is_what_a_buffer_opens(monkeypatch):
    """(A new user's find: ``info --emulated`` showed 8 QPs per peer while a Buffer used 4.) Without --num-qps the
    plan has the QPs per peer of a Buffer's normal-mode network leg (modes.internode.network_shape: its default,
    or TRITON_EP_RDMA_QPS_PER_PEER), and says where the number came from."""
    from triton_ep.modes import internode
    monkeypatch.delenv(internode.ENV_QPS, raising=False)
    n = internode.network_shape()[0]
    assert f"QP plan per peer: {n} QPs over 2 port(s)" in report(["--emulated"])
    assert "(QPs: as a Buffer's normal-mode network leg; " in report(["--emulated"])
    monkeypatch.setenv(internode.ENV_QPS, "6")
    text = report(["--emulated"])
    assert "QP plan per peer: 6 QPs over 2 port(s)" in text and "(QPs: TRITON_EP_RDMA_QPS_PER_PEER, as a" in text
    assert "QP plan per peer: 3 QPs " in report(["--emulated", "--num-qps", "3"])
    monkeypatch.setenv(internode.ENV_QPS, "0")
    text = report(["--emulated"])
    assert f"QP plan per peer: {internode.DEFAULT_QPS_PER_PEER} QPs" in text
    assert "TRITON_EP_RDMA_QPS_PER_PEER is bad" in text


def test_gid_indexes_of_32_and_above_are_listed(monkeypatch):
    """(A new user's find: only the first 32 GIDs of a port were read.) A port whose table holds 40 entries, the
    only routable RoCEv2 GID at index 37: the table lists all 40 and marks index 37 for use."""
    from triton_ep.transport import emulated as em
    gids = [("fe80::200:ff:fe00:1", "RoCEv1")] * 37 + [("2001:db8::7", "RoCEv2"), ("fe80::1", "RoCEv2"),
                                                        ("fe80::2", "RoCEv1")]
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", [em.PortSpec(gids=gids)])]))
    (dev,) = verbs.discover(fab.pyverbs())
    assert [g.index for g in dev.ports[0].gids] == list(range(40)) and dev.ports[0].best_gid().index == 37
    monkeypatch.setattr(machine, "emulated_api", fab.pyverbs)
    rows = [l.split() for l in report(["--emulated", "--num-qps", "2"]).splitlines() if l.startswith("mlx5_0 ")]
    assert [r[7] for r in rows[:40]] == [str(i) for i in range(40)]
    assert [r[7] for r in rows[:40] if r[-1] == "*"] == ["37"]


@pytest.mark.parametrize("argv,why", [
    (["--num-qps", "1000000"], "--num-qps: must be an integer in 1..1024, got 1000000"),
    (["--n-paths", "100000"], "--n-paths: must be an integer in 1..256, got 100000"),
    (["--devices", ",,"], "--devices: must be comma-separated non-empty names, got ',,'"),
    (["--devices", "mlx5_0,,mlx5_1"], "--devices: must be comma-separated non-empty names, got 'mlx5_0,,mlx5_1'"),
    (["--devices", ""], "--devices: must be comma-separated non-empty names, got ''"),
])
def test_info_option_bounds_and_empty_device_names_are_usage_errors(argv, why, capsys):
    """(A new user's find: ``--num-qps 1000000`` gave a PlanError traceback; ``--devices ,,`` said "no such RDMA
    device: ['', '', '']".) Both counts have a documented upper bound and device names must not be empty: exit 2
    at parse time, argparse's line naming the option."""
    assert info(["--emulated", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and why in err, err


def test_info_without_a_qp_plan_for_the_options_exits_2_with_one_line(monkeypatch, capsys):
    """A plan the options make impossible (``PlanError``; within the bounds of --num-qps and --n-paths none is
    known, so the planner is made to fail here): the report says so, one line on stderr, exit 2, no traceback."""
    from triton_ep.transport import topology

    def impossible(*a, **k):
        raise topology.PlanError("no flow label in 65536 tries puts QP 0 (mlx5_0:1) on path 0 of 4")
    monkeypatch.setattr(topology, "plan_flows", impossible)
    assert report(["--emulated"], rc=2).endswith("\nQP plan: none for these options (the error is on stderr)\n")
    assert capsys.readouterr().err == ("triton-ep info: no QP plan: no flow label in 65536 tries puts QP 0 "
                                       "(mlx5_0:1) on path 0 of 4\n")


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_info_flags_a_bad_ranks_per_host_as_a_buffer_would(value):
    """(A new user's find: ``TRITON_EP_RANKS_PER_HOST=0`` showed "ranks [0, 0), ... form hosts".) The internode
    section gives the Buffer's own message for a value it refuses (runtime.hosts.group_hosts), and the grouping
    for a good one."""
    from triton_ep.runtime import hosts
    out = io.StringIO()
    cli.print_internode(out, {hosts.ENV_RANKS_PER_HOST: value})
    line = next(l for l in out.getvalue().splitlines() if l.startswith("  hosts "))
    with pytest.raises(ValueError) as ex:
        hosts.group_hosts(["h"] * 2, [value] * 2)
    shown = line.split(None, 1)[1]
    assert shown.endswith(" (a Buffer refuses it)") and str(ex.value).startswith(shown[:-len(" (a Buffer refuses it)")])
    assert "form hosts" not in line
    out = io.StringIO()
    cli.print_internode(out, {hosts.ENV_RANKS_PER_HOST: "4"})
    assert "  hosts      TRITON_EP_RANKS_PER_HOST=4: ranks [0, 4), [4, 8), ... form hosts" in out.getvalue()


def test_the_help_and_docs_count_the_report_sections():
    """(A new user's find: --help said four sections, docs/cli.md five, the report has six.) The number the help and
    docs/cli.md give is the number of section heads of a report, and docs/cli.md's sample shows each head."""
    import re
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    text = report()
    heads = [l for l in text.splitlines() if l and not l.startswith(" ")]
    n = words[len(heads)]
    assert f"The report has {n} sections" in cli.__doc__
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert f"It prints {n} sections" in doc
    sample = doc.split("On the 2-core CPU machine")[1].split("```")[1]
    assert [re.sub(r" \(.*", "", l) for l in sample.splitlines() if l and not l.startswith(" ")] == \
        [re.sub(r" \(.*", "", h) for h in heads[:-1]] + ["RDMA: absent"]


@pytest.mark.parametrize("value,want", [
    ("", "  proxy      process (TRITON_EP_PROXY=''): the RDMA proxy runs as a process of its own"),
    (" Thread ", "  proxy      thread (TRITON_EP_PROXY=' Thread '): the RDMA proxy runs as a thread of the rank's process"),
    ("threads", "  proxy      TRITON_EP_PROXY='threads': the RDMA proxy runs as a 'thread'"),
])
def test_the_internode_section_says_where_the_proxy_runs(value, want):
    """(A new user's find: the report did not say where the RDMA proxy runs.) The Internode section's ``proxy`` line:
    the kind a Buffer would take from ``TRITON_EP_PROXY`` (Linux: ``process`` when unset or empty), or the Buffer's
    message for a bad value."""
    out = io.StringIO()
    cli.print_internode(out, {"TRITON_EP_PROXY": value})
    line = next(l for l in out.getvalue().splitlines() if l.startswith("  proxy "))
    assert line.startswith(want), line


def _report_within(seconds: float, fifo=None) -> str:
    """:func:`report` in a thread, bounded: its text within ``seconds``. ``fifo``: a FIFO a report that blocked would
    be waiting on; it is opened for writing then, which ends that wait (no thread left behind), and the test fails."""
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(report()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10.0)
    assert got, f"info did not return within {seconds} s"
    return got[0]


@pytest.mark.parametrize("kind", ["good", "missing", "other-gpu", "malformed", "fifo", "too-large"])
def test_info_says_whether_the_tuned_table_is_used_and_why_not(kind, tmp_path, monkeypatch):
    """(A new user's find: info did not say whether a tuned table is in use, or why one was ignored.) The Tuned table
    section names the file ``$TRITON_EP_TUNING_FILE`` points at, what it is checked against (this process's GPU
    name, ``'cpu'`` here without a GPU, Triton and triton-ep versions) and its state: used with its entries counted,
    absent, or not used with the loader's own reason (the reason is the one ``tuned.load`` warns with, and a table
    info calls used is one it returns); exit status 0 every time, no warning, no wait on a FIFO (bounded: 10 s) and
    no read of a file over ``tuned.MAX_TABLE_BYTES``."""
    import json
    import warnings
    from triton_ep import Config, tuned
    here = tuned.identity()
    path = tmp_path / "tuning.json"
    entries = [{"call": call, "num_ranks": r, "hidden": 7168, "num_tokens": 4096,
                "config": Config(24, 2, 256, num_warps=8).fields()} for call, r in
               (("dispatch", 2), ("combine", 2), ("dispatch", 8))]
    if kind in ("good", "other-gpu", "too-large"):
        tuned.save(str(path), entries, "test")
    if kind == "good":
        state = "present, used: 3 entries (dispatch 2, combine 1) for 2, 8 ranks"
    elif kind == "missing":
        state = "absent: the built-in tables apply (`python -m triton_ep tune` writes it)"
    elif kind == "other-gpu":
        path.write_text(json.dumps(dict(json.loads(path.read_text()), gpu="NVIDIA H100 80GB HBM3")))
        state = f"present, not used: it was measured for another gpu 'NVIDIA H100 80GB HBM3' (here {here['gpu']!r})"
    elif kind == "malformed":
        path.write_text("{not json")
        state = "present, not used: it cannot be read (JSONDecodeError: Expecting property name"
    elif kind == "fifo":
        os.mkfifo(path)
        state = "present, not used: it cannot be read (ValueError: it is a FIFO, not a regular file)"
    else:
        with open(path, "r+b") as f:        # (sparse: nothing written beyond the table)
            f.truncate(tuned.MAX_TABLE_BYTES + 1)
        state = (f"present, not used: it cannot be read (ValueError: it is {tuned.MAX_TABLE_BYTES + 1} bytes, more "
                 f"than the {tuned.MAX_TABLE_BYTES} a table may take)")
    monkeypatch.setenv(tuned.ENV_FILE, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = _report_within(10.0, fifo=path if kind == "fifo" else None)
    check_sections(text)
    lines = next(p for p in text.split("\n\n") if p.startswith(TUNED_HEAD)).splitlines()
    assert lines[1] == f"  file       {path} (from ${tuned.ENV_FILE})"
    gpu = repr(here["gpu"]) + (" (no CUDA device here" if not torch.cuda.is_available() else ",")
    assert lines[2].startswith(f"  checked    against gpu {gpu}") and f"triton {here['triton']!r}" in lines[2]
    assert lines[3].startswith(f"  state      {state}") and len(lines) == 4, lines
    with warnings.catch_warnings(record=True) as ws:     # (the loader: the same verdict, the same reason)
        warnings.simplefilter("always")
        table = tuned.load(str(path))
    if kind == "good":
        assert table is not None and len(table.entries) == 3 and not ws
    elif kind == "missing":
        assert table is None and not ws
    else:
        advice = tuned.fallback(str(path))     # (info and the warning advise alike: test_tuner checks the advice)
        assert lines[3].endswith(f"; {advice}"), lines[3]
        why = lines[3].split("present, not used: ", 1)[1].rsplit(f"; {advice}", 1)[0]
        assert table is None and len(ws) == 1 and f": {why}; {advice}" in str(ws[0].message), ws


def _module(args, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m triton_ep ARGS`` in a fresh interpreter (this checkout's package: PYTHONPATH is inherited)."""
    return subprocess.run([sys.executable, "-m", "triton_ep", *args], env=dict(os.environ, **(env or {})),
                          text=True, timeout=300, **kw)


def test_info_into_a_closed_pipe_ends_quietly_with_sigpipes_status():
    """(A new user's find: ``triton-ep info | head -1`` ended in a BrokenPipeError traceback.) A report whose reader
    went away ends at once, nothing on stderr, with a shell's status of a command ended by SIGPIPE (141). The read
    end is closed before the command starts, so its first write fails whatever the timing."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = _module(["info"], stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (cli.EXIT_BROKEN_PIPE, ""), p.stderr[-2000:]


class _Failing(io.StringIO):
    """A stdout whose writes fail as a full disk's do (and which has no file descriptor, as a test's capture)."""

    def write(self, text):
        raise OSError(28, "No space left on device")


def test_info_onto_a_full_disk_is_one_line_on_stderr(monkeypatch, capsys):
    """(A new user's find: ``triton-ep info > /dev/full`` ended in an OSError traceback.) A stdout that cannot be
    written: exit 1 and one line on stderr naming the error; the real /dev/full too where there is one."""
    monkeypatch.setattr(sys, "stdout", _Failing())
    assert main(["info"]) == cli.EXIT_WRITE_FAILED == 1
    err = capsys.readouterr().err
    assert err == "triton-ep info: error: cannot write to stdout: [Errno 28] No space left on device\n", err
    monkeypatch.undo()
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            p = _module(["info"], stdout=full, stderr=subprocess.PIPE)
        assert p.returncode == 1 and p.stderr.splitlines() == [
            "triton-ep info: error: cannot write to stdout: [Errno 28] No space left on device"], p.stderr[-2000:]


@pytest.mark.parametrize("value", ["junk", "2"])
def test_info_runs_with_a_triton_interpret_that_is_neither_on_nor_off(value):
    """(A new user's find: with TRITON_INTERPRET=junk or 2, ``import triton_ep`` raised an ImportError saying triton
    was imported first, which nothing had, and ``triton-ep info`` could not run.) The package imports, and the
    report's devices section names the value and what is accepted (a Buffer raises ValueError with the same
    words: tests/runtime/test_values.py)."""
    p = _module(["info"], env={"TRITON_INTERPRET": value}, capture_output=True)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("  kernels "))
    assert line.startswith(f"  kernels   none: TRITON_INTERPRET={value!r} is neither on nor off: set it to 1 "
                           f"(Triton's interpreter, CPU tensors) or 0"), line
    assert line.endswith("(a Buffer raises ValueError)"), line
