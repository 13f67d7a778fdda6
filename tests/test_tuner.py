"""``python -m triton_ep tune`` end to end on CPU (interpreted kernels, tiny shapes) into a temporary file, and the
library reading that table back (docs/tuning.md)."""
import io
import json
import os
import signal
import time
import warnings

import pytest

from triton_ep import Buffer, Config, tuned
from triton_ep.__main__ import main
from triton_ep.config import NUM_SMS_SET

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def table_env(tmp_path, monkeypatch):
    """``TRITON_EP_TUNING_FILE`` pointed at a file in ``tmp_path``; no ``set_num_sms`` in effect."""
    path = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv(tuned.ENV_FILE, str(path))
    monkeypatch.setattr(NUM_SMS_SET, "value", None)
    return path


@pytest.fixture
def fake_ranks(monkeypatch):
    """``triton_ep.testing.run_ranks`` replaced by a stand-in that starts nothing and returns 10 us for every Config
    of the tuner's spec; the fixture's value: the specs it was given, in order."""
    import triton_ep.testing
    specs = []

    def run(fn, world, spec, timeout_s):
        specs.append(spec)
        n = len(spec.candidates) + 1
        return [{"dispatch": [10.0] * n, "combine": [10.0] * n}] * world
    monkeypatch.setattr(triton_ep.testing, "run_ranks", run)
    return specs


def test_tune_writes_a_table_the_library_reads(table_env, capsys):
    """The quick tune on 2 CPU ranks saves a table naming this GPU ("cpu"), Triton and triton-ep versions, with a
    dispatch and a combine entry whose Config is the fastest candidate; get_dispatch_config / get_combine_config
    return those Configs for 2 ranks and the built-in ones for other group sizes."""
    assert Buffer.get_dispatch_config(2) == Config(20, 24, 256, 6, 128)     # (nothing loaded: DeepEP's)
    assert main(["tune", "--quick", "--iters", "1", "--warmup", "0", "--tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert f"saved 2 entries to {table_env}" in printed and "built-in us" in printed
    doc = json.loads(table_env.read_text())
    assert {k: doc[k] for k in ("gpu", "triton", "triton_ep")} == tuned.identity() and doc["gpu"] == "cpu"
    assert [e["call"] for e in doc["entries"]] == ["dispatch", "combine"]
    for e in doc["entries"]:
        assert (e["num_ranks"], e["hidden"], e["num_tokens"]) == (2, 64, 6)
        times = {json.dumps(c["config"], sort_keys=True): c["time_us"] for c in e["candidates"]}
        assert len(times) == 2 and e["builtin_time_us"] > 0
        assert e["time_us"] == min(min(times.values()), e["builtin_time_us"]) > 0     # (the built-in tables compete)
        if e["config"] is None:         # (none was faster: the built-in tables stay)
            assert e["time_us"] == e["builtin_time_us"]
        else:
            assert times[json.dumps(e["config"], sort_keys=True)] == e["time_us"]
    by_call = {e["call"]: e["config"] for e in doc["entries"]}
    for call, get in (("dispatch", Buffer.get_dispatch_config), ("combine", Buffer.get_combine_config)):
        got = get(2)
        if by_call[call] is None:
            assert got.builtin and got.num_warps is None, (call, got)
            continue
        assert got.fields() == by_call[call] and not got.builtin, (call, got)
        assert get(2, hidden=64, num_tokens=4096).fields() == by_call[call]
        assert get(4) == get(4) and get(4).num_warps is None        # (no entry for 4 ranks: built-in)


def _table(path, entries, **ident):
    doc = {"format": tuned.FORMAT, "version": tuned.VERSION, **tuned.identity(), **ident, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _entry(call, T, num_sms, hidden=7168):
    c = Config(num_sms, 2, 256, num_warps=8).fields()
    return {"call": call, "num_ranks": 8, "hidden": hidden, "num_tokens": T, "config": c}


@pytest.mark.parametrize("field", ["gpu", "triton", "triton_ep"], ids=["device-name", "triton", "triton-ep"])
def test_a_table_of_another_gpu_or_version_warns_and_falls_back(table_env, field):
    """A table naming another GPU, Triton or triton-ep version: a warning naming the field and the built-in Config;
    a table that does not parse warns the same way; an absent one is silent."""
    _table(table_env, [_entry("dispatch", 4096, 24)], **{field: "other"})
    with pytest.warns(UserWarning, match=f"another {field} 'other'"):
        assert Buffer.get_dispatch_config(8) == Config(20, 6, 256, 6, 128)
    table_env.write_text("{not json")
    with pytest.warns(UserWarning, match="cannot be read"):
        assert Buffer.get_combine_config(8) == Config(20, 4, 256, 6, 128)
    table_env.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Buffer.get_dispatch_config(8) == Config(20, 6, 256, 6, 128)


def _loads_once_with_a_warning(why: str, fifo=None) -> None:
    """``get_dispatch_config(8)`` in a thread, bounded: within 10 s it returns the built-in Config with one
    ``UserWarning`` matching ``why``; a second call (the same file) warns no more. ``fifo``: a FIFO a loader that
    blocked on would be waiting for; it is opened for writing then, which ends that wait (no thread left behind)."""
    import threading
    got, caught = [], []

    def call():
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            got.append(Buffer.get_dispatch_config(8))
        caught.extend(ws)
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10.0)
    if t.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))      # (the blocked open returns; the read sees EOF)
        t.join(10.0)
    assert got, "get_dispatch_config did not return within 10 s"
    assert got[0] == Config(20, 6, 256, 6, 128) and got[0].builtin
    assert len(caught) == 1 and issubclass(caught[0].category, UserWarning), [str(w.message) for w in caught]
    assert why in str(caught[0].message) and "the built-in tables apply" in str(caught[0].message), caught[0].message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Buffer.get_dispatch_config(8) == Config(20, 6, 256, 6, 128)


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink-loop", "too-large", "num-sms-1", "num-warps-3",
                                  "ranks-0", "entries-not-a-list", "config-empty", "same-shape-twice",
                                  "version-true", "version-1.0"])
