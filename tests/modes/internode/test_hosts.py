"""Internode mode, step 1: ranks grouped into hosts, the transport between them, and get_dispatch_layout's
``num_tokens_per_rdma_rank`` (DeepEP's internode layout). CPU: processes over gloo, one machine standing in
for several hosts through ``TRITON_EP_RANKS_PER_HOST``."""
import pytest
import torch

from tests.cases import internode as cases
from triton_ep.runtime import hosts as H
from triton_ep.testing import RankFailure, run_ranks


# ---------------------------------------------------------------- grouping (host side, no processes)
def test_ranks_with_one_identity_form_one_host_in_order_of_their_lowest_rank():
    h = H.group_hosts(["b", "a", "b", "a"])
    assert h.num_hosts == 2 and h.ranks_per_host == 2
    assert h.host_of == (0, 1, 0, 1) and h.ranks(0) == (0, 2) and h.ranks(1) == (1, 3)
    assert h.rank_order == (0, 2, 1, 3) and [h.local_index(r) for r in range(4)] == [0, 0, 1, 1]


def test_hosts_of_different_sizes_are_named():
    with pytest.raises(ValueError) as e:
        H.group_hosts(["a", "a", "a", "b"])
    assert "'a': ranks [0, 1, 2]" in str(e.value) and "'b': ranks [3]" in str(e.value)


def test_ranks_per_host_override_and_its_bad_values():
    h = H.group_hosts(["m"] * 6, ["3"] * 6)
    assert h.host_of == (0, 0, 0, 1, 1, 1) and h.source == "TRITON_EP_RANKS_PER_HOST=3"
    for bad in ("4", "0", "-2", "two"):
        with pytest.raises(ValueError, match="TRITON_EP_RANKS_PER_HOST"):
            H.group_hosts(["m"] * 6, [bad] * 6)
    with pytest.raises(ValueError, match="rank 1: '2'"):
        H.group_hosts(["m"] * 4, ["1", "2", "1", "1"])
    assert H.group_hosts(["m"] * 4, [""] * 4).num_hosts == 1


def test_rdma_backend_values():
    assert H.rdma_backend_arg(None, {}) == "auto"
    assert H.rdma_backend_arg(None, {"TRITON_EP_RDMA": "emulated"}) == "emulated"
    assert H.rdma_backend_arg("verbs", {"TRITON_EP_RDMA": "emulated"}) == "verbs"     # the keyword wins
    with pytest.raises(ValueError, match="TRITON_EP_RDMA"):
        H.rdma_backend_arg(None, {"TRITON_EP_RDMA": "ib"})
    with pytest.raises(ValueError, match="rdma_backend"):
        H.rdma_backend_arg("tcp", {})


def test_transport_choice():
    one, two = H.group_hosts(["a", "a"]), H.group_hosts(["a", "b"])
    none = lambda: ([], "PyverbsRDMAError: no RDMA")          # noqa: E731
    assert H.choose_transport("auto", one, none) is None
    assert H.choose_transport("emulated", two, none) == "emulated"
    assert H.choose_transport("auto", two, lambda: (["mlx5_0"], "")) == "verbs"
    for backend in ("auto", "verbs"):
        with pytest.raises(ValueError) as e:
            H.choose_transport(backend, two, none)
        msg = str(e.value)
        assert "2 hosts" in msg and "PyverbsRDMAError" in msg and "TRITON_EP_RDMA=emulated" in msg
        assert "rdma_backend='emulated'" in msg and "pyverbs" in msg


# ---------------------------------------------------------------- a group of processes
def _values(out):
    for o in out:
        if isinstance(o, RankFailure):
            raise AssertionError(str(o))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,per_host", [(2, 1), (4, 2)])
