"""Start the ranks of an example: under torchrun as they are, else as local processes.

``run(main, nranks, timeout_s)`` calls ``main()`` once per rank, with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set in the environment, so
``main`` can always call ``torch.distributed.init_process_group(init_method="env://")``:

- when the environment already names a rank (``torchrun``, ``srun`` wrappers, ...) this process is
  that rank and ``main()`` runs here;
- otherwise ``nranks`` processes are spawned (``spawn``, never ``fork``: CUDA and Triton must start
  fresh) with a TCP rendezvous on 127.0.0.1 at a free port.

A rank that raises or exits nonzero stops the others (torch.multiprocessing terminates them), and a
run that exceeds ``timeout_s`` is terminated; either way ``run`` returns a nonzero exit status, so a
failure never hangs the caller. Ranks other than 0 write their ``print`` output to stderr, so rank 0
alone owns stdout.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from typing import Callable

import torch.multiprocessing as mp

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_externally() -> bool:
    """True when the environment already describes this process's rank (e.g. torchrun)."""
    return all(k in os.environ for k in _ENV)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, nranks: int, port: int, main: Callable[[], int | None]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = _run_here(main)
    # Leave without the interpreter's finalisation: there, torch's gloo worker threads can race the teardown
    # and abort a rank whose run succeeded ("terminate called without an active exception", SIGABRT; seen
    # once in bench_ep8's CLI test). Exit handlers (atexit: cleanups of shared memory) still run first.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_here(main: Callable[[], int | None]) -> int:
    if int(os.environ["RANK"]) != 0:
        sys.stdout = sys.stderr
    code = main() or 0
    sys.stdout.flush()
    return code


def run(main: Callable[[], int | None], nranks: int, timeout_s: float) -> int:
    """Run ``main`` on every rank; returns the exit status for this process (0 on success)."""
    if launched_externally():
        return _run_here(main)
    ctx = mp.start_processes(_rank_entry, args=(nranks, _free_port(), main), nprocs=nranks,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                print(f"[launch] ranks still running after {timeout_s:.0f} s: terminating them",
                      file=sys.stderr)
                _stop(ctx.processes)
                return 124
    except mp.ProcessExitedException as e:  # a rank exited nonzero (its own message is on stderr)
        print(f"[launch] {e}", file=sys.stderr)
        return e.exit_code if e.exit_code > 0 else 128 - e.exit_code  # -N: killed by signal N
    except mp.ProcessRaisedException as e:  # a rank raised; e carries its traceback
        print(f"[launch] {e}", file=sys.stderr)
        return 1
    return 0


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
