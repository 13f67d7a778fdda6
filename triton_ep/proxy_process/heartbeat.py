"""A proxy process that stopped making progress (:class:`Heartbeat`): its process lives (no end of the channel tells
of it) but its sweeps no longer run: stopped by a signal (SIGSTOP) or a debugger, starved of CPU, or stuck in a
system call. Each sweep stores its clock into the rings' heartbeat word (``RING_BEAT``, :attr:`RingFlags.BEAT
<triton_ep.transport.ring_flags.RingFlags.BEAT>`), idle sweeps included (an idle proxy naps at most
:data:`~triton_ep.proxy_process.proxy_side.IDLE_DEEP_S`); the rank's process looks at it every :data:`LOOK_S` (the
thread that reads the command channel) and, where it stood still long enough, at the process's state in
``/proc/<pid>/stat``:

- stopped (``T``: by a signal; ``t``: by a debugger) and still for :attr:`Heartbeat.stop_s`: at most
  :data:`STOP_S`;
- any other state (running but starved, asleep, in a system call) and still for :attr:`Heartbeat.starve_s`: half
  ``timeout_s``, at least :data:`STARVE_MIN_S`. A live proxy's heartbeat stood still for up to about 1.2 s on a
  2-core machine running some 20 busy processes (its process runnable, not running); this bound stays far above that.

Both come before the peers' waits for this rank's chunks run out at ``timeout_s`` (for ``timeout_s`` above about
``4 * STOP_S`` and ``2 * STARVE_MIN_S``: with smaller bounds those waits may run out first and name this rank as
before)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: the most seconds the heartbeat of a stopped proxy process (state ``T`` or ``t``) may stand still
STOP_S = 1.0
#: the least seconds the heartbeat of a proxy process in any other state may stand still (half ``timeout_s`` else)
STARVE_MIN_S = 5.0
#: seconds between the rank's looks at the heartbeat
LOOK_S = 0.1
#: the states of ``/proc/<pid>/stat`` that say a process is stopped, and what stopped it
STOPPED = {"T": "stopped by a signal such as SIGSTOP", "t": "stopped by a debugger"}


def proc_state(pid: int) -> Optional[str]:
    """Process ``pid``'s state letter (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...: proc(5), ``/proc/<pid>/stat``),
    or ``None`` where it cannot be read (no ``/proc``, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1].decode()
    except (OSError, ValueError):
        return None


@dataclass
class Heartbeat:
    """The rank's view of its proxy process's heartbeat word (the module's docstring tells the rules).

    Attributes:
        timeout_s: the proxy's bound (seconds; the scheduler's ``timeout_s``).
        last: the word's value at the last look that saw it change (0: no sweep yet, which never counts as a stall:
            the sweeps start with the leg's set-up, whose steps have their own bounds).
        since: when (monotonic seconds) a look last saw it change.
    """
    timeout_s: float
    last: int = 0
    since: float = 0.0

    @property
    def stop_s(self) -> float:
        """Seconds a stopped proxy's heartbeat may stand still: :data:`STOP_S`, or a quarter of ``timeout_s`` where
        smaller."""
        return min(STOP_S, self.timeout_s / 4)

    @property
    def starve_s(self) -> float:
        """Seconds a proxy's heartbeat may stand still in any other state: half ``timeout_s``, at least
        :data:`STARVE_MIN_S`."""
        return max(STARVE_MIN_S, self.timeout_s / 2)

    def stalled(self, value: int, now: float, pid: int) -> Optional[str]:
        """Look at the word (``value``, read at ``now``, monotonic seconds) of the proxy process ``pid``. Returns
        why it stopped making progress (its state and the seconds its heartbeat stood still) where it did, else
        ``None`` (a process that is gone is the command channel's to tell)."""
        if value != self.last or value == 0:
            self.last, self.since = value, now
            return None
        still = now - self.since
        if still <= self.stop_s:
            return None
        state = proc_state(pid)
        if state in STOPPED:
            return f"{STOPPED[state]} (state {state})"
        if state is None or state in "ZX" or still <= self.starve_s:
            return None
        return f"it lives (state {state}) but is starved of CPU or stuck in a system call"

    def still_s(self, now: float) -> float:
        """Seconds the word has stood still at ``now``."""
        return now - self.since
