"""Ambient torch state a caller may set (DeepEP's own tests set some of it) changes nothing: results are
bit-equal to those of the plain state (docs/design.md, invariant 12), and every payload dtype DeepEP moves works."""
import contextlib

import pytest
import torch

from tests.cases import mp as mp_cases
from tests.cases.helpers import assert_bits, check_dispatch, make_inputs, raise_first, virtual_dispatch
from triton_ep import reference as ref
from triton_ep.testing import VirtualGroup, run_ranks


@contextlib.contextmanager
def _default_device(dev):
    torch.set_default_device(dev)
    try:
        yield
    finally:
        torch.set_default_device(None)


@contextlib.contextmanager
def _default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _deterministic():
    """``use_deterministic_algorithms``: ``torch.empty`` is then filled with NaN / the largest integer."""
    import torch.utils.deterministic as det
    old, old_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
        det.fill_uninitialized_memory = old_fill


AMBIENT = {
    "default_device_meta": lambda: _default_device("meta"),
    "default_dtype_float64": lambda: _default_dtype(torch.float64),
    "default_dtype_bfloat16": lambda: _default_dtype(torch.bfloat16),
    "deterministic_algorithms": _deterministic,
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
}


E_, INPUTS = 6, make_inputs(4, 6, 2, 32, (5, 0, 7))      # made in the plain state


def round_trip(device="cpu"):
    """Buffer construction, layout, dispatch, combine and cached dispatch on simulated ranks; returns every
    output tensor, moved to CPU, in a flat list."""
    (xs, idxs, ws), E = INPUTS, E_
    R = len(xs)
    xs = [x.to(device) for x in xs]
    vg = VirtualGroup(R, 1 << 12, device=device)        # small: several rounds
    res = virtual_dispatch(vg, xs, idxs, ws, E, device)
    ys = [r[0].to(torch.bfloat16) * 2 for r in res]
    comb = raise_first(vg.call("combine", [dict(x=ys[j], handle=res[j][4], topk_weights=res[j][2])
                                           for j in range(R)]))
    cached = raise_first(vg.call("dispatch", [dict(x=xs[r], handle=res[r][4]) for r in range(R)]))
    out = []
    for r in range(R):
        out += [res[r][0], res[r][1], res[r][2], res[r][4][0], res[r][4][3], comb[r][0], comb[r][1], cached[r][0]]
    if device != "cpu":
        torch.cuda.synchronize()
    return [t.to("cpu") for t in out]


@pytest.mark.parametrize("name", sorted(AMBIENT))
def test_ambient_state_changes_nothing(name):
    check_ambient(AMBIENT[name], name, "cpu")


def check_ambient(ctx, name, device):
    """``round_trip`` under ``ctx()`` is bit-equal to the plain state's."""
    plain = round_trip(device)
    with ctx():
        got = round_trip(device)
    assert len(got) == len(plain)
    for i, (a, b) in enumerate(zip(got, plain)):
        assert_bits(a, b, f"output {i} under {name}")


def test_inputs_requiring_grad_move_unchanged():
    """Rows that require grad (a training step) move as their values; the inputs keep their grad flag."""
    xs, idxs, ws = make_inputs(2, 6, 2, 32, [4, 3])
    xg = [x.float().requires_grad_() for x in xs]
    res = virtual_dispatch(VirtualGroup(2, 1 << 16), xg, idxs, ws, 6)
    check_dispatch(res, ref.dispatch([x.detach() for x in xg], idxs, ws, 6))
    assert all(x.requires_grad for x in xg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8, torch.int32, torch.float8_e4m3fn])
def test_dispatch_moves_any_dtype_with_16_byte_rows(dtype):
    """DeepEP's intranode dispatch moves any dtype whose row is a multiple of 16 bytes: the rows arrive bit
    for bit (NaN patterns, integers, fp8 without scales alike); cached dispatch too."""
    R, E, K, Ts = 2, 4, 2, [8, 5]
    H = 64 if dtype.itemsize < 8 else 16
    _, idxs, ws = make_inputs(7, E, K, H, Ts)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, 256, (T, H * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype) for T in Ts]
    vg = VirtualGroup(R, 1 << 10)
    res = virtual_dispatch(vg, xs, idxs, ws, E)
    exp = ref.dispatch(xs, idxs, ws, E)
    check_dispatch(res, exp)
    assert all(r[0].dtype == dtype for r in res)
    cached = raise_first(vg.call("dispatch", [dict(x=xs[r], handle=res[r][4]) for r in range(R)]))
    for j in range(R):
        assert_bits(cached[j][0], exp[j]["recv_x"], f"rank {j} cached")


def test_combine_of_unsupported_dtype_is_a_type_error():
    """Combine reduces bf16 rows only (as DeepEP): float32 rows get a TypeError naming x and bfloat16."""
    xs, idxs, ws = make_inputs(1, 4, 2, 16, [3, 2])
    xs = [x.float() for x in xs]
    vg = VirtualGroup(2, 1 << 16)
    res = virtual_dispatch(vg, xs, idxs, ws, 4)
    out = vg.call("combine", [dict(x=res[j][0], handle=res[j][4]) for j in range(2)])
    assert isinstance(out[0], TypeError) and "bfloat16" in str(out[0]) and "x" in str(out[0]), out


@pytest.mark.multiprocess
def test_processes_float32_payload_and_default_device_meta():
    """Two rank processes with the default device set to 'meta' around Buffer construction and every call
    (DeepEP's tests set 'cuda'): float32 x [8, 64] arrives bit for bit and combine's output is right."""
    out = run_ranks(mp_cases.ambient_float32, 2, "cpu", "meta")
    assert out == ["ok", "ok"], out


def test_buffer_built_in_inference_mode_works_outside_it_and_back():
    """Engines build buffers under ``inference_mode`` and may call them outside it (or the reverse): the
    Buffer's own tensors never take part in an autograd-checked in-place update."""
    (xs, idxs, ws), E = INPUTS, E_
    with torch.inference_mode():
        vg = VirtualGroup(len(xs), 1 << 12)
    res = virtual_dispatch(vg, xs, idxs, ws, E)
    check_dispatch(res, ref.dispatch(xs, idxs, ws, E))
    with torch.inference_mode():
        res = virtual_dispatch(vg, xs, idxs, ws, E)
    check_dispatch(res, ref.dispatch(xs, idxs, ws, E))
