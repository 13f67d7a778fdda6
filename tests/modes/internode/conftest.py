"""Every internode test runs with the RDMA proxy as a thread of the rank's process and as a process of its own
(``TRITON_EP_PROXY``, :mod:`triton_ep.proxy_process`): the ``proxy_mode`` parameter sets the variable in the test
process, whose rank processes take its environment. The process variants of :data:`DEFAULT_PROCESS` are in the
default tier (a representative subset: round trips of both modes across hosts, the capture path, a dropped signal;
before the proxy process's idle back-off, 4 ranks with 8 polling proxy processes (two legs a rank) on 2 cores ran up
to 10x slower than with proxy threads, e.g. test_round_trip_every_feature_two_hosts_of_two 89 s against 9 s); the
others are in the extended tier (``pytest --extended``). Tests that
set the variable per rank themselves (test_proxy_mode.py) run once in the default tier, as their thread variant."""
import pytest

#: node-id prefixes (after the file) of the tests whose process-proxy variant runs in the default tier
DEFAULT_PROCESS = (
    "test_round_trip[proxy=process-2-1-",
    "test_a_dropped_signal_fails_both_ranks_within_the_bound",
    "test_two_outstanding_hooks_received_in_reverse_order[proxy=process-False]",
    "test_capture_path_errors_reach_every_rank[proxy=process-capacity]",
    # a rank killed on the other host is seen in seconds (its proxy process ends with it: the probes fail)
    "test_a_rank_killed_on_the_other_host_is_a_remote_error_within_seconds[proxy=process-internode]",
    # GPU (skipped on CPU): the rings cudaHostRegister'd, a graph of low-latency calls across emulated hosts
    "test_round_trip_gpu[proxy=process-2-1-opts0]",
    "test_graph_capture_and_100_replays_across_hosts[proxy=process-False-False]",
)

#: tests whose process variant cannot run: the hook they plant lives in the rank's process
THREAD_ONLY = {
    "test_signal_after_rows_on_one_qp_and_the_planted_variant_fails":
        "its probe (the scheduler's on_signal) and planted variant (_chunk_ops) patch the Scheduler class in the "
        "rank's process; with TRITON_EP_PROXY=process the sweeps run in the proxy process",
}
#: process variants that failed in a run of the three files together on the 2-core CPU while other work loaded it
#: (every proxy process polled then, so 4 ranks added 8 polling processes to 2 cores); not strict until understood.
#: On 2026-12-05 the process variants of the masking tests, of test_errors_raise_everywhere_at_once_and_the_group_recovers
#: and of test_capture_path_errors_reach_every_rank[bad_ids] passed in a run of them all at load average 5-17 (they
#: were listed here before); the capture-path round trips of 3 hosts of 1 rank did not: one raised PeerGoneError (the
#: emulated QPs to host 2 stopped acknowledging, 128 s into the test), one failed as before
KNOWN_PROCESS_GAPS = (
    "test_capture_path_round_trips_and_host_path_between[proxy=process-3-1-",
)


@pytest.fixture(autouse=True, params=["thread", "process"], ids=lambda v: f"proxy={v}")
def proxy_mode(request, monkeypatch):
    """``TRITON_EP_PROXY`` for the test (and the rank processes it starts)."""
    monkeypatch.setenv("TRITON_EP_PROXY", request.param)
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The process variants outside :data:`DEFAULT_PROCESS` go to the extended tier (before the root conftest
    skips that tier)."""
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or spec.params.get("proxy_mode") != "process" or "/modes/internode/" not in item.nodeid:
            continue
        name = item.nodeid.split("::", 1)[1]
        only = next((why for t, why in THREAD_ONLY.items() if name.startswith(t)), None)
        if only is not None:
            item.add_marker(pytest.mark.skip(reason=f"thread proxy only: {only}"))
        elif any(name.startswith(p) for p in KNOWN_PROCESS_GAPS):
            item.add_marker(pytest.mark.xfail(reason="failed with TRITON_EP_PROXY=process under load here (issue 47, open)",
                                              strict=False))
        if not any(name.startswith(p) for p in DEFAULT_PROCESS):
            item.add_marker(pytest.mark.extended)
