"""The launch wrappers' bound-launch caches are keyed by everything their bind depends on.

Every launch wrapper of ``triton_ep.kernels`` (dispatch, combine, layout, ll_dispatch, ll_combine) keeps a
module-level dict of :class:`~triton_ep.kernels.launch.BoundLaunch` objects, filled through
:func:`triton_ep.kernels.launch.bound` under a key of shapes, flags, the grid (or the signals' ``max_programs``,
for the low-latency launches) and its tuning entry's items. A key that leaves out something the bind reads would
reuse a stale grid, ``num_warps`` or constexpr set, and a result-only test would not see it: other block sizes
still compute the right answer.

Here ``bound`` is replaced (in ``launch`` and in every module that imported it by name) by a checking version:
on every cache hit it also calls ``make()`` and asserts that the fresh launch equals the cached one in all it
launches with (the launcher, grid, ``num_warps``, the constexprs and their values, by type too). Real calls then
meet the caches many times on CPU: normal-mode dispatch (plain, ``num_worst_tokens``, cached; bf16 and FP8 with
scales; with and without top-k weights; one and several rounds), combine (with and without weights, 0-2
biases), ``get_dispatch_layout`` on simulated ranks and on a real one-rank group (split or fused launches), and
low-latency dispatch and combine (bf16, FP8, round_scale, UE8M0, hooks, zero-copy, stats, changing sizes) on a
one-rank Buffer. Each runs under the interpreter's tuning and under one of small blocks (grids of several
programs), with and without the signals' ``max_programs`` (a grid cap), and normal mode also under the
tuning's per-multiprocessor grid cap (``grid`` / ``programs_per_sm``). Neighbouring cases differ in one thing
only, so a key that leaves it out meets a launch bound for the other case. A change of a tuning entry between
calls must bind anew, and going back to the old entry must find the old launches.

Planting a key bug (e.g. dropping ``tuple(tune.items())`` from ``ll_dispatch_send``'s key, a flag, or
``max_programs``) makes a test here fail with the cache, the key and the differing grid / constexprs.
"""
import contextlib
import importlib
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.cases import ll as ll_cases
from tests.cases.helpers import assert_bits, check_dispatch, make_inputs, raise_first, virtual_dispatch
import triton_ep
from triton_ep import reference as ref
from triton_ep.kernels import _util, interpreted
from triton_ep.kernels import launch as launch_mod
from triton_ep.kernels.launch import BoundLaunch
from triton_ep.testing import VirtualGroup

#: the modules whose launch wrappers keep bound-launch caches (``grep -n "bound(" triton_ep/kernels``)
WRAPPERS = ("dispatch", "combine", "layout", "ll_dispatch", "ll_combine", "ll_fused")

pytestmark = pytest.mark.skipif(not interpreted(), reason="CPU (interpreter) test: small shapes, one process")


# ---------------------------------------------------------------------------------------------- the checker
def _strict(v):
    """``v`` with the type of every scalar in it, so that ``True != 1`` and ``2 != 2.0`` (Triton specialises
    a constexpr on its type too)."""
    if isinstance(v, (tuple, list)):
        return type(v).__name__, tuple(_strict(x) for x in v)
    if isinstance(v, dict):
        return "dict", tuple(sorted((k, _strict(x)) for k, x in v.items()))
    return type(v).__name__, v


def _fields(b: BoundLaunch) -> dict:
    """What a bound launch launches with: every public slot of :class:`BoundLaunch` (the launcher by
    identity; the grid, ``num_warps``, the constexprs ``meta`` and their ordered values ``cvals`` by value and
    type). The private slots are caches of compiled kernels, filled as the launch runs."""
    return {name: (getattr(b, name) if name == "launcher" else _strict(getattr(b, name)))
            for name in BoundLaunch.__slots__ if not name.startswith("_")}


