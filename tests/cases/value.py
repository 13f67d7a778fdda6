"""Rank bodies of tests/runtime/test_values.py (importable by the rank processes): Buffer set-up with a bad value
on one rank."""
import os
import time

import triton_ep

#: the values each case gives rank 1 alone: (what, value); ``what`` is an environment variable (upper case) or a
#: Buffer keyword argument
ENV_CASES = (("TRITON_EP_SHM_TAG", "bad/tag"), ("TRITON_EP_SHM_TAG", "t" * 300), ("TRITON_EP_TIMEOUT_S", "abc"), ("TRITON_EP_TIMEOUT_S", "1e300"),
             ("TRITON_EP_RDMA", "nope"), ("TRITON_EP_RANKS_PER_HOST", "0"), ("TRITON_EP_RDMA_TC", "300"))
#: the one case among them that builds: the QoS variables are read by the transport between hosts only
BUILDS_ON_ONE_HOST = ("TRITON_EP_RDMA_TC", "300")
#: ... across hosts (2 hosts of 1 rank over the emulated fabric: HOSTS_ENV), where the transport reads the QoS variables
HOSTS_CASES = (("TRITON_EP_RDMA_TC", "300"), ("TRITON_EP_RDMA_SL", "x"), ("TRITON_EP_SHM_TAG", "a.b"))
HOSTS_ENV = {"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated"}
ARG_CASES = (("timeout_s", 1e12), ("timeout_s", float("nan")), ("num_nvl_bytes", -5), ("num_nvl_bytes", 1 << 63),
             ("num_rdma_bytes", "4096"), ("device", "tpu"), ("rdma_backend", "infiniband"))
#: the ElasticBuffer case that builds (a good value, last: the failed set-ups before it left the group usable)
ELASTIC_BUILDS = ("num_bytes", 1 << 20)
#: ElasticBuffer keyword arguments that ElasticBuffer checks itself (not the underlying Buffer); ``hidden`` 0 is bad
#: because the buffer is then built without ``num_bytes``
ELASTIC_CASES = (("num_max_tokens_per_rank", -1), ("num_bytes", 1.5), ("hidden", 0), ("num_cpu_bytes", -5),
                 ("num_topk", -1), ELASTIC_BUILDS)


def bad_value_on_rank_1(rank, world, cases, timeout_s, base_env=None, elastic=False):
    """For each case in turn, every rank builds a Buffer over the default group (CPU, ``timeout_s``), rank 1 with
    the case's bad value (an environment variable set for that build alone, or a keyword argument; a bad
    ``TRITON_EP_TIMEOUT_S`` is read where rank 1 passes no ``timeout_s``); ``base_env``: variables every rank sets
    first; ``elastic``: an ElasticBuffer instead (``num_gpu_timeout_secs=timeout_s``, sized from ``hidden``).
    Returns per case (type of the error raised or ``"built"``, seconds the build took, message)."""
    os.environ.update(base_env or {})
    out = []
    for what, value in cases:
        if elastic:
            kw = dict(num_max_tokens_per_rank=8, hidden=128, num_topk=2, device="cpu", num_gpu_timeout_secs=timeout_s)
        else:
            kw = dict(num_nvl_bytes=1 << 16, device="cpu", timeout_s=timeout_s)
        env = what.isupper() and rank == 1
        if env:
            saved = os.environ.get(what)
            os.environ[what] = value
            if what == "TRITON_EP_TIMEOUT_S":
                kw["timeout_s"] = None
        elif rank == 1:
            kw[what] = value
        t0 = time.monotonic()
        try:
            (triton_ep.ElasticBuffer if elastic else triton_ep.Buffer)(None, **kw).destroy()
            out.append(("built", round(time.monotonic() - t0, 2), ""))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, round(time.monotonic() - t0, 2), str(e)))
        finally:
            if env:
                if saved is None:
                    os.environ.pop(what)
                else:
                    os.environ[what] = saved
    return out
