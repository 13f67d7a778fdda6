"""Imported last by the fork server the CPU suite's rank processes fork from (tests/conftest.py): it moves every
object the server's imports made (torch, triton, triton_ep, the rank bodies: about 190,000) into the garbage
collector's permanent generation, as the test process does for itself. Each forked rank inherits that, so a full
collection in a rank (``gc.collect()`` of :class:`triton_ep.testing.LiveBytes` after every interpreter launch, of the
tests' leak checks, or the collector's own) scans only what the rank made: about 0.09 s a collection on an idle
2-core machine, several times that under load, otherwise. Nothing of what a rank makes is frozen."""
import gc

gc.freeze()