def _diff(cached: dict, fresh: dict) -> str:
    out = []
    for name in cached:
        if cached[name] == fresh[name]:
            continue
        if name == "meta":
            c, f = dict(cached[name][1]), dict(fresh[name][1])
            for k in sorted(set(c) | set(f)):
                if c.get(k) != f.get(k):
                    out.append(f"constexpr {k}: cached {c.get(k)}, fresh {f.get(k)}")
        else:
            out.append(f"{name}: cached {cached[name]}, fresh {fresh[name]}")
    return "; ".join(out)


class BoundChecker:
    """A stand-in for :func:`triton_ep.kernels.launch.bound` that checks every hit against a fresh bind.

    ``log``: per call, ``(cache name, hit, the BoundLaunch returned)``."""

    def __init__(self, real, names: dict) -> None:
        self.real, self.names, self.log = real, names, []

    def __call__(self, cache, key, make):
        name = self.names.get(id(cache), f"<unknown cache {id(cache):#x}>")
        hit = key in cache
        b = self.real(cache, key, make)
        if hit:
            cached, fresh = _fields(b), _fields(make())
            assert cached == fresh, (f"{name}: its key {key!r} returned a launch bound for other arguments "
                                     f"(the key misses something the bind depends on): {_diff(cached, fresh)}")
        self.log.append((name, hit, b))
        return b

    def mark(self) -> int:
        return len(self.log)

    def since(self, mark: int, name: str):
        """``(hit, BoundLaunch)`` of the calls on cache ``name`` since ``mark``."""
        return [(hit, b) for n, hit, b in self.log[mark:] if n == name]

    def counts(self) -> dict:
        """Per cache name, ``[hits, misses]``."""
        out = {}
        for n, hit, _ in self.log:
            out.setdefault(n, [0, 0])[0 if hit else 1] += 1
        return out


def _caches() -> dict:
    """``{id(cache): "module._NAME_BOUND"}`` of every bound-launch cache of the wrapper modules."""
    names = {}
    for short in WRAPPERS:
        mod = importlib.import_module(f"triton_ep.kernels.{short}")
        for attr, v in vars(mod).items():
            if attr.endswith("_BOUND") and isinstance(v, dict):
                names[id(v)] = f"{short}.{attr}"
    return names


@pytest.fixture
def checker(monkeypatch):
    """Install a :class:`BoundChecker` wherever ``bound`` is reachable by name; the caches start empty (so
    every key is first made here, then met again)."""
    real = launch_mod.bound
    names = _caches()
    assert len(names) >= 9, f"expected the wrappers' bound caches, found {sorted(names.values())}"
    for mod in (sys.modules[f"triton_ep.kernels.{s}"] for s in WRAPPERS):
        for attr, v in vars(mod).items():
            if id(v) in names:
                v.clear()
    chk = BoundChecker(real, names)
    # every call takes the general path, which keys its launches (a call replayed from its plan, as a repeated call
    # of unchanged shapes is, makes no key: modes/intranode_replay.py and modes/low_latency/replay.py, tested apart)
    from triton_ep.modes import intranode_replay
    from triton_ep.modes.low_latency import replay as low_latency_replay
    for mod, fns in ((intranode_replay, ("layout", "cached_dispatch", "combine")),
                     (low_latency_replay, ("dispatch", "combine"))):
        for fn in fns:
            monkeypatch.setattr(mod, fn, lambda *a, **k: None)
    patched = []
    for modname, mod in list(sys.modules.items()):
        if (modname == "triton_ep" or modname.startswith("triton_ep.")) and getattr(mod, "bound", None) is real:
            monkeypatch.setattr(mod, "bound", chk)
            patched.append(modname)
    assert {f"triton_ep.kernels.{s}" for s in WRAPPERS} <= set(patched), patched
    yield chk
    for mod in (sys.modules[f"triton_ep.kernels.{s}"] for s in WRAPPERS):     # no launch bound under a
        for attr, v in vars(mod).items():                                    # test's tuning stays behind
            if id(v) in names:
                v.clear()


