"""Bad input gets a clear error before any kernel runs, naming the argument; nothing is modified."""
import re

import numpy as np
import pytest
import torch

import triton_ep
from tests.cases.helpers import make_inputs, virtual_dispatch
from triton_ep.testing import VirtualGroup


@pytest.fixture()
def one():
    vg = VirtualGroup(1, 1 << 16)
    return vg, vg.buffers[0]


def _dispatch(vg, **kw):
    (out,) = vg.call("dispatch", [kw])
    return out


def _layout(buf, idx, E):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx)


@pytest.mark.parametrize("bad,exc,words", [
    (dict(x=torch.zeros(4, 3, dtype=torch.float32)), ValueError, ["16 bytes", "12 bytes"]),   # any dtype, 16-byte rows
    (dict(x=torch.zeros(4, 8, dtype=torch.uint8)), ValueError, ["16 bytes"]),
    (dict(x=[[0.0] * 16] * 4), TypeError, ["x", "torch.Tensor"]),
    (dict(x=torch.zeros(4, 16, 1, dtype=torch.bfloat16)), ValueError, ["x", "shape"]),
    (dict(x=torch.zeros(4, 12, dtype=torch.bfloat16)), ValueError, ["16 bytes"]),
    (dict(x=torch.zeros(5, 16, dtype=torch.bfloat16)), ValueError, ["must have shape [5,"]),
    (dict(x=torch.zeros(4, 16, dtype=torch.bfloat16, device="meta")), ValueError, ["x", "meta"]),
    (dict(topk_weights=torch.zeros(4, 2, dtype=torch.float64)), TypeError, ["topk_weights"]),
    (dict(topk_idx=torch.zeros(4, 2, dtype=torch.float32)), TypeError, ["topk_idx"]),
    (dict(expert_alignment=0), ValueError, ["expert_alignment"]),
    (dict(num_worst_tokens=-1), ValueError, ["num_worst_tokens"]),
    # scales: [T, S] fp32 or int32, any S, with 1-byte x rows of 16-byte multiples (DeepEP's checks)
    (dict(x=(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.zeros(5, 2))), ValueError,
     ["x[1] (scales)", "shape [4, *] (T = 4 rows of x[0])", "[5, 2]"]),
    # the argument named is the one passed (dispatch takes no num_experts: E is its length)
    (dict(num_tokens_per_expert=torch.zeros(0, dtype=torch.int32)), ValueError,
     ["num_tokens_per_expert has 0 entries"]),
    (dict(x=(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.bfloat16))), TypeError,
     ["x[1] (scales)", "torch.float32 or torch.int32", "torch.bfloat16"]),
    (dict(x=(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(4, 1))), ValueError, ["16 bytes"]),
    (dict(x=(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 1))), TypeError, ["x[0]", "1-byte"]),
])
def test_dispatch_rejects_bad_arguments(one, bad, exc, words):
    vg, buf = one
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [2, 2]])
    kw = dict(x=torch.randn(4, 16).to(torch.bfloat16), topk_weights=torch.rand(4, 2), **_layout(buf, idx, 4))
    kw.update(bad)
    err = _dispatch(vg, **kw)
    assert isinstance(err, exc), err
    assert all(w in str(err) for w in words), str(err)


def _quantized_x():
    """A quantized ``[4, 16]`` tensor. torch 2.13 deprecates making one (a UserWarning naming
    ``torch.quantize_per_tensor``); that one warning is silenced here, where the test makes it on purpose, and only
    when the test runs (made in a ``parametrize`` list it was printed at every collection of this file)."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor.* are deprecated",
                                category=UserWarning)
        return torch.quantize_per_tensor(torch.zeros(4, 16), 0.1, 0, torch.quint8)


def test_dispatch_rejects_a_quantized_x(one):
    """A quantized x (its rows are not raw bytes) is a TypeError naming x, as the other bad x in the list above."""
    test_dispatch_rejects_bad_arguments(one, dict(x=_quantized_x()), TypeError, ["x", "quantized"])


def test_collecting_this_file_warns_nothing():
    """(A new user's find: collecting this file printed torch's deprecation UserWarning of
    ``torch.quantize_per_tensor``, made in the parametrize list above.) Executing the file, as collection does,
    warns nothing. In a fresh interpreter: torch gives that warning once per process."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = ("import runpy, sys, warnings; sys.path.insert(0, %r)\n"
            "import triton_ep, tests.cases.helpers, triton_ep.testing   # (their own import is not this file's)\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    runpy.run_path(%r, run_name='collected')\n"
            "print([f'{w.filename}:{w.lineno}: {w.message}' for w in seen])") % (root, os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]


