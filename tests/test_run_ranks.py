"""``triton_ep.testing.run_ranks``, the test helper that runs ranks as processes: on every path out of it (a timeout
of its own, a rank that could not start) it ends the ranks it started and releases what their process objects hold,
even while the caller keeps its exception (which holds run_ranks' frame)."""
import multiprocessing
import time

import pytest
import torch.multiprocessing

from tests.cases.helpers import sleeping_rank
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _new(before: dict, now: dict) -> dict:
    return {fd: what for fd, what in now.items() if before.get(fd) != what}


def test_its_own_timeout_leaves_no_descriptor_or_process_while_the_error_is_kept(open_fds):
    """(A new user's find: pipe descriptors stayed open in the test process after run_ranks hit its timeout.) Ranks
    that sleep 60 s under a 1 s bound: TimeoutError after about 1 s; with the exception still held (``ei``, and its
    traceback run_ranks' frame), no descriptor of this process is new (each rank's process object held the read end
    of its pipe until collected: 4 pipe ends for 2 ranks before) and no rank process lives."""
    assert run_ranks(sleeping_rank, 2, 0.0, timeout_s=120) == [0, 1]     # (a normal run first: the same path)
    before = open_fds()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="ranks did not finish within 1.0 s") as ei:
        run_ranks(sleeping_rank, 2, 60.0, timeout_s=1.0)
    assert time.monotonic() - t0 < 30.0
    assert ei.value.__traceback__ is not None
    assert not _new(before, open_fds()), _new(before, open_fds())
    assert not multiprocessing.active_children()


def test_a_rank_that_cannot_start_ends_those_started(open_fds, monkeypatch):
    """The start of rank 1 fails (a stand-in for a fork that fails: ``OSError`` from torch's start_processes on its
    second call): run_ranks raises that error at once, and rank 0, started and waiting for rank 1 at the rendezvous,
    is killed and released: no new descriptor, no live child."""
    real = torch.multiprocessing.start_processes
    calls = []

    def start(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(11, "Resource temporarily unavailable (a stand-in)")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", start)
    before = open_fds()
    with pytest.raises(OSError, match="a stand-in"):
        run_ranks(sleeping_rank, 2, 0.0, timeout_s=120)
    assert len(calls) == 2
    assert not _new(before, open_fds()), _new(before, open_fds())
    assert not multiprocessing.active_children()
