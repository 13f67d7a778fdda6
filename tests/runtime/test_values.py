"""Every value a user gives the set-up (Buffer arguments, environment variables, Config fields, size hints) is
checked against the range the code carries, with an error naming it; a bad value on one rank raises on every
rank at once (issue 46, items 4 and 5)."""
import math
import re

import numpy as np
import pytest
import torch

import triton_ep
from tests.cases import value as value_cases
from triton_ep.runtime import checks
from triton_ep.testing import RankFailure, run_ranks
from triton_ep.transport import ipc
from triton_ep.transport.ipc import LocalWorld

#: what each case's error must say (a case: rank 1's bad value, value_cases.*_CASES)
WANT = {"TRITON_EP_SHM_TAG": "TRITON_EP_SHM_TAG='", "TRITON_EP_RDMA_TC": "TRITON_EP_RDMA_TC='300': the RDMA traffic "
        "class must be", "TRITON_EP_RDMA_SL": "TRITON_EP_RDMA_SL='x': the RDMA service level must be", "TRITON_EP_TIMEOUT_S": "TRITON_EP_TIMEOUT_S=",
        "TRITON_EP_RDMA": "TRITON_EP_RDMA must be one of", "TRITON_EP_RANKS_PER_HOST": "TRITON_EP_RANKS_PER_HOST",
        "timeout_s": "timeout_s must be a number of seconds in [1e-09, 1e+09]", "num_nvl_bytes": "num_nvl_bytes must be",
        "num_rdma_bytes": "num_rdma_bytes must be", "device": "device must be", "rdma_backend": "rdma_backend must be",
        "num_max_tokens_per_rank": "num_max_tokens_per_rank must be an int in [0, 2147483647], got -1",
        "num_bytes": "ElasticBuffer: num_bytes must be an int (bytes), got float",
        "hidden": "ElasticBuffer needs num_bytes, or hidden", "num_cpu_bytes": "num_cpu_bytes must be an int",
        "num_topk": "num_topk must be an int in [0, 2147483647], got -1"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("cases", ["ENV_CASES", "ARG_CASES", "HOSTS_CASES", "ELASTIC_CASES"])
def test_a_bad_value_on_one_rank_raises_everywhere_at_once(cases):
    """(A new user's find: a bad TRITON_EP_SHM_TAG on one rank raised there and left the others waiting out their
    timeout; so did a bad TRITON_EP_RDMA_TC / _SL across hosts, at the QP exchange, and, new-user trial 8, a bad
    argument that ElasticBuffer checks itself, such as num_max_tokens_per_rank=-1.) Rank 1 alone gets a bad
    environment value, Buffer argument or ElasticBuffer argument: both ranks raise ValueError (ElasticBuffer's float
    num_bytes too, as every size that is not an int) naming it (and rank 1, where the value is rank 1's own), far
    within the 60 s bound; the next case's Buffers are built on the same group, so every failed set-up leaves the group usable (the
    last ElasticBuffer case builds)."""
    todo = getattr(value_cases, cases)
    base = value_cases.HOSTS_ENV if cases == "HOSTS_CASES" else None
    out = run_ranks(value_cases.bad_value_on_rank_1, 2, todo, 60.0, base, cases == "ELASTIC_CASES")
    assert not any(isinstance(o, RankFailure) for o in out), out
    builds = {"ENV_CASES": value_cases.BUILDS_ON_ONE_HOST, "ELASTIC_CASES": value_cases.ELASTIC_BUILDS}.get(cases)
    for i, (what, value) in enumerate(todo):
        for rank in (0, 1):
            kind, seconds, msg = out[rank][i]
            if (what, value) == builds:
                assert kind == "built", (what, value, rank, out[rank][i])
                continue
            assert kind == "ValueError" and WANT[what] in msg, (what, value, rank, out[rank][i])
            assert seconds < 20, (what, value, rank, out[rank][i])
            if what != "TRITON_EP_RANKS_PER_HOST":       # (a disagreement names every rank's value instead)
                assert msg.startswith("rank 1: "), (what, value, rank, msg)


@pytest.mark.parametrize("value,ok", [
    (1e-9, True), (1, True), (np.float32(2.5), True), (np.int64(7), True), (checks.MAX_TIMEOUT_S, True),
    (1e12, False), (1e300, False), (10 ** 400, False), (math.inf, False), (math.nan, False), (0, False),
    (-1.0, False), (True, False), ("5", False), (None, True), (1e-10, False), (1e-300, False)])
def test_timeout_arg_range(value, ok, monkeypatch):
    """timeout_s: a number in [MIN_TIMEOUT_S, MAX_TIMEOUT_S] (one nanosecond: what reaches the kernels is not 0),
    named with the range; None: the default."""
    monkeypatch.delenv(checks.ENV_TIMEOUT_S, raising=False)
    if ok:
        got = checks.timeout_arg(value)
        assert got == (checks.DEFAULT_TIMEOUT_S if value is None else float(value)) and type(got) is float
    else:
        with pytest.raises(ValueError, match=r"^timeout_s must be a number of seconds in \[1e-09, 1e\+09\]"):
            checks.timeout_arg(value)


@pytest.mark.parametrize("raw,want", [("", 100.0), ("  ", 100.0), (" 2.5 ", 2.5), ("1e9", 1e9), ("abc", None),
                                      ("1e300", None), ("1e10", None), ("inf", None), ("nan", None), ("0", None),
                                      ("-3", None), ("1e-300", None)])
def test_timeout_variable_range(raw, want):
    """TRITON_EP_TIMEOUT_S: the same range; the error names the variable and its value."""
    if want is not None:
        assert checks.timeout_arg(None, {checks.ENV_TIMEOUT_S: raw}) == want
    else:
        with pytest.raises(ValueError, match=rf"^TRITON_EP_TIMEOUT_S={raw!r} must be a number of seconds in"):
            checks.timeout_arg(None, {checks.ENV_TIMEOUT_S: raw})


def test_the_largest_timeout_runs_a_call_and_a_larger_one_is_refused_at_construction():
    """(A new user's find: timeout_s=1e12 built a Buffer whose first call failed in Triton with "integer to be
    specialized too large", and 1e300 failed at construction on one rank.) At MAX_TIMEOUT_S a dispatch and a
    combine run and return the rows; above it the constructor raises ValueError naming timeout_s."""
    world = LocalWorld(1, 1 << 16)
    buf = triton_ep.Buffer(world.comm(0), 1 << 16, timeout_s=checks.MAX_TIMEOUT_S)
    try:
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [0, 0], [1, 0]])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
        recv_x, _, _, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(5, 2),
                                                       num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert)
        assert torch.equal(recv_x, x[[0, 1, 3, 4]]) and counts == [4, 3], counts
        want = x.clone()
        want[2] = 0
        assert torch.equal(buf.combine(recv_x, handle)[0], want)
    finally:
        buf.destroy()
    for bad in (checks.MAX_TIMEOUT_S * 1.001, 1e12, 1e300):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds in"):
            triton_ep.Buffer(world.comm(0), 1 << 16, timeout_s=bad)