def test_checker_catches_a_key_missing_a_constexpr(checker):
    """The checker itself: a key that leaves out what the bind depends on fails on the next hit."""
    cache = {}
    checker.names[id(cache)] = "test._BOUND"
    la = launch_mod.Launcher(lambda: None)
    for block in (16, 16):
        checker(cache, ("shape",), lambda: la.bind((1,), num_warps=4, BLOCK=block))
    with pytest.raises(AssertionError,
                       match=r"test\._BOUND.*constexpr BLOCK: cached \('int', 16\), fresh \('int', 32\)"):
        checker(cache, ("shape",), lambda: la.bind((1,), num_warps=4, BLOCK=32))
    with pytest.raises(AssertionError, match="constexpr FLAG: cached .'bool', True., fresh .'int', 1."):
        checker(cache, ("flag",), lambda: la.bind((1,), num_warps=4, FLAG=True))
        checker(cache, ("flag",), lambda: la.bind((1,), num_warps=4, FLAG=1))
    with pytest.raises(AssertionError, match=r"grid: cached \('tuple', \(\('int', 1\),\)\), fresh"):
        checker(cache, ("grid",), lambda: la.bind((1,), num_warps=4))
        checker(cache, ("grid",), lambda: la.bind((2,), num_warps=4))
    with pytest.raises(AssertionError, match=r"num_warps: cached \('int', 4\), fresh \('int', 8\)"):
        checker(cache, ("warps",), lambda: la.bind((1,), num_warps=4))
        checker(cache, ("warps",), lambda: la.bind((1,), num_warps=8))


# ------------------------------------------------------------------------------------------- tunings
#: a second tuning under which the grids at these small shapes have several programs on their axes (small
#: blocks, a split row axis, several programs per expert, several layout blocks, the layout's atomic
#: histogram), so that the signals' grid cap (``max_programs``) and the block sizes change what is bound
_SMALL_BLOCKS = {
    "layout": dict(block_t=16, one_launch_tokens=16, histogram_max_bins=16),
    "dispatch_send": dict(block_t=4, block_w=16, split_w=1),
    "dispatch_recv": dict(block_t=4),
    "combine_send": dict(block_t=4),
    "combine_reduce": dict(block_t=4),
    "ll_send": dict(block_t=2, block_h=128),
    "ll_recv": dict(block_r=8, block_f=8, programs_per_expert=2),
    "ll_combine_send": dict(block_r=8, programs_per_expert=2),
    "ll_reduce": dict(block_t=2, block_h=128),
}


@contextlib.contextmanager
def _tuned(monkeypatch, profile):
    """The interpreter's tuning table with ``profile``'s entries changed in place (restored on exit)."""
    with monkeypatch.context() as mp:
        for entry, params in (profile or {}).items():
            for k, v in params.items():
                mp.setitem(_util.INTERP_TUNING[entry], k, v)
        yield


def _set_max_programs(buffers, cap) -> None:
    """The signals' grid cap of waiting launches (set where ranks share a GPU; none on CPU otherwise)."""
    for b in buffers:
        b._rt.sig_args["max_programs"] = cap


# ------------------------------------------------------------------------------------------- normal mode
class _OneRank:
    """One real Buffer with :class:`VirtualGroup`'s ``buffers`` / ``call`` interface (a group of one rank
    needs no lock step)."""

    def __init__(self, buf) -> None:
        self.buffers = [buf]

    def call(self, method, per_rank_kwargs):
        out = []
        for b, kw in zip(self.buffers, per_rank_kwargs):
            try:
                out.append(getattr(b, method)(**kw))
            except Exception as e:  # noqa: BLE001 - as VirtualGroup.call
                out.append(e)
        return out


def _rows(x):
    return x[0] if isinstance(x, tuple) else x


