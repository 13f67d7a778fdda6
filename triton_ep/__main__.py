"""Command line of triton-ep: ``triton-ep info`` (or ``python -m triton_ep info``), the first diagnostic to run.

    triton-ep info                                # this host: versions, devices, same-host IPC, RDMA
    triton-ep info --emulated                     # RDMA part for a model host: one dual-port mlx5 NIC, 4 paths
    triton-ep info --devices mlx5_0,mlx5_1        # only these RDMA devices
    triton-ep info --num-qps 8 --n-paths 4 --hash crc
    triton-ep info --traffic-class 106 --service-level 3   # the QoS line, as VerbsTransport would set it
    python -m triton_ep info                      # the same without the console script
    triton-ep tune                                # time Configs at DeepSeek-V3 shapes (no GPU: --quick's), save them
    triton-ep tune --quick --output /tmp/t.json   # tiny shapes, two candidates (also on CPU: 16-30 s seen)

The report has seven sections: the versions of triton-ep, Python, torch, triton, numpy and pyverbs; the
deep_ep switch (TRITON_EP_AS_DEEP_EP, the import hook, which deep_ep an import gets); the devices, and whether
Triton kernels are compiled for the GPU or interpreted on the CPU; the tuned table (its file, what it is checked
against, and whether it is absent, used with how many entries, or not used and why); how ranks on this host reach each other's
buffers (the GPU peer-access matrix, and the POSIX shared memory in /dev/shm that CPU ranks, and every rank's
control block, live in); the internode plan (how ranks group into hosts, the transport between them); and the
RDMA devices, ports and GIDs with the QP plan.

Every option shows its effect in the report, or a line ``  OPTION VALUE: not applied: WHY`` at the end of the RDMA
section says why it has none on this host (RDMA absent, the query failed, no active port, a port with no GID).

The QP plan has as many QPs per peer as a Buffer's normal-mode network leg opens (``TRITON_EP_RDMA_QPS_PER_PEER``,
default 4) unless --num-qps says otherwise; low-latency mode across hosts opens ``num_qps_per_rank`` per peer.
The plan's flows are computed towards a peer laid out like this host (its GIDs stand in for the peer's), with
the chosen path-hash model; on a real fabric the switch's hash decides, so treat the path column as a model.

``tune`` (docs/tuning.md) times a cached dispatch and a combine for the built-in tables and candidate Configs in
rank processes, prints built-in against tuned microseconds per call and shape, and saves the fastest Configs where
``Buffer.get_dispatch_config`` / ``get_combine_config`` read them ($TRITON_EP_TUNING_FILE, else
$XDG_CACHE_HOME/triton_ep/tuning.json: every later Buffer of this user), the file there first copied to NAME.bak;
its last line says which file it wrote, who reads it and how to undo that. It exits 0 when saved; 1 when a rank
failed, the ranks ran past --timeout-s or another save held the table's lock too long; 130 on Ctrl-C (nothing
saved, one line on stderr); 2 on bad usage: a bad option, options that do not go together (--hidden a multiple of
8 and at most 2^30 - 1, --ranks x --tokens at most 2^31 - 1 and tensors that fit this host's and a GPU's memory,
--num-experts a multiple of --ranks, --num-topk at most --num-experts, a buffer that holds a row), or an --output
that is empty, a symbolic link (never written through), not a regular file, read-only, in a directory that is
absent or takes no file, or an existing file that is not a triton-ep tuned table without --force (the message
names the path and the reason) -- all found before any measuring.

Exit status:
  0  the report was printed, RDMA present or absent (absent: pyverbs does not import, or there is no
     RDMA device, --devices given or not; the RDMA section says which), or present with no active port
     (then no QP plan)
  1  an RDMA device exists but a query of it failed (open, port or GID query), or a device named by
     --devices is not there while others are; the other sections are printed, the error goes to stderr;
     or stdout could not be written (a full disk: > /dev/full), one line on stderr says so
  2  bad usage: unknown command or option, or a bad option value, or a bad TRITON_EP_RDMA_TC /
     TRITON_EP_RDMA_SL value, or options for which no QP plan exists
  141  stdout's reader went away (triton-ep info | head -1), as for a command ended by SIGPIPE; nothing
     more is printed
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import List, Optional, Sequence, TextIO, Tuple

from triton_ep import tuned, tuner
from triton_ep.argtypes import int_in, name_list
from triton_ep.runtime.machine import DEFAULT_N_PATHS, EXIT_OK, EXIT_USAGE, print_ipc, print_rdma

#: the exit status of a command whose stdout's reader went away (``triton-ep info | head -1``): what a shell shows
#: for a command ended by SIGPIPE (128 + 13), as other command-line tools end there
EXIT_BROKEN_PIPE = 141
#: the exit status of a command whose stdout could not be written otherwise (``> /dev/full``)
EXIT_WRITE_FAILED = 1

#: ``--num-qps`` and ``--n-paths`` upper bounds: a plan this large prints a row per QP and takes seconds; beyond
#: some thousands of QPs the RoCEv2 source ports (14 bits) run out and no plan exists
MAX_NUM_QPS, MAX_N_PATHS = 1024, 256


class _Command(argparse.ArgumentParser):
    """The parser of one subcommand (``info``, ``tune``): an argument it does not know is its own usage error,
    printed with its usage (argparse hands a subcommand's unknown arguments back to the top-level parser, whose
    error shows ``triton-ep [-h] COMMAND ...`` instead)."""

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, with what is left over refused here (exit 2, this subcommand's usage on stderr)."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``triton-ep`` command and its ``info`` subcommand.

    Returns:
        An :class:`argparse.ArgumentParser`; its ``command`` attribute is ``"info"``, ``"tune"`` or None (no command).
    """
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="triton-ep", description=__doc__.strip(), formatter_class=fmt)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Command)
    exits = __doc__[__doc__.index("Exit status:"):].strip()
    ip = sub.add_parser("info", help="versions, devices, same-host IPC, RDMA devices and the QP plan",
                        description="Print versions, devices, same-host IPC reachability, RDMA devices, "
                                    "ports, GIDs and the QP plan.", epilog=exits, formatter_class=fmt)
    ip.add_argument("--emulated", action="store_true", help="describe an emulated dual-port NIC instead of RDMA")
    ip.add_argument("--num-qps", type=int_in(1, MAX_NUM_QPS), default=None,
                    help=f"QPs per peer, 1..{MAX_NUM_QPS} (default: what a Buffer's normal-mode network leg opens, "
                         "$TRITON_EP_RDMA_QPS_PER_PEER, else 4)")
    ip.add_argument("--n-paths", type=int_in(1, MAX_N_PATHS), default=None,
                    help=f"ECMP paths of the fabric model, 1..{MAX_N_PATHS} (default {DEFAULT_N_PATHS})")
    ip.add_argument("--hash", choices=["crc", "emulator"], default=None,
                    help="path hash model (default: crc on hardware, emulator with --emulated)")
    ip.add_argument("--devices", type=name_list, default=None,
                    help="comma-separated RDMA device names, each once (default: all)")
    ip.add_argument("--traffic-class", type=int_in(0, 255), default=None,
                    help="GRH traffic class to show for every QP, 0..255 (default: $TRITON_EP_RDMA_TC, else 0)")
    ip.add_argument("--service-level", type=int_in(0, 15), default=None,
                    help="service level to show for every QP, 0..15 (default: $TRITON_EP_RDMA_SL, else 0)")
    tp = sub.add_parser("tune", help="time candidate Configs here and save the tuned table the library reads",
                        description=tuner.__doc__.strip(), formatter_class=fmt)
    tuner.add_arguments(tp)
    return ap


