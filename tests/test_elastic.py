"""DeepEP V2's face, ``ElasticBuffer``: its dispatch / combine in both layouts (non-expanded, expanded), exact and
worst-case sizes, cached dispatches, handle fields, weights, biases and FP8 pairs, checked bit for bit against
``triton_ep.reference.elastic_dispatch`` / ``elastic_combine`` on rank processes within one host and across two
emulated hosts; the reference's own semantics on small cases; V2's primitives triton-ep does not provide."""
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.cases import elastic as elastic_cases
import triton_ep
from triton_ep import reference as ref
from triton_ep.testing import RankFailure, run_ranks


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(o.traceback or o.message for o in bad)
    return out


def _hosts(per_host):
    return {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated", "TRITON_EP_PROXY": "thread"}


# ---------------------------------------------------------------------------------------------------- the reference
def test_reference_expanded_layout_by_hand():
    """Two ranks, 4 experts (2 a rank), K = 2, alignment 4: the rows, ids, weights, prefix sums and metadata of
    rank 1's dispatch written out by hand."""
    x0 = torch.arange(3 * 8, dtype=torch.float32, device="cpu").reshape(3, 8).to(torch.bfloat16)
    x1 = -torch.arange(2 * 8, dtype=torch.float32, device="cpu").reshape(2, 8).to(torch.bfloat16)
    i0 = torch.tensor([[2, 3], [0, -1], [3, 1]], dtype=torch.int64, device="cpu")
    i1 = torch.tensor([[3, 2], [1, 2]], dtype=torch.int64, device="cpu")
    w0 = torch.tensor([[.1, .2], [.3, .4], [.5, .6]], dtype=torch.float32, device="cpu")
    w1 = torch.tensor([[.7, .8], [.9, 1.]], dtype=torch.float32, device="cpu")
    d = ref.elastic_dispatch([x0, x1], [i0, i1], [w0, w1], 4, 5, 4, do_expand=True)[1]
    # rank 1 holds experts 2, 3 (local 0, 1); it receives rank 0's tokens 0, 2 and rank 1's tokens 0, 1
    # local 0 (expert 2): (r0 t0 k0), (r1 t0 k1), (r1 t1 k1) -> rows 0..2, padded to 4
    # local 1 (expert 3): (r0 t0 k1), (r0 t2 k0), (r1 t0 k0) -> rows 4..6, padded to 8
    want_src = [x0[0], x1[0], x1[1], None, x0[0], x0[2], x1[0], None]
    got = d["recv_x"]
    assert got.shape == (8, 8)
    for r, want in enumerate(want_src):
        assert torch.equal(got[r], torch.zeros(8, dtype=torch.bfloat16, device="cpu") if want is None else want), r
    assert torch.equal(d["recv_topk_weights"], torch.tensor([.1, .8, 1., 0, .2, .5, .7, 0], dtype=torch.float32,
                                                            device="cpu"))
    assert d["recv_topk_idx"] is None and d["num_expanded_tokens"] == 8 and d["num_recv_tokens"] == 4
    assert d["num_recv_tokens_per_expert_list"] == [4, 4]
    assert d["num_unaligned_recv_tokens_per_expert"].tolist() == [3, 3]
    assert d["psum_num_recv_tokens_per_expert"].tolist() == [3, 7]          # start + count
    assert d["psum_num_recv_tokens_per_scaleup_rank"].tolist() == [2, 4]
    assert d["recv_src_metadata"].tolist() == [[0, 0, 0, 4], [2, 0, 5, -1], [5, 2, 6, 1], [6, 2 + 1, -1, 2]]


@pytest.mark.property
@settings(max_examples=8)
@given(R=st.integers(1, 3), El=st.integers(1, 3), K=st.integers(1, 3), align=st.sampled_from([1, 2, 8]),
       seed=st.integers(0, 1 << 16), expand=st.booleans(), sync=st.booleans())
def test_reference_round_trip(R, El, K, align, seed, expand, sync):
    """The reference with identity experts: expanded, rows weighted per entry before combine, each token comes back
    as x times the sum of its valid weights; non-expanded, as x times the number of ranks it reached. Small integer
    rows and dyadic weights keep every sum exact. Per-expert counts equal the histogram of the valid ids."""
    g = torch.Generator().manual_seed(seed)
    E, H, Ts = R * El, 16, [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(R)]
    xs = [torch.randint(-4, 5, (T, H), generator=g).to(torch.bfloat16) for T in Ts]
    idxs = [torch.randint(-1, E, (T, K), generator=g) for T in Ts]
    ws = [torch.randint(1, 5, (T, K), generator=g).float() / 4 for T in Ts]
    d = ref.elastic_dispatch(xs, idxs, ws, E, 6, align, expand, sync)
    for j in range(R):
        local = torch.cat([i[(i // El) == j] for i in idxs]) - j * El
        hist = torch.bincount(local, minlength=El)
        assert d[j]["num_unaligned_recv_tokens_per_expert"].tolist() == hist.tolist()
    if expand:
        ys = [(dj["recv_x"].float() * dj["recv_topk_weights"][:, None]).to(torch.bfloat16) for dj in d]
    else:
        ys = [dj["recv_x"] for dj in d]
    out = ref.elastic_combine(ys, d, Ts, None, None, expand)
    for i in range(R):
        valid = (idxs[i] >= 0) & (idxs[i] < E)
        if expand:
            factor = (ws[i] * valid).sum(1)
        else:
            factor = torch.stack([((idxs[i] // El == r) & valid).any(1) for r in range(R)], 1).sum(1).float() \
                if Ts[i] else torch.zeros(0)
        assert torch.equal(out[i][0].float(), xs[i].float() * factor[:, None]), i


# ---------------------------------------------------------------------------------------------------- the face
def test_face_names_and_primitives_not_provided():
    """``import triton_ep as deep_ep``: ``deep_ep.ElasticBuffer`` and ``deep_ep.EPHandle`` (a dataclass); V2's
    Engram, PP and AGRS calls raise NotImplementedError naming themselves."""
    import dataclasses
    deep_ep = triton_ep
    assert dataclasses.is_dataclass(deep_ep.EPHandle)
    buf = object.__new__(deep_ep.ElasticBuffer)
    for name in ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv", "create_agrs_session",
                 "destroy_agrs_session", "agrs_new_session", "agrs_set_config", "agrs_get_inplace_tensor",
                 "all_gather", "get_engram_storage_size_hint", "get_pp_buffer_size_hint",
                 "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint"):
        with pytest.raises(NotImplementedError, match=name):
            getattr(buf, name)(1, 2)
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(None, 4096, 7168) % (2 << 20) == 0
    with pytest.raises(ValueError, match="hidden"):
        deep_ep.ElasticBuffer.get_buffer_size_hint(None, 4096, 0)


def test_sizes_past_int32_name_the_v2_argument():
    """(A new user's find: ``hidden=2**31-1`` was told as the size hint's ``hidden_bytes``, and a dispatch's
    ``num_max_tokens_per_rank`` whose worst case passed int32 as Buffer's ``num_worst_tokens``, arguments a V2
    caller never passed.) ``hidden`` is at most 2^30 - 1 (bf16 rows of ``2 * hidden`` bytes, an int32 count) in the
    constructor and the size hint, and ``R * num_max_tokens_per_rank`` at most 2^31 - 1 (the worst case's rows and
    ``recv_src_metadata``'s source index are int32), each message naming the V2 argument. (The dispatch's check on
    every rank of a group: :func:`tests.cases.elastic.errors`.)"""
    from types import SimpleNamespace
    from triton_ep.elastic import checks
    counts = dict(num_cpu_bytes=0, num_max_tokens_per_rank=8, num_topk=8, sl_idx=3, num_allocated_qps=0)
    for big in (2**30, 2**31 - 1):
        with pytest.raises(ValueError, match=re.escape(f"hidden must be an int in [0, {2**30 - 1}] (a bf16 row of 2 * "
                                                       f"hidden bytes, an int32 count of bytes), got {big}")):
            triton_ep.ElasticBuffer._checked_size(None, None, hidden=big, **counts)
        with pytest.raises(ValueError, match=re.escape(f"hidden must be an int in [1, {2**30 - 1}]")):
            triton_ep.ElasticBuffer.get_buffer_size_hint(None, 8, big)
    assert triton_ep.ElasticBuffer._checked_size(None, None, hidden=2**30 - 1, **counts) > 0
    for R in (2, 3, 8):     # (one rank: num_max_tokens_per_rank's own [0, 2^31) bound comes first)
        eb = SimpleNamespace(num_ranks=R, num_max_tokens_per_rank=0)
        top = (2**31 - 1) // R
        assert checks.num_max(eb, top, 4) == top
        with pytest.raises(ValueError, match=re.escape(f"num_max_tokens_per_rank must be at most {top} with {R} ranks "
                                                       f"(R * num_max_tokens_per_rank, the worst case's rows and the "
                                                       f"bound of recv_src_metadata's source index, is int32), got "
                                                       f"{top + 1} ({R * (top + 1)})")):
            checks.num_max(eb, top + 1, 4)


@pytest.mark.multiprocess
@pytest.mark.property
@settings(max_examples=1)
@given(seed=st.integers(0, 1 << 20))
def test_one_host(seed):
    """3 ranks, 3 random cases on one ElasticBuffer (expanded or not, exact or worst case, alignment, FP8 pairs,
    duplicates, empty ranks, weights, biases, cached dispatch), then argument errors; bit for bit."""
    assert _values(run_ranks(elastic_cases.cases, 3, {}, seed, 3, timeout_s=400)) == [3] * 3


@pytest.mark.multiprocess
def test_two_emulated_hosts():
    """2 hosts of 1 rank over the emulated fabric: 3 random cases, then argument errors; combine checked against
    the reference's two-level sum; under torch.use_deterministic_algorithms(True)."""
    assert _values(run_ranks(elastic_cases.cases, 2, _hosts(1), 11, 3, "cpu", True, timeout_s=400)) == [3] * 2


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.property
@settings(max_examples=4)
@given(R=st.sampled_from([2, 3, 4]), seed=st.integers(0, 1 << 20))
def test_one_host_many_cases(R, seed):
    assert _values(run_ranks(elastic_cases.cases, R, {}, seed, 10, timeout_s=600)) == [10] * R


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.parametrize("world,per_host", [(4, 2), (3, 1)])
def test_emulated_hosts_many_cases(world, per_host):
    assert _values(run_ranks(elastic_cases.cases, world, _hosts(per_host), 5 + world, 8, timeout_s=600)) == [8] * world


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_round_trip_gpu():
    """On the GPU (2 ranks sharing it, gloo bootstrap): 8 random cases (async events among them) and the argument
    errors, bit for bit; then 4 more under torch.use_deterministic_algorithms(True)."""
    assert _values(run_ranks(elastic_cases.cases, 2, {}, 3, 8, "cuda", timeout_s=400)) == [8] * 2
    assert _values(run_ranks(elastic_cases.cases, 2, {}, 4, 4, "cuda", True, timeout_s=400)) == [4] * 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,env,body,n", [
    (2, {}, "rejected_on_one_rank", 4),
    pytest.param(2, _hosts(1), "rejected_on_one_rank", 4, marks=pytest.mark.extended),
    (2, dict(_hosts(1), TRITON_EP_INTERNODE_CAPTURE_PATH="1"), "rejected_on_one_rank_capture", 3)], ids=["one_host", "two_emulated_hosts", "two_emulated_hosts_capture_path"])
def test_rejected_on_one_rank(world, env, body, n):
    """A value only ElasticBuffer checks, bad on one rank alone (a dispatch with T > num_max_tokens_per_rank or a
    float topk_idx, a cached dispatch with topk_idx or of an expanded handle without do_expand=True, a combine with
    three biases): that rank raises its error naming the argument, its peers EPRemoteError at once (before, their
    pending call waited for that rank and paired with its next call); every rank's next good call gives the
    reference's results. On the capture path across hosts (the path of do_cpu_sync=False on a GPU) such a rejection
    ends the network leg, as Buffer's own argument errors do there: rank 0 raises its error, the peers' call
    returns or raises at once, every rank's check() and next call raise at once, and a new buffer works
    (:func:`tests.cases.elastic.rejected_on_one_rank_capture`)."""
    assert _values(run_ranks(getattr(elastic_cases, body), world, env, timeout_s=300)) == [n] * world


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", [{}, pytest.param(_hosts(1), marks=pytest.mark.extended)],
                         ids=["one_host", "two_emulated_hosts"])
def test_a_barrier_against_another_call_names_both(env):
    """Rank 0 calls ``barrier()`` where rank 1 makes a dispatch (exact or worst-case sizes) or a combine: both ranks
    raise at once, each naming what each rank called (``the operation: rank 0 called barrier, rank 1 called
    dispatch``), not the fields of the barrier's dispatch of no tokens; then both ranks' next barrier and round trip
    work (:func:`tests.cases.elastic.barrier_skipped`)."""
    assert _values(run_ranks(elastic_cases.barrier_skipped, 2, env, timeout_s=300)) == [3] * 2

@pytest.mark.multiprocess
def test_ambient_defaults():
    """2 ranks: ElasticBuffer built and called under torch.set_default_dtype(torch.bfloat16), then under
    torch.float64, each with the default device 'meta' (a device other than the buffer's): exact and worst-case
    sizes, both layouts, FP8 pairs, weights, biases and cached dispatches, bit for bit against the reference."""
    n = len(elastic_cases.AMBIENT_CASES) * 2
    assert _values(run_ranks(elastic_cases.ambient, 2, (torch.bfloat16, torch.float64), "meta",
                             timeout_s=300)) == [n] * 2


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ambient_defaults_gpu():
    """The GPU twin: 2 ranks sharing the GPU under torch.set_default_device('cuda') and
    torch.set_default_dtype(torch.bfloat16) (as DeepEP's tests run), then float64."""
    n = len(elastic_cases.AMBIENT_CASES) * 2
    assert _values(run_ranks(elastic_cases.ambient, 2, (torch.bfloat16, torch.float64), "cuda", "cuda",
                             timeout_s=300)) == [n] * 2


# ---------------------------------------------------------------------------------------------------- events
def test_event_handle_and_event_overlap_on_cpu():
    """DeepEP 2's ``EventHandle()`` (no argument: an event on the current stream; ``event`` None on CPU, where every
    call has finished when it returns) is what ``ElasticBuffer.capture()`` returns, and its waits are no-ops here.
    ``EventOverlap`` as the engines use it: its ``event`` attribute, ``current_stream_wait()`` and ``with`` (which
    waits at the end of the block) each run the buffer's check first, so an error its kernels recorded raises
    there; ``extra_tensors`` are kept."""
    h = triton_ep.ElasticBuffer.capture()
    assert isinstance(h, triton_ep.EventHandle) and h.event is None
    h.current_stream_wait()
    h.wait()
    assert triton_ep.EventHandle().event is None
    checks = []

    def check():
        checks.append(len(checks))
        if len(checks) == 3:
            raise triton_ep.EPRemoteError("recorded by a kernel")

    t = torch.zeros(2, dtype=torch.float32, device="cpu")
    ev = triton_ep.EventOverlap(None, extra_tensors=(t,), check=check)
    assert ev.event is None and ev.extra_tensors[0] is t
    ev.current_stream_wait()
    with ev as inside:
        assert inside is ev and checks == [0]       # (the wait comes at the end of the block)
    assert checks == [0, 1]
    with pytest.raises(triton_ep.EPRemoteError, match="recorded"):
        with ev:
            pass
    wrapped = triton_ep.EventOverlap(triton_ep.EventHandle())    # an EventOverlap around an EventHandle
    wrapped.current_stream_wait()
    with wrapped:
        pass


def test_event_overlap_v2_extras_on_cpu():
    """DeepEP 2.x's ``EventOverlap`` extras: a hook registered with ``register_hook_after_wait`` runs once, after the
    next ``current_stream_wait()`` or the end of a ``with`` block (after the buffer's check, not when the check
    raises); a second hook while one waits is a ValueError, a non-callable a TypeError; ``release_handle=True``
    (an argument, or ``with ev(release_handle=True):``, which returns the same object) drops the event after the
    wait, and only for that block. On CPU the waits are no-ops, the rest happens as on a GPU."""
    ran, fail = [], []

    def check():
        if fail:
            raise triton_ep.EPRemoteError("recorded by a kernel")

    ev = triton_ep.EventOverlap(triton_ep.EventHandle(), check=check)
    assert ev.hook_after_wait is None
    ev.register_hook_after_wait(lambda: ran.append(ev.event))
    with pytest.raises(ValueError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    with pytest.raises(TypeError, match="callable"):
        triton_ep.EventOverlap().register_hook_after_wait(3)
    assert ran == []                                    # (nothing runs at registration)
    fail.append(1)
    with pytest.raises(triton_ep.EPRemoteError):        # the check first: the hook waits for the next wait
        ev.current_stream_wait()
    fail.clear()
    assert ran == [] and ev.hook_after_wait is not None
    handle = ev.event
    ev.current_stream_wait(release_handle=True)
    assert ran == [handle] and ev.event is None and ev.hook_after_wait is None   # (the hook saw the event; then gone)
    ev.current_stream_wait()
    assert len(ran) == 1                                # once

    ev2 = triton_ep.EventOverlap(triton_ep.EventHandle())
    ev2.register_hook_after_wait(lambda: ran.append("with"))
    with ev2 as inside:
        assert inside is ev2 and ran[-1] != "with"
    assert ran[-1] == "with" and ev2.event is not None  # (no release without release_handle)
    with ev2(release_handle=True) as inside:
        assert inside is ev2 and ev2.event is not None
    assert ev2.event is None
    ev3 = triton_ep.EventOverlap(triton_ep.EventHandle())
    with ev3(release_handle=True):
        pass
    with ev3:                                           # (a later block without it keeps whatever is there)
        pass
    assert ev3.event is None

    def boom():
        raise RuntimeError("hook failed")
    ev4 = triton_ep.EventOverlap(triton_ep.EventHandle())
    ev4.register_hook_after_wait(boom)
    with pytest.raises(RuntimeError, match="hook failed"):
        ev4.current_stream_wait(release_handle=True)
    assert ev4.hook_after_wait is None and ev4.event is not None     # (at most once; the event kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_event_overlap_hook_after_wait_gpu():
    """On the GPU: the hook of an EventOverlap whose event a busy side stream recorded runs on the host right after
    the current stream was made to wait, so the work it queues there waits for the side stream too (as DeepEP 2.x's
    async deterministic epilogue relies on); ``release_handle`` then drops the event."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for how in ("current_stream_wait", "with"):
        with torch.cuda.stream(s1):
            torch.cuda._sleep(200_000_000)          # about 0.1 s
            ev = triton_ep.EventOverlap(triton_ep.EventHandle())
        marks = []

        def hook():
            done = torch.cuda.Event()
            done.record()                           # on the current stream, s2
            marks.append(done)
        ev.register_hook_after_wait(hook)
        with torch.cuda.stream(s2):
            if how == "current_stream_wait":
                ev.current_stream_wait(release_handle=True)
            else:
                with ev(release_handle=True):
                    pass
        assert len(marks) == 1 and ev.event is None, how
        assert not marks[0].query(), how            # s2's work after the hook waits for s1's sleep
        marks[0].synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_event_handle_orders_streams_gpu():
    """On the GPU: ``EventHandle()`` records on the current stream (a side stream busy with a sleep kernel); another
    stream's ``current_stream_wait()``, ``EventOverlap(handle)`` in a ``with`` block, and ``wait_event(handle)``
    each make that stream's later work wait for it."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for how in ("current_stream_wait", "with", "wait_event"):
        with torch.cuda.stream(s1):
            torch.cuda._sleep(200_000_000)          # about 0.1 s
            h = triton_ep.ElasticBuffer.capture() if how == "with" else triton_ep.EventHandle()
        assert isinstance(h.event, torch.cuda.Event) and not h.event.query(), how
        with torch.cuda.stream(s2):
            if how == "current_stream_wait":
                h.current_stream_wait()
            elif how == "with":
                with triton_ep.EventOverlap(h):
                    pass
            else:
                s2.wait_event(h)
            done = torch.cuda.Event()
            done.record()
        assert not done.query(), how                # s2 waits for s1's sleep
        done.synchronize()
        assert h.event.query(), how


def test_event_overlap_refuses_a_non_event_and_release_handle_is_one_blocks():
    """(A new user's finds.) ``EventOverlap(42)``: a TypeError at construction (it was "Torch not compiled with
    CUDA enabled" at the first wait); ``ev(release_handle=True)`` called outside a ``with`` changes nothing, so a
    later plain ``with ev:`` keeps the event; ``with ev(release_handle=True):`` still drops it."""
    for bad in (42, "event", object()):
        with pytest.raises(TypeError, match="event must be a torch.cuda.Event, an EventHandle or None, got"):
            triton_ep.EventOverlap(bad)
    with pytest.raises(TypeError, match="check must be callable"):
        triton_ep.EventOverlap(None, check=3)
    ev = triton_ep.EventOverlap(triton_ep.EventHandle())
    ev(release_handle=True)                              # (not a with block: nothing armed)
    with ev as inside:
        assert inside is ev
    assert ev.event is not None
    with ev(release_handle=True) as inside:
        assert inside is ev and ev.event is not None
    assert ev.event is None
