"""Helpers of the scheduler tests: emulated hosts with dual-port NICs, in-process groups of schedulers,
and rank code run in threads (one emulated host each) with bounded joins."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional

import numpy as np

from triton_ep.scheduler import Scheduler
from triton_ep.transport import emulated as em
from triton_ep.transport import topology, verbs


def fabric(hosts: int, reorder_seed=None, reorder_max_s: float = 0.004, ring_bytes: int = 1 << 20,
           n_paths: int = 4, port_gbps: float = 400.0, path_gbps: float = 200.0, skew_s: float = 0.0) -> em.Fabric:
    """``hosts`` emulated hosts, each one dual-port mlx5 device ``mlx5_<host>``, over ``n_paths`` ECMP paths."""
    ports = lambda: [em.PortSpec(speed_gbps=port_gbps), em.PortSpec(speed_gbps=port_gbps)]  # noqa: E731
    return em.Fabric(em.FabricSpec([em.DeviceSpec(f"mlx5_{h}", ports()) for h in range(hosts)], n_paths=n_paths,
                                   path_gbps=path_gbps, reorder_seed=reorder_seed, reorder_max_s=reorder_max_s,
                                   skew_s=skew_s, ring_bytes=ring_bytes))


def transport(fab: em.Fabric, rank: int, world: int, qps: int = 4, timeout_s: float = 20.0, **kw):
    """Rank ``rank``'s VerbsTransport on host ``rank`` of ``fab``, QPs planned over ports and paths."""
    kw.setdefault("sq_depth", 128)
    return verbs.VerbsTransport(rank, world, api=fab.pyverbs([f"mlx5_{rank}"]), num_qps_per_peer=qps,
                                n_paths=fab.spec.n_paths, path_hash=topology.emulator_path_hash,
                                timeout_s=timeout_s, **kw)


class Group:
    """``world`` ranks in this process: transports connected pairwise, a started scheduler each.
    ``cls``: the scheduler class (a planted variant in one test); ``close()`` releases everything."""

    def __init__(self, fab, world: int, qps: int = 4, cls=Scheduler, timeout_s: float = 20.0, **sched_kw):
        self.ts, self.scheds = [], []
        try:
            self.ts = [transport(fab, r, world, qps, timeout_s) for r in range(world)]
            for a in range(world):
                for b in range(a + 1, world):
                    self.ts[a].connect(b, self.ts[b].local_info(a))
                    self.ts[b].connect(a, self.ts[a].local_info(b))
            for t in self.ts:
                self.scheds.append(cls(t, timeout_s=timeout_s, **sched_kw))
            regions = [s.remote_region() for s in self.scheds]
            for s in self.scheds:
                s.start(regions)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s in self.scheds:
            s.close()
        for t in self.ts:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def in_threads(fn, world: int, timeout_s: float = 60.0) -> list:
    """``fn(rank)`` in one thread per rank; returns each result or the exception it raised."""
    out = [None] * world

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as ex:   # noqa: BLE001
            out[r] = ex

    ths = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in ths), "a rank hung"
    return out


def payload(src: int, dst: int, n: int, salt: int = 0) -> np.ndarray:
    """Deterministic bytes ``src`` sends ``dst``."""
    return np.random.default_rng([src, dst, salt, n]).integers(0, 256, n, dtype=np.uint8)


class ProcGroup(Group):
    """``world`` ranks in this process, each with its RDMA proxy in a process of its own
    (:class:`triton_ep.proxy_process.ProcessScheduler` over host ``rank`` of ``fab``), connected pairwise;
    ``close()`` ends and reaps every proxy process (the transports are theirs). ``peers``: per rank, the ranks it has
    QPs to (default: every other rank; low-latency mode across hosts has none to its host mates)."""

    def __init__(self, fab, world: int, qps: int = 4, timeout_s: float = 20.0,
                 peers: Optional[Dict[int, List[int]]] = None, **sched_kw):
        from triton_ep.proxy_process import ProcessScheduler
        self.ts, self.scheds = [], []
        try:
            for r in range(world):
                mine = None if peers is None else peers[r]
                self.scheds.append(ProcessScheduler(
                    "emulated", r, world, dict(fabric=fab, device_name=f"mlx5_{r}", num_qps_per_peer=qps,
                                               timeout_s=timeout_s, peers=mine), timeout_s=timeout_s, peers=mine,
                    **sched_kw))
            regions = [s._request("connect", {p: self.scheds[p].local_infos[s.rank] for p in s.peers})
                       for s in self.scheds]
            for s in self.scheds:
                s._request("start", regions)
        except BaseException:
            self.close()
            raise