def _normal_case(vg, R, E, K, H, Ts, seed, fp8=False, weights=True, worst=0, biases=0):
    """Layout, dispatch, combine and a cached dispatch on the ranks of ``vg``, each checked against the
    reference (with ``worst``: the received rows before the padding, and ``worst`` rows in all)."""
    xs, idxs, ws = make_inputs(seed, E, K, H, Ts, fp8=fp8)
    ws = ws if weights else None
    extra = dict(num_worst_tokens=worst) if worst else {}
    res = virtual_dispatch(vg, xs, idxs, ws, E, **extra)
    exp = ref.dispatch(xs, idxs, ws, E)
    ns = [_rows(e["recv_x"]).shape[0] for e in exp]
    if worst:
        for j, e in enumerate(exp):
            assert _rows(res[j][0]).shape[0] == worst >= ns[j]
            assert_bits(_rows(res[j][0])[:ns[j]], _rows(e["recv_x"]), f"rank {j} recv_x (worst)")
    else:
        check_dispatch(res, exp, fp8)
    if fp8:       # combine takes bf16 rows: stand-ins of the expert outputs
        ys = [(e["recv_x"][0].float() * e["recv_x"][1].repeat_interleave(128, 1)).to(torch.bfloat16) for e in exp]
    else:
        ys = [(e["recv_x"].float() * 3 - 1).to(torch.bfloat16) for e in exp]
    g = torch.Generator().manual_seed(seed + 1)
    bs = [[torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(biases)] for T in Ts]
    # with worst, combine takes the padded rows (the padding is ignored)
    x_in = [torch.cat([y, torch.zeros(_rows(res[j][0]).shape[0] - ns[j], H, dtype=torch.bfloat16)])
            for j, y in enumerate(ys)]
    kw = [dict(x=x_in[j], handle=res[j][4], topk_weights=res[j][2] if weights else None,
               bias=tuple(bs[j]) if biases else None) for j in range(R)]
    got = raise_first(vg.call("combine", kw))
    want = ref.combine(ys, exp, Ts, [e["recv_topk_weights"] for e in exp] if weights else None,
                       bs if biases else None)
    for i in range(R):
        assert_bits(got[i][0], want[i][0], f"rank {i} combined_x")
        assert_bits(got[i][1], want[i][1], f"rank {i} combined_topk_weights")
    cached = raise_first(vg.call("dispatch", [dict(x=xs[r], handle=res[r][4]) for r in range(R)]))
    for j in range(R):
        assert_bits(_rows(cached[j][0])[:ns[j]], _rows(exp[j]["recv_x"]), f"rank {j} cached recv_x")


#: (R, E, K, H, Ts, case options). Neighbouring cases differ in one thing only (biases, weights, FP8
#: scales...), so a key leaving that thing out meets a launch bound for the other case.
_NORMAL = [
    (2, 4, 3, 64, [5, 3], dict()),
    (2, 4, 3, 64, [5, 3], dict(biases=1)),
    (2, 4, 3, 64, [5, 3], dict(biases=2)),
    (2, 4, 3, 64, [5, 3], dict(weights=False)),
    (2, 4, 3, 64, [5, 3], dict(worst=16)),
    (2, 6, 2, 136, [9, 20], dict()),
    (2, 4, 2, 256, [4, 6], dict(fp8=True)),
    (2, 4, 2, 256, [4, 6], dict(fp8=True, weights=False)),
    (2, 4, 2, 128, [4, 6], dict()),
    (1, 3, 2, 64, [6], dict()),
    (2, 6, 2, 64, [9, 20], dict()),
]
#: the cases run again in several rounds a call, and under the small blocks (each with two grid caps)
_ROUNDS = [0, 2, 5, 6]
_SMALL = [0, 1, 3, 4, 6, 10]


def _normal_pass(nbytes, caps, which=range(len(_NORMAL)), repeats=2):
    """The cases ``which`` of ``_NORMAL``, each ``repeats`` times (twice: each key is made once, then met again;
    once: only the neighbouring cases meet each other's launches), under each grid cap, on simulated ranks with
    buffers of ``nbytes``."""
    cases = [(i, _NORMAL[i]) for i in which]
    groups = {R: VirtualGroup(R, nbytes) for R in {c[0] for _, c in cases}}
    for cap in caps:
        for vg in groups.values():
            _set_max_programs(vg.buffers, cap)
        for i, (R, E, K, H, Ts, opts) in cases:
            for _ in range(repeats):
                _normal_case(groups[R], R, E, K, H, Ts, seed=10 * i + 1, **opts)


def _assert_met(checker, names, hits, misses):
    counts = checker.counts()
    for name in names:
        h, m = counts.get(name, [0, 0])
        assert h >= hits and m >= misses, (name, counts)


