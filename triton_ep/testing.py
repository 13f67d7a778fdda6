"""Ranks simulated in one process, for tests: ``R`` Buffers over in-process memory, driven in lock step.

Every collective call of :class:`triton_ep.Buffer` is a generator that yields where ranks must meet; in a
real run each yield is a bounded barrier, here :func:`lockstep` advances all ranks to the same yield
before any goes on. The kernels, offsets and rounds are exactly those of the multi-process path.

Also: :func:`run_ranks` (ranks as processes) and :class:`LiveBytes` (the peak live memory of a block of calls).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys
import weakref
from typing import Any, Generator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .buffer import Buffer
from .runtime import LocalWorld


def lockstep(gens: Sequence[Generator]) -> List[Any]:
    """Run one generator per rank to completion, meeting at every yield.

    Returns:
        per rank, the generator's return value, or the exception it raised (as an object, not raised).

    Raises:
        AssertionError: the ranks yielded different numbers of times (a protocol bug).
    """
    results: List[Any] = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        stepped, done = [], []
        for r in live:
            try:
                next(gens[r])
                stepped.append(r)
            except StopIteration as stop:
                results[r] = stop.value
                done.append(r)
            except Exception as e:  # noqa: BLE001 - returned to the caller per rank
                results[r] = e
                done.append(r)
        if stepped and done and any(not isinstance(results[r], Exception) for r in done):
            raise AssertionError(f"ranks {stepped} wait at a barrier that ranks {done} skipped")
        live = stepped
    return results


class VirtualGroup:
    """``R`` Buffers of one simulated group on CPU.

    Args:
        num_ranks: ``R``.
        num_nvl_bytes: each rank's buffer size in bytes.
        device: where the buffers live (``"cpu"``, or ``"cuda"`` to run compiled kernels in one process).

    Use :meth:`call` to run one collective method on all ranks: ``call("dispatch", [kwargs_0, ...])``, or
    :func:`steps` and :func:`lockstep` to run different calls on different ranks.
    """

    def __init__(self, num_ranks: int, num_nvl_bytes: int, device: str = "cpu") -> None:
        self.world = LocalWorld(num_ranks, num_nvl_bytes, device=device)
        self.buffers = [Buffer(self.world.comm(r), num_nvl_bytes) for r in range(num_ranks)]

    def call(self, method: str, per_rank_kwargs: Sequence[dict]) -> List[Any]:
        """Run ``Buffer.<method>`` (``dispatch`` or ``combine``) on every rank in lock step; returns per rank
        the result tuple or the exception raised."""
        return lockstep([steps(buf, method, **kw) for buf, kw in zip(self.buffers, per_rank_kwargs)])


def steps(buf: Buffer, method: str, **kwargs) -> Generator:
    """The step generator of ``buf.<method>(**kwargs)`` (``method``: ``"dispatch"`` or ``"combine"``), with
    the method's own arguments and defaults, for :func:`lockstep`: the very steps the method runs.

    Raises:
        ValueError: another method name.
    """
    mode = buf._modes.intranode
    fns = {"dispatch": mode.dispatch_steps, "combine": mode.combine_steps}
    if method not in fns:
        raise ValueError(f"steps() takes 'dispatch' or 'combine', got {method!r}")
    return fns[method](**kwargs)


def host_waits(buf: Buffer) -> dict:
    """How often ``buf`` has waited on the host so far: ``{"meet": n, "poll": n}`` (rendezvous with the other
    ranks, the re-synchronisation after an error; polls of a plain dispatch's counts). A copy."""
    return dict(buf._rt.host_waits)


def break_rdma_qp(buf: Buffer, peer_host: int, qp: int) -> None:
    """Test hook (internode mode): move this rank's QP ``qp`` towards its RDMA peer on host ``peer_host`` into
    the error state (verbs ``IBV_QPS_ERR``), as a failing link would; the work requests posted on it next
    complete with a flush error.

    Raises:
        ValueError: the Buffer's ranks are on one host (no QPs).
    """
    mode = buf._modes.internode
    if mode is None:
        raise ValueError("break_rdma_qp needs a Buffer whose ranks span several hosts")
    t = mode.transport
    if hasattr(t, "test_hook"):     # the proxy in a process of its own (TRITON_EP_PROXY=process) holds the QPs
        return t.test_hook("break_qp", peer_host, qp)
    t.qps[(peer_host, qp)].qp.modify(t.api.QPAttr(qp_state=t.e.IBV_QPS_ERR), 0)


def drop_rdma_signal(buf: Buffer, peer_host: int, nth: int = 0) -> None:
    """Test hook (internode mode): this rank's proxy leaves out the signal (the WRITE_WITH_IMM) of its
    ``nth`` chunk (counting from 0, from now on) towards its RDMA peer on host ``peer_host``, as a lost
    message would: the chunk's data lands but the peer never learns it arrived.

    Raises:
        ValueError: the Buffer's ranks are on one host (no RDMA scheduler).
    """
    mode = buf._modes.internode
    if mode is None:
        raise ValueError("drop_rdma_signal needs a Buffer whose ranks span several hosts")
    sched = mode.sched
    mode.capture.sync_host_path()   # after capture-path calls, the chunk numbers are the ring counters'
    first = sched._next_tx[peer_host]
    if hasattr(sched, "test_hook"):     # the proxy in a process of its own builds the work requests
        return sched.test_hook("drop_signal", peer_host, first + nth)
    chunk_ops = sched._chunk_ops

    def without_signal(peer, qp, seq, nbytes, signaled):
        ops = chunk_ops(peer, qp, seq, nbytes, signaled)
        return ops[:-1] if peer == peer_host and seq == first + nth else ops

    sched._chunk_ops = without_signal


#: The start method :func:`run_ranks` uses when its caller names none: ``"spawn"`` (a fresh interpreter per
#: rank) or ``"forkserver"`` (see :func:`start_forkserver`; CPU machines only, ``"spawn"`` where CUDA is present).
START_METHOD = "spawn"
#: The modules a forkserver imports once, before it forks any rank.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "numpy", "triton_ep")


def start_forkserver(modules: Sequence[str] = ()) -> bool:
    """Start multiprocessing's fork server with :data:`FORKSERVER_PRELOAD` and ``modules`` imported in it, so
    each rank :func:`run_ranks` starts with ``start_method="forkserver"`` is a fork of a process that has
    imported torch and triton_ep already (on a 2-core CPU machine that import costs about 4 s of CPU per
    rank with ``"spawn"``). ``modules``: more module names, importable from this process's ``sys.path`` (the
    modules the rank functions live in); one that fails to import is skipped silently (the ranks import it
    themselves). Where CUDA is present nothing starts and the result is False (a process forked after CUDA
    initialised cannot use it); else True. The server lives until this process exits; it starts once (later
    calls add no modules), with this process's environment and standard streams as they are then."""
    import multiprocessing.forkserver as forkserver
    import os
    import sys

    import torch
    if torch.cuda.is_available():
        return False
    forkserver.set_forkserver_preload(list(dict.fromkeys([*FORKSERVER_PRELOAD, *modules])))
    # the server imports from this sys.path (Python before 3.12 does not hand it over: PYTHONPATH does)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return True


#: set by :func:`exit_after_return` in a rank process of :func:`run_ranks`
_exit_after_return = False


def exit_after_return() -> None:
    """In a rank of :func:`run_ranks`: once its function returned and its result is written, the process ends at once
    (``os._exit(0)``), without tearing down the process group: for a rank whose group's store no longer answers
    (its server's process died while another process holds its sockets), where that teardown would wait for it.
    Call it only once every Buffer of the process is destroyed."""
    global _exit_after_return
    _exit_after_return = True


def _rank_main(_index: int, rank: int, fn, world: int, init_file: str, out_dir: str, backend: str, args: tuple,
               parent_pid: Optional[int], env: Optional[dict] = None) -> None:
    # (``_index``: torch's process index, 0: :func:`run_ranks` starts each rank by a call of its own)
    import os
    import pickle
    import traceback

    import torch.distributed as dist

    from triton_ep.runtime import exit_with_parent
    # the caller (or, forked, the fork server, which ends with the caller) killed, SIGKILL included, now or while
    # this process imported torch: end now, not when a wait for peers that also stop answering times out (torch's
    # parent-death SIGINT is set after the imports, is handled only between bytecodes, is caught by the except
    # below, and does nothing where SIGINT is ignored, as in a background job of a script)
    exit_with_parent(parent_pid)
    if env is not None:
        # a fork server's child: the caller's environment at the call (not the server's), set before the rank
        # function and its arguments are unpickled (``fn``: their pickle), so modules they import read it
        os.environ.clear()
        os.environ.update(env)
        fn, args = pickle.loads(fn)
        # the server's liveness pipe, inherited: closed, so that the server exits when its parent (the caller)
        # dies, and torch's parent-death signal then ends this rank too
        from multiprocessing import forkserver
        server = getattr(forkserver, "_forkserver", None)
        fd = getattr(server, "_forkserver_alive_fd", None)
        if isinstance(fd, int):
            try:
                os.close(fd)
            except OSError:
                pass
            server._forkserver_alive_fd = None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # one intra-op thread per rank unless OMP_NUM_THREADS says otherwise, as torchrun gives each of several ranks
    # of a host: a rank's CPU work shares the cores with its peers (and with other test workers); a pool per rank
    # oversubscribed them (a 128 x 7168 CPU oracle took 15 s instead of 0.06 on a 16-core GPU machine under six
    # pytest-xdist workers). Set here, not left to torch: a forked rank keeps the count its fork server started with
    import torch
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    result = None
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("err", (type(e).__name__, str(e), traceback.format_exc(), e if _picklable(e) else None))
    finally:
        with open(os.path.join(out_dir, f"r{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if _exit_after_return:
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _picklable(obj) -> bool:
    import pickle
    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:  # noqa: BLE001
        return False


def _start_method(start_method: Optional[str]) -> Tuple[str, Optional[int]]:
    """``run_ranks``' start method (``None``: :data:`START_METHOD`; ``"forkserver"`` falls back to ``"spawn"`` where
    no fork server starts) and the process each rank watches as its parent (the fork server's, when forked).
    Raises ``ValueError`` for a method other than ``"spawn"`` and ``"forkserver"``."""
    import os
    method = START_METHOD if start_method is None else start_method
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {method!r}")
    if method == "forkserver" and not start_forkserver():
        method = "spawn"
    parent_pid: Optional[int] = os.getpid()     # whom each rank watches (its parent)
    if method == "forkserver":
        from multiprocessing import forkserver
        parent_pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return method, parent_pid


def run_ranks(fn, world: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
              start_method: Optional[str] = None) -> List[Any]:
    """Start ``world`` processes, bootstrap a ``torch.distributed`` group over a file rendezvous and call
    ``fn(rank, world, *args)`` in each (``fn`` must be importable: defined at module level; a script that calls
    this keeps the call under ``if __name__ == "__main__":``, since each rank imports the script's module again
    and would otherwise start ranks of its own, then die: a :class:`RankFailure`). The processes
    start by ``start_method`` (default :data:`START_METHOD`, which is ``"spawn"``): ``"spawn"`` (a fresh interpreter
    per rank), or ``"forkserver"`` on a machine without CUDA (forks of :func:`start_forkserver`'s server, started
    here if it is not running; each rank gets this process's environment as it is at the call, before ``fn`` and
    ``args`` are unpickled there, but modules the server imported keep what they read from the environment at
    import, e.g. ``TRITON_EP_PDL``: a rank that needs such a variable changed is spawned; its standard streams are
    the server's). Where CUDA is present ``"forkserver"`` means ``"spawn"``. A rank ends within about 0.1 s once
    this process is gone, SIGKILL included (:func:`triton_ep.transport.parent.exit_with_parent`; forked, once the
    fork server is, which ends with this process). Each rank runs torch's CPU operators on ``OMP_NUM_THREADS``
    threads (a positive integer), else on one (as torchrun does for several ranks of a host), whatever the start
    method.

    Every path out of it, a timeout or a rank that could not start included, first ends the ranks it started (killed
    where still running), waits for them and releases what their process objects hold (the pipes their start made),
    so nothing of them outlives the call, even while the caller keeps its exception.

    Returns:
        per rank, ``fn``'s return value, or a :class:`RankFailure` describing its exception.

    Raises:
        TimeoutError: the ranks did not all finish within ``timeout_s`` seconds (they are killed).
        OSError and others: a rank could not be started (those started are killed).
    """
    import os
    import pickle
    import tempfile
    import time

    import torch.multiprocessing as mp
    method, parent_pid = _start_method(start_method)
    env = None
    if method == "forkserver":      # (_rank_main unpickles fn and args after it set env)
        env, fn, args = dict(os.environ), pickle.dumps((fn, args)), ()
    with tempfile.TemporaryDirectory(prefix="triton_ep_ranks_") as d:
        procs: list = []
        try:
            for r in range(world):      # (one at a time: where a start fails, those before it are in procs)
                procs += mp.start_processes(_rank_main, args=(r, fn, world, os.path.join(d, "init"), d, backend, args,
                                                              parent_pid, env),
                                            nprocs=1, join=False, start_method=method).processes
            deadline = time.monotonic() + timeout_s
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s")
                time.sleep(0.05)
        finally:
            codes = _end(procs)
        out = []
        for r in range(world):
            path = os.path.join(d, f"r{r}.pkl")
            if not os.path.exists(path):
                out.append(RankFailure("ProcessDied", f"rank {r} exited with code {codes[r]}", "", None))
                continue
            with open(path, "rb") as f:
                kind, val = pickle.load(f)
            out.append(val if kind == "ok" else RankFailure(*val))
        return out


def _end(procs: list) -> List[Optional[int]]:
    """End :func:`run_ranks`' rank processes ``procs`` (``multiprocessing`` processes, started): each still running
    is killed, each is waited for, then closed (``Process.close``: the pipes its start made are closed now, not when
    the object is collected, which a caller's exception that holds ``run_ranks``' frame would put off). Returns their
    exit codes, in order."""
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
        codes.append(p.exitcode)
        p.close()
    return codes


class RankFailure:
    """What a rank of :func:`run_ranks` raised: ``type_name``, ``message``, ``traceback`` and, when it
    could be pickled, the ``exception`` itself."""

    def __init__(self, type_name: str, message: str, tb: str, exception) -> None:
        self.type_name, self.message, self.traceback, self.exception = type_name, message, tb, exception

    def __repr__(self) -> str:
        return f"RankFailure({self.type_name}: {self.message})"


@dataclasses.dataclass
class Allocation:
    """One storage allocated while a :class:`LiveBytes` was active."""
    nbytes: int                     # bytes of its storage
    op: str                         # the aten op that made it (e.g. ``aten.index_select.default``)
    site: str                       # where: the innermost frames in triton_ep (``file:line function``, callee first)


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages allocated while it is active (``with LiveBytes() as m: ...``), and their
    peak: what a call adds to a process's memory at its worst. On a GPU, PyTorch's caching allocator keeps a
    process's peak, so this peak is what a call costs there; it is measured here on any device, CPU included.

    Every aten op's output tensors are looked at (a :class:`~torch.utils._python_dispatch.TorchDispatchMode`); a
    storage that is none of the op's inputs' (tensors' or storages') and not seen before is new and counts its
    ``nbytes`` once (views, in-place and ``out=`` ops count nothing; a storage of the block resized counts its new
    size), until Python frees it (``weakref.finalize`` on its storage object, which PyTorch keeps while any
    tensor or view holds the storage). Only this thread's ops count (dispatch modes are thread-local); memory an
    op takes and frees inside itself (a sort's workspace) is not seen, nor memory made outside aten (numpy,
    ``torch.from_numpy``, pinned host rings).

    Args:
        collect: collect garbage held in reference cycles (``gc.collect()``) after each launch of Triton's
            interpreter (``TRITON_INTERPRET=1``), which keeps each launch's arguments in reference cycles until the
            collector runs (compiled kernels do not); cycles of the measured code itself still count.
        depth: the frames of the triton_ep package each :class:`Allocation` names.

    Attributes (bytes):
        now: live now. peak: the most live at once. peak_live: the :class:`Allocation` s live at the peak, largest
        first. allocations: every allocation made, in order. ``freed_all`` after the block: whether every storage it
        allocated is gone.
    """

    def __init__(self, collect: bool = True, depth: int = 2) -> None:
        super().__init__()
        self.collect, self.depth = collect, depth
        self.now = self.peak = 0
        self.live: dict = {}        # id(storage object) -> Allocation
        self.peak_live: List[Allocation] = []
        self.allocations: List[Allocation] = []
        self._undo = None

    def __enter__(self):
        self._undo = _collect_after_launches() if self.collect else None
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._undo is not None:
                self._undo()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) if isinstance(t, torch.Tensor) else id(t)
                  for t in tree_leaves((args, kwargs)) if isinstance(t, (torch.Tensor, torch.UntypedStorage))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t.untyped_storage(), inputs, func)
        return out

    def _note(self, st, inputs: set, func) -> None:
        key, n = id(st), st.nbytes()
        if key in self.live:            # (a storage of this block resized in place: resize_, out=)
            self.now += n - self.live[key].nbytes
            self.live[key].nbytes = n
        elif key in inputs:
            return
        else:
            a = Allocation(n, str(func), _site(self.depth))
            self.live[key] = a
            self.allocations.append(a)
            self.now += n
            weakref.finalize(st, self._freed, key)
        if self.now > self.peak:
            self.peak = self.now
            self.peak_live = sorted(self.live.values(), key=lambda a: -a.nbytes)

    def _freed(self, key: int) -> None:
        a = self.live.pop(key, None)
        if a is not None:
            self.now -= a.nbytes

    @property
    def freed_all(self) -> bool:
        return not self.live

    def largest(self, n: int = 8) -> List[Allocation]:
        """The ``n`` largest allocations made (their sizes as last seen), largest first."""
        return sorted(self.allocations, key=lambda a: -a.nbytes)[:n]


def _collect_after_launches():
    """Make every launch of Triton's interpreter collect reference cycles as it returns (the interpreter keeps its
    arguments' storages in cycles). Returns the undo (None where Triton's interpreter cannot be imported)."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return None
    call = GridExecutor.__call__

    def collected(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        finally:
            gc.collect()
    GridExecutor.__call__ = collected

    def undo():
        GridExecutor.__call__ = call
    return undo


def _site(depth: int) -> str:
    """The innermost ``depth`` frames of the caller in the triton_ep package (this module and torch left out), as
    ``file:line function`` joined by ``' <- '``; else the innermost frame outside torch and this module."""
    here = os.path.dirname(os.path.abspath(__file__))
    me = os.path.abspath(__file__)
    f, got, outside = sys._getframe(1), [], None
    while f is not None and len(got) < depth:
        path = os.path.abspath(f.f_code.co_filename)
        if path != me and f"{os.sep}torch{os.sep}" not in path:
            where = f"{os.path.relpath(path, os.path.dirname(here))}:{f.f_lineno} {f.f_code.co_name}"
            if path.startswith(here + os.sep):
                got.append(where)
            elif outside is None:
                outside = where
        f = f.f_back
    return " <- ".join(got) if got else (outside or "?")