def test_a_table_that_cannot_be_used_warns_once_and_falls_back(kind, tmp_path, table_env, monkeypatch):
    """(A new user's find: a FIFO as the table blocked get_dispatch_config for ever, /dev/zero grew memory without
    bound, an entry with ``num_sms`` 1 loaded and every dispatch given its Config failed, a symlink loop was ignored
    without a word.) Only a regular file of at most ``tuned.MAX_TABLE_BYTES`` is read, and every entry is checked as
    a call would use it; anything else is one warning naming the reason, and the built-in Configs. (``/dev/null``
    stands for a device: reading it ends at once even where the check were missing.)"""
    good = [_entry("dispatch", 4096, 24)]
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        path, why = tmp_path / "fifo", "it is a FIFO, not a regular file"
    elif kind == "device":
        path, why = "/dev/null", "it is a character device, not a regular file"
    elif kind == "symlink-loop":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        path, why = tmp_path / "a", "it cannot be reached (OSError: Too many levels of symbolic links)"
    elif kind == "too-large":
        path = tmp_path / "big.json"
        _table(path, good)
        with open(path, "r+b") as f:        # (sparse: nothing written beyond the table)
            f.truncate(tuned.MAX_TABLE_BYTES + 1)
        why = f"it is {tuned.MAX_TABLE_BYTES + 1} bytes, more than the {tuned.MAX_TABLE_BYTES} a table may take"
    else:
        path = tmp_path / "t.json"
        bad = dict(_entry("dispatch", 1024, 16))
        if kind == "num-sms-1":
            bad["config"] = dict(bad["config"], num_sms=1)
            why = "entry 1: config.num_sms is 1, below the intranode normal mode's minimum of 2"
        elif kind == "num-warps-3":
            bad["config"] = dict(bad["config"], num_warps=3)
            why = "entry 1: Config's num_warps must be None or one of"
        elif kind == "ranks-0":
            bad["num_ranks"] = 0
            why = "entry 1: num_ranks must be an int of at least 1, got 0"
        elif kind == "config-empty":        # (a new user's find: {} loaded as Config()'s defaults)
            bad["config"] = {}
            why = "entry 1: its config must name exactly num_sms,"
        elif kind == "same-shape-twice":    # (a new user's find: the first of two entries of one shape held)
            bad = dict(good[0], config=dict(good[0]["config"], num_sms=32))
            why = "entries 0 and 1 are both for dispatch at num_ranks 8, hidden 7168, num_tokens 4096"
        if kind in ("version-true", "version-1.0"):     # (a new user's find: True and 1.0 equal 1)
            _table(path, good, version=True if kind == "version-true" else 1.0)
            why = f"not a {tuned.FORMAT!r} of version {tuned.VERSION}"
        elif kind == "entries-not-a-list":
            _table(path, {"0": good[0]})
            why = "its entries are not a list, got dict"
        else:
            _table(path, good + [bad])
    monkeypatch.setenv(tuned.ENV_FILE, str(path))
    _loads_once_with_a_warning(why, fifo=path if kind == "fifo" else None)
    if kind == "too-large":         # (the bound: a smaller one sets aside a table of that many bytes plus one)
        _table(path, good)
        monkeypatch.setattr(tuned, "MAX_TABLE_BYTES", path.stat().st_size - 1)
        _loads_once_with_a_warning("more than the")
        _table(path, good + [_entry("dispatch", 128, 16)])      # (another file version: read again)
        monkeypatch.setattr(tuned, "MAX_TABLE_BYTES", path.stat().st_size)
        assert Buffer.get_dispatch_config(8).num_sms == 24
    if kind == "num-sms-1":         # (the same table with a valid entry there is used)
        _table(path, good + [_entry("dispatch", 1024, 16)])
        assert Buffer.get_dispatch_config(8, num_tokens=1024).num_sms == 16


@pytest.mark.parametrize("kind", ["other-gpu", "not-a-table", "fifo", "directory", "symlink-to-table"])
def test_the_warning_advises_what_tune_accepts_at_that_path(kind, tmp_path, table_env, monkeypatch):
    """(A new user's find: a FIFO as the table warned "run `python -m triton_ep tune` again", and that tune then
    refused the path, exit 2.) The warning's advice (and ``triton-ep info``'s, :func:`tuned.fallback`) is what tune
    does at the table's path: ``tune`` again where it replaces the file as it is; ``--force`` where the file is no
    tuned table (tune refuses it without); for a path tune refuses even with ``--force``, its reason and another
    path. Each advice is checked against tune's own check of the path (:func:`triton_ep.tuner.resolve`)."""
    import argparse
    from triton_ep.tuner import resolve
    if kind == "other-gpu":
        path = table_env
        _table(path, [_entry("dispatch", 4096, 24)], gpu="other")
        advice, plain, forced = "(run `python -m triton_ep tune` again)", True, True
    elif kind == "not-a-table":
        path = tmp_path / "notes.json"
        path.write_text('{"not": "a table"}')
        advice, plain, forced = "run `python -m triton_ep tune --force`, or remove the file)", False, True
    elif kind == "symlink-to-table":
        _table(table_env, [_entry("dispatch", 4096, 24)], gpu="other")
        path = tmp_path / "link.json"
        os.symlink(table_env, path)
        advice, plain, forced = f"refuses this path too: {path} is a symbolic link", False, False
    else:
        path = tmp_path / kind
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
        advice, plain, forced = f"refuses this path too: {path} is a", False, False
    monkeypatch.setenv(tuned.ENV_FILE, str(path))
    with pytest.warns(UserWarning) as ws:
        assert Buffer.get_dispatch_config(8) == Config(20, 6, 256, 6, 128)
    (w,) = [w for w in ws if "tuned table" in str(w.message)]
    assert str(w.message).endswith(f"; {tuned.fallback(str(path))}") and advice in str(w.message), w.message
    assert (tuned.fallback(str(path)) == tuned.FALLBACK) == plain
    for force, accepted in ((False, plain), (True, forced)):
        a = argparse.Namespace(quick=True, ranks=2, hidden=None, tokens=None, num_experts=None, num_topk=None,
                               iters=None, warmup=None, num_nvl_bytes=None, output=None, force=force)
        if accepted:
            assert resolve(a).path == str(path)
        else:
            with pytest.raises(ValueError, match=f"the table's file at \\${tuned.ENV_FILE}: "):
                resolve(a)