def _parse(argv: Sequence[str]):
    """``build_parser().parse_args(argv)``, with argparse's exit turned into a return value (namespace or int)."""
    try:
        return build_parser().parse_args(list(argv))
    except SystemExit as ex:   # --help (0) or bad usage (2); argparse has printed the message
        return EXIT_OK if ex.code in (0, None) else EXIT_USAGE


def _pyverbs_version() -> str:
    try:
        mod = importlib.import_module("pyverbs.device")
    except Exception as ex:   # ImportError, or a .so built for another libibverbs
        return f"not importable ({type(ex).__name__}: {ex})"
    try:
        return importlib.metadata.version("pyverbs")
    except Exception:
        pass
    where = os.path.realpath(os.path.dirname(mod.__file__))
    if where.startswith("/usr/lib/python3/dist-packages/"):
        try:   # Debian's python3-pyverbs, linked in by scripts/install_pyverbs.sh: no Python metadata
            v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-pyverbs"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
            if v:
                return f"{v} (Debian python3-pyverbs, {where})"
        except (OSError, subprocess.SubprocessError):
            pass
    return f"version unknown ({where})"


def print_versions(out: TextIO) -> None:
    """Print the versions of triton-ep, Python, torch, triton, numpy and pyverbs (pyverbs may be absent).

    Args:
        out: the stream written to.
    """
    import numpy
    import torch
    import triton
    import triton_ep
    rows = [("triton-ep", f"{triton_ep.__version__} ({os.path.dirname(triton_ep.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", torch.__version__), ("triton", triton.__version__), ("numpy", numpy.__version__),
            ("pyverbs", _pyverbs_version())]
    print("Versions:", file=out)
    for k, v in rows:
        print(f"  {k:<10} {v}", file=out)


