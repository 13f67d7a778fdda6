"""Seconds from a rank's death to the error on every other rank, per mode, within one host and across hosts
(issue 46, item 3).

For each mode, ``--ranks`` rank processes (gloo; CPU under the Triton interpreter, or ``--device cuda``) build a
Buffer with ``--timeout-s``, make one correct call of the mode's kind and meet at a barrier; then rank 1 notes the
wall-clock time and kills itself (SIGKILL) at the mode's point while every other rank makes the call. Each
survivor notes the wall-clock time its error is raised. Modes (tests/cases/dead_peer.py): ``notify`` (the victim
never calls the dispatch: the others wait in the count exchange), ``dispatch`` (it dies in its send, after the
count exchange), ``worst`` (a dispatch with num_worst_tokens: the others wait on the host), ``combine``,
``ll_dispatch`` (a low-latency dispatch, after the victim's send), ``ll_combine``. Target: 2 s; before the liveness
watcher a survivor waited out ``timeout_s``.

Across hosts (``--host-modes``, CPU only): for each count of ``--host-ranks`` (default 2 and 4), that many ranks on 2
emulated hosts (``TRITON_EP_RDMA=emulated``, ``TRITON_EP_RANKS_PER_HOST`` half of it), once per RDMA proxy kind of
``--proxies`` (``TRITON_EP_PROXY``); rank 1 dies 0.3 s after the barrier, while the others are in the call:
``internode`` (a normal-mode dispatch), ``internode_ll`` (a low-latency dispatch), ``internode_ll_combine``, and
``internode_ll_send`` (rank 1 makes the low-latency dispatch and dies right after its send, its chunks on their way;
with 2 ranks per host rank 3 makes the call only once its proxy found rank 1 gone, so the others' proxies fail while
they still wait for its part) (tests/cases/dead_peer.py, ``killed_across_hosts``; the times count from rank 1's death,
or for ``internode_ll_send`` from the start of its receive, where it dies). With 1 rank per host rank 1 is alone on host 1; with 2 it shares
host 0 with rank 0 (its liveness lock), its RDMA peer is rank 3 (its probes), and rank 2 hears of it from rank 0.
Before the liveness probes of the RDMA proxy (its probe WRITE fails once the peer's QPs are gone) a survivor there
waited out ``timeout_s``; before the host's lock was watched in low-latency mode across hosts, rank 0 there did too;
before the low-latency waits read the proxy's abort word, a rank whose proxy failed while a live peer's part was still
to come waited out ``timeout_s`` (``internode_ll_send`` with 2 ranks per host, and at times ``internode_ll_combine``).

    ./run.sh python benchmarks/bench_dead_peer.py [--ranks 3] [--timeout-s 60] [--modes dispatch,combine]
        [--device cpu] [--host-modes internode,internode_ll] [--host-ranks 2,4] [--proxies thread,process] [--out DIR]

About 2 minutes on two CPU cores at the defaults within one host, and 5-10 more across hosts (the rank processes'
set-up; each error itself comes in well under 2 s). Output: a table on stdout; ``dead_peer.json`` in ``--out`` only when it is given.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from _common import check_out, print_table, say, write_json  # (puts the repository root on sys.path)

import torch  # noqa: E402

from tests.cases import dead_peer as cases  # noqa: E402
from triton_ep import testing  # noqa: E402

TARGET_S = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3, help="rank processes (default 3; rank 1 dies)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="the Buffer's timeout_s (default 60)")
    p.add_argument("--modes", default=",".join(cases.MODES), help=f"comma-separated, of {', '.join(cases.MODES)}")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the buffers live (default cpu)")
    p.add_argument("--host-modes", default=",".join(cases.HOST_MODES),
                   help=f"across 2 emulated hosts, comma-separated, of {', '.join(cases.HOST_MODES)} (empty: none)")
    p.add_argument("--host-ranks", default="2,4", help="ranks across the 2 hosts, comma-separated (default 2,4; each even)")
    p.add_argument("--proxies", default="thread,process", help="RDMA proxy kinds across hosts (default thread,process)")
    p.add_argument("--out", default=None, help="folder for dead_peer.json (default: none, stdout only)")
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error(f"--ranks must be at least 2 (a victim and a survivor), got {a.ranks}")
    if not 0 < a.timeout_s <= 1e9:
        p.error(f"--timeout-s must be in (0, 1e9], got {a.timeout_s}")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in cases.MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; the modes are {', '.join(cases.MODES)}")
    a.host_modes = [m for m in a.host_modes.split(",") if m]
    bad = [m for m in a.host_modes if m not in cases.HOST_MODES]
    if bad:
        p.error(f"--host-modes: unknown {bad}; the modes are {', '.join(cases.HOST_MODES)}")
    try:
        a.host_ranks = [int(v) for v in a.host_ranks.split(",") if v.strip()]
    except ValueError:
        p.error(f"--host-ranks must be comma-separated ints, got {a.host_ranks!r}")
    if not a.host_ranks or any(n < 2 or n % 2 for n in a.host_ranks):
        p.error(f"--host-ranks must each be even and at least 2 (2 hosts), got {a.host_ranks}")
    a.proxies = [v for v in a.proxies.split(",") if v]
    bad = [v for v in a.proxies if v not in ("thread", "process")]
    if bad or not a.proxies:
        p.error(f"--proxies: {bad or 'none'}; the kinds are thread, process")
    if a.device == "cuda" and a.host_modes:
        p.error("--host-modes run on CPU only (the emulated fabric's rank processes): pass --host-modes ''")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    if a.out is not None:
        check_out(p, a.out)
    return a


def one_mode(mode: str, ranks: int, timeout_s: float, device: str, proxy: str = "") -> dict:
    """Run ``mode`` once (with ``proxy``: across 2 emulated hosts, that RDMA proxy kind): the survivors' error
    types and their seconds from the kill to the error."""
    with tempfile.TemporaryDirectory(prefix="triton_ep_dead_peer_") as stamp:
        if proxy:
            out = testing.run_ranks(cases.killed_across_hosts, ranks, mode, proxy, timeout_s, 1, stamp,
                                    timeout_s=2 * timeout_s + 240)
        else:
            out = testing.run_ranks(cases.killed_mid_call, ranks, mode, timeout_s, 1, device, stamp,
                                    timeout_s=timeout_s + 240)
        with open(os.path.join(stamp, "killed")) as f:
            killed = float(f.read())
    row = {"mode": f"{mode} (2x{ranks // 2}, {proxy} proxy)" if proxy else mode, "errors": [], "seconds": []}
    for r, o in enumerate(out):
        if r == 1:
            continue
        if isinstance(o, testing.RankFailure):
            raise RuntimeError(f"{mode}: survivor rank {r} failed: {o.message}\n{o.traceback}")
        row["errors"].append(o[0])
        row["seconds"].append(o[5] - killed)
    return row


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.device == "cpu":
        testing.start_forkserver(["tests.cases.dead_peer"])       # (the ranks start as forks: no import each)
    say(f"{a.ranks} ranks on {a.device}, timeout_s {a.timeout_s:g}; rank 1 dies (SIGKILL); target {TARGET_S:g} s")
    rows = [one_mode(m, a.ranks, a.timeout_s, a.device) for m in a.modes]
    if a.host_modes:
        say(f"across 2 emulated hosts: {', '.join(map(str, a.host_ranks))} ranks, rank 1 dies; proxies "
            f"{', '.join(a.proxies)}")
        rows += [one_mode(m, n, a.timeout_s, a.device, proxy) for n in a.host_ranks for m in a.host_modes
                 for proxy in a.proxies]
    print_table(["mode", "survivors' errors", "kill to error, s (min / max)", f"within {TARGET_S:g} s"],
                [[r["mode"], ", ".join(sorted(set(r["errors"]))),
                  f"{min(r['seconds']):.2f} / {max(r['seconds']):.2f}",
                  "yes" if max(r["seconds"]) <= TARGET_S else "no"] for r in rows])
    if a.out is not None:
        write_json(os.path.join(a.out, "dead_peer.json"),
                   {"ranks": a.ranks, "host_ranks": a.host_ranks, "timeout_s": a.timeout_s, "device": a.device,
                    "target_s": TARGET_S, "rows": rows})


if __name__ == "__main__":
    main()