@pytest.mark.parametrize("name,value,want", [
    ("num_nvl_bytes", -1, "num_nvl_bytes must be an int in [0, 4611686018427387904]"),
    ("num_nvl_bytes", (1 << 62) + 1, "num_nvl_bytes must be an int in [0, "),
    ("num_nvl_bytes", 4096.0, "(float, not an int)"),
    ("num_rdma_bytes", 1 << 64, "num_rdma_bytes must be an int in [0, "),
    ("num_rdma_bytes", True, "num_rdma_bytes must be an int"),
])
def test_constructor_values_are_named(name, value, want):
    kw = dict(num_nvl_bytes=1 << 16, device="cpu")
    kw[name] = value
    with pytest.raises(ValueError) as ei:
        triton_ep.Buffer(LocalWorld(1, 1 << 16).comm(0), **kw)
    assert want in str(ei.value), str(ei.value)


@pytest.mark.parametrize("value,want", [("tpu", "device must be a torch.device or a string"), (3.5, "got 3.5"),
                                        ("meta", "device must be a CUDA device or the CPU, got meta")])
def test_device_values_are_named(value, want):
    """(A Buffer over a process group checks its device; one over ranks simulated in one process takes theirs.)"""
    with pytest.raises(ValueError) as ei:
        checks.device_arg(value)
    assert want in str(ei.value), str(ei.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_value_error():
    for dev in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="this process has no CUDA device"):
            checks.device_arg(dev)


