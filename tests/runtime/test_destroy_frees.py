"""``Buffer.destroy()`` releases this rank's shared memory at once, whatever the caller still holds: with an event of
every kind, a handle, the receive hooks, the combine's tuple and the Buffer itself kept, and Python's garbage
collector off, the rank maps none of the Buffer's /dev/shm files and holds none open after destroy() (before: the
Runtime, its signals and call card, the low-latency state and the network leg kept views of them, reached from an
event's check or a hook, and the RDMA proxy's mapping kept its descriptor until a collection). Every kept object
used afterwards raises ``EPError`` ("this Buffer was destroyed"); destroy() again does nothing. Normal and
low-latency mode within one host, ElasticBuffer, and 2 emulated hosts (the proxy as a process, the default; and as
a thread). The rank bodies are in tests/cases/destroy.py; nothing is left in /dev/shm (the autouse fixture)."""
import pytest

from tests.cases import destroy as cases
from triton_ep.testing import RankFailure, run_ranks


#: across hosts the normal-mode dispatch and combine return events without a check (their work has finished when
#: they return: ``EventOverlap(None)``), whose wait does nothing, after destroy() as before
_NO_CHECK_ACROSS_HOSTS = {"dispatch event", "combine event", "cached dispatch event"}


def _check(out, across_hosts: bool = False):
    for r, o in enumerate(out):
        assert not isinstance(o, RankFailure), (r, o)
        before, after, outcomes = o
        assert before["maps"], (r, before)        # (the check sees the Buffer's files while it lives)
        assert after == {"maps": [], "fds": []}, (r, after)
        for use, got in outcomes.items():
            if use == "destroy again" or (across_hosts and use in _NO_CHECK_ACROSS_HOSTS):
                assert got == "ok", (r, use, got)
            else:
                assert got.startswith("EPError: ") and "this Buffer was destroyed" in got, (r, use, got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["normal", "low_latency", "elastic"])
def test_destroy_releases_the_shared_memory_that_kept_objects_reached(kind):
    """2 ranks of one host: after destroy() with every returned object and the Buffer kept, the gc off (one collection
    before destroy() for the CPU interpreter's own cycles, none in it: tests/cases/destroy.py), no mapping or
    descriptor of the Buffer's /dev/shm files is left, and every kept object raises EPError when used."""
    _check(run_ranks(cases.destroyed_while_held, 2, kind, timeout_s=240))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["normal", "low_latency"])
def test_destroy_on_a_cpu_frees_what_the_interpreter_held(kind):
    """As above, with the collection of the CPU interpreter's reference cycles (which hold the launches' arguments,
    this rank's own buffer among them) right after destroy() instead, everything still kept, as a CPU user's next
    collection makes it: nothing is left (before: a kept event pinned the memory through any collection)."""
    _check(run_ranks(cases.destroyed_while_held, 2, kind, False, timeout_s=240))


@pytest.mark.multiprocess
@pytest.mark.parametrize("proxy", ["process", "thread"])
def test_destroy_across_hosts_releases_the_rings_and_buffers(proxy, monkeypatch):
    """2 emulated hosts of 1 rank (a Buffer in low-latency mode: normal and low-latency calls), the RDMA proxy a
    ``proxy``: after destroy() with everything kept and the gc off, neither the host's buffers nor the proxy's rings
    stay mapped, and no descriptor of theirs stays open (before, with the proxy a process: its rings' descriptor
    and mapping until a collection)."""
    monkeypatch.setenv("TRITON_EP_PROXY", proxy)
    _check(run_ranks(cases.destroyed_while_held, 2, "hosts", timeout_s=240), across_hosts=True)
