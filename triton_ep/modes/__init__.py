"""The modes of a Buffer, each with its own arguments, steps and handle: ``intranode`` (normal mode within one
host) and ``low_latency`` (DeepEP's decode-time mode). Each gets the Buffer's shared
:class:`~triton_ep.runtime.Runtime`."""
