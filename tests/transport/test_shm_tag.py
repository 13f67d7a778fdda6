"""The suite's leak check sees only this run's /dev/shm files (issue 17, item 9).

Every /dev/shm file triton-ep makes is named by ``ipc.shm_name``: ``triton_ep.<tag>.<rest>`` with the tag of
``$TRITON_EP_SHM_TAG``, which tests/conftest.py sets to a value of its own for the run (the rank processes
inherit it). The check counts only files with this run's tag, so another triton-ep program on the host (a
second test run, a user's job) no longer makes tests fail at teardown with "left in /dev/shm".
"""
from __future__ import annotations

import os
import types
import uuid

import pytest
import torch

from triton_ep.transport import ipc

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this machine")


@pytest.fixture(scope="module")
def foreign_files():
    """Paths of files another program "made" during a test; removed only after the test's own leak check ran
    (a module fixture is torn down after every function fixture), so that check sees them."""
    paths = []
    yield paths
    for p in paths:
        os.unlink(p)


def _touch(name: str) -> str:
    path = os.path.join(SHM, name)
    open(path, "x").close()
    return path


def test_another_programs_files_are_not_flagged_and_ours_are(foreign_files, shm_check):
    """Files of another triton-ep program appear during this test and stay past its teardown: the check
    (conftest.shm_left_behind, what nothing_left_behind calls) ignores them. A file with this run's tag that
    is left behind is flagged."""
    before = shm_check.files()
    key = uuid.uuid4().hex[:16]
    foreign_files.append(_touch(ipc.shm_name(f"{key}.ctrl", tag="")))            # an untagged program
    foreign_files.append(_touch(ipc.shm_name(f"{key}.r0", tag="otherrun-1")))    # another test run
    assert shm_check.left_behind(before, grace_s=0.2) == set()
    ours = _touch(ipc.shm_name(f"{key}.r1"))
    try:
        assert os.path.basename(ours) == f"triton_ep.{shm_check.tag}.{key}.r1"
        assert shm_check.left_behind(before, grace_s=0.2) == {os.path.basename(ours)}
    finally:
        os.unlink(ours)
    assert shm_check.left_behind(before, grace_s=0.2) == set()
    # the foreign files stay until after nothing_left_behind has checked this test


def test_shm_name_takes_the_tag_from_the_environment(monkeypatch, shm_check):
    assert os.environ[ipc.SHM_TAG_ENV] == shm_check.tag          # set for the run, inherited by ranks
    assert ipc.shm_name("x.ctrl") == f"triton_ep.{shm_check.tag}.x.ctrl"
    monkeypatch.delenv(ipc.SHM_TAG_ENV)
    assert ipc.shm_name("x.ctrl") == "triton_ep.x.ctrl"                # default: no tag, the old names
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "a_B-9")
    assert ipc.shm_name("x.r0") == "triton_ep.a_B-9.x.r0"
    for bad in ("a/b", "a.b", "a b", "é"):
        monkeypatch.setenv(ipc.SHM_TAG_ENV, bad)
        with pytest.raises(ValueError, match="TRITON_EP_SHM_TAG="):
            ipc.shm_name("x")


def test_every_shm_file_triton_ep_makes_carries_the_tag(monkeypatch, tmp_path, shm_check):
    """open_group's control block and CPU data buffers, and the probe file of ``triton-ep info``."""
    made = []

    def record(path, nbytes, create):
        made.append(path)
        raise RuntimeError("stop here")
    monkeypatch.setattr(ipc, "_map_file", record)
    for rank in (0, 1):
        group = types.SimpleNamespace(rank=lambda r=rank: r, size=lambda: 2)
        with pytest.raises(RuntimeError, match="stop here"):
            ipc.open_group(group, 4096, torch.device("cpu"), 1.0, 8)
    assert [os.path.basename(p).split(".")[::3] for p in made] == [["triton_ep", "ctrl"], ["triton_ep", "r1"]]
    assert all(os.path.basename(p).startswith(f"triton_ep.{shm_check.tag}.") for p in made)

    from triton_ep.runtime import machine
    import tempfile
    probes = []
    real = tempfile.NamedTemporaryFile

    def spy(*a, **kw):
        f = real(*a, **kw)
        probes.append(os.path.basename(f.name))
        return f
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", spy)
    assert machine.shm_state(str(tmp_path)).startswith("writable, ")
    assert len(probes) == 1 and probes[0].startswith(f"triton_ep.{shm_check.tag}.info.")
    monkeypatch.setenv(ipc.SHM_TAG_ENV, "bad/tag")
    assert machine.shm_state(str(tmp_path)).startswith("NOT usable: TRITON_EP_SHM_TAG='bad/tag'")


def test_emulated_fabric_ring_files_carry_the_tag(shm_check):
    """The emulated fabric's ring files (one per QP, until every peer has mapped it) are named by
    ``ipc.shm_name`` too, so a run's leak check sees one its processes leave behind (a process killed
    before its peers moved their QPs to RTR) and another program's are not counted."""
    from tests.cases.rdma import dual_port_fabric
    from triton_ep.transport import verbs
    before = shm_check.files()
    fab = dual_port_fabric()
    api = fab.pyverbs()
    ctx = api.Context(name="mlx5_0")
    qp = api.QP(api.PD(ctx), verbs.build_init_attr(api, api.CQ(ctx, 8, None, None, 0), 4, 4))
    try:
        left = shm_check.left_behind(before, grace_s=0.2)
        assert left == {os.path.basename(fab.ring_prefix) + f"{qp.qp_num:06x}"}, left
        assert all(f.startswith(f"triton_ep.{shm_check.tag}.tep_{fab.token}_q") for f in left)
    finally:
        qp.close()
    assert shm_check.left_behind(before, grace_s=0.2) == set()


def test_cpu_buffers_are_reserved_up_front_and_too_little_room_is_an_error(monkeypatch, shm_check):
    """(A new user's find: CPU data buffers were sparse /dev/shm files, so a Buffer larger than the free space was
    built and the first large transfer killed every rank with SIGBUS, no message.) Each file open_group makes is
    reserved with posix_fallocate; where that finds no room (ENOSPC, as in a container's 64 MiB /dev/shm) the
    Buffer fails at construction with an OSError naming the size and --shm-size / --ipc=host, and no file stays."""
    import errno
    sizes = []
    real = os.posix_fallocate

    def full(fd, offset, length):
        sizes.append(length)
        if length > 1 << 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", full)
    group = types.SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes .* for the ranks' shared buffers .*--shm-size.*"
                                      r"--ipc=host") as got:
        ipc.open_group(group, 4 << 20, torch.device("cpu"), 1.0, 8)
    assert got.value.errno == errno.ENOSPC and len(sizes) == 2 and sizes[1] > 4 << 20, sizes   # ctrl, then data
    assert not shm_check.files(), shm_check.files()
