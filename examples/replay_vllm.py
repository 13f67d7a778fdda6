"""A REPLAY of vLLM's DeepEP calls against triton-ep on CPU -- not vLLM itself.

vLLM's calls to ``deep_ep`` (construction, a prefill and a decode step per backend), written down from its source
with their lines in tests/engines/vllm_calls.py, are made here through ``import deep_ep`` with TRITON_EP_AS_DEEP_EP=1,
on CPU ranks, and every result is compared with the reference. The experts are stand-ins and the sizes small.

    python examples/replay_vllm.py                      # deepep_low_latency, 2 ranks on one host
    python examples/replay_vllm.py --backend NAME --ranks 4 --hosts 2    # 4 ranks on 2 emulated hosts
    python examples/replay_vllm.py --list               # the backends (V1 Buffer and V2 ElasticBuffer)
    python examples/replay_vllm.py --backend deepep_v2  # DeepEP V2's ElasticBuffer path

Run it from a checkout (it imports the fixtures from tests/).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.engines.replay import replay_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(replay_main("vllm_calls", "vLLM", "deepep_low_latency", __doc__.splitlines()[0]))
