"""Command line: ``python -m triton_ep info`` (or ``triton-ep info``) prints RDMA devices, ports, GIDs and the QP plan.

    python -m triton_ep info                      # this host's devices through pyverbs
    python -m triton_ep info --emulated           # a model host: one dual-port mlx5 NIC, 4 fabric paths
    python -m triton_ep info --num-qps 8 --n-paths 4 --hash crc

The plan's flows are computed towards a peer laid out like this host (its GIDs stand in for the peer's), with
the chosen path-hash model; on a real fabric the switch's hash decides, so treat the path column as a model.
Exit status: 0 on success, 1 when no RDMA device or pyverbs is available (the message says why).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from triton_ep.transport import topology


def _emulated_api():
    from triton_ep.transport import emulated as em
    ports = [em.PortSpec(speed_gbps=400), em.PortSpec(speed_gbps=400)]
    return em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", ports)], n_paths=4)).pyverbs()


def info(argv: Optional[List[str]] = None, out=None) -> int:
    """Print the device/port/GID table and the QP plan; returns the exit status (0 ok, 1 no RDMA)."""
    from triton_ep.transport import rdma, verbs
    ap = argparse.ArgumentParser(prog="triton-ep info", description="RDMA devices, ports, GIDs and the QP plan")
    ap.add_argument("--emulated", action="store_true", help="describe an emulated dual-port NIC instead")
    ap.add_argument("--num-qps", type=int, default=8, help="QPs per peer (default 8)")
    ap.add_argument("--n-paths", type=int, default=4, help="ECMP paths of the fabric model (default 4)")
    ap.add_argument("--hash", choices=["crc", "emulator"], default=None,
                    help="path hash model (default: crc on hardware, emulator with --emulated)")
    ap.add_argument("--devices", default=None, help="comma-separated device names (default: all)")
    a = ap.parse_args(argv)
    out = out or sys.stdout
    try:
        api = _emulated_api() if a.emulated else verbs.load_pyverbs()
        devs = verbs.discover(api, a.devices.split(",") if a.devices else None)
    except rdma.RdmaUnavailable as ex:
        print(str(ex), file=sys.stderr)
        return 1
    t = topology.PlanTable([["device", "port", "state", "link", "Gb/s", "mtu", "lid", "gid_idx", "gid", "type", "use"]])
    for d in devs:
        for p in d.ports:
            best = p.best_gid()
            rows = p.gids or [verbs.GidInfo(-1, "-", "-")]
            for g in rows:
                t.rows.append([d.name, str(p.port), "ACTIVE" if p.active else "DOWN", p.link_layer,
                               f"{p.speed_gbps:g}", str(128 << p.mtu), str(p.lid), str(g.index), g.gid, g.type,
                               "*" if best is not None and g.index == best.index else ""])
    print(f"RDMA devices ({api.name}):", file=out)
    print(t.render(), file=out)
    ports = verbs.ports_of(devs)
    if not ports:
        print("\nno active port: no QP plan", file=out)
        return 1
    hash_name = a.hash or ("emulator" if a.emulated else "crc")
    fn = topology.emulator_path_hash if hash_name == "emulator" else topology.crc_path_hash
    plan = topology.plan_peer(a.num_qps, ports)
    dst = [e.port.gid for e in plan]
    if all(g.strip("0:") for g in dst):
        topology.plan_flows(plan, dst, a.n_paths, fn)
    print(f"\nQP plan per peer: {a.num_qps} QPs over {len(ports)} port(s), {a.n_paths} paths, "
          f"{hash_name} path hash (peer assumed laid out like this host):", file=out)
    print(topology.plan_table(plan).render(), file=out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m triton_ep`` and the ``triton-ep`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] == "info":
        return info(argv[1:])
    print(f"triton-ep: unknown command {argv[0]!r} (try: info)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
