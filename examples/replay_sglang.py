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
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.engines.replay import replay_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(replay_main("sglang_calls", "SGLang", "deepep_auto", __doc__.splitlines()[0]))