def test_normal_mode_keys(checker, monkeypatch):
    """Dispatch (plain, worst, cached; bf16 and FP8 with scales; with and without weights), combine (with and
    without weights, 0-2 biases) and layout, over shapes, one round a call, two tunings and the signals' grid
    cap: every cache hit binds what a fresh bind gives (several rounds and the per-multiprocessor cap: the
    extended test below)."""
    _normal_pass(1 << 16, caps=(None,))
    with _tuned(monkeypatch, _SMALL_BLOCKS):
        _normal_pass(1 << 16, caps=(None, 1), which=_SMALL, repeats=1)
    _assert_met(checker, ("dispatch._SEND_BOUND", "dispatch._RECV_BOUND", "combine._SEND_BOUND",
                          "combine._REDUCE_BOUND", "layout._BLOCK_BOUND"), hits=20, misses=6)
    _assert_met(checker, ("layout._POS_BOUND",), hits=1, misses=1)      # (the layout's second launch: small blocks)


@pytest.mark.extended
def test_normal_mode_keys_rounds_and_multiprocessor_cap(checker, monkeypatch):
    """The same over several rounds a call, and under the tuning's per-multiprocessor grid cap after the same calls
    uncapped."""
    _normal_pass(4096, caps=(None,), which=_ROUNDS)
    with _tuned(monkeypatch, _SMALL_BLOCKS):
        _normal_pass(1 << 16, caps=(None,), which=_SMALL)
    # the per-multiprocessor cap (the interpreter's 4 "multiprocessors": 4 programs) after the same calls
    # uncapped (the pass above: the interpreter's tuning has no cap): a key that leaves the cap out meets a
    # launch bound with another grid
    with _tuned(monkeypatch, {**_SMALL_BLOCKS, "grid": dict(programs_per_sm=1)}):
        _normal_pass(1 << 16, caps=(None,), which=_SMALL)
    _assert_met(checker, ("dispatch._SEND_BOUND", "dispatch._RECV_BOUND", "combine._SEND_BOUND",
                          "combine._REDUCE_BOUND", "layout._BLOCK_BOUND"), hits=10, misses=4)