def test_tune_keeps_the_entries_of_other_shapes_of_a_usable_table(table_env, fake_ranks, capsys):
    """(A new user's find: ``tune`` replaced the whole table, so tuning 2 ranks and then 8 kept only the 8.) Saving
    keeps the entries of other calls and shapes from a table the library would use here, and replaces those of the
    shapes measured again; another GPU's table (or one that cannot be used) is replaced whole, said on stderr."""
    def shapes():
        doc = json.loads(table_env.read_text())
        return sorted((e["call"], e["num_ranks"], e["num_tokens"]) for e in doc["entries"])
    assert main(["tune", "--quick", "--tokens", "4"]) == 0
    assert main(["tune", "--quick", "--tokens", "6", "--ranks", "4"]) == 0
    assert "(and kept 2 of other calls and shapes from the table there)" in capsys.readouterr().out
    assert shapes() == [("combine", 2, 4), ("combine", 4, 6), ("dispatch", 2, 4), ("dispatch", 4, 6)]
    assert main(["tune", "--quick", "--tokens", "6,8", "--ranks", "4"]) == 0
    assert shapes() == [("combine", 2, 4), ("combine", 4, 6), ("combine", 4, 8), ("dispatch", 2, 4),
                        ("dispatch", 4, 6), ("dispatch", 4, 8)]
    capsys.readouterr()
    doc = json.loads(table_env.read_text())
    table_env.write_text(json.dumps(dict(doc, gpu="other")))
    assert main(["tune", "--quick", "--tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert f"triton-ep tune: replacing the table {table_env} whole: it was measured for another gpu 'other'" in err
    assert "kept" not in out and shapes() == [("combine", 2, 4), ("dispatch", 2, 4)]


def test_tune_says_who_reads_the_table_and_how_to_undo(tmp_path, table_env, fake_ranks, capsys, monkeypatch):
    """(A new user's find: ``tune`` without ``--output``, run as a probe, silently wrote the user-wide table that
    every later Buffer reads.) Its last line names the file, who reads it (every Buffer of this user at the default
    location; processes with $TRITON_EP_TUNING_FILE naming it; for another file, only those) and how to undo:
    delete the file, or, where a file was there, move its copy (``.bak`` beside it, made before the save) back."""
    def last_line(*args):
        assert main(["tune", "--quick", *args]) == 0
        return capsys.readouterr().out.splitlines()[-1]
    env = f"Every later Buffer of a process with ${tuned.ENV_FILE}={table_env} reads it"
    assert last_line("--tokens", "4") == f"saved 2 entries to {table_env}. {env}; to undo, delete {table_env}"
    first = table_env.read_text()
    bak = tmp_path / "cache" / "tuning.json.bak"
    assert not bak.exists()
    assert last_line("--tokens", "6") == (
        f"saved 2 entries to {table_env} (and kept 2 of other calls and shapes from the table there), replacing the "
        f"file there (copied first to {bak}). {env}; to undo, move {bak} back to {table_env} (or delete {table_env} "
        f"for the built-in tables)")
    assert bak.read_text() == first != table_env.read_text()
    monkeypatch.delenv(tuned.ENV_FILE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "triton_ep" / "tuning.json"
    assert last_line("--tokens", "4") == (
        f"saved 2 entries to {user}. Every later Buffer of this user reads it (get_dispatch_config / "
        f"get_combine_config), unless its process sets ${tuned.ENV_FILE}; to undo, delete {user}")
    other = tmp_path / "other.json"
    assert last_line("--tokens", "4", "--output", str(other)) == (
        f"saved 2 entries to {other}. A Buffer reads it only where ${tuned.ENV_FILE} names it; to undo, delete "
        f"{other}")
    assert sorted(p.name for p in user.parent.iterdir()) == [".tuning.json.lock", "tuning.json"]


def test_the_backup_is_never_written_through_a_symlink(tmp_path):
    """``tuned.save(backup=True)`` copies the file there to ``.bak`` only where that path is absent or a regular file
    (never through a symlink: a ValueError naming it, and nothing is replaced); without a file there, no backup."""
    path = tmp_path / "t.json"
    assert tuned.save(str(path), [], "first", backup=True) == ([], None, None)
    first = path.read_text()
    (tmp_path / "elsewhere").write_text("keep")
    (tmp_path / "t.json.bak").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="t.json.bak is a symbolic link"):
        tuned.save(str(path), [], "second", backup=True)
    assert path.read_text() == first and (tmp_path / "elsewhere").read_text() == "keep"
    (tmp_path / "t.json.bak").unlink()
    assert tuned.save(str(path), [], "second", backup=True)[2] == str(tmp_path / "t.json.bak")
    assert (tmp_path / "t.json.bak").read_text() == first


def test_entries_are_chosen_by_shape_and_set_num_sms_wins(table_env, monkeypatch):
    """Several shapes for one group size: without a shape the entry of the most tokens, else the entry of that
    hidden size nearest in tokens; after ``set_num_sms`` the tuned Config carries that SM count."""
    _table(table_env, [_entry("dispatch", 128, 16), _entry("dispatch", 4096, 64), _entry("dispatch", 1024, 32),
                       _entry("dispatch", 4096, 48, hidden=4096)])
    get = Buffer.get_dispatch_config
    assert get(8).num_sms == 64 and get(8).num_warps == 8
    assert [get(8, num_tokens=t).num_sms for t in (1, 200, 700, 2000, 9999)] == [16, 16, 32, 32, 64]
    assert get(8, hidden=4096).num_sms == 48 and get(8, hidden=5).num_sms == 64
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    Buffer.set_num_sms(24)
    assert get(8).num_sms == 24 and get(8).num_warps == 8
    assert tuned.default_path() == str(table_env)
    monkeypatch.delenv(tuned.ENV_FILE)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert tuned.default_path() == "/x/cache/triton_ep/tuning.json"


def test_the_built_in_tables_compete_and_their_config_launches_as_none(table_env):
    """(A new user's find: the tuner saved a Config 2.8x slower than the built-in tables.) Where no candidate beats
    the built-in tables, the entry keeps them (``"config"`` null) and get_*_config returns the built-in Config; a
    Config from get_*_config without a tuned one launches as a call without a Config (the built-in tables: launch
    key None), while the same fields written by hand are honoured."""
    from triton_ep.kernels.params import config_key
    from triton_ep.tuner import TuneSpec, entries_of
    cands = [Config(4, 1, 64).fields(), Config(8, 2, 64).fields()]
    spec = TuneSpec(2, 64, 8, 8, 2, 1 << 20, 1, 0, cands)
    es = entries_of(spec, {"dispatch": [10.0, 30.0, 20.0], "combine": [10.0, 5.0, 20.0]})
    assert es[0]["config"] is None and es[0]["time_us"] == 10.0
    assert es[1]["config"] == cands[0] and es[1]["time_us"] == 5.0
    _table(table_env, [dict(e, num_ranks=2) for e in es])
    d, c = Buffer.get_dispatch_config(2), Buffer.get_combine_config(2)
    assert d.builtin and d == Config(20, 24, 256, 6, 128) and config_key(d) is None
    assert not c.builtin and c.fields() == cands[0] and config_key(c) == c.launch_key()
    assert config_key(Config(20, 24, 256, 6, 128)) is not None     # (by hand: honoured)
    assert main(["tune", "--quick", "--tokens", "-5"]) == 2        # (argparse's error, before any work)
    assert main(["tune", "--quick", "--output", str(table_env.parent)]) == 2     # (a directory: before any work)


def test_without_a_gpu_the_defaults_are_quick_and_given_options_win(table_env, monkeypatch, fake_ranks, capsys):
    """(A new user's find: ``tune`` without ``--quick`` on CPU ran DeepSeek-V3 shapes for more than 5 minutes with no
    output, though docs/tuning.md says a run without a GPU uses tiny shapes.) Without a GPU the defaults are
    ``--quick``'s (shapes, iterations, the two candidates); an option given keeps its value; a GPU keeps
    DeepSeek-V3's defaults. ``main`` says so on stderr and prints a line as each token count starts (the ranks are
    a stand-in here that returns times: no rank process starts)."""
    import argparse
    import torch
    from triton_ep.tuner import QUICK, candidates, resolve

    def opts(**given):
        base = dict(quick=False, ranks=2, hidden=None, tokens=None, num_experts=None, num_topk=None, iters=None,
                    warmup=None, num_nvl_bytes=None, output=None)
        return argparse.Namespace(**dict(base, **given))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = resolve(opts())
    assert (r.hidden, r.tokens, r.num_experts, r.num_topk, r.iters, r.warmup) == (64, [8], 8, 2, 2, 1)
    assert candidates(False, 2) == list(QUICK)
    r = resolve(opts(hidden=128, tokens=(16, 32), num_topk=4, iters=5, warmup=0))
    assert (r.hidden, r.tokens, r.num_experts, r.num_topk, r.iters, r.warmup) == (128, [16, 32], 8, 4, 5, 0)
    specs = fake_ranks
    assert main(["tune", "--tokens", "4,6"]) == 0
    assert [(s.hidden, s.num_tokens, s.num_experts, s.num_topk, s.iters, s.warmup) for s in specs] == [
        (64, 4, 8, 2, 2, 1), (64, 6, 8, 2, 2, 1)]
    assert [s.label for s in specs] == ["triton-ep tune: tokens 4 (1/2)", "triton-ep tune: tokens 6 (2/2)"]
    out, err = capsys.readouterr()
    assert "triton-ep tune: no GPU: --quick's defaults" in err and f"saved 4 entries to {table_env}" in out
    assert "triton-ep tune: tokens 6 (2/2): 2 ranks, hidden 64, top-2 of 8 experts, the built-in tables and 2 " \
           "candidates, 1 + 2 calls each" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = resolve(opts(output=str(table_env)))
    assert (r.hidden, r.tokens, r.num_experts, r.num_topk, r.iters, r.warmup) == (7168, [128, 1024, 4096], 256, 8,
                                                                                   20, 3)


@pytest.mark.parametrize("args,why", [
    (["tune", "--tokens", "1,x"], "--tokens: must be comma-separated positive ints, got '1,x'"),
    (["tune", "--tokens", "8,0"], "--tokens: must be comma-separated positive ints, got '8,0'"),
    (["tune", "--tokens", ""], "--tokens: must be comma-separated positive ints, got ''"),
    (["tune", "--tokens", "8,8"], "--tokens: must be comma-separated positive ints, each once, got '8,8' (8 twice)"),
    (["tune", "--tokens", "8,4,08"], "each once, got '8,4,08' (8 twice)"),
    (["tune", "--tokens", "4,4,4"], "each once, got '4,4,4' (4 3 times)"),
    (["info", "--devices", "mlx5_0, mlx5_0"], "--devices: must be comma-separated non-empty names, each once, got "
                                              "'mlx5_0, mlx5_0' (mlx5_0 twice)"),
    (["tune", "--warmup", "-1"], "--warmup: must be at least 0, got -1"),
    (["tune", "--warmup", "two"], "--warmup: must be an int at least 0, got 'two'"),
    (["tune", "--ranks", "0"], "--ranks: must be at least 1, got 0"),
    (["tune", "--iters", "1.5"], "--iters: must be an int at least 1, got '1.5'"),
    (["tune", "--timeout-s", "0"], "--timeout-s: must be seconds in (0, 1e9], got '0'"),
    (["tune", "--timeout-s", "nan"], "--timeout-s: must be seconds in (0, 1e9], got 'nan'"),
    (["info", "--num-qps", "x"], "--num-qps: must be an integer in 1..1024, got 'x'"),
    (["info", "--service-level", "0x10"], "--service-level: must be an integer in 0..15, got 16"),
    (["info", "--traffic-class", "high"], "--traffic-class: must be an integer in 0..255, got 'high'"),
])
def test_bad_option_values_are_usage_errors_naming_the_option(args, why, capsys):
    """Every subcommand's option values come from one place (triton_ep.argtypes): a bad one exits 2 (bad usage)
    before any work, with argparse's line naming the option, the allowed values and the text given. (A new user's
    find: ``--tokens 8,8`` measured 8 tokens twice.) A list option refuses a value given twice (it is not folded),
    naming the first repeated value."""
    assert main(args) == 2
    assert why in capsys.readouterr().err


def test_option_values_parse():
    """The CLI's value types on good text: ints (``info`` takes 0x hex for its QoS values), token lists, seconds; the
    tuner records a token list as it was written, and a zero (``--warmup 0``; it was dropped before as if left
    out, so the saved command line would have rerun with the default warm-up)."""
    import argparse
    from triton_ep import argtypes
    from triton_ep.tuner import _argv
    assert argtypes.positive_int("3") == 3 and argtypes.non_negative_int("0") == 0
    assert argtypes.int_in(0, 255)("0x68") == 104 and argtypes.int_in(0, 15)("15") == 15
    assert argtypes.positive_int_list("128,1024") == (128, 1024)
    assert argtypes.seconds("2.5") == 2.5 and argtypes.seconds("1e9") == 1e9     # (a Buffer's timeout_s bound)
    a = argparse.Namespace(command="tune", tokens=(8, 16), quick=True, warmup=0, output=None)
    assert _argv(a) == ["--quick", "--tokens=8,16", "--warmup=0"]


def _fifo(tmp_path):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return fifo


def _is_fifo(path) -> bool:
    import os
    import stat
    return stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo", "directory", "absent-directory", "under-a-file",
                                  "empty", "proc", "proc-file", "read-only-file"])
