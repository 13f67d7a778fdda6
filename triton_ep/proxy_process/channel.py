"""The command channel between a rank's process and its proxy process (a socket pair: set-up, renumbering,
failure, statistics, close; never per chunk): length-prefixed pickled messages, exceptions as they cross it, and the
start of a proxy process at its other end (:func:`start_proxy`)."""
from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Optional

from triton_ep.scheduler import ProxyError

#: the proxy process's entry, run by path (it must not go through ``triton_ep/__init__.py``)
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "proxy_main.py")


def send_msg(sock: socket.socket, msg: Any) -> None:
    """Send ``msg`` (picklable) on the channel ``sock``: its pickle's length (8 bytes, little-endian), then the
    pickle. Raises OSError where the channel is gone."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    """The next message, or ``None`` at the end of the channel."""
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)


def pack_error(ex: BaseException) -> tuple:
    """An exception as it crosses the channel: ``(class, attributes, message)`` (triton-ep's errors take their
    fields as arguments, which plain pickling of an exception loses); one that does not pickle goes as a
    :class:`ProxyError` holding its text."""
    msg = (type(ex), dict(getattr(ex, "__dict__", {})), str(ex))
    try:
        pickle.dumps(msg)
        return msg
    except Exception:   # noqa: BLE001
        return (ProxyError, {}, f"{type(ex).__name__}: {ex}")


def unpack_error(msg: tuple) -> BaseException:
    """The exception :func:`pack_error` packed."""
    cls, attrs, text = msg
    ex = cls.__new__(cls)
    ex.args = (text,)
    ex.__dict__.update(attrs)
    return ex


@dataclass
class StartedProxy:
    """A proxy process as :func:`start_proxy` started it."""
    proc: subprocess.Popen
    #: this side's end of the command channel
    sock: socket.socket
    #: the doorbell: an eventfd both processes hold (``os.eventfd_write(bell, 1)`` wakes an idle proxy's sweeps);
    #: this side closes it when done
    bell: int


def start_proxy() -> StartedProxy:
    """Start a proxy process: a fresh interpreter running :data:`ENTRY` (descriptors closed but its end of the
    channel and the doorbell, its own session). Raises OSError where the process or its descriptors cannot be
    made (nothing is left open then)."""
    mine, theirs = socket.socketpair()
    bell = -1
    try:
        bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        proc = subprocess.Popen([sys.executable, ENTRY, str(theirs.fileno()), str(os.getpid()), str(bell)],
                                pass_fds=(theirs.fileno(), bell), close_fds=True, start_new_session=True,
                                stdin=subprocess.DEVNULL)
    except BaseException:
        mine.close()
        if bell >= 0:
            os.close(bell)
        raise
    finally:
        theirs.close()
    return StartedProxy(proc, mine, bell)
