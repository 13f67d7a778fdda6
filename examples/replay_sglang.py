"""A REPLAY of SGLang's DeepEP calls against triton-ep on CPU -- not SGLang itself.

SGLang's calls to ``deep_ep`` (construction, a prefill and a decode step per backend), written down from its source
with their lines in tests/engines/sglang_calls.py, are made here through ``import deep_ep`` with TRITON_EP_AS_DEEP_EP=1,
on CPU ranks, and every result is compared with the reference. The experts are stand-ins and the sizes small.

    python examples/replay_sglang.py                      # deepep_auto, 2 ranks on one host
    python examples/replay_sglang.py --backend NAME --ranks 4 --hosts 2    # 4 ranks on 2 emulated hosts
    python examples/replay_sglang.py --list               # the backends (V1 Buffer and V2 ElasticBuffer)
    python examples/replay_sglang.py --backend deepep_v2  # DeepEP V2's ElasticBuffer path

Run it from a checkout (it imports the fixtures from tests/).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.engines import sglang_calls  # noqa: E402
from tests.engines.replay import Shape, replay_rank  # noqa: E402
from triton_ep.testing import run_ranks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="deepep_auto", choices=[s.backend for s in sglang_calls.SEQUENCES])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hosts", type=int, default=1, help="emulated hosts (ranks are split evenly)")
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    if a.list:
        for s in sglang_calls.SEQUENCES:
            print(f"{s.backend:40s} {'V2 ElasticBuffer' if s.v2 else 'V1 Buffer':16s}", "-", "; ".join(s.deviations))
        return 0
    env = {} if a.hosts == 1 else {"TRITON_EP_RANKS_PER_HOST": str(a.ranks // a.hosts), "TRITON_EP_RDMA": "emulated"}
    print(f"replaying {a.backend} (SGLang's calls, not SGLang) on {a.ranks} CPU ranks, {a.hosts} host(s)...")
    t = time.time()
    out = run_ranks(replay_rank, a.ranks, "sglang_calls", a.backend, Shape(H=512 if "ue8m0" in a.backend else 256), env)
    for r, o in enumerate(out):
        if not hasattr(o, "checks"):
            print(f"rank {r} failed: {o!r}\n{getattr(o, 'traceback', '')}")
            return 1
    print(f"rank 0 made {len(out[0].calls)} calls through {out[0].deep_ep_file}:")
    for c in out[0].calls:
        print("  ", c)
    print(f"all {a.ranks} ranks: {len(out[0].checks)} results equal to the reference ({time.time() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