def test_layout_per_host_and_dispatch_checks(world, per_host):
    """num_tokens_per_rdma_rank equals, per host, the tokens with an expert on one of its ranks (ragged T
    with -1 ids); dispatch checks it (required without a handle, int32 [num_hosts]) before anything moves,
    on every rank alike."""
    env = {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated"}
    E, K = 4 * world, 3
    out = _values(run_ranks(cases.layout_and_checks, world, env, E, K, 5, 11))
    num_hosts = world // per_host
    for r, o in enumerate(out):
        idx = o["idx"]
        owner = torch.where(idx >= 0, idx // (E // world), -1)
        want = torch.tensor([int(((owner // per_host) == h).any(1).sum()) for h in range(num_hosts)],
                            dtype=torch.int32)
        assert o["per_host"].dtype == torch.int32 and torch.equal(o["per_host"], want), (r, o["per_host"], want)
        assert o["missing"][0] == "ValueError" and "num_tokens_per_rdma_rank" in o["missing"][1]
        assert o["int64"][0] == "TypeError" and "num_tokens_per_rdma_rank" in o["int64"][1]
        assert o["shape"][0] == "ValueError" and "num_tokens_per_rdma_rank" in o["shape"][1]
        assert o["value"][0] == "ValueError" and "differs from the tokens this rank sends" in o["value"][1], o["value"]
        assert o["ok"] is None, o["ok"]
        assert o["combine"] == ["TypeError", "handle must be a handle this Buffer's dispatch returned, got NoneType"]
        assert o["float"] == ["TypeError", "handle[7] (recv_src_meta) must be a torch.Tensor, got float"], o["float"]
        assert o["rebuilt"][0] == "TypeError" and "got a tuple of its entries" in o["rebuilt"][1], o["rebuilt"]


@pytest.mark.multiprocess
def test_construction_errors_across_hosts_on_every_rank():
    """Two hosts and no RDMA device (this machine has none): a ValueError naming both ways out on every
    rank; ranks that disagree on TRITON_EP_RDMA: a ValueError naming each rank's value. Nothing is left
    behind (the autouse fixture checks /dev/shm)."""
    two = {"TRITON_EP_RANKS_PER_HOST": "1"}
    out = _values(run_ranks(cases.build_only, 2, dict(two, TRITON_EP_RDMA="auto"), {}))
    for o in out:
        assert o[0] == "ValueError" and "TRITON_EP_RDMA=emulated" in o[1] and "pyverbs" in o[1], o
    out = _values(run_ranks(cases.build_only, 2, {"TRITON_EP_RANKS_PER_HOST": ""}, {"rdma_backend": "verbs"}))
    assert out == [None, None], out          # one host: no transport needed, whatever was asked
    out = _values(run_ranks(cases.build_only, 2, [dict(two, TRITON_EP_RDMA="emulated"), dict(two, TRITON_EP_RDMA="auto")],
                            {}))
    for o in out:
        assert o[0] == "ValueError" and "rank 0: 'emulated', rank 1: 'auto'" in o[1], o
    emu = dict(two, TRITON_EP_RDMA="emulated")
    out = _values(run_ranks(cases.build_only, 2, [dict(emu, TRITON_EP_RDMA_SLOTS="4"), emu], {}))
    for o in out:
        assert o[0] == "ValueError" and "TRITON_EP_RDMA_SLOTS" in o[1] and "rank 0: (4, 4, 65536)" in o[1], o
    big = dict(emu, TRITON_EP_RDMA_SLOTS="1024", TRITON_EP_RDMA_CHUNK_BYTES=str(1 << 30))   # each in range, 2 TiB
    for o in _values(run_ranks(cases.build_only, 2, big, {})):
        assert o[0] == "ValueError" and "2048.0 GiB of rings" in o[1] and "TRITON_EP_RDMA_CHUNK_BYTES" in o[1], o


def test_network_shape_from_the_environment():
    """TRITON_EP_RDMA_QPS_PER_PEER / _SLOTS / _CHUNK_BYTES override the defaults; bad values raise naming the
    variable."""
    from triton_ep.modes.internode import network_shape
    assert network_shape({}) == (4, 8, 65536)
    assert network_shape({"TRITON_EP_RDMA_QPS_PER_PEER": "2", "TRITON_EP_RDMA_SLOTS": "3",
                          "TRITON_EP_RDMA_CHUNK_BYTES": "128"}) == (2, 3, 128)
    for name, bad in [("TRITON_EP_RDMA_CHUNK_BYTES", "100"), ("TRITON_EP_RDMA_SLOTS", "0"),
                      ("TRITON_EP_RDMA_QPS_PER_PEER", "two")]:
        with pytest.raises(ValueError, match=name):
            network_shape({name: bad})


def test_info_shows_the_plan_a_buffer_would_use():
    import io
    from triton_ep.__main__ import print_internode
    for env, words in [({}, ["host identity", "none here", "TRITON_EP_RDMA=emulated"]),
                       ({"TRITON_EP_RANKS_PER_HOST": "2", "TRITON_EP_RDMA": "emulated"},
                        ["TRITON_EP_RANKS_PER_HOST=2", "emulated", "RC QPs per peer"]),
                       ({"TRITON_EP_RDMA": "ib"}, ["must be one of"]),
                       ({"TRITON_EP_RDMA": "emulated", "TRITON_EP_RDMA_SLOTS": "3", "TRITON_EP_RDMA_CHUNK_BYTES": "4096"},
                        ["3 ring slots of 4 KiB", "kernels"]),
                       ({"TRITON_EP_RDMA": "emulated", "TRITON_EP_RDMA_CHUNK_BYTES": "100"},
                        ["TRITON_EP_RDMA_CHUNK_BYTES='100' must be"])]:
        out = io.StringIO()
        print_internode(out, env)
        assert all(w in out.getvalue() for w in words), (env, out.getvalue())


def test_ranks_on_several_machines():
    """Ranks that report two machines (host identities) form two hosts of two ranks without
    TRITON_EP_RANKS_PER_HOST: each host's ranks map only each other's buffers (nothing is mapped between
    hosts), the RDMA buffer is the scheduler's rings, and a round trip matches the reference. A
    TRITON_EP_RANKS_PER_HOST that puts ranks of two machines into one host is a ValueError on every rank."""
    emu = {"TRITON_EP_RDMA": "emulated", "TRITON_EP_RANKS_PER_HOST": ""}
    out = _values(run_ranks(cases.machines, 4, emu, 2, 3, timeout_s=240))
    for o in out:
        assert o["hosts"] == (0, 0, 1, 1) and o["hosts_runtime"] and o["mapped"] == 2, o
        assert o["rdma_buffer"] > 0 and o["combined"], o
    out = _values(run_ranks(cases.machines, 4, dict(emu, TRITON_EP_RANKS_PER_HOST="4"), 2, 3, timeout_s=120))
    for o in out:
        assert o["error"][0] == "ValueError" and "a host's ranks must share a machine" in o["error"][1], o


@pytest.mark.multiprocess
def test_low_latency_mode_buffer_serves_both_modes_across_hosts():
    """DeepEP's one Buffer for both modes (SGLang: normal mode for prefill, low-latency for decode): built
    with low_latency_mode over 2 hosts of 2 ranks, its dispatch, combine and cached dispatch work across
    hosts bit for bit the reference, then its low-latency dispatch and combine (bf16 and FP8) against their
    oracle, then normal mode again."""
    env = {"TRITON_EP_RANKS_PER_HOST": "2", "TRITON_EP_RDMA": "emulated"}
    out = _values(run_ranks(cases.low_latency_buffer, 4, env, 3))
    for first, rows, again in out:
        assert first and again, out
    assert sum(o[1] for o in out) > 0, out


@pytest.mark.parametrize("shape,strides", [((5, 1), (1, 8)), ((1, 1), (1, 4)), ((0, 1), (1, 4)), ((3, 2), (1, 4)),
                                           ((4, 3), (3, 1))])
def test_rows_as_words_take_any_strides(shape, strides):
    """The network leg's rows as int32 words (``_words``) from column-major scales, as SGLang's DeepEP V2 path
    passes packed UE8M0 ones (``[T, 1]`` with a pack stride of ``T`` rounded up to 4 counts as contiguous)."""
    from triton_ep.kernels.net import words as _words
    n = shape[0] * shape[1]
    src = torch.arange(100, 100 + n, dtype=torch.int32, device="cpu").reshape(shape)
    t = torch.empty_strided(shape, strides, dtype=torch.int32, device="cpu").copy_(src)
    w = _words(t, shape[0], "cpu")
    assert w.dtype == torch.int32 and tuple(w.shape) == shape and torch.equal(w, src)
