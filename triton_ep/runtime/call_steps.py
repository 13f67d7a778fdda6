"""The steps of a collective call. The body of every call is a generator that yields at each phase boundary:
:meth:`triton_ep.runtime.context.Runtime.run` drives it for a real rank, meeting the other ranks on the host only at
:class:`Meet` steps (the re-synchronisation after an error), while the kernels wait for each other on the device;
:mod:`triton_ep.testing` drives the same generators for ranks simulated in one process.
"""
from __future__ import annotations

import functools
from typing import Callable


class Meet(str):
    """A step where the ranks meet on the host (a bounded barrier in the control block): the
    re-synchronisation after an error. Every other step a call yields is only a phase boundary: ranks
    simulated in one process run their launches phase by phase, and real ranks wait for each other on the
    device."""


def collective(e: BaseException) -> BaseException:
    """Mark ``e`` as raised on every rank at the same step (the group stays in step)."""
    e._ep_collective = True
    return e


def steps(fn: Callable) -> Callable:
    """Decorate a mode's step generator (a method of an object with a ``rt`` :class:`Runtime`): whatever
    it raises, this rank first tells its peers (a failure word in their signal headers), so kernels of
    theirs that wait for this rank's part of the call stop at once and raise ``EPRemoteError``; the next
    call re-synchronises the group. Every call it starts counts as one (:meth:`Runtime.count_call`), also on
    a rank that rejects its arguments before publishing its card, so the ranks' call numbers stay equal."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        self.rt.count_call()
        try:
            return (yield from fn(self, *args, **kwargs))
        except GeneratorExit:
            raise
        except BaseException as e:
            self.rt.tell_failure(e)
            raise
    return run