@pytest.mark.parametrize("value", ["junk", "2", " 1"])
def test_a_triton_interpret_neither_on_nor_off_is_a_value_error_naming_it(monkeypatch, value):
    """(A new user's find: TRITON_INTERPRET=junk or 2 made ``import triton_ep`` raise an ImportError saying triton
    had been imported first, which was false.) A value Triton reads neither as on (1, true, yes, y, on) nor as off
    (0, empty, false, no, n, off) is named, with what is accepted, by the Buffer's device check, on any device; a
    spelling of off is the off case's error. ``interpreted`` is read once per process: its cache is cleared
    around."""
    from triton_ep import triton_mode
    monkeypatch.setenv("TRITON_INTERPRET", value)
    triton_mode.interpreted.cache_clear()
    try:
        for dev in ("cpu", None):
            with pytest.raises(ValueError, match=re.escape(f"TRITON_INTERPRET={value!r} is neither on nor off: set "
                                                           f"it to 1 (Triton's interpreter, CPU tensors) or 0")):
                checks.device_arg(dev)
        monkeypatch.setenv("TRITON_INTERPRET", "Off")
        triton_mode.interpreted.cache_clear()
        assert triton_mode.problem() is None and not triton_mode.interpreted()
        with pytest.raises(ValueError, match="TRITON_INTERPRET='Off' here"):
            checks.device_arg("cpu")
    finally:
        monkeypatch.undo()
        triton_mode.interpreted.cache_clear()


def test_a_cpu_device_without_the_interpreter_is_a_value_error(monkeypatch):
    """TRITON_INTERPRET=0 (set by hand on a machine without CUDA, or a CPU device where CUDA runs the kernels):
    the Buffer's device check names the variable (new user's find: the Buffer was built, and its first call died
    in Triton with "0 active drivers"). ``interpreted`` is read once per process: its cache is cleared around."""
    from triton_ep import triton_mode
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    triton_mode.interpreted.cache_clear()
    try:
        with pytest.raises(ValueError, match="TRITON_INTERPRET='0'"):
            checks.device_arg("cpu")
    finally:
        monkeypatch.undo()
        triton_mode.interpreted.cache_clear()
    if not torch.cuda.is_available():
        assert checks.device_arg("cpu") == torch.device("cpu")


def test_shm_tag_is_checked_by_itself(monkeypatch):
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "ok_tag-1")
    assert ipc.shm_tag() == "ok_tag-1" and ipc.shm_tag("") == ""
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "bad/tag")
    with pytest.raises(ValueError, match="TRITON_EP_SHM_TAG='bad/tag'"):
        ipc.shm_tag()
    with pytest.raises(ValueError, match="TRITON_EP_SHM_TAG='bad/tag'"):
        triton_ep.Buffer(LocalWorld(1, 1 << 16).comm(0), 1 << 16)
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "t" * 65)       # (a new user's 300 characters: OSError "File name too long")
    with pytest.raises(ValueError, match="a tag of 65 characters; the shared-memory tag may hold at most 64"):
        ipc.shm_tag()
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "t" * 64)
    assert ipc.shm_tag() == "t" * 64


@pytest.mark.parametrize("args,want", [
    ((0,), "Config's num_sms must be an int in [1, 2147483647]"),
    ((20, 2 ** 31), "Config's num_max_nvl_chunked_send_tokens must be"),
    ((20, 6, True), "Config's num_max_nvl_chunked_recv_tokens must be"),
    ((20, 6, 256, 6.0), "Config's num_max_rdma_chunked_send_tokens must be"),
    ((20, 6, 256, 6, -1), "Config's num_max_rdma_chunked_recv_tokens must be"),
])
def test_config_fields_are_int32_and_named(args, want):
    with pytest.raises(ValueError) as ei:
        triton_ep.Config(*args)
    assert want in str(ei.value), str(ei.value)
    assert repr(triton_ep.Config(np.int32(2), 2 ** 31 - 1)) == "Config(2, 2147483647, 256, 6, 256)"


