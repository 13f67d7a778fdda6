"""Every internode test runs with the RDMA proxy as a process of its own and as a thread of the rank's process
(``TRITON_EP_PROXY``, :mod:`triton_ep.proxy_process`): the ``proxy_mode`` parameter sets the variable in the test
process, whose rank processes take its environment. The default tier runs every variant of the library's default
(:data:`~triton_ep.proxy_process.rank_side.DEFAULT_PROXY`, ``process`` on Linux) and the other kind's variants of
:data:`DEFAULT_OTHER` (a representative subset: round trips across hosts, the capture path's errors, a killed rank, a
forked child); the others are in the extended tier (``pytest --extended``), as are the default kind's
variants of :data:`DEFAULT_TIER_THREAD` (many-process cases whose thread variant stays). Tests that set the variable
per rank themselves (test_proxy_mode.py) run once in the default tier, as their variant of the default kind."""
import pytest

from triton_ep.proxy_process.rank_side import DEFAULT_PROXY

#: the tests whose variants of the kind that is not the default run in the default tier too
DEFAULT_OTHER = {
    "test_round_trip",
    "test_capture_path_errors_reach_every_rank",
    "test_a_rank_killed_on_the_other_host_is_a_remote_error_within_seconds",
    "test_a_forked_child_that_destroys_the_buffer_changes_nothing",
    # GPU (skipped on CPU): round trips, a graph of low-latency calls across emulated hosts
    "test_round_trip_gpu",
    "test_graph_capture_and_100_replays_across_hosts",
}

#: many-process cases whose default-tier variant is the thread one (their variant of the default kind, 2-3x slower
#: on 2 cores with two proxy processes a rank, is in the extended tier): 9 ranks as 3 hosts (30.9 s against about
#: 8), the low-latency property test (24.5 s against 10) and a dead host's masking (25.0 s against 13)
DEFAULT_TIER_THREAD = {
    "test_three_hosts_of_three_ranks",
    "test_round_trip_across_hosts_property",
    "test_masked_dead_host",
}

#: tests whose process variant cannot run: the hook they plant lives in the rank's process
THREAD_ONLY = {
    "test_signal_after_rows_on_one_qp_and_the_planted_variant_fails":
        "its probe (the scheduler's on_signal) and planted variant (_chunk_ops) patch the Scheduler class in the "
        "rank's process; with TRITON_EP_PROXY=process the sweeps run in the proxy process",
}


@pytest.fixture(autouse=True, params=["process", "thread"], ids=lambda v: f"proxy={v}")
def proxy_mode(request, monkeypatch):
    """``TRITON_EP_PROXY`` for the test (and the rank processes it starts)."""
    monkeypatch.setenv("TRITON_EP_PROXY", request.param)
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The variants of the kind that is not the default, outside :data:`DEFAULT_OTHER`, go to the extended tier
    (before the root conftest skips that tier); thread-only tests skip their process variant and keep their thread
    variant in the default tier."""
    for item in items:
        spec = getattr(item, "callspec", None)
        kind = None if spec is None else spec.params.get("proxy_mode")
        if kind is None or "/modes/internode/" not in item.nodeid:
            continue
        name = item.nodeid.split("::", 1)[1]
        only = next((why for t, why in THREAD_ONLY.items() if name.startswith(t)), None)
        if only is not None:
            if kind == "process":
                item.add_marker(pytest.mark.skip(reason=f"thread proxy only: {only}"))
            continue
        base = name.split("[", 1)[0]
        if base in DEFAULT_TIER_THREAD:
            if kind != "thread":
                item.add_marker(pytest.mark.extended)
        elif kind != DEFAULT_PROXY and base not in DEFAULT_OTHER:
            item.add_marker(pytest.mark.extended)
