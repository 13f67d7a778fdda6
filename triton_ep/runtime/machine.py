"""What this machine offers a Buffer, as ``triton-ep info`` prints it (docs/cli.md): how ranks on this host share
buffers (``/dev/shm``, CUDA peer access), and the RDMA devices, ports and GIDs with the QP plan over them, or why
RDMA is absent. The command line (``triton_ep.__main__``) parses the options and reaches the transports through
here."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from typing import Callable, Optional, Sequence, TextIO, Tuple

from ..transport import topology

#: Where ranks on one host put their shared buffers (CPU data buffers, and every rank's control block).
SHM_DIR = "/dev/shm"
#: The exit statuses, as the module docstring and ``--help`` state them.
EXIT_OK, EXIT_RDMA_QUERY_FAILED, EXIT_USAGE = 0, 1, 2
#: ``--n-paths`` when not given (its argparse default is None, so a given value is seen); ``--num-qps`` when not
#: given is what a Buffer uses (the caller's ``default_qps`` of :func:`print_rdma`).
DEFAULT_N_PATHS = 4


def emulated_api():
    """The pyverbs-like API of an emulated host with one dual-port 400 Gb/s NIC (``mlx5_0``) on a fabric of 4 paths:
    what ``triton-ep info --emulated`` describes."""
    from ..transport import emulated as em
    ports = [em.PortSpec(speed_gbps=400), em.PortSpec(speed_gbps=400)]
    return em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", ports)], n_paths=4)).pyverbs()


def shm_state(d: str = SHM_DIR) -> str:
    """Whether ``d`` takes a file (one is created and removed), and its free space."""
    from ..transport.ipc import shm_name
    try:
        prefix = shm_name("info.")   # named like every triton-ep file there ($TRITON_EP_SHM_TAG)
    except ValueError as ex:
        return f"NOT usable: {ex}"
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=prefix):
            pass
        return f"writable, {shutil.disk_usage(d).free / 2**30:.1f} GiB free"
    except OSError as ex:
        return f"NOT writable ({ex.strerror or ex}): triton-ep falls back to {tempfile.gettempdir()}"


def print_ipc(out: TextIO, n_gpus: int, can_access: Optional[Callable[[int, int], bool]] = None) -> None:
    """Print how ranks on this host reach each other's buffers.

    Args:
        out: the stream written to.
        n_gpus: the number of CUDA devices.
        can_access: ``(i, j) -> bool``, may GPU ``i`` access GPU ``j``'s memory (default
            ``torch.cuda.can_device_access_peer``); asked only when ``n_gpus >= 2``.
    """
    print("Same-host IPC:", file=out)
    shm = shm_state()
    if n_gpus == 0:
        print(f"  no GPU: ranks share buffers through POSIX shared memory in {SHM_DIR} ({shm})", file=out)
        return
    print(f"  control blocks (barriers, small exchanges) in {SHM_DIR} ({shm})", file=out)
    if n_gpus == 1:
        print("  one GPU: ranks sharing it map each other's buffers through CUDA IPC; no peer access needed",
              file=out)
        return
    if can_access is None:
        import torch
        can_access = torch.cuda.can_device_access_peer
    t = topology.PlanTable([["from\\to"] + [f"cuda:{j}" for j in range(n_gpus)]])
    for i in range(n_gpus):
        t.rows.append([f"cuda:{i}"] + ["-" if i == j else ("yes" if can_access(i, j) else "NO")
                                       for j in range(n_gpus)])
    print("  CUDA IPC with peer access (torch.cuda.can_device_access_peer); NO: ranks on those two GPUs "
          "cannot share buffers", file=out)
    print("\n".join("  " + line for line in t.render().splitlines()), file=out)


def qos_line(qos) -> str:
    """The report's line on the QoS every QP's address carries (a :class:`verbs.QoS`), naming each value's source
    (``--traffic-class`` / ``--service-level``, ``TRITON_EP_RDMA_TC`` / ``TRITON_EP_RDMA_SL``, or the default)."""
    tc_src = "--traffic-class" if qos.sources[0] == "argument" else qos.sources[0]
    sl_src = "--service-level" if qos.sources[1] == "argument" else qos.sources[1]
    return (f"\nQoS of every QP: traffic class {qos.traffic_class} (DSCP {qos.traffic_class >> 2}, ECN "
            f"{qos.traffic_class & 3}; {tc_src}), service level {qos.service_level} ({sl_src})")


#: The ``info`` options that shape the RDMA section: (attribute, option); the QoS ones also come from a variable.
_RDMA_OPTIONS = (("num_qps", "--num-qps"), ("n_paths", "--n-paths"), ("hash", "--hash"),
                 ("traffic_class", "--traffic-class"), ("service_level", "--service-level"), ("devices", "--devices"))



def _not_applied(a: argparse.Namespace, qos, attrs: Sequence[str], why: str, out: TextIO) -> None:
    """Say, one line each, why the options among ``attrs`` that were given (and the QoS values set by
    ``TRITON_EP_RDMA_TC`` / ``TRITON_EP_RDMA_SL``) have no effect on this report: every option shows its
    effect or this line."""
    from ..transport import verbs
    for attr, flag in _RDMA_OPTIONS:
        if attr not in attrs:
            continue
        value = getattr(a, attr, None)
        value = ",".join(value) if isinstance(value, tuple) else value     # (--devices: names as given)
        if value is not None:
            print(f"  {flag} {value}: not applied: {why}", file=out)
        elif qos is not None and attr in verbs.QOS_ENV and qos.sources[attr == "service_level"] != "default":
            print(f"  {verbs.QOS_ENV[attr][0]}={getattr(qos, attr)}: not applied: {why}", file=out)


def print_rdma(a: argparse.Namespace, out: TextIO, default_qps: Callable[[], Tuple[int, str]]) -> int:
    """Print the RDMA device/port/GID table and the QP plan, or why RDMA is absent.

    Args:
        a: the parsed ``info`` options (``emulated``, ``num_qps``, ``n_paths``, ``hash``, ``devices``,
            ``traffic_class``, ``service_level``).
        out: the stream written to; errors go to stderr.
        default_qps: ``() -> (QPs per peer, where that number comes from)``, what a Buffer opens: the plan's QPs
            without ``--num-qps`` (asked only then).
    Returns:
        The exit status: 0 with RDMA present or absent (``--devices`` given or not), 1 when a device exists but a
        query of it failed or a device named by ``--devices`` is not there while others are, 2 when
        ``TRITON_EP_RDMA_TC`` or ``TRITON_EP_RDMA_SL`` holds a bad value (the message, naming the variable, goes
        to stderr).
    """
    from ..transport import rdma, verbs
    try:
        qos = verbs.QoS.resolve(getattr(a, "traffic_class", None), getattr(a, "service_level", None))
    except ValueError as ex:   # a bad TRITON_EP_RDMA_TC / TRITON_EP_RDMA_SL (the options are checked by argparse)
        print("RDMA: bad QoS setting (the error is on stderr)", file=out)
        print(f"triton-ep info: {ex}", file=sys.stderr)
        return EXIT_USAGE
    try:
        api = emulated_api() if a.emulated else verbs.load_pyverbs()
        devs = verbs.discover(api, list(a.devices) if a.devices else None)
    except rdma.RdmaError as ex:
        every = [attr for attr, _ in _RDMA_OPTIONS]
        # no RDMA at all (pyverbs absent, no device): --devices names none that could be there either
        if isinstance(ex, rdma.RdmaUnavailable) and (not a.devices or ex.device is None):
            print(f"RDMA: absent\n  {ex}", file=out)
            _not_applied(a, qos, every, "RDMA is absent on this machine (use --emulated to see the plan)", out)
            return EXIT_OK
        # a device failed a query, or the devices named by --devices are not there
        print("RDMA: query failed (the error is on stderr)", file=out)
        _not_applied(a, qos, every[:-1], "the RDMA query failed (the error is on stderr)", out)   # (not --devices)
        print(str(ex), file=sys.stderr)
        return EXIT_RDMA_QUERY_FAILED
    print(f"RDMA devices ({api.name}):", file=out)
    print(_device_table(devs).render(), file=out)
    print(qos_line(qos), file=out)
    ports = verbs.ports_of(devs)
    if not ports:
        print("\nno active port: no QP plan", file=out)
        _not_applied(a, None, ("num_qps", "n_paths", "hash"), "no active port, so no QP plan", out)
        return EXIT_OK
    try:
        _print_qp_plan(a, ports, out, default_qps)
    except topology.PlanError as ex:     # (within the bounds of --num-qps / --n-paths a plan exists; defence)
        print("\nQP plan: none for these options (the error is on stderr)", file=out)
        print(f"triton-ep info: no QP plan: {ex}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _device_table(devs) -> "topology.PlanTable":
    """One row per GID of every port of ``devs`` (:func:`triton_ep.transport.verbs.discover`'s devices; a port
    without GIDs: one row of dashes), the GID a QP would use marked ``*``."""
    from ..transport import verbs
    t = topology.PlanTable([["device", "port", "state", "link", "Gb/s", "mtu", "lid", "gid_idx", "gid", "type", "use"]])
    for d in devs:
        for p in d.ports:
            best = p.best_gid()
            rows = p.gids or [verbs.GidInfo(-1, "-", "-")]
            for g in rows:
                t.rows.append([d.name, str(p.port), "ACTIVE" if p.active else "DOWN", p.link_layer,
                               f"{p.speed_gbps:g}", str(128 << p.mtu), str(p.lid), str(g.index), g.gid, g.type,
                               "*" if best is not None and g.index == best.index else ""])
    return t


def _print_qp_plan(a: argparse.Namespace, ports, out: TextIO,
                   default_qps: Callable[[], Tuple[int, str]]) -> None:
    """Print the QP plan per peer over the active ``ports`` (``--num-qps``, else what a Buffer opens), with each
    QP's flow over ``--n-paths`` paths by ``--hash``, or why no flows were planned."""
    num_qps, qps_from = (a.num_qps, "--num-qps") if a.num_qps is not None else default_qps()
    n_paths = a.n_paths if a.n_paths is not None else DEFAULT_N_PATHS
    hash_name = a.hash or ("emulator" if a.emulated else "crc")
    fn = topology.emulator_path_hash if hash_name == "emulator" else topology.crc_path_hash
    plan = topology.plan_peer(num_qps, ports)
    dst = [e.port.gid for e in plan]
    flows = all(g.strip("0:") for g in dst)
    if flows:
        topology.plan_flows(plan, dst, n_paths, fn)
    how = (f"{n_paths} paths, {hash_name} path hash" if flows else
           "no flows planned: a port has no GID to hash (flow label 0, no path)")
    print(f"\nQP plan per peer: {num_qps} QPs over {len(ports)} port(s), {how} "
          f"(QPs: {qps_from}; peer assumed laid out like this host):", file=out)
    print(topology.plan_table(plan).render(), file=out)
    if not flows:
        _not_applied(a, None, ("n_paths", "hash"), "no flows planned (a port has no GID to hash)", out)