def _kernels_alone(T, H, K, E, R, seed, weights, n_on_device):
    """Layout, dispatch send and receive, combine send and reduce launched alone (``signals`` None, as
    benchmarks/bench_kernels.py runs them) over ``R`` buffers of this process, one round each; with
    ``n_on_device`` the receive and the combine send read the rows received from a device tensor. The received
    rows and the sums are checked against the reference."""
    from triton_ep import kernels
    from triton_ep.kernels.combine import record_bytes
    from triton_ep.kernels.geometry import record_words
    from triton_ep.transport.ipc import LocalWorld
    xs, idxs, ws = make_inputs(seed, E, K, H, [T] * R)
    ws = ws if weights else None
    exp = ref.dispatch(xs, idxs, ws, E)
    lays = [kernels.routing_layout(i, E, R) for i in idxs]
    counts = torch.stack([lay[0].long() for lay in lays])          # [source, destination]
    rpm = counts.cumsum(0)
    recv, wx = rpm[-1].tolist(), H // 2
    rec_words, comb_rb = record_words(wx, 0, K, True), record_bytes(H, 0)
    world = LocalWorld(R, max(max(recv) * rec_words * 4, T * R * comb_rb, 4096))
    rec = [d.view(torch.int32) for d in world.data]
    delta = [world.comm(r).delta_bytes // 4 for r in range(R)]
    cap, ccap = world.data[0].numel() // (rec_words * 4), world.data[0].numel() // comb_rb
    n_dev = [torch.tensor([n], dtype=torch.int64) if n_on_device else None for n in recv]
    for i in range(R):
        row_base = rpm[i - 1] if i else torch.zeros(R, dtype=torch.int64)
        kernels.dispatch_send(xs[i].view(torch.int32), None, idxs[i], ws[i].view(torch.int32) if weights else None,
                              lays[i][3], row_base, delta[i], rec[i], 0, cap, E, rec_words, with_src=True)
    ys = []
    for j in range(R):
        out_x = torch.empty((recv[j], wx), dtype=torch.int32)
        out_w = torch.empty((recv[j], K), dtype=torch.int32) if weights else None
        kernels.dispatch_recv(rec[j], recv[j], 0, j, E // R, wx, 0, K, rec_words, out_x, None,
                              torch.empty((recv[j], K), dtype=torch.int64), out_w, torch.empty(recv[j], dtype=torch.int32),
                              n_recv=n_dev[j], cap=cap)
        assert_bits(out_x.view(torch.bfloat16), exp[j]["recv_x"], f"rank {j} recv_x (kernels alone)")
        ys.append((exp[j]["recv_x"].float() * 3 - 1).to(torch.bfloat16))
    for j in range(R):
        kernels.combine_send(ys[j].view(torch.int32), None, recv[j], rpm[:, j].contiguous(),
                             counts[:, :j].sum(1).contiguous(), delta[j], rec[j], 0, ccap, comb_rb // 4,
                             n_recv=n_dev[j])
    want = ref.combine(ys, exp, [T] * R)
    for i in range(R):
        out = torch.empty((T, H), dtype=torch.bfloat16)
        send_base = torch.cat([torch.zeros(1, dtype=torch.int64), counts[i].cumsum(0)[:-1]])
        kernels.combine_reduce(world.data[i], lays[i][3], send_base, 0, ccap, H, 0, comb_rb, None, out, [], None, None,
                               first=True, last=True)
        assert_bits(out, want[i][0], f"rank {i} combined_x (kernels alone)")


def test_kernels_alone_keys(checker):
    """The launch wrappers called alone (no signals, as the kernel benchmark calls them), with and without the
    rows received on the device, next to the same shapes through a Buffer (signals): every hit binds what a
    fresh bind gives."""
    vg = VirtualGroup(2, 1 << 16)
    for n_on_device in (False, True):
        for weights in (False, True):
            for _ in range(2):
                _kernels_alone(5, 64, 3, 4, 2, 3, weights, n_on_device)
                _normal_case(vg, 2, 4, 3, 64, [5, 5], seed=3, weights=weights)
    _assert_met(checker, ("dispatch._SEND_BOUND", "dispatch._RECV_BOUND", "combine._SEND_BOUND",
                          "combine._REDUCE_BOUND", "layout._BLOCK_BOUND"), hits=4, misses=1)


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank (a file rendezvous in a temporary folder), as benchmarks/host_cost.py
    builds. Module-scoped: made before, and closed after, each test's leak check (a failing test's traceback
    keeps the group's sockets alive until pytest lets it go)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'rdv')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("fused", ["0", "1"])
def test_one_rank_group_keys(checker, monkeypatch, one_rank_group, fused):
    """The same calls on a real one-rank Buffer (a process group: the path real ranks take, where a call of
    one round may run its send and receive as one launch; ``TRITON_EP_FUSED`` forces it on or off)."""
    monkeypatch.setenv("TRITON_EP_FUSED", fused)
    buf = triton_ep.Buffer(one_rank_group, 1 << 16, timeout_s=60)
    try:
        cases = [(1, 3, 3, 64, [5], dict()), (1, 3, 3, 64, [5], dict(biases=2, weights=False)),
                 (1, 3, 2, 256, [4], dict(fp8=True)), (1, 3, 3, 64, [5], dict(worst=8))]
        for profile, caps in ((None, (None,)), (_SMALL_BLOCKS, (1,))):
            with _tuned(monkeypatch, profile):
                for cap in caps:
                    _set_max_programs([buf], cap)
                    for i, (R, E, K, H, Ts, opts) in enumerate(cases):
                        for _ in range(2):
                            _normal_case(_OneRank(buf), R, E, K, H, Ts, seed=10 * i + 3, **opts)
    finally:
        buf.destroy()
    counts = checker.counts()
    assert sum(h for h, _ in counts.values()) >= 20, counts


# ------------------------------------------------------------------------------------------- low latency
#: (N, H, E, K, T, use_fp8, round_scale, use_ue8m0, hook, zero_copy, stats); sizes change between calls, and
#: neighbouring cases differ in one flag
_LL = [
    (8, 256, 4, 2, 5, False, False, False, False, False, False),
    (8, 256, 4, 2, 5, True, False, False, False, False, False),
    (8, 256, 4, 2, 5, True, False, False, False, False, True),
    (8, 256, 4, 3, 8, True, True, False, True, False, False),
    (8, 256, 4, 1, 0, False, False, False, False, True, True),
    (4, 256, 6, 2, 3, False, False, False, True, True, False),
    (4, 512, 4, 2, 4, True, True, False, False, False, True),
    (4, 512, 4, 2, 4, True, True, True, False, False, True),
]


def _ll_case(buf, seed, N, H, E, K, T, use_fp8, round_scale, use_ue8m0, hook, zero_copy, stats):
    """Low-latency dispatch and combine on a one-rank Buffer, checked against the oracle of tests/cases/ll.py."""
    xs, idxs, ws = ll_cases.ll_inputs(seed, 1, E, K, H, [T])
    st = torch.zeros(E, dtype=torch.int32) if stats else None
    cost = torch.zeros(1, dtype=torch.int64) if stats else None
    out, count, handle, _, h = buf.low_latency_dispatch(
        xs[0], idxs[0], N, E, cumulative_local_expert_recv_stats=st, dispatch_wait_recv_cost_stats=cost,
        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook)
    if hook:
        h()
    ll_cases.check_dispatch(out, count, handle, xs, idxs, 1, E, 0, use_fp8, round_scale, use_ue8m0)
    if stats:
        assert torch.equal(st, count.cpu())
    rx = ll_cases._dequant_rows(out[0], out[1], use_ue8m0).to(torch.bfloat16) if use_fp8 else out
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle).copy_(rx)
    comb, _, h = buf.low_latency_combine(rx, idxs[0], ws[0], handle, zero_copy=zero_copy, return_recv_hook=hook,
                                         combine_wait_recv_cost_stats=cost)
    if hook:
        h()
    xin = xs[0]
    if use_fp8 and T:
        q, s = ll_cases.quantize_reference(xin, round_scale)
        xin = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    want = ll_cases.expected_combine(xin, idxs[0], ws[0], E, 1, "identity")
    assert torch.equal(comb.view(torch.int16), want.view(torch.int16)), "low-latency combine"