@pytest.mark.parametrize("field,value,want", [
    ("num_max_nvl_chunked_recv_tokens", -5, "Config's num_max_nvl_chunked_recv_tokens must be an int in [1, "),
    ("num_max_nvl_chunked_send_tokens", 0, "Config's num_max_nvl_chunked_send_tokens must be"),
    ("num_sms", -(2 ** 31), "Config's num_sms must be"),
    ("num_max_rdma_chunked_recv_tokens", 1.5, "Config's num_max_rdma_chunked_recv_tokens must be"),
    ("num_warps", 3, "Config's num_warps must be None or one of (1, 2, 4, 8, 16, 32), got 3"),
])
def test_a_config_field_assigned_later_is_checked_as_at_construction(field, value, want):
    """A field assigned after construction (a new user's ``cfg.num_max_nvl_chunked_recv_tokens = -5`` once gave
    wrong rows from dispatch and zeros from combine, with no error) raises as the constructor does, and the
    Config keeps its old value."""
    cfg = triton_ep.Config(20, 6, 256, 6, 128)
    with pytest.raises(ValueError) as ei:
        setattr(cfg, field, value)
    assert want in str(ei.value), str(ei.value)
    assert cfg == triton_ep.Config(20, 6, 256, 6, 128)
    cfg.num_max_nvl_chunked_recv_tokens, cfg.num_warps = np.int64(64), 8      # (good values: taken, as ints)
    assert cfg.launch_key() == (20, 6, 64, 8) and type(cfg.num_max_nvl_chunked_recv_tokens) is int


@pytest.mark.parametrize("call,want", [
    (lambda: triton_ep.Config().get_nvl_buffer_size_hint(0, 2), "hidden_bytes must be"),
    (lambda: triton_ep.Config().get_rdma_buffer_size_hint(7168, 2 ** 31), "num_ranks must be"),
    (lambda: triton_ep.Buffer.get_low_latency_rdma_size_hint(2 ** 31, 7168, 2, 16),
     "num_max_dispatch_tokens_per_rank must be an int in [1, 2147483647]"),
    (lambda: triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 0, 2, 16), "hidden must be"),
    (lambda: triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 2.0, 16), "num_ranks must be"),
    (lambda: triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, checks.MAX_EXPERTS + 2),
     f"num_experts must be an int in [1, {checks.MAX_EXPERTS}]"),
    (lambda: triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 16), "num_experts % num_ranks == 0"),
    (lambda: triton_ep.Buffer.set_num_sms(2 ** 31), "the SM count must be an even int in [2, 2147483646]"),
    (lambda: triton_ep.Buffer.set_num_sms(3), "the SM count must be an even int"),
])
def test_hints_and_sm_count_are_bounded_and_named(call, want):
    with pytest.raises(ValueError) as ei:
        call()
    assert want in str(ei.value), str(ei.value)


def test_hints_in_range_still_work():
    assert triton_ep.Config().get_nvl_buffer_size_hint(7168 * 2, np.int64(8)) > 0
    assert triton_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 16) % 128 == 0


@pytest.mark.parametrize("raw,ok", [("", True), ("0.5", True), ("3600", True), ("3601", False), ("1e300", False),
                                    ("inf", False), ("nan", False), ("-1", False), ("x", False)])
def test_fabric_delay_variables_range(raw, ok, monkeypatch):
    """TRITON_EP_EMULATED_REORDER_S / _SKEW_S: seconds in [0, MAX_DELAY_S], named with the range."""
    from triton_ep.transport import factory
    for var in (factory.ENV_REORDER_S, factory.ENV_SKEW_S):
        monkeypatch.delenv(factory.ENV_REORDER_S, raising=False)
        monkeypatch.delenv(factory.ENV_SKEW_S, raising=False)
        monkeypatch.setenv(var, raw)
        if ok:
            assert max(factory.fabric_delays()) == (float(raw) if raw else 0.0)
        else:
            with pytest.raises(ValueError, match=rf"^{var}={raw!r} must be a number of seconds in \[0, 3600\]"):
                factory.fabric_delays()