def print_devices(out: TextIO) -> int:
    """Print the compute devices and whether triton-ep's Triton kernels are compiled or interpreted.

    Kernels are interpreted (Triton's interpreter on CPU tensors) when ``TRITON_INTERPRET`` is on (1, as
    :mod:`triton_ep.triton_mode` sets it itself when no CUDA device exists); a value that is neither on nor off
    gets a line of its own (a Buffer refuses it).

    Args:
        out: the stream written to.
    Returns:
        The number of CUDA devices (0 on a CPU-only host).
    """
    import torch
    from triton_ep.triton_mode import interpreted, problem
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print("Devices:", file=out)
    print(f"  cpu       {os.cpu_count()} cores ({platform.machine()})", file=out)
    if n == 0:
        why = "a CPU build of torch" if torch.version.cuda is None else f"torch for CUDA {torch.version.cuda}"
        print(f"  cuda      none ({why}, torch.cuda.is_available() is False)", file=out)
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i:<5}{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB", file=out)
    bad = problem()
    if bad is not None:
        print(f"  kernels   none: {bad} (a Buffer raises ValueError)", file=out)
    elif interpreted():
        why = "no CUDA device" if n == 0 else "set in the environment although CUDA is present"
        print(f"  kernels   interpreted: Triton's interpreter on CPU tensors (TRITON_INTERPRET="
              f"{os.environ.get('TRITON_INTERPRET')}: {why})", file=out)
    elif n:
        print("  kernels   compiled: Triton JIT-compiles each kernel for the GPU at its first call", file=out)
    else:
        print(f"  kernels   neither: no CUDA device and TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} "
              f"(off), so kernels cannot run", file=out)
    return n


def print_tuned(out: TextIO) -> None:
    """The tuned table (docs/tuning.md) that ``Buffer.get_dispatch_config`` / ``get_combine_config`` would read here:
    its path and where that comes from, what it is checked against (this process's GPU name, ``"cpu"`` without
    one, and its Triton and triton-ep versions), and whether it is absent, used (its entries counted) or not used
    (the loader's reason: :func:`triton_ep.tuned.examine`, the loader's own checks, which never block on a FIFO and
    read at most ``tuned.MAX_TABLE_BYTES``).

    Args:
        out: the stream written to.
    """
    v, here = tuned.examine(), tuned.identity()
    print("Tuned table (get_dispatch_config / get_combine_config, docs/tuning.md):", file=out)
    print(f"  file       {v.path} (from {tuned.path_source()})", file=out)
    gpu = repr(here["gpu"]) + (" (no CUDA device here; a rank on a GPU checks torch.cuda.get_device_name())"
                               if here["gpu"] == "cpu" else "")
    print(f"  checked    against gpu {gpu}, triton {here['triton']!r}, triton-ep {here['triton_ep']!r}", file=out)
    if not v.exists:
        state = "absent: the built-in tables apply (`python -m triton_ep tune` writes it)"
    elif v.table is None:
        state = f"present, not used: {v.why}; {tuned.fallback(v.path)}"
    else:
        es = v.table.entries
        calls = ", ".join(f"{c} {sum(e.call == c for e in es)}" for c in tuned.CALLS)
        ranks = ", ".join(str(r) for r in sorted({e.num_ranks for e in es})) or "no"
        state = f"present, used: {len(es)} entries ({calls}) for {ranks} ranks"
    print(f"  state      {state}", file=out)


def buffer_qps_per_peer(env=None) -> Tuple[int, str]:
    """The RC QPs per peer a Buffer's normal-mode network leg opens (``triton_ep.modes.internode.network_shape``,
    the one source of that number: ``TRITON_EP_RDMA_QPS_PER_PEER``, else its default), and where it came from.
    A bad value of the variable gives the default (the internode section of the report names the error)."""
    from triton_ep.modes import internode as I
    env = os.environ if env is None else env
    try:
        qps = I.network_shape(env)[0]
    except ValueError:
        return I.DEFAULT_QPS_PER_PEER, f"a Buffer's normal-mode default; {I.ENV_QPS} is bad"
    if env.get(I.ENV_QPS, "").strip():
        return qps, f"{I.ENV_QPS}, as a Buffer's normal-mode network leg"
    return qps, "as a Buffer's normal-mode network leg"


def info(argv: Optional[List[str]] = None, out: Optional[TextIO] = None) -> int:
    """Run ``triton-ep info``: versions, devices, same-host IPC, the internode plan, then the RDMA table and
    the QP plan.

    Args:
        argv: the options after ``info`` (default none).
        out: the stream the report goes to (default stdout); errors go to stderr.
    Returns:
        The exit status: 0 report printed (RDMA present or absent), 1 an RDMA device exists but a query of
        it failed (or ``--devices`` names one that is not there), 2 bad usage.
    """
    a = _parse(["info", *(argv or [])])
    return a if isinstance(a, int) else _report(a, out or sys.stdout)


def _hosts_line(value: Optional[str]) -> str:
    """How a Buffer would group ranks into hosts with ``TRITON_EP_RANKS_PER_HOST`` = ``value`` (``None``: unset),
    or the Buffer's error for a value it refuses (any group size: one that is not a positive integer)."""
    from triton_ep.runtime import hosts as H
    if value is None or not value.strip():
        return f"by host identity (hostname and boot id); {H.ENV_RANKS_PER_HOST}=n overrides it"
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        return (f"{H.ENV_RANKS_PER_HOST}={value!r} must be a positive integer dividing the group size "
                f"(a Buffer refuses it)")
    return (f"{H.ENV_RANKS_PER_HOST}={n}: ranks [0, {n}), [{n}, {2 * n}), ... form hosts (a Buffer refuses a group "
            f"size that is not a multiple of {n})")


def print_internode(out: TextIO, env=None) -> None:
    """The plan a Buffer would use across hosts from this machine: how ranks are grouped into hosts, and the
    transport between hosts it would choose (docs/internode.md)."""
    from triton_ep.modes import internode as I
    from triton_ep.runtime import hosts as H
    env = os.environ if env is None else env
    print("Internode (a Buffer whose ranks span several hosts, docs/internode.md):", file=out)
    print(f"  hosts      {_hosts_line(env.get(H.ENV_RANKS_PER_HOST))}", file=out)
    try:
        raw = env.get(I.ENV_PROXY, "")
        kind = I.proxy_kind(raw)
        print(f"  proxy      {kind} ({I.ENV_PROXY}={raw!r}): the RDMA proxy runs as " +
              ("a process of its own per rank and network leg (two a rank with low_latency_mode across hosts), off "
               "the rank's GIL" if kind == "process" else "a thread of the rank's process"), file=out)
    except ValueError as ex:
        print(f"  proxy      {ex}", file=out)
    try:
        backend = H.rdma_backend_arg(None, env)
    except ValueError as ex:
        print(f"  transport  {ex}", file=out)
        return
    two = H.group_hosts(["a", "b"])
    try:
        chosen = H.choose_transport(backend, two)
        qps, slots, chunk = I.network_shape(env)
        print(f"  transport  rdma_backend {backend!r} ({H.ENV_RDMA}={env.get(H.ENV_RDMA, '')!r}): {chosen}, "
              f"{qps} RC QPs per peer over the NIC's ports, {slots} ring slots of {chunk >> 10} KiB per peer "
              f"({I.ENV_QPS}, {I.ENV_SLOTS}, {I.ENV_CHUNK}); records packed into the rings by kernels", file=out)
    except ValueError as ex:
        if "TRITON_EP_RDMA_" in str(ex):
            print(f"  transport  {ex}", file=out)
            return
        print(f"  transport  rdma_backend {backend!r}: none here (no usable RDMA device); set "
              f"{H.ENV_RDMA}=emulated or Buffer(..., rdma_backend='emulated') to use the emulated fabric", file=out)


def print_deep_ep(out: TextIO) -> None:
    """The ``deep_ep`` switch (``TRITON_EP_AS_DEEP_EP``, docs/engines.md): whether the import hook is installed and
    which ``deep_ep`` an ``import deep_ep`` gets here, triton-ep or a real DeepEP (it shadows one with the switch
    on)."""
    hook = importlib.import_module("triton_ep.deep_ep_hook")   # the module the .pth loaded, if it did
    print("deep_ep (serving engines' import, docs/engines.md):", file=out)
    for line in hook.describe():
        print(line, file=out)


def _report(a: argparse.Namespace, out: TextIO) -> int:
    print_versions(out)
    print(file=out)
    print_deep_ep(out)
    print(file=out)
    n_gpus = print_devices(out)
    print(file=out)
    print_tuned(out)
    print(file=out)
    print_ipc(out, n_gpus)
    print(file=out)
    print_internode(out)
    print(file=out)
    return print_rdma(a, out, buffer_qps_per_peer)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m triton_ep`` and of the ``triton-ep`` console script.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
    Returns:
        The exit status: no command or ``--help`` 0 (the help is printed); otherwise the command's
        (``info``: 0, 1 or 2, see :func:`info`; ``tune``: :func:`triton_ep.tuner.main`'s, 0 saved, 1 a rank failed
        or timed out, 130 Ctrl-C); 2 for an unknown command or option; :data:`EXIT_BROKEN_PIPE` (nothing printed)
        when stdout's reader went away, :data:`EXIT_WRITE_FAILED` (one line on stderr) when stdout could not be
        written otherwise.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parse(argv)
    if isinstance(a, int):
        return a
    if a.command is None:
        build_parser().print_help()
        return EXIT_OK
    out = _Stdout(sys.stdout)
    try:
        rc = tuner.main(a, out) if a.command == "tune" else _report(a, out)
        out.flush()     # (what is still buffered fails here, not as Python exits)
        return rc
    except OSError as ex:
        if ex is not out.error:
            raise
    _stdout_to_devnull()
    if isinstance(out.error, BrokenPipeError):
        return EXIT_BROKEN_PIPE
    print(f"triton-ep {a.command}: error: cannot write to stdout: {out.error}", file=sys.stderr)
    return EXIT_WRITE_FAILED


class _Stdout:
    """The stream a command prints to (``sys.stdout``), remembering the error of a write or flush of it that failed
    (its reader went away: ``triton-ep info | head -1``; a full disk: ``> /dev/full``), so that :func:`main` ends
    such a run quietly, without taking another ``OSError`` for one of stdout."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.error = stream, None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as ex:
            self.error = ex
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as ex:
            self.error = ex
            raise


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at /dev/null once a write to stdout has failed: what is still buffered then goes
    nowhere as Python exits, instead of failing again there with "Exception ignored ..." (Python's own recipe for
    SIGPIPE, docs.python.org's signal page). Nothing is done where stdout has no descriptor (a test's capture)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