def test_numpy_integers_are_taken_as_ints(one):
    """A numpy integer num_worst_tokens (as a config loaded with numpy gives) sizes the outputs as an int does
    (it used to reach a kernel launch and fail there)."""
    import numpy as np
    vg, buf = one
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [2, 2]])
    kw = dict(x=torch.randn(4, 16).to(torch.bfloat16), topk_weights=torch.rand(4, 2), **_layout(buf, idx, 4))
    out = _dispatch(vg, num_worst_tokens=np.int64(6), **kw)
    assert not isinstance(out, BaseException), out
    assert out[0].shape[0] == 6 and out[1][3:].eq(-1).all(), out[1]


def test_ids_out_of_range_are_masked_then_raised(one):
    """Ids >= E and < -1 are masked by the layout kernel and raised at dispatch; the input is untouched."""
    vg, buf = one
    idx = torch.tensor([[0, 7], [-3, 1]])
    keep = idx.clone()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    assert per_expert.tolist() == [1, 1, 0, 0] and in_rank.tolist() == [[True], [True]]
    err = _dispatch(vg, x=torch.randn(2, 16).to(torch.bfloat16), **_layout(buf, idx, 4))
    assert isinstance(err, ValueError) and "2 ids outside [-1, 4)" in str(err)
    assert torch.equal(idx, keep)


def test_layout_and_group_size_errors():
    vg = VirtualGroup(2, 1 << 16)
    buf = vg.buffers[0]
    with pytest.raises(ValueError, match="multiple of the group size 2"):
        buf.get_dispatch_layout(torch.zeros(3, 2, dtype=torch.int64), 5)
    with pytest.raises(TypeError, match="topk_idx"):
        buf.get_dispatch_layout(torch.zeros(3, 2, dtype=torch.int16), 4)
    with pytest.raises(ValueError, match="topk_idx must have shape"):
        buf.get_dispatch_layout(torch.zeros(3, dtype=torch.int64), 4)


def test_layout_refuses_a_topk_idx_without_columns_as_dispatch_does(one):
    """(A new user's find: ``get_dispatch_layout`` returned a layout for a ``[T, 0]`` topk_idx that ``dispatch``
    then refused.) Both raise the same ValueError (K >= 1)."""
    vg, buf = one
    idx = torch.zeros(3, 0, dtype=torch.int64)
    with pytest.raises(ValueError) as layout:
        buf.get_dispatch_layout(idx, 4)
    err = _dispatch(vg, x=torch.zeros(3, 16, dtype=torch.bfloat16), topk_idx=idx,
                    num_tokens_per_rank=torch.zeros(1, dtype=torch.int32),
                    is_token_in_rank=torch.zeros(3, 1, dtype=torch.bool),
                    num_tokens_per_expert=torch.zeros(4, dtype=torch.int32))
    assert isinstance(err, ValueError), err
    assert str(layout.value) == str(err) == "topk_idx must have at least one column"


@pytest.mark.parametrize("group", ["x", 3, object()])
def test_a_group_that_is_no_process_group_is_a_type_error(group):
    """``Buffer(group, ...)`` with something that is no process group (a fresh user passed a string) is a
    TypeError naming ``group``, not an AttributeError from inside the bootstrap; ``ElasticBuffer`` alike."""
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        triton_ep.Buffer(group, 1 << 20)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        triton_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=2)


def test_a_rank_outside_the_group_is_told_so():
    """(A new user's find: on a rank outside ``dist.new_group([0, 2])`` torch gives ``NON_GROUP_MEMBER``, an int, and
    the Buffer said "must be a ProcessGroup, got int".) A ValueError saying this rank is not a member."""
    import torch.distributed as dist
    for make in (lambda g: triton_ep.Buffer(g, 1 << 20),
                 lambda g: triton_ep.ElasticBuffer(g, num_max_tokens_per_rank=8, hidden=128, num_topk=2)):
        with pytest.raises(ValueError, match="is not a member of it .*NON_GROUP_MEMBER"):
            make(dist.GroupMember.NON_GROUP_MEMBER)


