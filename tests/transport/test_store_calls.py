"""Store calls bounded in time (triton_ep/transport/bootstrap.py: ``StoreCaller``, ``bounded_store_call``): one worker
thread reused from call to call, a call that never answers raises ``TimeoutError`` within its bound (the next call gets
a fresh worker), and nothing is left running once closed (the autouse fixture checks threads). The store is torch's
in-process ``HashStore``; a call that never answers is one blocked on an event (a ``TCPStore`` whose server's process
died while a forked child holds its sockets blocks so: tests/modes/internode/test_proxy_faults.py)."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from triton_ep.errors import EPRemoteError
from triton_ep.modes.internode.peer_tokens import PeerTokens
from triton_ep.transport import bootstrap
from triton_ep.transport.bootstrap import StoreCaller, bounded_store_call


def _ends(th: threading.Thread, bound_s: float = 5.0) -> bool:
    th.join(bound_s)
    return not th.is_alive()


def test_one_worker_makes_every_call():
    """20 calls (set, add, get, a raising one) through one StoreCaller run on one thread that is not the caller's;
    results and the exception come back as they are; close() ends that thread."""
    store, calls, threads = dist.HashStore(), StoreCaller(), set()

    def on_worker(fn):
        def run():
            threads.add(threading.current_thread())
            return fn()
        return run
    try:
        for i in range(5):
            calls.call(on_worker(lambda: store.set(f"k{i}", str(i))), 1.0)
            assert calls.call(on_worker(lambda: store.add("n", 1)), 1.0) == i + 1
            assert calls.call(on_worker(lambda: store.get(f"k{i}")), 1.0) == str(i).encode()
            with pytest.raises(ValueError, match="planted"):
                calls.call(on_worker(lambda: (_ for _ in ()).throw(ValueError("planted"))), 1.0)
    finally:
        calls.close()
    assert len(threads) == 1 and threading.current_thread() not in threads, threads
    assert _ends(threads.pop())


def test_a_call_that_never_answers_raises_within_its_bound():
    """A call blocked for good raises TimeoutError naming the call within its bound (0.2 s, < 1 s measured); the next
    call runs on a fresh worker and answers; the stuck worker ends once its call returns."""
    calls, release, stuck = StoreCaller(), threading.Event(), []

    def never():
        stuck.append(threading.current_thread())
        release.wait(10.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="telling the peers: the group's store did not answer within 0.2 s"):
            calls.call(never, 0.2, "telling the peers")
        assert time.monotonic() - t0 < 1.0
        assert calls.call(threading.current_thread, 1.0) is not stuck[0]
    finally:
        release.set()
        calls.close()
    assert _ends(stuck[0])


def test_a_second_caller_waits_within_its_own_bound():
    """While one thread's call holds the worker, another thread's call with a bound of 0.1 s raises TimeoutError
    within about that (calls are made one at a time); once the first ends, the next call answers."""
    calls, release, started = StoreCaller(), threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10.0)
        return "slow"
    out = []
    first = threading.Thread(target=lambda: out.append(calls.call(slow, 10.0)))
    first.start()
    try:
        assert started.wait(5.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another store call of this rank did not end within 0.1 s"):
            calls.call(lambda: "second", 0.1)
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        assert _ends(first)
    try:
        assert out == ["slow"] and calls.call(lambda: "third", 1.0) == "third"
    finally:
        calls.close()


def test_an_idle_worker_ends_and_the_next_call_starts_another(monkeypatch):
    """With STORE_WORKER_IDLE_S at 0.1 s the worker ends after a call once idle that long (within 2 s); the next call
    starts another and answers."""
    monkeypatch.setattr(bootstrap, "STORE_WORKER_IDLE_S", 0.1)
    calls = StoreCaller()
    try:
        first = calls.call(threading.current_thread, 1.0)
        assert _ends(first, 2.0)
        second = calls.call(threading.current_thread, 1.0)
        assert second is not first and second.is_alive()
    finally:
        calls.close()
    assert _ends(second)


def test_bounded_store_call_leaves_no_thread():
    """The one-off form: the value, the call's exception, TimeoutError past the bound; its thread ends with the call
    (the fixture: no thread left)."""
    store = dist.HashStore()
    store.set("k", "v")
    assert bounded_store_call(lambda: store.get("k"), 1.0) == b"v"
    with pytest.raises(KeyError):
        bounded_store_call(lambda: {}["missing"], 1.0)
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError):
            bounded_store_call(lambda: release.wait(10.0), 0.1)
    finally:
        release.set()
    deadline = time.monotonic() + 5.0
    left = lambda: [t for t in threading.enumerate() if t.name == "triton-ep-store-call"]  # noqa: E731
    while left() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left(), left()


def test_mark_host_path_without_a_store_starts_no_thread():
    """A rank without the group's store (or without RDMA peers) tells nobody that it took the host path: no worker
    starts for it."""
    for tokens in (PeerTokens(0, [1], 1.0), PeerTokens(0, [], 1.0, store=dist.HashStore())):
        tokens.mark_host_path(3)
        assert tokens.calls._worker is None
        tokens.close()


def test_fault_notices_look_hears_a_notice_at_once(monkeypatch):
    """``FaultNotices.look`` (an error path: a host mate's failure word ended a wait) hears a notice already posted
    before it returns, not at the watching thread's next look (here 60 s away); each notice is heard once, by the
    look or the thread; a look blocked past its bound raises TimeoutError (a store that never answers). Nothing is
    left running once closed (the fixture)."""
    from triton_ep.proxy_process import notices as notices_mod
    monkeypatch.setattr(notices_mod, "FAULT_POLL_S", 60.0)
    store, heard = dist.HashStore(), []
    mine = notices_mod.FaultNotices(store, "p/", 0, [1], lambda *a: heard.append(a))
    theirs = notices_mod.FaultNotices(store, "p/", 1, [0], lambda *a: None)
    try:
        mine.look()
        assert heard == []
        theirs.post(7, "stopped making progress")
        t0 = time.monotonic()
        mine.look()
        assert heard == [(1, 7, "stopped making progress")] and time.monotonic() - t0 < 1.0, heard
        mine.look()
        assert len(heard) == 1, heard
        with mine._lock:        # (the thread's look in progress, blocked in the store)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                mine.look(0.2)
            assert time.monotonic() - t0 < 1.0
    finally:
        mine.close()
        theirs.close()
    deadline = time.monotonic() + 5.0
    while [t for t in threading.enumerate() if t.name == "triton-ep-store-call"] and time.monotonic() < deadline:
        time.sleep(0.01)


class _GoneStore:
    """A store whose server's process has exited: every call raises torch's DistNetworkError, C++ frames and all."""

    def __getattr__(self, name):
        def gone(*args):
            raise dist.DistNetworkError("Broken pipe\nException raised from sendBytes at tcputils.hpp:120 (most "
                                        "recent call first):\nframe #0: c10::Error::Error(...) + 0x98")
        return gone


class _Group:
    def __init__(self, store, rank=1, size=2):
        self.store, self._rank, self._size = store, rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def get_group_store(self):
        return self.store


def test_an_exchange_whose_store_went_away_is_a_remote_error():
    """A late rank whose group's store is gone (rank 0 gave up and exited) gets EPRemoteError naming the exchange and
    the store's first line, not torch's DistNetworkError with its C++ frames; a store that answers still gathers."""
    ex = bootstrap.Exchange(_Group(_GoneStore()), 5.0, "bootstrap: exchange host identities")
    with pytest.raises(EPRemoteError) as info:
        ex.gather({"host": "h"})
    msg = str(info.value)
    assert "rank 1: the group's store stopped answering at 'bootstrap: exchange host identities'" in msg
    assert "DistNetworkError: Broken pipe" in msg and "frame #0" not in msg and "rank 0" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    store = dist.HashStore()
    assert bootstrap.Exchange(_Group(store, 0, 1), 5.0, "a stage").gather("x") == ["x"]


def test_an_exchange_passes_the_checks_own_errors_through():
    """What ``check`` raises while a rank waits reaches the caller as it was, a RuntimeError included (only the store's
    own failures become EPRemoteError)."""
    def check():
        raise RuntimeError("the proxy stopped")
    with pytest.raises(RuntimeError, match="the proxy stopped"):
        bootstrap.Exchange(_Group(dist.HashStore()), 5.0, "a stage").gather("x", check)
