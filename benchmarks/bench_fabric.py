"""Benchmark of the RDMA transport on the emulated fabric.

1. Modelled bandwidth (the rate model's virtual time) from rank 0 to rank 1, each host with one dual-port NIC
   model and a fabric of 4 ECMP paths: 1 QP, versus ``--qps`` QPs on one port, spread over both ports with
   the kernel's default source ports (flow label 0), and spread by the QP plan (ports and source ports).
   Next to each: the model's own analytic prediction, bytes / max over resources (load / bandwidth) for the
   resources the QPs actually used.  The emulator shows the mechanism, not a hardware figure.
2. Host cost per posted work request (wall clock on this CPU): the verbs backend posting 64-byte RDMA
   WRITEs in chains of 16 with selective signalling, over the emulated fabric (post calls alone, and until
   every write is acknowledged); plus, where real pyverbs imports, the cost of building one pyverbs
   ``SendWR`` + ``SGE`` (no device needed).

    ./run.sh python benchmarks/bench_fabric.py [--qps 8] [--port-gbps 400] [--path-gbps 200] [--mib 64] [--json]

CPU only (the emulator), about 5 s on two cores; output: stdout only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton_ep.transport import emulated as em  # noqa: E402
from triton_ep.transport import rdma, topology, verbs  # noqa: E402
from triton_ep.transport.rdma import WRITE, Op  # noqa: E402


def make_pair(num_qps, port_gbps, path_gbps, n_paths, plan_paths, one_port):
    """Two connected emulated ranks, each with a dual-port NIC model (port 2 down when ``one_port``);
    ``plan_paths``: flow labels from the QP plan (else 0, the kernel's default) and mlx5 source ports set."""
    ports = lambda: [em.PortSpec(speed_gbps=port_gbps), em.PortSpec(speed_gbps=port_gbps, active=not one_port)]  # noqa
    fab = em.Fabric(em.FabricSpec([em.DeviceSpec("mlx5_0", ports()), em.DeviceSpec("mlx5_1", ports())],
                                  n_paths=n_paths, path_gbps=path_gbps, ring_bytes=4 << 20))
    kw = dict(num_qps_per_peer=num_qps, n_paths=n_paths if plan_paths else 0, force_sport=plan_paths,
              path_hash=topology.emulator_path_hash, sq_depth=128, timeout_s=120)
    t0 = verbs.VerbsTransport(0, 2, api=fab.pyverbs(["mlx5_0"]), **kw)
    t1 = verbs.VerbsTransport(1, 2, api=fab.pyverbs(["mlx5_1"]), **kw)
    t0.connect(1, t1.local_info(0))
    t1.connect(0, t0.local_info(1))
    return fab, t0, t1


def modelled_bandwidth(num_qps, port_gbps, path_gbps, n_paths, plan_paths, one_port, total_bytes, chunk):
    """(modelled GB/s, analytic GB/s, paths used) for ``total_bytes`` sent round-robin over the QPs."""
    fab, t0, t1 = make_pair(num_qps, port_gbps, path_gbps, n_paths, plan_paths, one_port)
    try:
        src, dst = t0.register(chunk * num_qps), t1.register(chunk * num_qps)
        fab.model.reset()
        n_chunks = total_bytes // chunk
        for k in range(n_chunks):
            q = k % num_qps
            t0.post(1, q, [Op(WRITE, src, q * chunk, chunk, dst.remote(), q * chunk, signaled=True)])
            if k % 64 == 63:
                t0.wait(lambda cs: len(cs) >= 64, stage="bench")
        t0.wait(lambda cs: len(cs) >= n_chunks % 64, stage="bench")
        model = fab.model
        bw = {"tx": port_gbps * 1e9 / 8, "path": path_gbps * 1e9 / 8, "rx": port_gbps * 1e9 / 8}
        bound = max(b / bw[k[0]] for k, b in model.bytes.items() if k[0] in bw)
        paths = sorted(k[1] for k in model.bytes if k[0] == "path")
        sent = n_chunks * chunk
        return sent / model.makespan() / 1e9, sent / bound / 1e9, paths
    finally:
        t0.close()
        t1.close()


def host_cost_per_wr(n_wr=20000, batch=16):
    """(us per WR in post calls, us per WR until all are acknowledged) on the emulated fabric."""
    fab, t0, t1 = make_pair(1, 400, 400, 4, True, True)
    try:
        src, dst = t0.register(4096), t1.register(4096)
        ops = [Op(WRITE, src, 64 * (i % 16), 64, dst.remote(), 64 * (i % 16)) for i in range(batch)]
        t_post = 0.0
        t_start = time.perf_counter()
        for _ in range(n_wr // batch):
            a = time.perf_counter()
            t0.post(1, 0, ops)
            t_post += time.perf_counter() - a
        t0.post(1, 0, [Op(WRITE, src, 0, 64, dst.remote(), 0, signaled=True, wr_id=1 << 40)])
        t0.wait(lambda cs: any(c.wr_id == 1 << 40 for c in cs), stage="bench drain")
        t_all = time.perf_counter() - t_start
        n = (n_wr // batch) * batch + 1
        return t_post / n * 1e6, t_all / n * 1e6
    finally:
        t0.close()
        t1.close()


def pyverbs_build_cost(n=20000):
    """us to build one real pyverbs SendWR (RDMA WRITE) with its SGE, or None without pyverbs."""
    try:
        api = verbs.load_pyverbs()
    except rdma.RdmaUnavailable:
        return None
    t = time.perf_counter()
    for i in range(n):
        verbs.build_send_wr(api, WRITE, i, api.SGE(0x1000, 64, 1), 2, 0x2000)
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None):
    """Run both measurements and print them as markdown tables (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qps", type=int, default=8)
    ap.add_argument("--port-gbps", type=float, default=400.0)
    ap.add_argument("--path-gbps", type=float, default=200.0)
    ap.add_argument("--paths", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per scenario, MiB")
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--wrs", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    total, chunk = a.mib << 20, a.chunk_kib << 10
    scenarios = [("1 QP", 1, False, True), (f"{a.qps} QPs, one port, default sports", a.qps, False, True),
                 (f"{a.qps} QPs, 2 ports, default sports", a.qps, False, False),
                 (f"{a.qps} QPs, 2 ports, planned sports", a.qps, True, False)]
    rows = []
    for name, nq, plan, one_port in scenarios:
        gbs, pred, paths = modelled_bandwidth(nq, a.port_gbps, a.path_gbps, a.paths, plan, one_port, total, chunk)
        rows.append({"scenario": name, "modelled_GBps": gbs, "analytic_GBps": pred, "paths_used": paths})
    post_us, e2e_us = host_cost_per_wr(a.wrs)
    build_us = pyverbs_build_cost()
    res = {"config": vars(a), "bandwidth": rows,
           "host_cost_us_per_wr": {"post": post_us, "post_to_ack": e2e_us, "pyverbs_build": build_us}}
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"Emulated fabric: dual-port NIC {a.port_gbps:g} Gb/s per port, {a.paths} paths of {a.path_gbps:g} Gb/s; "
          f"{a.mib} MiB in {a.chunk_kib} KiB writes (the emulator's rate model: it shows the mechanism, "
          f"not a hardware figure)")
    print("| scenario | modelled GB/s | analytic GB/s | paths used |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['modelled_GBps']:.1f} | {r['analytic_GBps']:.1f} | {r['paths_used']} |")
    print(f"\nHost cost per work request (64 B WRITE, chains of 16, selective signalling), {os.cpu_count()} CPUs:")
    print(f"| post calls (verbs backend on the emulator) | {post_us:.1f} us |")
    print(f"| post until acknowledged (emulator included) | {e2e_us:.1f} us |")
    print(f"| build one real pyverbs SendWR + SGE | {'n/a (no pyverbs)' if build_us is None else f'{build_us:.2f} us'} |")


if __name__ == "__main__":
    main()