def test_buffer_too_small_for_one_row_is_a_clear_error():
    xs, idxs, ws = make_inputs(0, 2, 1, 4096, [3])
    vg = VirtualGroup(1, 4096)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        virtual_dispatch(vg, xs, idxs, ws, 2)


@pytest.mark.parametrize("R", range(1, 9))
def test_configs_for_every_group_size(R):
    for cfg in (triton_ep.Buffer.get_dispatch_config(R), triton_ep.Buffer.get_combine_config(R)):
        assert isinstance(cfg, triton_ep.Config)
        hint = cfg.get_nvl_buffer_size_hint(7168 * 2, R)
        assert hint >= 7168 * 2 * R and hint % 128 == 0


def test_static_api_surface():
    with pytest.raises(ValueError):
        triton_ep.Buffer.set_num_sms(7)
    assert triton_ep.topk_idx_t is torch.int64
    assert issubclass(triton_ep.EPTimeoutError, RuntimeError) and issubclass(triton_ep.EPTimeoutError, TimeoutError)
    assert triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    ev = triton_ep.Buffer.capture()
    ev.current_stream_wait()
    with ev:
        pass


def test_runtime_is_absent_and_says_what_to_use(one):
    """(A new user's find: scripts written for DeepEP read ``buffer.runtime.get_num_rdma_ranks()`` /
    ``get_local_device_id()``; here a bare AttributeError.) vLLM and SGLang never touch DeepEP's ``runtime`` (its C++
    object), so none is provided: reading it raises an AttributeError naming what answers those getters, and
    those answers hold; a misspelt attribute keeps Python's own message."""
    _, buf = one
    with pytest.raises(AttributeError) as ex:
        buf.runtime
    assert str(ex.value) == triton_ep.buffer.RUNTIME_ABSENT and not hasattr(buf, "runtime")
    for words in ("get_num_rdma_ranks() is buffer.get_rdma_stats()['num_hosts']",
                  "get_local_device_id() is buffer.device.index"):
        assert words in str(ex.value), ex.value
    assert buf.get_rdma_stats()["num_hosts"] == 1 and buf.device.index is None      # (one host, CPU)
    with pytest.raises(AttributeError, match="^'Buffer' object has no attribute 'runtme'$"):
        buf.runtme


def test_destroyed_buffer_raises():
    vg = VirtualGroup(1, 1 << 16)
    buf = vg.buffers[0]
    buf.destroy()
    buf.destroy()
    with pytest.raises(triton_ep.EPError, match="destroyed"):
        buf.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), 1)


def test_low_latency_entry_points_need_a_low_latency_buffer():
    buf = VirtualGroup(1, 1 << 16).buffers[0]
    for name, nargs in (("low_latency_dispatch", 4), ("low_latency_combine", 4), ("clean_low_latency_buffer", 3),
                        ("get_next_low_latency_combine_buffer", 1), ("low_latency_clean_mask_buffer", 0)):
        with pytest.raises(ValueError, match="low_latency_mode=True"):
            getattr(buf, name)(*([None] * nargs))
    assert buf.get_comm_stream() is None


def test_ranks_calling_different_collectives_fail_instead_of_hanging():
    """Rank 0 dispatches while rank 1 combines: both raise at once (a bug would let them run mismatched
    protocols and hang or corrupt)."""
    xs, idxs, ws = make_inputs(3, 4, 2, 16, [4, 4])
    vg = VirtualGroup(2, 1 << 16)
    first = virtual_dispatch(vg, xs, idxs, ws, 4)
    b0, b1 = vg.buffers
    lay = _layout(b0, idxs[0], 4)
    from triton_ep.testing import lockstep, steps
    out = lockstep([steps(b0, "dispatch", x=xs[0], topk_weights=ws[0], **lay),
                    steps(b1, "combine", x=first[1][0], handle=first[1][4])])
    # the dispatching rank's notify finds that rank 1 released data of the round before notifying (it runs
    # another collective); the combining rank learns from the device words that rank 0 found a
    # mismatch: neither waits out its timeout, both name the other rank
    # a disagreement is a ValueError on every rank, naming what each rank called (docs/design.md, Errors)
    assert isinstance(out[0], ValueError) and "rank 0 called dispatch, rank 1 called combine" in str(out[0]), out
    assert isinstance(out[1], ValueError) and "rank 1 called combine, rank 0 called dispatch" in str(out[1]), out