def test_tune_output_is_checked_before_any_measuring(kind, tmp_path, table_env, no_ranks, capsys):
    """(A new user's find: ``--output /dev/null`` measured, then renamed a file over the device; an absent
    directory was made at the root; ``''`` wrote the real cache file; ``/proc/version`` was refused as "its directory
    /proc takes no new file (No such file or directory)", and a read-only file was replaced.) Every --output is
    checked as it is parsed: exit 2, argparse's error naming --output, the path and the reason (the system's where it
    refused something) on stderr, nothing on stdout, nothing made or replaced. (A FIFO in tmp_path stands for a
    device: never point such a test at /dev/null.)"""
    import os
    fifo = _fifo(tmp_path)
    os.symlink(fifo, tmp_path / "link")
    (tmp_path / "f.py").write_text("")
    (tmp_path / "ro.json").write_text("kept")
    os.chmod(tmp_path / "ro.json", 0o444)
    # (root opens a read-only file for writing: there the mode is the reason; elsewhere the system's refusal)
    ro_why = ("cannot be written (read-only: mode 0444)" if os.geteuid() == 0 else
              "cannot be written (Permission denied)")
    path, why = {"fifo": (str(fifo), "is a FIFO, not a regular file"),
                 "symlink-to-fifo": (str(tmp_path / "link"), f"is a symbolic link (to {fifo}); tune never writes "
                                                             "through one"),
                 "directory": (str(tmp_path), "is a directory, not a regular file"),
                 "absent-directory": (str(tmp_path / "no" / "dir" / "x.json"),
                                      "does not exist (No such file or directory; it is not made"),
                 "under-a-file": (str(tmp_path / "f.py" / "x.json"), "f.py is not a directory"),
                 "empty": ("", "must be a non-empty path, got ''"),
                 "proc": ("/proc/triton_ep_no_such_table.json",
                          "its directory /proc (a proc file system) takes no new file ("),
                 "proc-file": ("/proc/version", ro_why),
                 "read-only-file": (str(tmp_path / "ro.json"), ro_why)}[kind]
    assert main(["tune", "--quick", "--output", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: argument --output: {path}" in err and why in err, err
    assert _is_fifo(fifo) and os.path.islink(tmp_path / "link") and not (tmp_path / "no").exists()
    assert (tmp_path / "ro.json").read_text() == "kept"
    assert not table_env.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["f.py", "fifo", "link", "ro.json"]


def test_save_replaces_only_a_regular_file(tmp_path):
    """``tuned.save`` checks again (defence in depth): a FIFO, a symlink to one, an absent directory: ValueError,
    nothing replaced, made or left behind. A symlink, even to a table, is never written through (it was followed
    before: a new user's find); a file that is not a table is replaced only with ``force``; a table is replaced
    (beside it stays its lock file, ``tuned.lock_path``)."""
    import os
    fifo = _fifo(tmp_path)
    os.symlink(fifo, tmp_path / "link")
    _table(tmp_path / "t.json", [])
    os.symlink(tmp_path / "t.json", tmp_path / "t-link.json")
    for path, why in ((fifo, "is a FIFO"), (tmp_path / "link", "is a symbolic link"),
                      (tmp_path / "no" / "t.json", "does not"), (tmp_path / "t-link.json", "is a symbolic link")):
        with pytest.raises(ValueError, match=why):
            tuned.save(str(path), [], "test")
    assert _is_fifo(fifo) and os.path.islink(tmp_path / "link") and not (tmp_path / "no").exists()
    assert os.path.islink(tmp_path / "t-link.json") and "created" not in json.loads((tmp_path / "t.json").read_text())
    tuned.save(str(tmp_path / "t.json"), [], "test")
    assert json.loads((tmp_path / "t.json").read_text())["command"] == "test"
    (tmp_path / "old.json").write_text("old")
    with pytest.raises(ValueError, match="is not a triton-ep tuned table .*pass --force to replace it"):
        tuned.save(str(tmp_path / "old.json"), [], "test")
    assert (tmp_path / "old.json").read_text() == "old"
    tuned.save(str(tmp_path / "old.json"), [], "test", force=True)
    assert json.loads((tmp_path / "old.json").read_text())["entries"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old.json.lock", ".t.json.lock", "fifo", "link", "old.json",
                                                          "t-link.json", "t.json"]


def test_the_default_table_file_is_checked_and_its_directory_made(tmp_path, table_env, monkeypatch, no_ranks,
                                                                  capsys):
    """Without --output: ``$TRITON_EP_TUNING_FILE`` naming a FIFO is refused the same way before any work (exit 2,
    one line naming the variable); the default location's directory is made (only there)."""
    import argparse
    from triton_ep.tuner import resolve
    monkeypatch.setenv(tuned.ENV_FILE, str(_fifo(tmp_path)))
    assert main(["tune", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"triton-ep tune: error: the table's file at ${tuned.ENV_FILE}: ")
    assert "is a FIFO" in err and _is_fifo(tmp_path / "fifo")
    monkeypatch.delenv(tuned.ENV_FILE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = argparse.Namespace(quick=True, ranks=2, hidden=None, tokens=None, num_experts=None, num_topk=None,
                           iters=None, warmup=None, num_nvl_bytes=None, output=None)
    assert resolve(a).path == str(tmp_path / "cache" / "triton_ep" / "tuning.json")
    assert (tmp_path / "cache" / "triton_ep").is_dir()


@pytest.mark.parametrize("args,why", [
    (["--hidden", "7"], "--hidden 7: bf16 rows must be a multiple of 16 bytes, so hidden must be a multiple of 8"),
    (["--num-experts", "3"], "--num-experts 3: must be a multiple of --ranks 2"),
    (["--ranks", "3"], "--num-experts 8 (the default): must be a multiple of --ranks 3"),
    (["--num-experts", "32768"], "--num-experts 32768: must be at most 16384"),
    (["--num-topk", "99"], "--num-topk 99: must be at most --num-experts 8"),
    (["--hidden", "2048", "--num-nvl-bytes", "1"], "--num-nvl-bytes 1: a Buffer rounds it up to 4 KiB (4096 bytes), "
                                                   "which must hold one record of a row of --hidden 2048"),
    (["--hidden", "2147483648"], "--hidden 2147483648: must be at most 1073741823 (a row of bf16 values is 2 * hidden "
                                 "bytes, an int32 count of bytes)"),
    (["--tokens", "99999999999"], "--tokens 99999999999: must be at most 1073741823 with --ranks 2 (a rank may "
                                  "receive every rank's tokens: --ranks x --tokens rows, an int32 count as a "
                                  "Buffer's num_worst_tokens)"),
    (["--ranks", "4", "--tokens", "8,536870912"], "--tokens 536870912: must be at most 536870911 with --ranks 4"),
    (["--tokens", "8,100000000", "--hidden", "7168"], "--tokens 100000000: the tensors of --ranks 2 ranks at --hidden "
                                                      "7168 would need about "),
])
def test_tune_options_that_do_not_go_together_exit_2_before_any_work(args, why, table_env, no_ranks, capsys):
    """(A new user's find: ``--hidden 7``, ``--num-experts 3``, ``--num-topk 99`` gave tracebacks, exit 1; and
    ``--hidden 2147483648`` was told as ``hidden_bytes``, ``--tokens 99999999999`` started the ranks, which died
    allocating 25.6 TB.) The options are checked together, with their defaults, before any work: exit 2, one line
    on stderr naming the option and the rule; ``--tokens`` is bounded as int32 row counts, and by the memory its
    ranks' tensors would need (about 10 TiB a rank at 10^8 tokens of 7168 values: more than any host here)."""
    assert main(["tune", "--quick", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("triton-ep tune: error: " + why), err
    assert not table_env.exists()


@pytest.mark.parametrize("args,why", [
    (["--qps", "5000"], "--qps: must be an integer in 1..1024, got 5000"),
    (["--slots", "2000"], "--slots: must be an integer in 1..1024, got 2000"),
    (["--chunk-kib", "9999999"], "--chunk-kib: must be an integer in 1..1048576, got 9999999"),
])
def test_scheduler_cli_counts_have_upper_bounds(args, why, capsys):
    """``python -m triton_ep.scheduler_cli``'s counts are bounded as a Buffer's network leg bounds them
    (TRITON_EP_RDMA_SLOTS, TRITON_EP_RDMA_CHUNK_BYTES) or as ``info --num-qps``: a usage error at parse time."""
    from triton_ep.scheduler_cli import build_parser
    with pytest.raises(SystemExit) as ex:
        build_parser().parse_args(args)
    assert ex.value.code == 2 and why in capsys.readouterr().err


def _state(pid: int) -> str:
    """A process's state letter (``/proc/PID/stat``; ``"gone"`` where there is none): ``"Z"``, ended but not reaped
    (the orphans of a killed process are reaped by whoever adopted them, here whenever that gets to it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _children(pid: int) -> list:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _maps_a_buffer(pid: int) -> bool:
    """Whether process ``pid`` maps a shared-memory file of this test run (a Buffer of a rank: past its imports)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f"/triton_ep.{os.environ['TRITON_EP_SHM_TAG']}." in f.read()     # (conftest's tag)
    except OSError:
        return False


def _ended_within(pids, seconds: float) -> list:
    """The ``pids`` still running (neither gone nor a zombie) after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _state(p) not in ("gone", "Z")]
    return left


def _kill_all(proc, pids) -> None:
    """Nothing left behind by a test that failed: ``proc`` (a Popen) killed and reaped, ``pids`` killed."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in pids:
        if _state(p) not in ("gone", "Z"):
            os.kill(p, signal.SIGKILL)


def test_tune_killed_with_sigkill_leaves_no_rank_running(tmp_path):
    """(A new user's find: ``kill -9`` of ``triton-ep tune`` left its ranks running for 25-70 s.) ``tune`` in a
    subprocess (2 CPU ranks, spawned: the tuner's own start method; SIGINT ignored), SIGKILLed once both ranks are
    inside the rank function (each maps its Buffer's shared memory): every process it started (the ranks,
    multiprocessing's resource tracker) has ended within 3 s (each rank watches its parent:
    triton_ep.transport.parent.exit_with_parent)."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # SIGINT ignored, as in a background job of a script: torch's parent-death signal for its ranks (SIGINT) then
    # does nothing (elsewhere it raises KeyboardInterrupt, whose handling may wait on peers); sh execs python
    argv = [sys.executable, "-m", "triton_ep", "tune", "--quick", "--tokens", "6", "--iters", "200", "--warmup", "0",
            "--output", str(tmp_path / "t.json")]
    tune = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and tune.poll() is None:
            kids = _children(tune.pid)
            ranks = [p for p in kids if _maps_a_buffer(p)]
            if len(ranks) == 2:
                break
            time.sleep(0.1)
        assert len(ranks) == 2, f"the ranks did not start (tune's status {tune.poll()}, children {kids})"
        tune.kill()
        tune.wait()
        left = _ended_within(kids, 3.0)
        assert not left, f"still running 3 s after tune's SIGKILL: {left} of {kids} ({[_state(p) for p in left]})"
    finally:
        _kill_all(tune, kids)
    assert not (tmp_path / "t.json").exists()


def test_a_process_that_starts_watching_after_its_parent_died_ends_at_once(tmp_path):
    """exit_with_parent(ppid) with the pid the parent knew: a child that starts watching only after its parent died
    (a rank still importing torch at the kill) ends at once, as does one that watched before (within 0.1 s);
    ``getppid()`` asked at the late start would have named the process that adopted it, watched for good."""
    import subprocess
    import sys
    from triton_ep.transport import parent
    code = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("parent", {parent.__file__!r})
m = sys.modules["parent"] = importlib.util.module_from_spec(spec)     # (stdlib only: no torch to import)
spec.loader.exec_module(m)
me = os.getpid()
for delay in (0.0, 2.0):        # (watching before the parent dies, and after)
    pid = os.fork()
    if pid == 0:
        time.sleep(delay)
        m.exit_with_parent(me)
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    kids = []
    try:
        kids = [int(proc.stdout.readline()) for _ in range(2)]
        time.sleep(0.3)
        proc.kill()
        proc.wait()
        assert not _ended_within(kids[:1], 1.0), "the child that watched did not end within 1 s"
        assert _state(kids[1]) not in ("gone", "Z")       # (it sleeps on; it watches at 2 s)
        assert not _ended_within(kids[1:], 3.0), "the child that started watching late did not end"
    finally:
        proc.stdout.close()
        _kill_all(proc, kids)


@pytest.mark.parametrize("kind", ["source-file", "empty-file", "truncated-table", "symlink-to-table",
                                  "dangling-symlink", "env-source-file"])
def test_tune_refuses_a_file_that_is_no_table_and_any_symlink_before_measuring(kind, tmp_path, table_env, monkeypatch,
                                                                               no_ranks, capsys):
    """(A new user's find: ``--output victim/precious.py`` replaced the source file with the table, said only after
    the run; a symlink at the path, dangling or not, was followed and its target created or replaced.) Before any
    measuring, exit 2 with one line naming the path: an existing file that is not a triton-ep tuned table (JSON of
    our format, of any GPU or version) needs ``--force``; a symlink is never written through (a link planted in a
    shared /tmp would redirect the write). Nothing is changed or made."""
    src = tmp_path / "precious.py"
    src.write_text("print('keep me')\n")
    _table(tmp_path / "table.json", [_entry("dispatch", 8, 24)])
    table_text = (tmp_path / "table.json").read_text()
    args = ["tune", "--quick"]
    if kind == "source-file":
        path, why = src, "exists and is not a triton-ep tuned table (JSONDecodeError: "
    elif kind == "empty-file":
        path = tmp_path / "empty.json"
        path.write_text("")
        why = "exists and is not a triton-ep tuned table (JSONDecodeError: "
    elif kind == "truncated-table":
        path = tmp_path / "cut.json"
        path.write_text(table_text[:-20])
        why = "exists and is not a triton-ep tuned table (JSONDecodeError: "
    elif kind == "symlink-to-table":
        path = tmp_path / "link.json"
        os.symlink(tmp_path / "table.json", path)
        why = f"is a symbolic link (to {tmp_path / 'table.json'}); tune never writes through one"
    elif kind == "dangling-symlink":
        path = tmp_path / "dangling.json"
        os.symlink(tmp_path / "created_by_tune.txt", path)
        why = f"is a symbolic link (to {tmp_path / 'created_by_tune.txt'}); tune never writes through one"
    else:
        path, why = src, "exists and is not a triton-ep tuned table (JSONDecodeError: "
        monkeypatch.setenv(tuned.ENV_FILE, str(src))
    if kind != "env-source-file":
        args += ["--output", str(path)]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and why in err, err
    if "symlink" in kind:       # (argparse's usage error: when the option is parsed)
        assert err.splitlines()[-1].startswith(f"triton-ep tune: error: argument --output: {path} "), err
    else:
        assert err.count("\n") == 1, err
        where = f"the table's file at ${tuned.ENV_FILE}: " if kind.startswith("env") else "--output "
        assert err.startswith(f"triton-ep tune: error: {where}{path} ") and err.rstrip().endswith(
            "the table would replace it whole: name another file, or pass --force to replace it"), err
    assert src.read_text() == "print('keep me')\n" and (tmp_path / "table.json").read_text() == table_text
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not table_env.exists()


def test_tune_force_replaces_a_file_that_is_no_table_and_says_so_before_measuring(tmp_path, table_env, fake_ranks,
                                                                                  capsys):
    """With ``--force`` such a file is replaced whole: tune says so on stderr before any measuring (the first
    progress line comes after it); the saved command records ``--force``. A table of another GPU needs no
    ``--force`` (docs/tuning.md: it is replaced whole, said on stderr)."""
    path = tmp_path / "notes.txt"
    path.write_text("notes")
    assert main(["tune", "--quick", "--tokens", "4", "--output", str(path), "--force"]) == 0
    out, err = capsys.readouterr()
    notice = f"triton-ep tune: replacing the table {path} whole: it cannot be read (JSONDecodeError: "
    assert notice in err and err.index(notice) < err.index("triton-ep tune: tokens 4 (1/1)"), err
    assert err.count("replacing the table") == 1 and f"saved 2 entries to {path}" in out
    doc = json.loads(path.read_text())
    assert len(doc["entries"]) == 2 and "--force" in doc["command"].split()
    path.write_text(json.dumps(dict(doc, gpu="other")))
    assert main(["tune", "--quick", "--tokens", "4", "--output", str(path)]) == 0
    assert f"replacing the table {path} whole: it was measured for another gpu 'other'" in capsys.readouterr().err
    assert json.loads(path.read_text())["gpu"] == tuned.identity()["gpu"]


def test_a_saved_table_keeps_the_mode_and_owner_of_the_file_it_replaces(tmp_path):
    """(A new user's find: a 0600 table owned by nobody became 0644 and root's when root tuned into it.) The new file
    takes the replaced file's permission bits and, where the system allows it (root), its owner and group; a new
    table gets 0666 less the umask."""
    import stat
    path = tmp_path / "perm.json"
    tuned.save(str(path), [], "test")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    owner = (65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    os.chown(path, *owner)
    for mode in (0o600, 0o640, 0o604):
        os.chmod(path, mode)
        tuned.save(str(path), [], f"mode {mode:o}")
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, *owner), (oct(st.st_mode), st.st_uid)
        assert json.loads(path.read_text())["command"] == f"mode {mode:o}"


_RACER = """
import os, sys, time
from triton_ep import tuned
path, k, n, ready = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
open(f"{ready}.{k}", "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(f"{ready}.{1 - k}") and time.monotonic() < deadline:    # (both start saving together)
    time.sleep(0.005)
for i in range(n):
    entry = {"call": "dispatch", "num_ranks": 2, "hidden": 64, "num_tokens": 1000 * (k + 1) + i, "config": None}
    tuned.save(path, [entry], f"racer {k}", merge=True)
"""


def test_two_processes_saving_to_one_table_keep_each_others_entries(tmp_path):
    """(A new user's find: two writers of 100 saves each, each reading the table then renaming a new one over it,
    kept 236 of 400 entries.) ``tuned.save(merge=True)``, tune's save, holds a lock beside the table from the read
    to the rename: two processes saving 60 times each at once keep all 120 entries, and no temporary file is left."""
    import subprocess
    import sys
    path, n = tmp_path / "t.json", 60
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(path), str(k), str(n), str(tmp_path / "ready")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], outs
    got = sorted(e["num_tokens"] for e in json.loads(path.read_text())["entries"])
    assert got == sorted([1000 + i for i in range(n)] + [2000 + i for i in range(n)]), f"{len(got)} of {2 * n} kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".t.json.lock", "ready.0", "ready.1", "t.json"]


def test_a_save_waits_for_the_lock_a_bounded_time(tmp_path):
    """While another save holds the table's lock, ``tuned.save`` waits at most ``lock_timeout_s``, then raises
    TimeoutError naming the lock file; nothing is written. A lock file that is a symlink is refused (ValueError)."""
    path = tmp_path / "t.json"
    with tuned.locked(str(path)) as lock:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"held its lock file {lock} for more than 0.3 s"):
            tuned.save(str(path), [], "test", lock_timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 10
    assert not path.exists() and lock == str(tmp_path / ".t.json.lock")
    tuned.save(str(path), [], "test", lock_timeout_s=0.3)      # (released)
    os.unlink(lock)
    os.symlink(tmp_path / "elsewhere", lock)
    with pytest.raises(ValueError, match="its lock file .* cannot be opened"):
        tuned.save(str(path), [], "again")
    assert json.loads(path.read_text())["command"] == "test" and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("exc,status,line", [
    (TimeoutError("ranks did not finish within 1.0 s"), 1,
     "triton-ep tune: error: tokens 4: ranks did not finish within 1.0 s (--timeout-s 1.0); nothing saved"),
    (KeyboardInterrupt(), 130, "triton-ep tune: interrupted (Ctrl-C); nothing saved"),
], ids=["timeout", "ctrl-c"])
def test_tune_timeout_and_ctrl_c_end_in_one_line(exc, status, line, table_env, monkeypatch, capsys):
    """(A new user's find: ``--timeout-s`` expiring and Ctrl-C ended in a raw traceback.) The ranks' run raising
    TimeoutError (run_ranks has killed them) or KeyboardInterrupt ends tune with one line on stderr and a non-zero
    status (1; 130 for Ctrl-C, the shell's for SIGINT), nothing saved."""
    import triton_ep.testing

    def run(fn, world, spec, timeout_s):
        raise exc
    monkeypatch.setattr(triton_ep.testing, "run_ranks", run)
    assert main(["tune", "--quick", "--tokens", "4", "--timeout-s", "1"]) == status
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == line and "Traceback" not in err, err
    assert not table_env.exists()
