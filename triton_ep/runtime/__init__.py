"""What every mode shares: the runtime of one Buffer (shared buffers, signals, streams, errors, the driver
of a collective's steps) and the argument checks."""
from ..transport.bootstrap import STORE_CALL_S, StoreCaller, bounded_store_call
from ..transport.ipc import SLOT_HEADER, LocalWorld
from ..transport.parent import exit_with_parent
from ..transport.signals import call_signature
from .across_hosts import HostsRuntime
from .call_steps import Meet, collective, steps
from .context import Runtime, current_event
from .opening import ll_area_bytes, open_runtime

# (the modes reach transport/ through here: a call's signature words, the first mode word of a meeting's slot,
# store calls bounded in time;
# and the test kit reaches the ranks-in-one-process world, and its rank processes' watch of their parent, through
# here)
__all__ = ["HostsRuntime", "LocalWorld", "Meet", "Runtime", "SLOT_HEADER", "STORE_CALL_S", "StoreCaller", "bounded_store_call", "call_signature", "collective",
           "current_event", "exit_with_parent", "ll_area_bytes", "open_runtime", "steps"]
