"""The kernels' launcher (triton_ep/kernels/launch.py): launching through the compiled kernel gives what
``kernel[grid]`` gives, for every specialisation Triton makes (dtype, 16-byte alignment, integers equal
to 1 or multiples of 16, 64-bit integers), and never reuses a kernel compiled for other arguments."""
import functools

import pytest
import torch
import triton
import triton.language as tl

from triton_ep.kernels import interpreted
from triton_ep.kernels.launch import Launcher, _arg_key, _arg_key_unspecialized, bound


def _axpb_body(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0)
    tl.store(y_ptr + offs, (v * a + b + SHIFT).to(y_ptr.dtype.element_ty), mask=m)


_axpb = Launcher(triton.jit(_axpb_body))
#: the same kernel with n and a declared do_not_specialize (as the library's per-call integers)
_axpb_dns = Launcher(triton.jit(do_not_specialize=["n", "a"])(_axpb_body))


def _check(device, bind=False):
    """Every specialisation, launched through ``launcher[grid]`` or (``bind``) through one bound launch per
    grid that then meets every dtype, alignment and integer kind in turn."""
    binds = {}
    for dtype in (torch.float32, torch.int64, torch.float16):
        for n in (1, 16, 37, 130):
            for off in (0, 1):          # offset 1: the pointers lose their 16-byte alignment
                for a, b in ((1, 0), (3, 16), (2, 5), (1, (1 << 33) + 7)):
                    if b >= 1 << 31 and dtype != torch.int64:
                        continue        # 64-bit integer arguments: checked exactly on int64 rows
                    x = (torch.arange(n + 1, device=device) % 7).to(dtype)[off:off + n]
                    y = torch.empty(n + 1, dtype=dtype, device=device)[off:off + n]
                    for _ in range(2):  # the second launch takes the compiled kernel's path
                        y.fill_(-99)
                        grid = (triton.cdiv(n, 32),)
                        if bind:
                            launch = bound(binds, grid, lambda: _axpb.bind(grid, num_warps=1, BLOCK=32, SHIFT=2))
                        else:
                            launch = _axpb[grid]
                            launch = functools.partial(launch, BLOCK=32, SHIFT=2, num_warps=1)
                        launch(x, y, n, a, b)
                        exp = (x.to(torch.int64) * a + b + 2).to(dtype) if dtype == torch.int64 else \
                            (x.double() * a + b + 2).to(dtype)
                        assert torch.equal(y, exp), (dtype, n, off, a, b)


def test_launcher_matches_kernel_call_cpu():
    """Under the interpreter the launcher is Triton's own call: the same results."""
    if not interpreted():
        pytest.skip("interpreter only")
    _check("cpu")


def test_bound_launch_matches_kernel_call_cpu():
    """A bound launch (grid and constexprs fixed) gives what the plain call gives, under the interpreter."""
    if not interpreted():
        pytest.skip("interpreter only")
    _check("cpu", bind=True)


def test_bound_cache_makes_once_and_stays_bounded():
    """``bound`` makes a launch once per key and starts again past 256 keys (shapes that keep changing)."""
    made, cache = [], {}
    for i in range(300):
        for _ in range(2):
            bound(cache, (i,), lambda i=i: made.append(i) or object())
    assert made == list(range(300)) and 0 < len(cache) <= 256
    assert bound(cache, (299,), lambda: 1 / 0) is cache[(299,)]


def test_arg_key_tells_specialisations_apart():
    """Keys differ wherever Triton compiles differently: dtypes, alignment, 1, multiples of 16, 64 bits."""
    t = torch.zeros(8, dtype=torch.float32)
    assert _arg_key(t) != _arg_key(t[1:])
    assert _arg_key(t) != _arg_key(t.view(torch.int32))
    keys = {_arg_key(v) for v in (1, 2, 16, 32, 1 << 31, -(1 << 31) - 1, 1 << 63)}
    assert len({_arg_key(1), _arg_key(2), _arg_key(16), _arg_key(1 << 31)}) == 4
    assert _arg_key(2) == _arg_key(3) and _arg_key(16) == _arg_key(48)
    assert len(keys) >= 5
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) != _arg_key(0)


def test_unspecialized_integers_share_one_key():
    """``do_not_specialize`` integers (per-call values: token counts, rounds, signatures) key on their type
    only, as Triton compiles them: 1, 16 and 37 share one kernel; 32 and 64 bits still differ."""
    k = _arg_key_unspecialized
    assert k(1) == k(16) == k(37) == k(0) and k(1 << 31) != k(1) and k(1 << 63) != k(1 << 31)


def _check_dns(device):
    x = torch.arange(80, device=device, dtype=torch.float32)
    for n, a in ((1, 1), (16, 16), (37, 3), (64, 32), (80, 2)):
        for _ in range(2):
            y = torch.full((80,), -1.0, device=device)
            _axpb_dns[(triton.cdiv(n, 32),)](x, y, n, a, 5, BLOCK=32, SHIFT=1, num_warps=1)
            exp = torch.where(torch.arange(80, device=device) < n, x * a + 6, torch.full_like(x, -1.0))
            assert torch.equal(y, exp), (n, a)


def test_unspecialized_launches_are_correct_cpu():
    if not interpreted():
        pytest.skip("interpreter only")
    _check_dns("cpu")


@pytest.mark.gpu
def test_unspecialized_integers_compile_once_gpu():
    """Varying per-call integers compile one kernel (one launcher entry), and every launch is right."""
    _check_dns("cuda")
    assert len(_axpb_dns._cache) == 1, _axpb_dns._cache.keys()


@pytest.mark.gpu
def test_launcher_matches_kernel_call_gpu():
    """On GPU the second launch of each specialisation goes through the compiled kernel: same results,
    one cache entry per specialisation, and the current stream is the one launched on."""
    _check("cuda")
    assert len(_axpb._cache) >= 6
    n = len(_axpb._cache)
    _check("cuda", bind=True)           # the bound launches reuse the launcher's kernels: no new entry
    assert len(_axpb._cache) == n
    s = torch.cuda.Stream()
    x = torch.arange(64, device="cuda", dtype=torch.float32)
    y = torch.zeros(64, device="cuda", dtype=torch.float32)
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)
        _axpb[(2,)](x, y, 64, 2, 1, BLOCK=32, SHIFT=0, num_warps=1)
    s.synchronize()
    assert torch.equal(y, x * 2 + 1)


def test_triton_imported_first_on_cpu_is_a_clear_import_error():
    """On a machine without CUDA, triton imported before triton_ep has its standard library built for
    compilation; kernels would later fail far from the cause ("Cannot call @triton.jit'd outside of the
    scope of a kernel"). Importing triton_ep then says what to do; imported first, it works."""
    import os
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("the interpreter is only chosen without CUDA")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bad = subprocess.run([sys.executable, "-c", "import triton; import triton_ep"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode != 0 and "Import triton_ep before triton" in bad.stderr, bad.stderr[-500:]
    good = subprocess.run([sys.executable, "-c", "import triton_ep, triton; print('ok')"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert good.returncode == 0 and "ok" in good.stdout, good.stderr[-500:]