def test_a_bystander_names_the_rank_that_differs():
    """Three ranks, rank 1 passes another hidden size. Rank 0 finds it first and tells every peer; rank 2's
    record then names rank 0, which agrees with it: the message must still name rank 1 and both values."""
    from triton_ep.testing import lockstep, steps
    vg = VirtualGroup(3, 1 << 16)
    gens = []
    for r in range(3):
        H = 16 if r == 1 else 32
        xs, idxs, ws = make_inputs(9, 6, 2, H, [3, 3, 3])
        gens.append(steps(vg.buffers[r], "dispatch", x=xs[r], topk_weights=ws[r], **_layout(vg.buffers[r], idxs[r], 6)))
    out = lockstep(gens)
    assert all(isinstance(o, ValueError) for o in out), out
    assert "hidden: rank 0 passed 32, rank 1 passed 16" in str(out[0]), str(out[0])
    assert "hidden: rank 2 passed 32, rank 1 passed 16" in str(out[2]), str(out[2])
    assert "hidden: rank 1 passed 16, rank " in str(out[1]) and "passed 32" in str(out[1]), str(out[1])


@pytest.mark.parametrize("field,kw0,kw1,want", [
    ("hidden", dict(H=32), dict(H=16), "hidden: rank {me} passed {a}, rank {peer} passed {b}"),
    ("dtype", dict(dtype=torch.bfloat16), dict(dtype=torch.float16),
     "x dtype: rank {me} passed {a}, rank {peer} passed {b}"),
    ("K", dict(K=2), dict(K=3), "top-k (topk_idx columns): rank {me} passed {a}, rank {peer} passed {b}"),
    ("E", dict(E=4), dict(E=8), "num_experts: rank {me} passed {a}, rank {peer} passed {b}"),
])
def test_disagreeing_ranks_name_the_field_and_both_values(field, kw0, kw1, want):
    """Two ranks pass different sizes or dtypes to dispatch: both raise ValueError naming the field and each
    rank's value (not a list of candidates), and no field of another mode (num_worst_tokens) appears."""
    from triton_ep.testing import lockstep, steps
    vg = VirtualGroup(2, 1 << 16)
    gens, vals = [], []
    for r, kw in enumerate((kw0, kw1)):
        H, E, K, dtype = kw.get("H", 32), kw.get("E", 4), kw.get("K", 2), kw.get("dtype", torch.bfloat16)
        xs, idxs, ws = make_inputs(7, E, K, H, [3, 3])
        buf = vg.buffers[r]
        lay = _layout(buf, idxs[r], E)
        gens.append(steps(buf, "dispatch", x=xs[r].to(dtype), topk_weights=ws[r], **lay))
        vals.append({"hidden": H, "dtype": str(dtype).replace("torch.", ""), "K": K, "E": E}[field])
    out = lockstep(gens)
    for me, peer in ((0, 1), (1, 0)):
        assert isinstance(out[me], ValueError), out
        text = want.format(me=me, peer=peer, a=vals[me], b=vals[peer])
        assert text in str(out[me]) and "num_worst_tokens" not in str(out[me]), (text, str(out[me]))


@pytest.mark.parametrize("kw,exc,words", [
    (dict(previous_event=object()), TypeError, ["previous_event"]),
    (dict(num_worst_tokens=2 ** 63), ValueError, ["num_worst_tokens"]),
    (dict(expert_alignment=2 ** 70), ValueError, ["expert_alignment"]),
])
def test_more_bad_dispatch_arguments_go_through_the_exchange(one, kw, exc, words):
    """Each is reported as a clear error naming the argument (a bug: AttributeError/OverflowError raised
    before the exchange, leaving peers to pair with this rank's next call)."""
    vg, buf = one
    idx = torch.tensor([[0, 1], [1, -1]])
    err = _dispatch(vg, x=torch.randn(2, 16).to(torch.bfloat16), **_layout(buf, idx, 4), **kw)
    assert isinstance(err, exc) and all(w in str(err) for w in words), err