def _ll_pass(buf, caps, repeats=2):
    """Every case of ``_LL``, ``repeats`` times, under each grid cap (see ``_normal_pass``)."""
    for cap in caps:
        _set_max_programs([buf], cap)
        for i, case in enumerate(_LL):
            for _ in range(repeats):
                _ll_case(buf, 100 + i, *case)


@contextlib.contextmanager
def _ll_buffer(group):
    """A low-latency Buffer of one rank, large enough for every case of ``_LL``."""
    hint = max(triton_ep.Buffer.get_low_latency_rdma_size_hint(c[0], c[1], 1, c[2]) for c in _LL)
    buf = triton_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=6, timeout_s=60)
    try:
        yield buf
    finally:
        buf.destroy()


def test_low_latency_keys(checker, monkeypatch, one_rank_group):
    """Low-latency dispatch and combine on one rank: bf16, FP8, round_scale, UE8M0, hooks, zero-copy, stats,
    changing sizes, two tunings and grid caps: every cache hit binds what a fresh bind gives."""
    with _ll_buffer(one_rank_group) as buf:
        _ll_pass(buf, caps=(None,))
        with _tuned(monkeypatch, _SMALL_BLOCKS):
            _ll_pass(buf, caps=(None, 1), repeats=1)
    _assert_met(checker, ("ll_dispatch._ROUTE_BOUND", "ll_dispatch._SEND_BOUND", "ll_dispatch._RECV_BOUND",
                          "ll_combine._SEND_BOUND", "ll_combine._REDUCE_BOUND"), hits=8, misses=3)


