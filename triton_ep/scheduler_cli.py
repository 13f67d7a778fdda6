"""``python -m triton_ep.scheduler_cli`` (also ``python -m triton_ep.scheduler``, its old name): a checked
all-to-all between the ranks of a torchrun job through the RDMA scheduler (:mod:`triton_ep.scheduler`), one rank per
host, over real pyverbs or, with ``--emulated``, the emulated fabric (docs/rdma.md).

The command has a module of its own, which the scheduler never imports (the command imports torch; the RDMA proxy
process imports the scheduler without it); ``python -m triton_ep.scheduler`` runs the package's ``__main__``, which
only hands over to this one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from triton_ep.argtypes import int_in, non_negative_int, seconds
from triton_ep.protocol.limits import check_ring_memory
from triton_ep.scheduler import bootstrap, host_alltoall
from triton_ep.transport import factory
from triton_ep.transport.bootstrap import gather_objects


def build_parser() -> argparse.ArgumentParser:
    """The command's options (sizes in MiB / KiB, counts, seconds), each checked as it is parsed."""
    ap = argparse.ArgumentParser(prog="python -m triton_ep.scheduler_cli",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="A checked all-to-all between the ranks of a torchrun job (gloo), one "
                                             "rank per host, through real pyverbs or, with --emulated, the emulated "
                                             "fabric (all ranks on this machine: torchrun --nnodes 1 "
                                             "--nproc-per-node N). Prints wall-clock GB/s, bytes per port and per QP "
                                             "on rank 0.")
    ap.add_argument("--mib", type=non_negative_int, default=64, help="MiB each rank sends each peer (default 64)")
    ap.add_argument("--qps", type=int_in(1, 1024), default=8,
                    help="QPs per peer, at most 1024 (default 8; a Buffer's normal-mode network leg opens "
                         "TRITON_EP_RDMA_QPS_PER_PEER, default 4)")
    ap.add_argument("--chunk-kib", type=int_in(1, 1 << 20), default=1024,
                    help="chunk (ring slot) size in KiB, at most 1048576 (1 GiB, as TRITON_EP_RDMA_CHUNK_BYTES; "
                         "default 1024)")
    ap.add_argument("--slots", type=int_in(1, 1024), default=8,
                    help="slots per send and receive ring, at most 1024 (as TRITON_EP_RDMA_SLOTS; default 8)")
    ap.add_argument("--timeout", type=seconds, default=60.0,
                    help="seconds every wait may take before it raises, at most 1e9 (default 60)")
    ap.add_argument("--emulated", action="store_true", help="emulated dual-port NICs, one per rank, on this machine")
    return ap


def _open_transport(a: argparse.Namespace, rank: int, world: int):
    """This rank's transport: the emulated fabric (one device per rank, named after torchrun's run id) or real
    pyverbs (the NICs nearest the local GPU where there is one). Returns ``(transport, its keyword arguments)``."""
    kw = dict(num_qps_per_peer=a.qps, timeout_s=a.timeout)
    if a.emulated:
        kw.update(fabric=factory.emulated_fabric([f"mlx5_{r}" for r in range(world)],
                                                 "sched" + os.environ.get("TORCHELASTIC_RUN_ID", "0")[:8]),
                  device_name=f"mlx5_{rank}")
    elif torch.cuda.is_available():
        kw["gpu"] = int(os.environ.get("LOCAL_RANK", "0"))
    return factory.open_transport("emulated" if a.emulated else "verbs", rank, world, **kw), kw


def _exchange(sched, a: argparse.Namespace, rank: int, world: int) -> None:
    """The checked all-to-all: ``--mib`` MiB of seeded random bytes to each peer, timed from a bounded barrier;
    rank 0 prints every rank's result. Raises ``SystemExit(1)`` where any rank received wrong bytes."""
    n = a.mib << 20
    peers = [p for p in range(world) if p != rank]
    data = {p: np.random.default_rng([rank, p]).integers(0, 256, n, dtype=np.uint8) for p in peers}
    world_group = dist.group.WORLD
    gather_objects(world_group, None, a.timeout, "scheduler CLI: start")      # a bounded barrier
    t0 = time.perf_counter()
    got = host_alltoall(sched, data, {p: n for p in peers})
    dt = time.perf_counter() - t0
    ok = all(np.array_equal(got[p], np.random.default_rng([p, rank]).integers(0, 256, n, dtype=np.uint8))
             for p in peers)
    stats = sched.stats()
    results = gather_objects(world_group, (ok, n * len(peers) / dt / 1e9, stats["ports"]), a.timeout,
                             "scheduler CLI: results")
    if rank == 0:
        for r, (okr, gbs, ports) in enumerate(results):
            print(f"rank {r}: {'byte-exact' if okr else 'WRONG BYTES'}, {gbs:.2f} GB/s sent (wall clock), "
                  f"bytes per port {ports}")
        print("bytes per QP (rank 0):", {k: v["bytes"] for k, v in stats["qps"].items()})
    if not all(r[0] for r in results):
        raise SystemExit(1)


def main(argv=None) -> None:
    """``python -m triton_ep.scheduler_cli``: a checked all-to-all between the ranks of a torchrun job (gloo from
    the torchrun environment), one rank per host, through real pyverbs (the NICs nearest the local GPU, else
    every active device) or, with ``--emulated``, the emulated fabric (all ranks on this machine).  Prints
    wall-clock GB/s, bytes per port and per QP on rank 0."""
    ap = build_parser()
    a = ap.parse_args(argv)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        ap.error(f"run it under torchrun (environment variables {', '.join(missing)} are not set), e.g. "
                 f"torchrun --nnodes 1 --nproc-per-node 2 -m triton_ep.scheduler_cli --emulated")
    peers = int(os.environ["WORLD_SIZE"]) - 1 if os.environ["WORLD_SIZE"].isdigit() else 1
    try:
        check_ring_memory(a.slots, a.chunk_kib << 10, peers, "--slots", "--chunk-kib (in bytes)")
    except ValueError as ex:
        ap.error(str(ex))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t, kw = _open_transport(a, rank, world)
    sched = None
    try:
        sched = bootstrap(t, dict(slots=a.slots, slot_bytes=a.chunk_kib << 10))
        if a.emulated:      # every peer has mapped this rank's rings: a killed rank (torchrun's SIGTERM) leaves none
            kw["fabric"].unlink_rings()
        _exchange(sched, a, rank, world)
    finally:
        if sched is not None:
            sched.close()
        t.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
