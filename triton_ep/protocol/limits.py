"""Bounds that a value must fit wherever the code carries it: in kernel arguments, in shared words, in Python's
thread waits. Read by the argument checks (:mod:`triton_ep.runtime.checks`) and the commands."""

#: The largest ``timeout_s`` (about 31.7 years). The code carries it as int64 nanoseconds that the GPU kernels
#: compare with ``%globaltimer`` (nanoseconds since 1970, about 1.8e18 now; the int64 limit is about 9.2e18)
#: and as Python thread-wait bounds of ``timeout_s`` plus some seconds (``threading.TIMEOUT_MAX``, about
#: 9.2e9 s): 1e9 s leaves room in both.
MAX_TIMEOUT_S = 1e9
