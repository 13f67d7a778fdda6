"""Bounds that a value must fit wherever the code carries it: in kernel arguments, in shared words, in Python's
thread waits, in the machine's memory. Read by the argument checks (:mod:`triton_ep.runtime.checks`), the network
leg's set-up and the commands."""
import os

#: The largest ``timeout_s`` (about 31.7 years). The code carries it as int64 nanoseconds that the GPU kernels
#: compare with ``%globaltimer`` (nanoseconds since 1970, about 1.8e18 now; the int64 limit is about 9.2e18)
#: and as Python thread-wait bounds of ``timeout_s`` plus some seconds (``threading.TIMEOUT_MAX``, about
#: 9.2e9 s): 1e9 s leaves room in both.
MAX_TIMEOUT_S = 1e9
#: The smallest ``timeout_s``: one nanosecond, the unit the kernels count in (a smaller value would reach them as 0)
MIN_TIMEOUT_S = 1e-9


def check_ring_memory(slots: int, slot_bytes: int, num_peers: int, slots_name: str, bytes_name: str) -> None:
    """An RDMA network leg's rings (a send and a receive ring of ``slots`` slots of ``slot_bytes`` bytes per peer)
    must fit in this machine's physical memory: each value may be in its range and their product still not.

    Raises:
        ValueError: ``2 * num_peers * slots * slot_bytes`` bytes above the machine's memory, naming both values as
            ``slots_name`` and ``bytes_name`` call them (an environment variable, a command-line option).
    """
    ring = 2 * max(num_peers, 1) * slots * slot_bytes
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if ring > memory:
        raise ValueError(f"{slots_name}={slots} x {bytes_name}={slot_bytes} take {ring / 2 ** 30:.1f} GiB of rings "
                         f"for {max(num_peers, 1)} RDMA peer(s) (2 x peers x slots x bytes), more than this "
                         f"machine's {memory / 2 ** 30:.1f} GiB of memory")