@pytest.mark.extended
def test_low_latency_one_launch_keys(checker, monkeypatch, one_rank_group):
    """The same with ``TRITON_EP_FUSED=1``: the one-launch dispatch (with and without a hook) and combine."""
    monkeypatch.setenv("TRITON_EP_FUSED", "1")
    with _ll_buffer(one_rank_group) as buf:
        _ll_pass(buf, caps=(None,))
        with _tuned(monkeypatch, _SMALL_BLOCKS):
            _ll_pass(buf, caps=(None, 1))
    _assert_met(checker, ("ll_fused._DISPATCH_BOUND", "ll_fused._COMBINE_BOUND"), hits=20, misses=3)


# --------------------------------------------------------------------------------------- tuning changes
#: (tuning entry, parameter, new value, cache, what the new bind must carry: a constexpr or "num_warps")
_TUNING = [
    ("dispatch_send", "block_w", 16, "dispatch._SEND_BOUND", "BLOCK_W"),
    ("dispatch_recv", "block_t", 16, "dispatch._RECV_BOUND", "BLOCK_T"),
    ("dispatch_recv", "block_w", 8, "dispatch._RECV_BOUND", "BLOCK_W"),
    ("combine_send", "block_w", 16, "combine._SEND_BOUND", "BLOCK_W"),
    ("combine_reduce", "block_h", 32, "combine._REDUCE_BOUND", "BLOCK_H"),
    ("layout", "num_warps", 2, "layout._BLOCK_BOUND", "num_warps"),
    ("ll_send", "block_h", 128, "ll_dispatch._SEND_BOUND", "BLOCK_H"),
    ("ll_recv", "block_r", 16, "ll_dispatch._RECV_BOUND", "BLOCK_R"),
    ("ll_combine_send", "block_r", 16, "ll_combine._SEND_BOUND", "BLOCK_R"),
    ("ll_reduce", "block_t", 4, "ll_combine._REDUCE_BOUND", "BLOCK_T"),
]


def _carried(b: BoundLaunch, what: str):
    return b.num_warps if what == "num_warps" else b.meta[what]


def test_tuning_change_binds_anew(checker, monkeypatch, one_rank_group):
    """A tuning entry changed between calls (as the benchmark's sweep and tests do) gives new launches that
    carry the new value; restored, the calls find the launches of the old value again (and the checker sees
    them equal to fresh binds)."""
    assert _util.tuning("dispatch_recv") is _util.INTERP_TUNING["dispatch_recv"]
    vg = VirtualGroup(1, 1 << 16)
    R, E, K, H, Ts, opts = 1, 4, 3, 64, [6], {}

    def normal():
        _normal_case(vg, R, E, K, H, Ts, seed=5, **opts)

    with _ll_buffer(one_rank_group) as buf:
        def low_latency():
            _ll_case(buf, 7, *_LL[1])
        for entry, param, value, cache, what in _TUNING:
            call = low_latency if entry.startswith("ll_") else normal
            call()                                   # the current tuning's launches, bound
            m = checker.mark()
            call()
            before = checker.since(m, cache)
            assert before and all(hit for hit, _ in before), (entry, "unchanged tuning must hit", before)
            old = {_carried(b, what) for _, b in before}
            assert value not in old, (entry, param, value, old)
            old_ids = {id(b) for _, b in before}
            with monkeypatch.context() as mp:
                mp.setitem(_util.INTERP_TUNING[entry], param, value)
                m = checker.mark()
                call()
                after = checker.since(m, cache)
                # bound anew: the first launch misses, and none is one bound under the old entry
                assert after and not after[0][0] and not old_ids & {id(b) for _, b in after}, \
                    (entry, param, "a changed entry must bind anew", after)
                assert {_carried(b, what) for _, b in after} == {value}, (entry, param, value)
                call()                               # met again: hits, equal to fresh binds
                assert all(hit for hit, _ in checker.since(m, cache)[len(after):])
            m = checker.mark()
            call()                                   # restored: the old launches again
            back = checker.since(m, cache)
            assert back and all(hit for hit, _ in back) and {id(b) for _, b in back} <= old_ids, (entry, param, back)
            assert {_carried(b, what) for _, b in back} == old, (entry, param, back)