def test_config_of_wrong_type_and_timeout_values_are_named(monkeypatch):
    buf = VirtualGroup(1, 1 << 16).buffers[0]
    with pytest.raises(TypeError, match="config"):
        buf.dispatch(torch.zeros(1, 16, dtype=torch.bfloat16), config="abc")
    from triton_ep.transport.ipc import LocalWorld
    comm = LocalWorld(1, 4096).comm(0)
    for bad in (float("nan"), "x", 0, -1, float("inf")):
        with pytest.raises(ValueError, match="timeout_s"):
            triton_ep.Buffer(comm, 4096, timeout_s=bad)
    monkeypatch.setenv("TRITON_EP_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match="TRITON_EP_TIMEOUT_S"):
        triton_ep.Buffer(comm, 4096)


def test_internode_entry_points_need_ranks_on_several_hosts():
    """DeepEP's internode_dispatch / internode_combine on a one-host Buffer say to call dispatch / combine."""
    buf = VirtualGroup(1, 1 << 16).buffers[0]
    for name in ("internode_dispatch", "internode_combine"):
        with pytest.raises(ValueError, match=name.replace("internode_", "") + r"\(\)"):
            getattr(buf, name)()


@pytest.mark.parametrize("kw,exc,words", [
    (dict(hidden=-5), ValueError, "hidden must be None or an int of at least 1, got -5"),
    (dict(hidden=0), ValueError, "hidden must be None or an int of at least 1, got 0"),
    (dict(hidden="64"), ValueError, "hidden must be None or an int of at least 1, got '64' (str)"),
    (dict(hidden=True), ValueError, "hidden must be None or an int of at least 1, got True (bool)"),
    (dict(hidden=64.0), ValueError, "hidden must be None or an int of at least 1, got 64.0 (float)"),
    (dict(num_tokens=-1), ValueError, "num_tokens must be None or an int of at least 0, got -1"),
    (dict(num_tokens=1.5), ValueError, "num_tokens must be None or an int of at least 0, got 1.5 (float)"),
    (dict(num_tokens=float("nan")), ValueError, "num_tokens must be None or an int of at least 0, got nan (float)"),
])
def test_config_shape_keywords_are_checked(kw, exc, words):
    """(A new user's find: ``hidden=-5``, ``0``, ``'64'``, ``True``, ``num_tokens=-1`` and ``1.5`` were taken
    silently, ``nan`` gave a bare "cannot convert float NaN to integer".) ``get_dispatch_config`` /
    ``get_combine_config`` check ``hidden=`` and ``num_tokens=`` as they check ``num_ranks``: a ValueError (a
    non-int too, as for every size argument) naming the argument and the value; ``None``, ints (numpy's too) and
    ``num_tokens=0`` (a rank without tokens) are taken."""
    import numpy as np
    for get in (triton_ep.Buffer.get_dispatch_config, triton_ep.Buffer.get_combine_config):
        with pytest.raises(exc) as ex:
            get(2, **kw)
        assert str(ex.value) == words, ex.value
        assert get(2, hidden=np.int64(64), num_tokens=0) == get(2) == get(2, hidden=None, num_tokens=None)


def test_a_size_that_is_not_an_int_is_a_value_error_everywhere(one):
    """(A new user's find: a float, str or bool where an int size, count or offset goes was a ValueError in some
    calls and a TypeError in others, ``get_dispatch_config(2.0)`` and ``get_dispatch_config(2, hidden=64.0)``
    among them.) It is a ValueError everywhere, as in most calls already (docs/api.md, its opening), its message
    naming the argument. (Low-latency dispatch's ``num_max_dispatch_tokens_per_rank``:
    tests/modes/low_latency/test_low_latency.py::test_bad_ids_and_shapes; a Buffer's and an ElasticBuffer's
    sizes on every rank at once: tests/runtime/test_values.py.)"""
    from triton_ep.elastic import ElasticBuffer
    vg, buf = one
    B = triton_ep.Buffer
    idx = torch.tensor([[0, 1], [1, -1]])
    counts = dict(num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0, sl_idx=3, num_allocated_qps=0)
    calls = {
        "num_ranks": lambda bad: B.get_dispatch_config(bad),
        "hidden": lambda bad: B.get_combine_config(2, hidden=bad),
        "num_tokens": lambda bad: B.get_dispatch_config(2, num_tokens=bad),
        "num_max_dispatch_tokens_per_rank": lambda bad: B.get_low_latency_rdma_size_hint(bad, 64, 1, 8),
        "the SM count": lambda bad: B.set_num_sms(bad),
        "Config's num_sms": lambda bad: triton_ep.Config(bad, 6, 256, 6, 128),
        "num_experts": lambda bad: buf.get_dispatch_layout(idx, bad),
        "offset": lambda bad: buf.get_local_buffer_tensor(torch.int8, offset=bad),
        "ElasticBuffer: num_bytes": lambda bad: ElasticBuffer._checked_size(None, bad, **counts),
        "num_topk": lambda bad: ElasticBuffer._checked_size(None, 4096, **dict(counts, num_topk=bad)),
    }
    for name, call in calls.items():
        for bad in (8.0, "8", True):
            with pytest.raises(ValueError) as ex:
                call(bad)
            assert not isinstance(ex.value, TypeError) and str(ex.value).startswith(name), (name, bad, ex.value)
    kw = dict(x=torch.randn(2, 16).to(torch.bfloat16), **_layout(buf, idx, 4))
    for name in ("expert_alignment", "num_worst_tokens"):
        err = _dispatch(vg, **{name: 4.0}, **kw)
        assert type(err) is ValueError and str(err).startswith(name), err


def test_local_buffer_tensor_refuses_negative_and_past_the_end_views(one):
    """(A new user's find: ``offset=-1`` gave the buffer's last element, ``size=(-1,)`` all but one element, an offset
    past the end an empty tensor.) ``get_local_buffer_tensor`` takes no Python-style negative index (DeepEP adds
    the offset to the buffer's pointer): a negative offset or size dimension, or an offset past the end, is a
    ValueError naming the argument and value, for the RDMA-side scratch too; the whole range still works."""
    _, buf = one
    n = buf.get_local_buffer_tensor(torch.int32).numel()
    for kw, words in ((dict(offset=-1), "offset must be in [0, "), (dict(offset=-1000), "got -1000"),
                      (dict(offset=n + 1), f"offset must be in [0, {n}] (elements of the buffer as this dtype), "
                                           f"got {n + 1}"),
                      (dict(size=torch.Size([-1])), "size must have no negative dimension, got (-1,)"),
                      (dict(size=(2, -3), offset=4), "size must have no negative dimension, got (2, -3)"),
                      (dict(offset=-1, use_rdma_buffer=True), "offset must be in [0, 0] (elements of the RDMA buffer"),
                      (dict(size=(-1,), use_rdma_buffer=True), "size must have no negative dimension")):
        with pytest.raises(ValueError, match=re.escape(words)):
            buf.get_local_buffer_tensor(torch.int32, **kw)
    for bad in (1.0, True, "1"):
        with pytest.raises(ValueError, match="offset must be an int"):
            buf.get_local_buffer_tensor(torch.int32, offset=bad)
    assert buf.get_local_buffer_tensor(torch.int32, offset=n).numel() == 0
    t = buf.get_local_buffer_tensor(torch.int32, torch.Size([2, 3]), offset=n - 6)
    assert t.shape == (2, 3) and t.data_ptr() == buf.get_local_buffer_tensor(torch.int32).data_ptr() + 4 * (n - 6)
    with pytest.raises(ValueError, match="exceeds the buffer"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size([7]), offset=n - 6)


def test_local_buffer_tensor_names_a_bad_dtype_or_size(one):
    """(A new user's find: a str dtype, a size of floats and ``torch.Size([2**62, 2**62])`` gave torch's own errors,
    the last ``numel: integer multiplication overflow``.) A ``dtype`` that is not a ``torch.dtype`` is a TypeError
    naming it; a ``size`` that is not a sequence of ints is a ValueError (docs/api.md's rule for sizes), and one
    whose elements overflow int64 is too large for the buffer, as one that merely exceeds it is; the RDMA-side
    view alike."""
    _, buf = one
    for rdma in (False, True):
        with pytest.raises(TypeError, match=re.escape("dtype must be a torch.dtype, got 'float'")):
            buf.get_local_buffer_tensor("float", use_rdma_buffer=rdma)
        for bad in ((4.0,), (2, 1.5), (True,), 4, "4"):
            with pytest.raises(ValueError, match=re.escape(f"size must be a torch.Size or a sequence of ints, got "
                                                           f"{bad!r}")):
                buf.get_local_buffer_tensor(torch.int8, bad, use_rdma_buffer=rdma)
        for big in (torch.Size([2**62, 2**62]), (2**70,)):
            with pytest.raises(ValueError, match=re.escape(f"size {tuple(big)} exceeds the ")):
                buf.get_local_buffer_tensor(torch.int8, big, use_rdma_buffer=rdma)
    assert buf.get_local_buffer_tensor(torch.int8, [np.int64(2), 3]).shape == (2, 3)
