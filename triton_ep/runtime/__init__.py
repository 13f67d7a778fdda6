"""What every mode shares: the runtime of one Buffer (shared buffers, signals, streams, errors, the driver
of a collective's steps) and the argument checks."""
from .context import Meet, Runtime, collective, open_runtime, steps

__all__ = ["Meet", "Runtime", "collective", "open_runtime", "steps"]
